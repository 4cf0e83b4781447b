"""Ragged paged attention: reference vs a float64 oracle, kernels vs the reference."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_paged_batch, naive_attention, relative_error

from pallas_kernels.ragged_paged_attention import ragged_paged_attention, reference, resolve_impl


@dataclasses.dataclass(frozen=True)
class Case:
    seqs: tuple  # ((q_len, kv_len), ...)
    num_heads: int = 4
    kv_heads: int = 1
    head_dim: int = 64
    page_size: int = 8
    max_pages: int = 6
    dtype: object = jnp.float32
    kv_dtype: object = None
    sliding_window: int | None = None
    soft_cap: float | None = None
    kv_scale: float | None = None
    pad_tokens: int = 0
    pad_seqs: int = 0
    block_q: int = 4
    pages_per_block: int = 2


# Each case covers several axes at once (a full cartesian product would not fit CI's budget):
# decode-only, prefill-only and mixed batches; lengths 1, exactly one/two pages (8, 16) and partial
# last pages; GQA ratios 1, 4, 8; head dims 64/128/256; window, soft-cap, int8/fp8 KV, padding.
CASES = {
    "decode_gqa4_h128": Case(((1, 1), (1, 8), (1, 17), (1, 40), (1, 16)), num_heads=8, kv_heads=2,
                             head_dim=128),
    "prefill_mha_h64": Case(((13, 13), (16, 16), (1, 1)), num_heads=2, kv_heads=2, block_q=8),
    "mixed_mqa8_h256": Case(((5, 21), (1, 8), (9, 32), (1, 33)), num_heads=8, kv_heads=1,
                            head_dim=256, pad_tokens=3, pad_seqs=2),
    "chunked_prefill_window": Case(((7, 30), (1, 9), (12, 12)), num_heads=4, kv_heads=1,
                                   sliding_window=5, block_q=8),
    "mixed_softcap_gqa4": Case(((3, 24), (1, 1), (6, 14)), num_heads=4, kv_heads=1, soft_cap=2.0),
    "window_softcap_pages16": Case(((17, 40), (1, 48)), num_heads=4, kv_heads=2, page_size=16,
                                   max_pages=3, sliding_window=20, soft_cap=30.0, pages_per_block=1),
    "int8_kv": Case(((4, 20), (1, 9), (8, 8)), num_heads=8, kv_heads=2, kv_dtype=jnp.int8,
                    kv_scale=0.01),
    "fp8_kv_bf16_q": Case(((4, 20), (1, 9), (2, 16)), num_heads=4, kv_heads=1,
                          dtype=jnp.bfloat16, kv_dtype=jnp.float8_e4m3fn, kv_scale=0.5),
    "bf16_padding": Case(((2, 5), (1, 24)), num_heads=4, kv_heads=1, dtype=jnp.bfloat16,
                         pad_tokens=5, pad_seqs=3),
}


def _build(rng, case: Case):
    batch = make_paged_batch(
        rng, case.seqs, num_heads=case.num_heads, kv_heads=case.kv_heads, head_dim=case.head_dim,
        page_size=case.page_size, max_pages=case.max_pages, dtype=case.dtype,
        kv_dtype=case.kv_dtype, pad_tokens=case.pad_tokens, pad_seqs=case.pad_seqs)
    kwargs = dict(sm_scale=case.head_dim ** -0.5, sliding_window=case.sliding_window,
                  soft_cap=case.soft_cap, k_scale=case.kv_scale, v_scale=case.kv_scale)
    return batch, kwargs


def _tolerance(case: Case) -> float:
    # bf16 output rounding is ~4e-3 relative; fp32 math differs from float64 only by rounding.
    return 1e-2 if case.dtype == jnp.bfloat16 else 1e-5


REFERENCE_CASES = ["decode_gqa4_h128", "mixed_mqa8_h256", "chunked_prefill_window",
                   "mixed_softcap_gqa4", "int8_kv", "fp8_kv_bf16_q"]


@pytest.mark.parametrize("name", REFERENCE_CASES)
def test_reference_matches_float64_oracle(rng, name):
    case = CASES[name]
    batch, kwargs = _build(rng, case)
    out = reference.ragged_paged_attention(*batch.args(), **kwargs)
    real = batch.num_real_tokens
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    assert relative_error(out[:real], naive_attention(batch, **kwargs)) < _tolerance(case)
    assert np.all(np.isfinite(np.asarray(out[real:].astype(jnp.float32))))


@pytest.mark.parametrize("name", list(CASES))
def test_tpu_kernel_matches_reference(rng, name):
    case = CASES[name]
    batch, kwargs = _build(rng, case)
    from pallas_kernels.ragged_paged_attention import tpu
    out = tpu.ragged_paged_attention(*batch.args(), **kwargs, block_q=case.block_q,
                                     pages_per_block=case.pages_per_block, interpret=True)
    want = reference.ragged_paged_attention(*batch.args(), **kwargs)
    real = batch.num_real_tokens
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    assert relative_error(out[:real], want[:real].astype(jnp.float32)) < _tolerance(case)
    assert np.all(np.isfinite(np.asarray(out.astype(jnp.float32))))


def test_public_entry_point_runs_tpu_kernel_in_interpret_mode(rng):
    batch, kwargs = _build(rng, CASES["mixed_softcap_gqa4"])
    out = ragged_paged_attention(*batch.args(), **kwargs, impl="pallas_tpu", interpret=True)
    want = ragged_paged_attention(*batch.args(), **kwargs, impl="reference")
    real = batch.num_real_tokens
    assert relative_error(out[:real], want[:real]) < 1e-5


def test_auto_picks_reference_on_cpu_and_rejects_unknown_impls():
    assert resolve_impl("auto") == {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(
        jax.default_backend(), "reference")
    assert resolve_impl("auto", gpu_supported=False) in ("pallas_tpu", "reference")
    with pytest.raises(ValueError, match="impl must be one of"):
        resolve_impl("triton")


def test_reference_is_memory_bounded_at_serving_size():
    """T=1024 tokens, S=8 sequences, M*R=2048: temporaries stay far below a per-token cache gather."""
    t, s, m, r, n, k, h = 1024, 8, 128, 16, 8, 2, 128
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)
    args = (spec((t, n, h), jnp.bfloat16), spec((s * m + 1, r, k, h), jnp.bfloat16),
            spec((s * m + 1, r, k, h), jnp.bfloat16), spec((s,), jnp.int32),
            spec((s, m), jnp.int32), spec((s + 1,), jnp.int32), spec((1,), jnp.int32))
    fn = jax.jit(lambda *a: reference.ragged_paged_attention(*a, sm_scale=0.1))
    temp = fn.lower(*args).compile().memory_analysis().temp_size_in_bytes
    per_token_gather = t * m * r * k * h * 2  # bytes of one [T, M*R, K, H] bf16 gather
    assert temp < per_token_gather // 16


@pytest.mark.parametrize("group", [1, 4, 8])
def test_gpu_tile_queries_puts_every_token_at_its_tile_row(rng, group):
    """The tile-major q the GPU kernel loads: tile w, kv head k, row g*Bt + t = q[tok0 + t, k*G + g].

    Ragged starts that are not multiples of 8 are the case a direct TMA copy out of [T, N, H] got
    wrong (zero-filled rows); the gather must place them exactly.
    """
    from pallas_kernels.ragged_paged_attention import gpu
    kv_heads, head_dim, q_lens = 2, 8, [5, 1, 13, 9, 1]
    num_seqs = len(q_lens)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    q = jnp.asarray(rng.standard_normal((sum(q_lens), kv_heads * group, head_dim)), jnp.float32)
    bt = 64 // group
    max_tiles = q.shape[0] // bt + num_seqs
    _, tok0, _ = gpu.tile_table(cu, jnp.asarray([num_seqs]), bt, max_tiles)
    tiles = np.asarray(gpu.tile_queries(q, tok0, group, kv_heads))  # [W, K, 64, H]
    assert tiles.shape == (max_tiles, kv_heads, 64, head_dim)
    q_np, tok0 = np.asarray(q), np.asarray(tok0)
    checked = 0
    for w in np.flatnonzero(tok0 >= 0):
        seq = np.searchsorted(np.asarray(cu)[1:], tok0[w], side="right")
        for t in range(min(bt, int(cu[seq + 1]) - tok0[w])):
            for k in range(kv_heads):
                for g in range(group):
                    np.testing.assert_array_equal(tiles[w, k, g * bt + t],
                                                  q_np[tok0[w] + t, k * group + g])
                    checked += 1
    assert checked == sum(q_lens) * kv_heads * group


def test_gpu_supported_config_routes_quantized_kv_to_the_reference():
    from pallas_kernels.ragged_paged_attention import gpu
    q = jax.ShapeDtypeStruct((4, 8, 128), jnp.bfloat16)
    pages = lambda dtype, r=16: jax.ShapeDtypeStruct((9, r, 2, 128), dtype)
    assert gpu.supported_config(q, pages(jnp.bfloat16))
    assert not gpu.supported_config(q, pages(jnp.int8))
    assert not gpu.supported_config(q, pages(jnp.bfloat16, r=24))
    assert not gpu.supported_config(jax.ShapeDtypeStruct((4, 8, 96), jnp.bfloat16),
                                    jax.ShapeDtypeStruct((9, 16, 2, 96), jnp.bfloat16))


# Ragged starts off the 8-row grid at every GQA ratio (the bug fixed in gpu.tile_queries).
GPU_EXTRA_CASES = {
    "ragged_starts_gqa4_h128": Case(((5, 5), (11, 30), (3, 3), (17, 40), (1, 7)), num_heads=8,
                                    kv_heads=2, head_dim=128),
    "ragged_starts_mha_h128_pages16": Case(((3, 20), (21, 21), (1, 33)), num_heads=2,
                                           kv_heads=2, head_dim=128, page_size=16, max_pages=3),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", [
    "decode_gqa4_h128", "chunked_prefill_window", "bf16_padding", "prefill_mha_h64",
    "mixed_mqa8_h256", "mixed_softcap_gqa4", "window_softcap_pages16", *GPU_EXTRA_CASES])
def test_gpu_kernel_matches_reference(rng, name):
    case = dataclasses.replace({**CASES, **GPU_EXTRA_CASES}[name], dtype=jnp.bfloat16)
    batch, kwargs = _build(rng, case)
    from pallas_kernels.ragged_paged_attention import gpu
    out = gpu.ragged_paged_attention(*batch.args(), **kwargs)
    want = reference.ragged_paged_attention(*batch.args(), **kwargs)
    real = batch.num_real_tokens
    assert relative_error(out[:real], want[:real].astype(jnp.float32)) < 2e-2
    assert np.all(np.isfinite(np.asarray(out.astype(jnp.float32))))


@pytest.mark.gpu
def test_gpu_decode_splits_long_context(rng):
    """Few sequences with long contexts take the flash-decoding split + combine path."""
    case = Case(((1, 1000), (1, 517), (3, 700)), num_heads=32, kv_heads=8, head_dim=128,
                page_size=16, max_pages=64, dtype=jnp.bfloat16)
    batch, kwargs = _build(rng, case)
    from pallas_kernels.ragged_paged_attention import gpu
    out = gpu.ragged_paged_attention(*batch.args(), **kwargs, num_splits=4)
    want = reference.ragged_paged_attention(*batch.args(), **kwargs)
    assert relative_error(out[:5], want[:5].astype(jnp.float32)) < 2e-2


@pytest.mark.gpu
def test_gpu_auto_routes_soft_cap_and_mha_to_the_kernel(rng):
    """impl="auto" on the GPU now takes every bf16 configuration, soft-cap and G = 1 included."""
    case = dataclasses.replace(CASES["prefill_mha_h64"], dtype=jnp.bfloat16)
    batch, kwargs = _build(rng, case)
    kwargs["soft_cap"] = 5.0
    assert resolve_impl("auto") == "pallas_gpu"
    out = ragged_paged_attention(*batch.args(), **kwargs, impl="auto")
    want = reference.ragged_paged_attention(*batch.args(), **kwargs)
    real = batch.num_real_tokens
    assert relative_error(out[:real], want[:real].astype(jnp.float32)) < 2e-2
