"""The decode step's QK-norm, RoPE and KV write as one kernel (norm_rope_write) against a float64 oracle on fresh
random inputs: interpreted on any backend, compiled on a GPU; and tiny Qwen3 dense, Qwen3-MoE and Llama models giving
the same logits and cache with the kernel in their layers as with XLA's path (normed_qkv, apply_rope, write_kv)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine.batcher import BatchShape, SeqChunk, pack
from jaxinfer.models import LLAMA, QWEN3, QWEN3_MOE, common
from jaxinfer.models.common import rope_inv_freq
from jaxinfer.models.fused import fuse_projections
from model_helpers import build_runner, float32_twin, rel_err, tiny_config, tiny_qwen3_dense, tiny_qwen3_moe
from pallas_kernels.ragged_paged_attention.norm_rope_write import norm_rope_write, takes

PAGES, PAGE_SIZE = 12, 4


def oracle(parts, q_norm, k_norm, positions, inv_freq, n, kv, eps) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q [T, N, H], k and v [T, K, H] in float64 from the partials (angles as float32 products, as the model takes
    them: at positions in the thousands that rounding is the model's own)."""
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    num_tokens, head_dim = parts.shape[1], parts.shape[2] // (n + 2 * kv)
    y = f64(parts).sum(axis=0).reshape(num_tokens, n + 2 * kv, head_dim)  # [T, N + 2K, H]
    weight = np.concatenate([np.tile(f64(q_norm), (n, 1)), np.tile(f64(k_norm), (kv, 1))])  # [N + K, H]
    qk = y[:, :n + kv] / np.sqrt((y[:, :n + kv] ** 2).mean(-1, keepdims=True) + eps) * weight
    angles = f64(np.asarray(positions, np.float32)[:, None] * np.asarray(inv_freq, np.float32)[None, :])  # [T, H/2]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    a, b = np.split(qk, 2, axis=-1)
    qk = np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    return qk[:, :n], qk[:, n:], y[:, n + kv:]


def random_case(seed: int, splits: int, tokens: int, n: int, kv: int, head_dim: int, dtype=jnp.bfloat16):
    r = np.random.default_rng(seed)
    width = (n + 2 * kv) * head_dim
    parts = r.standard_normal((splits, tokens, width)) * 3
    parts = jnp.asarray(parts, jnp.float32 if splits > 1 else dtype)  # a whole product comes in the model's dtype
    q_norm, k_norm = (jnp.asarray(r.standard_normal(head_dim) + 1, dtype) for _ in range(2))
    positions = jnp.asarray(r.integers(0, 40_000, tokens), jnp.int32)  # far positions: large RoPE angles
    inv_freq = rope_inv_freq(head_dim, 1e6, None)
    slots = jnp.asarray(r.choice(np.arange(PAGE_SIZE, PAGES * PAGE_SIZE), tokens, replace=False), jnp.int32)
    pages = [jnp.asarray(r.standard_normal((PAGES, PAGE_SIZE, kv, head_dim)), dtype) for _ in range(2)]
    return parts, q_norm, k_norm, positions, inv_freq, slots, *pages


def check_case(case, n: int, interpret: bool) -> None:
    parts, q_norm, k_norm, positions, inv_freq, slots, k_pages, v_pages = case
    kv = k_pages.shape[2]
    q, k, v = oracle(parts, q_norm, k_norm, positions, inv_freq, n, kv, 1e-6)
    got_q, got_k, got_v = norm_rope_write(*case, num_q_heads=n, eps=1e-6, interpret=interpret)
    assert got_q.dtype == k_pages.dtype and got_k.shape == k_pages.shape and got_v.dtype == v_pages.dtype

    def close(got, want):  # one rounding to 16 bits from the exact values (float32 arithmetic on the way)
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=8e-3, atol=1e-3)

    close(got_q, q)
    rows = np.asarray(slots)
    for got, old, want in ((got_k, k_pages, k), (got_v, v_pages, v)):
        flat, old = np.asarray(got, np.float32).reshape(-1, *got.shape[2:]), np.asarray(old, np.float32)
        close(flat[rows], want)
        keep = np.ones(flat.shape[0], bool)
        keep[rows] = False  # every row no token owns is as it was
        np.testing.assert_array_equal(flat[keep], old.reshape(flat.shape)[keep])


@pytest.mark.parametrize("splits, tokens", [(1, 1), (4, 2), (4, 8), (2, 5)])
def test_interpreted_kernel_matches_the_float64_oracle(splits: int, tokens: int) -> None:
    check_case(random_case(splits * 10 + tokens, splits, tokens, n=8, kv=2, head_dim=16), n=8, interpret=True)


