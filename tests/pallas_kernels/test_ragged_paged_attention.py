"""Ragged paged attention: the reference vs a float64 oracle, the TPU kernel (interpreted) and the CPU's xla form
vs the reference. The GPU kernel's tests are in test_ragged_paged_attention_gpu.py."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import CASES, Case, build, dequantized, quantized_batch, tolerance
from conftest import naive_attention, relative_error

from pallas_kernels.ragged_paged_attention import ragged_paged_attention, reference, resolve_impl, xla


REFERENCE_CASES = ["decode_gqa4_h128", "mixed_mqa8_h256", "chunked_prefill_window",
                   "mixed_softcap_gqa4", "int8_kv", "fp8_kv_bf16_q"]


@pytest.mark.parametrize("name", REFERENCE_CASES)
def test_reference_matches_float64_oracle(rng, name):
    case = CASES[name]
    batch, kwargs = build(rng, case)
    out = reference.ragged_paged_attention(*batch.args(), **kwargs)
    real = batch.num_real_tokens
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    assert relative_error(out[:real], naive_attention(batch, **kwargs)) < tolerance(case)
    assert np.all(np.isfinite(np.asarray(out[real:].astype(jnp.float32))))


@pytest.mark.parametrize("name", list(CASES))
def test_tpu_kernel_matches_reference(rng, name):
    case = CASES[name]
    batch, kwargs = build(rng, case)
    from pallas_kernels.ragged_paged_attention import tpu
    out = tpu.ragged_paged_attention(*batch.args(), **kwargs, block_q=case.block_q,
                                     pages_per_block=case.pages_per_block, interpret=True)
    want = reference.ragged_paged_attention(*batch.args(), **kwargs)
    real = batch.num_real_tokens
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    assert relative_error(out[:real], want[:real].astype(jnp.float32)) < tolerance(case)
    assert np.all(np.isfinite(np.asarray(out.astype(jnp.float32))))


def test_public_entry_point_runs_tpu_kernel_in_interpret_mode(rng):
    batch, kwargs = build(rng, CASES["mixed_softcap_gqa4"])
    out = ragged_paged_attention(*batch.args(), **kwargs, impl="pallas_tpu", interpret=True)
    want = ragged_paged_attention(*batch.args(), **kwargs, impl="reference")
    real = batch.num_real_tokens
    assert relative_error(out[:real], want[:real]) < 1e-5


def test_auto_picks_xla_on_cpu_and_rejects_unknown_impls():
    assert resolve_impl("auto") == {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(
        jax.default_backend(), "xla")
    assert resolve_impl("auto", gpu_supported=False) in ("pallas_tpu", "reference", "xla")
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


def test_auto_on_cpu_runs_the_reference_without_a_warning(rng):
    batch, kwargs = build(rng, CASES["int8_kv"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ragged_paged_attention(*batch.args(), **kwargs, impl="auto")


@pytest.mark.parametrize("kv_dtype,q_dtype", [(jnp.int8, jnp.float32), (jnp.float8_e4m3fn, jnp.bfloat16)])
def test_tpu_kernel_dequantizes_quantized_pages_in_vmem(rng, kv_dtype, q_dtype):
    """int8 / fp8 pages with per-token scales: the TPU kernel (interpreted) equals the reference, which
    dequantizes the whole block in jnp, and the reference equals attention over the dequantized pages."""
    from pallas_kernels.ragged_paged_attention import tpu
    batch = quantized_batch(rng, kv_dtype, num_heads=8, kv_heads=2, head_dim=64, page_size=8, max_pages=5,
                             dtype=q_dtype, pad_tokens=2)
    kwargs = dict(sm_scale=0.125, soft_cap=20.0)
    out = tpu.ragged_paged_attention(*batch.args(), **kwargs, block_q=4, pages_per_block=2, interpret=True)
    want = reference.ragged_paged_attention(*batch.args(), **kwargs)
    real = batch.num_real_tokens
    tol = 1e-2 if q_dtype == jnp.bfloat16 else 1e-5
    assert relative_error(out[:real], want[:real].astype(jnp.float32)) < tol
    dequant = dataclasses.replace(batch, k_pages=dequantized(batch.k_pages), v_pages=dequantized(batch.v_pages))
    assert relative_error(want[:real], naive_attention(dequant, **kwargs)) < tol


# ----------------------------------------------------------------------------- xla.py (the CPU's "auto")

# Beside the kernel cases (every sequence inside one kv block of 8 pages), sequences spanning several blocks:
# a decode-only batch of very different lengths with padding slots and tokens, and a mixed batch whose
# prefill chunks and decodes cross blocks under a sliding window and a soft cap.
XLA_CASES = {
    **CASES,
    "decode_many_blocks": Case(tuple((1, kv) for kv in (1, 33, 64, 65, 130, 159, 7, 96)), num_heads=6,
                               kv_heads=2, page_size=4, max_pages=40, pad_seqs=3, pad_tokens=2),
    "mixed_many_blocks_window": Case(((1, 150), (20, 90), (1, 3), (37, 37), (1, 64)), num_heads=4, kv_heads=2,
                                     page_size=4, max_pages=40, sliding_window=50, soft_cap=10.0),
}


@pytest.mark.parametrize("name", list(XLA_CASES))
def test_xla_matches_reference(rng, name):
    case = XLA_CASES[name]
    batch, kwargs = build(rng, case)
    out = xla.ragged_paged_attention(*batch.args(), **kwargs)
    want = reference.ragged_paged_attention(*batch.args(), **kwargs)
    real = batch.num_real_tokens
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    assert relative_error(out[:real], want[:real].astype(jnp.float32)) < tolerance(case)
    assert not np.asarray(out[real:].astype(jnp.float32)).any()  # padding rows are zeros, as the reference's


@pytest.mark.parametrize("kv_dtype,q_dtype", [(jnp.int8, jnp.float32), (jnp.float8_e4m3fn, jnp.bfloat16)])
def test_xla_dequantizes_quantized_pages_like_the_reference(rng, kv_dtype, q_dtype):
    batch = quantized_batch(rng, kv_dtype, num_heads=8, kv_heads=2, head_dim=64, page_size=4, max_pages=10,
                             dtype=q_dtype, pad_tokens=2, pad_seqs=1)
    kwargs = dict(sm_scale=0.125, soft_cap=20.0)
    out = xla.ragged_paged_attention(*batch.args(), **kwargs)
    want = reference.ragged_paged_attention(*batch.args(), **kwargs)
    real = batch.num_real_tokens
    assert relative_error(out[:real], want[:real].astype(jnp.float32)) < (1e-2 if q_dtype == jnp.bfloat16 else 1e-5)


def test_xla_decode_step_runs_no_per_sequence_loop(rng):
    """A decode-only step does its work in the batched pass: the per-sequence loop's trip count is 0, so the
    result does not change when that loop's body is made to fail loudly (NaN) on every row it would touch."""
    batch, kwargs = build(rng, XLA_CASES["decode_many_blocks"])
    poisoned = lambda s, out, q, *a, **k: jnp.full_like(out, jnp.nan)
    want = xla.ragged_paged_attention(*batch.args(), **kwargs)
    import unittest.mock
    with unittest.mock.patch.object(xla, "attend_sequence", poisoned):
        got = xla.ragged_paged_attention(*batch.args(), **kwargs)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
