"""Quantized matmul: kernels vs the reference, the reference vs the exact float64 product."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quantized_matmul import (dequantize_weights, quantize_weights,
                                             quantized_matmul, resolve_impl)
from pallas_kernels.quantized_matmul.reference import pack_int4, unpack_int4

# (M, K, N, bits, group_size, fp8): odd M, K off the 128 grid, N off the 512/256 blocks,
# per-channel and grouped scales, K spanning several blocks and several groups per block.
SHAPES = {
    "int8_odd_m_ragged_k": (5, 300, 256, 8, None, False),
    "int8_groups_many_k_blocks": (3, 2304, 384, 8, 256, False),
    "int4_g128": (7, 520, 384, 4, 128, False),
    "int4_per_channel_m1": (1, 256, 128, 4, None, False),
    "int4_g384_n_unaligned": (2, 1000, 200, 4, 384, False),
    "fp8_per_channel": (9, 384, 640, 8, None, True),
}


def _inputs(rng, m, k, n, dtype):
    w = jnp.asarray(rng.standard_normal((k, n), dtype=np.float32))
    x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32)).astype(dtype)
    return x, w


def _rel(actual, expected) -> float:
    a = np.asarray(jnp.asarray(actual).astype(jnp.float32), np.float64)
    e = np.asarray(expected, np.float64)
    return float(np.linalg.norm(a - e) / np.linalg.norm(e))


def _exact(x, w):
    return np.asarray(x.astype(jnp.float32), np.float64) @ np.asarray(w, np.float64)


def _error_bound(x, w, wq, fp8: bool):
    """Elementwise worst case of |x @ (w_q - w)|: half a quantization step per weight (int), or
    half an e4m3 ulp (2^-4 relative) per weight (fp8); [M, N]."""
    xa = np.abs(np.asarray(x.astype(jnp.float32), np.float64))
    if fp8:
        return xa @ (np.abs(np.asarray(w, np.float64)) * 2.0 ** -4) + 1e-6
    k = w.shape[0]
    scales = np.asarray(wq.scales, np.float64)  # [G, N]
    step = np.repeat(scales, wq.group_size, axis=0)[:k]  # [K, N]
    return xa @ (step / 2) + 1e-6


@pytest.mark.parametrize("name", list(SHAPES))
def test_tpu_kernel_matches_reference(rng, name):
    m, k, n, bits, group, fp8 = SHAPES[name]
    x, w = _inputs(rng, m, k, n, jnp.float32)
    wq = quantize_weights(w, bits=bits, group_size=group, fp8=fp8)
    want = quantized_matmul(x, wq, impl="reference")
    got = quantized_matmul(x, wq, impl="tpu", interpret=True)
    assert got.shape == (m, n) and got.dtype == x.dtype
    assert _rel(got, want) < 1e-4


def test_tpu_kernel_bf16_activations_match_reference(rng):
    x, w = _inputs(rng, 3, 520, 256, jnp.bfloat16)
    wq = quantize_weights(w, bits=4, group_size=128)
    got = quantized_matmul(x, wq, impl="tpu", interpret=True)
    assert got.dtype == jnp.bfloat16
    assert _rel(got, quantized_matmul(x, wq, impl="reference").astype(jnp.float32)) < 1e-2


@pytest.mark.parametrize("name", list(SHAPES))
def test_reference_within_quantization_error(rng, name):
    m, k, n, bits, group, fp8 = SHAPES[name]
    x, w = _inputs(rng, m, k, n, jnp.float32)
    wq = quantize_weights(w, bits=bits, group_size=group, fp8=fp8)
    got = np.asarray(quantized_matmul(x, wq, impl="reference"), np.float64)
    exact = _exact(x, w)
    assert np.all(np.abs(got - exact) <= _error_bound(x, w, wq, fp8))
    # Typical (not worst-case) error for Gaussian weights: int8 ~0.7%, fp8 ~3%, int4 ~11%.
    assert _rel(got, exact) < {8: 0.05 if fp8 else 0.015, 4: 0.16}[bits]


def test_int4_packing_roundtrips(rng):
    q = jnp.asarray(rng.integers(-8, 8, size=(16, 384)), jnp.int8)
    packed = pack_int4(q)
    assert packed.shape == (16, 192) and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(unpack_int4(packed), q)


def test_quantized_weights_are_a_pytree_and_dequantize_pads_k(rng):
    _, w = _inputs(rng, 1, 300, 128, jnp.float32)
    wq = quantize_weights(w, bits=8)
    leaves = jax.tree_util.tree_leaves(wq)
    assert len(leaves) == 2
    doubled = jax.tree_util.tree_map(lambda a: a, wq)
    assert doubled.in_features == 300 and doubled.padded_in_features == 384
    deq = dequantize_weights(wq)
    assert deq.shape == (384, 128) and not np.any(np.asarray(deq[300:]))


@pytest.mark.parametrize("kwargs, match", [
    (dict(bits=3), "bits must be 8 or 4"),
    (dict(bits=4, group_size=100), "multiple of 128"),
    (dict(bits=8, group_size=128, fp8=True), "fp8 weights"),
])
def test_bad_quantization_arguments_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        quantize_weights(jnp.ones((256, 128)), **kwargs)


def test_auto_impl_and_shape_errors():
    assert resolve_impl("auto") == {"tpu": "tpu", "gpu": "gpu"}.get(jax.default_backend(),
                                                                    "reference")
    wq = quantize_weights(jnp.ones((256, 128)))
    with pytest.raises(ValueError, match=r"x must be \[M, 256\]"):
        quantized_matmul(jnp.ones((2, 200)), wq, impl="reference")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k", [640, 4096, 14336])
def test_kernel_step_fits_shared_memory_and_divides_k(bits, k):
    from pallas_kernels.quantized_matmul import gpu

    for m in (1, 8, 16, 32, 64, 128):
        tile_k = gpu.step_k(bits, k + (-k) % 128, m)
        assert (k + (-k) % 128) % tile_k == 0 and tile_k >= 128
        assert gpu._smem_bytes(bits, m, tile_k) <= gpu._SMEM_BUDGET, (m, tile_k)


@pytest.mark.gpu
@pytest.mark.parametrize("m, k, n, bits, group, fp8", [
    (1, 4096, 1024, 8, None, False), (13, 1000, 512, 8, None, False),
    (64, 4096, 512, 4, 128, False), (5, 640, 256, 4, None, False), (8, 1024, 512, 8, None, True),
    (3, 768, 256, 4, 128, False), (1, 14336, 512, 4, 128, False),  # int4 steps of 2 and 4 chunks
    # Wide M with N = 264 tiles (no split-K): a full 4-stage pipeline of wide activation tiles in SMEM.
    (64, 4096, 16896, 4, 128, False), (128, 4096, 16896, 8, None, False)])
def test_gpu_kernel_matches_reference(rng, m, k, n, bits, group, fp8):
    x, w = _inputs(rng, m, k, n, jnp.bfloat16)
    wq = quantize_weights(w, bits=bits, group_size=group, fp8=fp8)
    got = quantized_matmul(x, wq, impl="gpu")
    want = quantized_matmul(x, wq, impl="reference")
    assert got.dtype == jnp.bfloat16
    assert _rel(got, want.astype(jnp.float32)) < 1e-2