def test_takes_only_what_it_can_write() -> None:
    page = jax.ShapeDtypeStruct((4, 4, 4, 128), jnp.bfloat16)
    assert takes(page, 2, 32) and takes(page, 8, 32)
    assert not takes(page, 9, 32)  # a prefill-sized step keeps XLA's path
    assert not takes(page, 2, 24)  # Triton blocks are powers of two
    assert not takes(jax.ShapeDtypeStruct((4, 4, 4, 128), jnp.float32), 2, 32)
    assert not takes(jax.ShapeDtypeStruct((4, 4, 3, 128), jnp.bfloat16), 2, 32)
    with pytest.raises(ValueError, match="power-of-two"):
        norm_rope_write(*random_case(0, 1, 2, n=6, kv=2, head_dim=16), num_q_heads=6, eps=1e-6, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("n, kv", [(32, 4), (32, 8)])  # Qwen3-30B-A3B's and Qwen3-8B's heads of 128
@pytest.mark.parametrize("splits, tokens", [(1, 1), (1, 2), (4, 2), (4, 8)])
def test_gpu_kernel_matches_the_float64_oracle(n: int, kv: int, splits: int, tokens: int) -> None:
    check_case(random_case(n + kv + splits + tokens, splits, tokens, n=n, kv=kv, head_dim=128), n=n, interpret=False)


def decode_logits(runner, ids: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Feed `ids` in decode-sized chunks of 3 tokens (one sequence, pages 1-4): the last logits of each, and the
    layers' K and V pages after."""
    shape = BatchShape(tokens=8, seqs=2, pages_per_seq=8)
    out = []
    for start in range(0, len(ids), 3):
        batch = pack([SeqChunk(ids[start:start + 3], start, [1, 2, 3, 4])], shape, runner.kv_cache.page_size)
        out.append(np.asarray(runner.logits(runner.place(batch)), np.float32)[0])
    cache = [np.asarray(p, np.float32) for p in (*runner.kv_cache.k, *runner.kv_cache.v)]
    return np.stack(out), cache


def check_model(monkeypatch, family, make_cfg, mode: str) -> None:
    """A tiny bf16 model (q/k/v joined at load, heads of powers of two) decoding in 3-token steps, with the
    kernel in every layer (`mode`: common.NORM_ROPE_WRITE) and with XLA's path: the same logits and cache within
    bf16's rounding, and the kernel's logits no further from the same weights run in float32 than XLA's."""
    cfg = make_cfg(num_heads=4, num_kv_heads=2, head_dim=16)
    ids = list(np.random.default_rng(2).integers(0, cfg.vocab_size, 12))

    def build(dtype=jnp.bfloat16, weights=None):
        hook = fuse_projections if weights is None else (lambda _: weights)
        return build_runner(cfg, seed=3, family=family, weights_hook=hook, dtype=dtype, num_pages=8,
                            page_size=PAGE_SIZE)

    monkeypatch.setattr(common, "NORM_ROPE_WRITE", None)
    xla = build()
    want, want_cache = decode_logits(xla, ids)
    exact, _ = decode_logits(float32_twin(build, xla), ids)
    monkeypatch.setattr(common, "NORM_ROPE_WRITE", mode)
    calls = []
    kernel = common.norm_rope_write.norm_rope_write
    monkeypatch.setattr(common.norm_rope_write, "norm_rope_write", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    got, got_cache = decode_logits(build(), ids)  # a new runner: its programs trace anew
    assert calls, "the kernel was not called"
    assert rel_err(got, want) < 2e-2
    for g, w in zip(got_cache, want_cache):
        assert rel_err(g, w) < 1e-2
    assert rel_err(got, exact) < 1.1 * rel_err(want, exact)


FAMILIES = pytest.mark.parametrize("family, make_cfg", [(QWEN3, tiny_qwen3_dense), (QWEN3_MOE, tiny_qwen3_moe),
                                                         (LLAMA, tiny_config)])  # Llama: no QK-norm


@FAMILIES
def test_model_with_the_interpreted_kernel_gives_the_same_logits_and_cache(monkeypatch, family, make_cfg) -> None:
    check_model(monkeypatch, family, make_cfg, "interpret")


@pytest.mark.gpu
@FAMILIES
def test_model_with_the_gpu_kernel_gives_the_same_logits_and_cache(monkeypatch, family, make_cfg) -> None:
    check_model(monkeypatch, family, make_cfg, "gpu")
