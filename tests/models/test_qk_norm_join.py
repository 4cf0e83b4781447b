"""QK-norm of q and k in one pass (qwen3.normed_qkv): with q/k/v joined at load on one device, decode-sized steps norm
the q and k heads of the joined product together; the logits and the norm's outputs are those of the two norms."""

from __future__ import annotations

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
