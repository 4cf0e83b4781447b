"""QK-norm of q and k in one pass (qwen3.normed_qkv): with q/k/v joined at load on one device, decode-sized steps norm
the q and k heads of the joined product together; the logits and the norm's outputs are those of the two norms."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.models import QWEN3, qwen3
from jaxinfer.models.fused import FusedColumns, fuse_projections
from model_helpers import build_runner, rel_err, run_chunks, tiny_qwen3_dense

CFG = dict(num_heads=8, num_kv_heads=4, head_dim=8)


def test_joined_qk_norm_gives_the_same_logits() -> None:
    """One device (the join's N axis unsplit): 4-token steps take the joined norm; same logits as apart weights."""
    cfg = tiny_qwen3_dense(**CFG)
    ids = list(np.random.default_rng(4).integers(0, cfg.vocab_size, 11))
    apart = build_runner(cfg, tp=1, seed=5, family=QWEN3)
    joined = build_runner(cfg, tp=1, seed=5, family=QWEN3, weights_hook=fuse_projections)
    assert isinstance(joined.weights.layers[0].wq, FusedColumns) and joined.weights.layers[0].wq.shards == 1
    want = run_chunks(apart, ids, chunk=4, pages=[1, 2, 3])
    assert rel_err(run_chunks(joined, ids, chunk=4, pages=[1, 2, 3]), want) < 1e-6


def test_joined_qk_norm_equals_two_norms() -> None:
    """normed_qkv on a joined layer (a decode-sized step, and one over QK_NORM_JOIN_MAX_TOKENS that norms apart)
    against the two norms on the split product, with distinct random q and k norm weights."""
    cfg = tiny_qwen3_dense(**CFG)
    runner = build_runner(cfg, tp=1, seed=5, family=QWEN3, weights_hook=fuse_projections)
    r = np.random.default_rng(3)
    layer = runner.weights.layers[0]
    layer = layer.replace(q_norm=jnp.asarray(r.standard_normal(8), layer.q_norm.dtype),
                          k_norm=jnp.asarray(r.standard_normal(8), layer.k_norm.dtype))
    for tokens in (2, qwen3.QK_NORM_JOIN_MAX_TOKENS + 1):
        x = jnp.asarray(r.standard_normal((tokens, cfg.hidden_size)), runner.weights.embed.dtype)
        q, k, v = jax.jit(qwen3.normed_qkv, static_argnums=2)(layer, x, cfg.rms_norm_eps)
        y = jnp.einsum("td,dn->tn", x, layer.wq.w).reshape(tokens, -1, 8)  # [T, N + 2K, H]: q, k, v heads
        want_q = qwen3.rms_norm(y[:, :8], layer.q_norm, cfg.rms_norm_eps)
        want_k = qwen3.rms_norm(y[:, 8:12], layer.k_norm, cfg.rms_norm_eps)
        assert q.shape == (tokens, 8, 8) and k.shape == (tokens, 4, 8) and v.shape == (tokens, 4, 8)
        np.testing.assert_allclose(np.asarray(q, np.float32), np.asarray(want_q, np.float32), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(k, np.float32), np.asarray(want_k, np.float32), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(v), np.asarray(y[:, 12:]))


def test_split_k_product_equals_the_plain_product() -> None:
    """qwen3.split_k_product (the GPU's decode-sized q/k/v product) against the one product, fresh random inputs."""
    r = np.random.default_rng(7)
    for t, k, n, splits in ((1, 64, 48, 4), (2, 128, 40, 2), (8, 256, 72, 4)):
        x = jnp.asarray(r.standard_normal((t, k)), jnp.float32)
        w = jnp.asarray(r.standard_normal((k, n)), jnp.float32)
        got = jax.jit(qwen3.split_k_product, static_argnums=2)(x, w, splits)
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        assert got.shape == (t, n) and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)


def test_gpu_decode_steps_split_the_joined_product(monkeypatch) -> None:
    """The split is taken on a GPU backend only, for steps of at most QKV_SPLIT_K_MAX_TOKENS tokens over float
    weights at most QKV_SPLIT_K_MAX_IN wide; with it, normed_qkv's q, k and v are those of the one product."""
    cfg = tiny_qwen3_dense(**CFG)
    runner = build_runner(cfg, tp=1, seed=5, family=QWEN3, weights_hook=fuse_projections)
    layer = runner.weights.layers[0]
    r = np.random.default_rng(8)
    x = jnp.asarray(r.standard_normal((2, cfg.hidden_size)), runner.weights.embed.dtype)
    want = jax.jit(qwen3.normed_qkv, static_argnums=2)(layer, x, cfg.rms_norm_eps)  # CPU: one product
    assert not qwen3._takes_split_k(x, layer.wq)
    monkeypatch.setattr(qwen3.jax, "default_backend", lambda: "gpu")
    assert qwen3._takes_split_k(x, layer.wq)
    wide = jnp.zeros((2, qwen3.QKV_SPLIT_K_MAX_IN * 2), x.dtype)
    long = jnp.zeros((qwen3.QKV_SPLIT_K_MAX_TOKENS + 1, cfg.hidden_size), x.dtype)
    assert not qwen3._takes_split_k(wide, layer.wq) and not qwen3._takes_split_k(long, layer.wq)
    calls = []
    split = qwen3.split_k_product
    monkeypatch.setattr(qwen3, "split_k_product", lambda *a: calls.append(a[2]) or split(*a))
    # A new function object: jax.jit keys its trace cache by function, and would hand back the CPU trace above.
    got = jax.jit(functools.partial(qwen3.normed_qkv), static_argnums=2)(layer, x, cfg.rms_norm_eps)
    assert calls == [qwen3.QKV_SPLIT_K]
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-5, atol=1e-5)
