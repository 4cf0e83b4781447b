"""Quantized matmul: kernels vs the reference, the reference vs the exact float64 product."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quantized_matmul import (dequantize_weights, from_codes, quantize_weights,
                                             quantized_matmul, resolve_impl)
from pallas_kernels.quantized_matmul.reference import NATURAL_PACK, pack_int4, unpack_int4
from pallas_kernels.quantized_matmul import gpu

# (M, K, N, bits, group_size, fp8): odd M, K off the 128 grid, N off the 512/256 blocks,
# per-channel and grouped scales, K spanning several blocks and several groups per block, the GGUF
# block sizes (16, 32) with K = 576 (SmolLM2's width, no 128 multiple), zero points and W8A8.
SHAPES = {
    "int8_odd_m_ragged_k": (5, 300, 256, 8, None, False),
    "int8_groups_many_k_blocks": (3, 2304, 384, 8, 256, False),
    "int4_g128": (7, 520, 384, 4, 128, False),
    "int4_per_channel_m1": (1, 256, 128, 4, None, False),
    "int4_g384_n_unaligned": (2, 1000, 200, 4, 384, False),
    "fp8_per_channel": (9, 384, 640, 8, None, True),
    "int8_g32_k576": (3, 576, 384, 8, 32, False),
    "int8_g16": (2, 512, 128, 8, 16, False),
    "int4_g32_zero_point_k576": (4, 576, 256, 4, 32, "zp"),
    "int4_g64": (1, 640, 128, 4, 64, False),
    "fp8_w8a8": (6, 384, 256, 8, None, "w8a8"),
}


def _quantize(w, bits, group, mode):
    """mode: False, True (fp8 weight-only), "zp" (zero points), "w8a8" (fp8 weights and activations),
    "natural" / "natural_zp" (int4 in plain order, pack 2, without / with zero points)."""
    return quantize_weights(w, bits=bits, group_size=group, fp8=mode in (True, "w8a8"),
                            zero_point=mode in ("zp", "natural_zp"), w8a8=mode == "w8a8",
                            pack=NATURAL_PACK if mode in ("natural", "natural_zp") else None)


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


def _error_bound(x, w, wq, fp8):
    """Elementwise worst case of |x @ (w_q - w)|: half a quantization step per weight (int), or
    half an e4m3 ulp (2^-4 relative) per weight (fp8; W8A8 adds the same per activation); [M, N]."""
    xa = np.abs(np.asarray(x.astype(jnp.float32), np.float64))
    if fp8:
        wa = np.abs(np.asarray(w, np.float64))
        return xa @ (wa * (2.0 ** -4 if fp8 is True else 2 * 2.0 ** -4 + 2.0 ** -8)) + 1e-6
    k = w.shape[0]
    scales = np.asarray(wq.scales, np.float64)  # [G, N]
    step = np.repeat(scales, wq.group_size, axis=0)[:k]  # [K, N]
    return xa @ (step / 2 * 1.0001) + 1e-6


@pytest.mark.parametrize("name", list(SHAPES))
def test_tpu_kernel_matches_reference(rng, name):
    m, k, n, bits, group, fp8 = SHAPES[name]
    x, w = _inputs(rng, m, k, n, jnp.float32)
    wq = _quantize(w, bits, group, fp8)
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
    wq = _quantize(w, bits, group, fp8)
    got = np.asarray(quantized_matmul(x, wq, impl="reference"), np.float64)
    exact = _exact(x, w)
    assert np.all(np.abs(got - exact) <= _error_bound(x, w, wq, fp8))
    # Typical (not worst-case) error for Gaussian weights: int8 ~0.7%, fp8 ~3% (W8A8 ~4%), int4 ~11%
    # (zero points over groups of 32: ~8%).
    assert _rel(got, exact) < {8: 0.06 if fp8 else 0.015, 4: 0.16}[bits]


@pytest.mark.parametrize("pack", [NATURAL_PACK, 32, 64, 128])
def test_int4_packing_roundtrips(rng, pack):
    q = jnp.asarray(rng.integers(-8, 8, size=(16, 384)), jnp.int8)
    packed = pack_int4(q, pack)
    assert packed.shape == (16, 192) and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(unpack_int4(packed, pack), q)
    # Byte j of a chunk holds element j (low nibble) and j + pack / 2 (high nibble), two's complement.
    np.testing.assert_array_equal(np.asarray(packed[:, 0]) & 0xF, np.asarray(q[:, 0]) & 0xF)
    np.testing.assert_array_equal(np.asarray(packed[:, 0]) >> 4, np.asarray(q[:, pack // 2]) & 0xF)


def test_natural_int4_packing_is_jax_int4_bytes(rng):
    """pack 2 stores exactly the bytes of a jnp.int4 array (what the GPU kernel bitcasts its weights to), and
    the NumPy packer of the loaders writes the same bytes as the jnp one."""
    from jaxinfer.quantization import pack_int4 as pack_int4_host

    q = rng.integers(-8, 8, size=(8, 64)).astype(np.int8)
    packed = pack_int4(jnp.asarray(q), NATURAL_PACK)
    as_int4 = jax.lax.bitcast_convert_type(packed, jnp.int4).reshape(8, 64)  # [8, 32, 2] -> [8, 64]
    np.testing.assert_array_equal(np.asarray(as_int4.astype(jnp.int8)), q)
    np.testing.assert_array_equal(pack_int4_host(q, NATURAL_PACK), np.asarray(packed))


def test_from_codes_is_exact_with_zero_points(rng):
    """GGUF repacks build weights from codes, scales and minimums: dequantize gives exactly q*s + z."""
    q = rng.integers(-8, 8, size=(64, 256)).astype(np.int8)
    scales = rng.random((8, 64)).astype(np.float32)
    zeros = rng.standard_normal((8, 64)).astype(np.float32)
    wq = from_codes(jnp.asarray(q), jnp.asarray(scales), jnp.asarray(zeros), bits=4, group_size=32, in_features=256)
    assert wq.pack == 64 and wq.values.shape == (64, 128)
    want = q.reshape(64, 8, 32) * scales.T[:, :, None] + zeros.T[:, :, None]
    np.testing.assert_array_equal(np.asarray(dequantize_weights(wq)).T, want.reshape(64, 256))


def test_quantized_weights_are_a_pytree_and_dequantize_pads_k(rng):
    _, w = _inputs(rng, 1, 300, 128, jnp.float32)
    wq = quantize_weights(w, bits=8)
    leaves = jax.tree_util.tree_leaves(wq)
    assert len(leaves) == 2  # values, scales; zeros is None
    doubled = jax.tree_util.tree_map(lambda a: a, wq)
    assert doubled.in_features == 300 and doubled.padded_in_features == 320  # K to a multiple of 32
    deq = dequantize_weights(wq)
    assert deq.shape == (320, 128) and not np.any(np.asarray(deq[300:]))


@pytest.mark.parametrize("kwargs, match", [
    (dict(bits=3), "bits must be 8 or 4"),
    (dict(bits=4, group_size=100), "multiple of 128"),
    (dict(bits=4, group_size=16), "32, 64 or a positive multiple of 128 for 4-bit"),
    (dict(bits=8, group_size=128, fp8=True), "fp8 weights"),
    (dict(bits=8, w8a8=True), "w8a8"),
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


@pytest.mark.parametrize("bits, group, pack", [(4, 128, None), (8, None, None), (4, 32, None), (8, 32, None),
                                               (8, 16, None), (4, 32, NATURAL_PACK), (4, 384, NATURAL_PACK)])
@pytest.mark.parametrize("k", [576, 640, 4096, 14336])
def test_kernel_step_fits_shared_memory_and_divides_k(bits, group, pack, k):
    wq = quantize_weights(jnp.ones((k, 64)), bits=bits, group_size=group, pack=pack)
    for m in (1, 8, 16, 32, 64, 128):
        p = gpu.plan(wq, m)
        assert wq.padded_in_features % p.tile_k == 0 and p.tile_k >= 32
        assert p.tile_k % wq.group_size == 0 or wq.group_size % p.tile_k == 0  # a step never straddles a group
        assert p.stages == gpu.default_stages(m) and p.tile_k % p.part_k == 0
        assert gpu.smem_bytes(wq, m, p.tile_k, stages=p.stages) <= gpu._SMEM_BUDGET, (m, p.tile_k)


# GPU kernel cases (M, K, N, bits, group, mode): every piece layout (8-bit per channel and groups
# of 16 / 32, int4 packing chunks of 64 and 128 with groups of 32 / 64 / 128 and per channel), zero
# points, W8A8 on both paths, K = 576 (no multiple of 128).
GPU_CASES = {
    "int8_pc_k320": (5, 320, 128, 8, None, False),
    "int8_g32_k576": (3, 576, 128, 8, 32, False),
    "int8_g16": (2, 512, 64, 8, 16, False),
    "int4_g32_zp_k576": (3, 576, 128, 4, 32, "zp"),
    "int4_g64": (1, 640, 64, 4, 64, False),
    "int4_g128": (7, 512, 128, 4, 128, False),
    "int4_pc": (1, 256, 128, 4, None, False),
    "int4_natural_g32_zp_k576": (3, 576, 128, 4, 32, "natural_zp"),
    "int4_natural_g128": (2, 1024, 128, 4, 128, "natural"),
    "int4_natural_pc": (1, 512, 64, 4, None, "natural"),
    "fp8_weight_only": (4, 256, 128, 8, None, True),
    "w8a8_cols": (5, 256, 128, 8, None, "w8a8"),
    "w8a8_rows": (130, 256, 256, 8, None, "w8a8"),
}


@pytest.mark.parametrize("name", ["int8_g32_k576", "int8_g16", "int4_g32_zp_k576", "int4_pc", "w8a8_cols",
                                  "w8a8_rows", "int4_natural_g32_zp_k576", "int4_natural_g128", "int4_natural_pc"])
def test_gpu_kernel_in_interpret_mode_matches_reference(rng, name):
    """The Mosaic GPU kernels run by Pallas' GPU interpreter on CPU (dequantized pieces staged through
    SMEM, the interpreter's wgmma reads only SMEM operands)."""
    m, k, n, bits, group, mode = GPU_CASES[name]
    x, w = _inputs(rng, m, k, n, jnp.bfloat16)
    wq = _quantize(w, bits, group, mode)
    got = quantized_matmul(x, wq, impl="gpu", interpret=True)
    assert got.shape == (m, n) and got.dtype == jnp.bfloat16
    assert _rel(got, quantized_matmul(x, wq, impl="reference").astype(jnp.float32)) < 1e-2


@pytest.mark.parametrize("name, kw", [("int8_pc_k320", dict(tile_k=64, stages=3, k_splits=5)),
                                      ("int4_natural_g32_zp_k576", dict(tile_k=192, stages=2, k_splits=3)),
                                      ("int8_g16", dict(tile_k=128, stages=4))])
def test_gpu_kernel_tiling_overrides_in_interpret_mode(rng, name, kw):
    """The overrides the tiling sweeps time (K step, steps in flight, split-K) give the same product, with a
    grouped block sliced into several group parts in registers."""
    m, k, n, bits, group, mode = GPU_CASES[name]
    x, w = _inputs(rng, m, k, n, jnp.bfloat16)
    wq = _quantize(w, bits, group, mode)
    got = gpu.quantized_matmul(x, wq, interpret=True, **kw)
    assert _rel(got, quantized_matmul(x, wq, impl="reference").astype(jnp.float32)) < 1e-2


# Zero points in the kernel (gpu.ZEROS_IN_KERNEL): (m, k, n, bits, group, mode, overrides). Off-centre weights make
# the zero points large; a K step of 128 inside a group of 256 reads one zero row per step.
ZEROS_CASES = {"int4_natural_g32": (3, 576, 128, 4, 32, "natural_zp", {}),
               "int4_halves_g32": (2, 512, 64, 4, 32, "zp", {}),
               "int4_natural_g256_step_in_group": (1, 1024, 64, 4, 256, "natural_zp", dict(tile_k=128)),
               "int8_g32": (5, 320, 128, 8, 32, "zp", dict(tile_k=64, k_splits=5))}


@pytest.mark.parametrize("name", list(ZEROS_CASES))
def test_gpu_kernel_adds_zero_points_in_the_kernel_in_interpret_mode(rng, name):
    """Grouped zero points added to each dequantized part inside the kernel give the reference's product, as the
    wrapper's xsum @ zeros does, on weights far from zero where the zero points carry most of the value. Inside,
    the weight q x s + z is rounded to bf16 (twice here: the interpreter does not fuse the multiply-add), so the
    bound is a few times what rounding the dequantized weights to bf16 once costs: the products cancel heavily
    (weights ~0.5, the sums ~1/5 of their terms' spread), which magnifies that rounding."""
    m, k, n, bits, group, mode, kw = ZEROS_CASES[name]
    x, w = _inputs(rng, m, k, n, jnp.bfloat16)
    wq = _quantize(w * 0.1 + 0.5, bits, group, mode)
    assert float(jnp.abs(wq.zeros).mean()) > 0.3
    want = quantized_matmul(x, wq, impl="reference").astype(jnp.float32)
    rounded_once = x.astype(jnp.float32) @ dequantize_weights(wq)[:k].astype(jnp.bfloat16).astype(jnp.float32)
    inside = gpu.quantized_matmul(x, wq, interpret=True, zeros_in_kernel=True, **kw)
    outside = gpu.quantized_matmul(x, wq, interpret=True, zeros_in_kernel=False, **kw)
    assert gpu.plan(wq, m, kw.get("tile_k"), zeros_in_kernel=True).zeros
    assert _rel(outside, want) < 1e-2
    assert _rel(inside, want) < 3 * _rel(rounded_once, want) + 1e-3


# Activation rows not padded to 8 (gpu.UNPADDED_ROWS): (m, k, n, bits, group, mode). The 2-row batch-1 decode
# bucket, one row with a K the quantizer pads, and 136 rows (a multiple of 8; the second 128-row tile mostly past
# M). 13 rows are padded either way (Mosaic GPU's 8-row tiling).
UNPADDED_CASES = {"decode_2_rows_int8": (2, 512, 128, 8, None, False),
                  "one_row_int4_zeros_padded_k": (1, 1000, 128, 4, 32, "natural_zp"),
                  "odd_rows": (13, 512, 64, 8, None, False),
                  "past_one_tile": (136, 256, 64, 8, 32, False)}


@pytest.mark.parametrize("name", list(UNPADDED_CASES))
def test_gpu_kernel_reads_unpadded_rows_in_interpret_mode(rng, name):
    """The kernel given the M activation rows as they are (the last block's copy reads past them) gives exactly
    the padded call's product: a row past M only reaches output columns past M."""
    m, k, n, bits, group, mode = UNPADDED_CASES[name]
    x, w = _inputs(rng, m, k, n, jnp.bfloat16)
    wq = _quantize(w, bits, group, mode)
    unpadded = gpu.quantized_matmul(x, wq, interpret=True, unpadded_rows=True)
    padded = gpu.quantized_matmul(x, wq, interpret=True, unpadded_rows=False)
    assert unpadded.shape == (m, n)
    np.testing.assert_array_equal(np.asarray(unpadded, np.float32), np.asarray(padded, np.float32))


def _has_mosaic_gpu_bindings() -> bool:
    try:
        import jax._src.lib.mosaic_gpu  # noqa: F401
        from jax._src.lib import mosaic_gpu_dialect  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("m", [1, 2, 13, 300])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_per_channel_8bit_goes_to_xla_dot(rng, m, fmt):
    """Per-channel 8-bit weight-only products take XLA's dot on the widened codes on the GPU path (plain jnp, so
    CPU runs the very code a GPU does): no kernel in the program, and the kernel's arithmetic (codes exact in
    bf16, fp32 accumulation, the scale on the output), so it matches the kernel in interpret mode to rounding."""
    x, w = _inputs(rng, m, 320, 128, jnp.bfloat16)
    wq = quantize_weights(w, bits=8, fp8=fmt == "fp8")
    assert gpu.xla_takes(wq)
    call = jax.jit(lambda x, wq: quantized_matmul(x, wq, impl="gpu"))
    got = call(x, wq)
    lowered = call.lower(x, wq).as_text()
    assert "mosaic_gpu" not in lowered and "dot_general" in lowered
    assert got.shape == (m, 128) and got.dtype == jnp.bfloat16
    assert _rel(got, quantized_matmul(x, wq, impl="reference").astype(jnp.float32)) < 1e-2
    kernel = gpu.quantized_matmul(x, wq, interpret=True)
    assert _rel(got, np.asarray(kernel.astype(jnp.float32), np.float64)) < 2e-3  # bf16 output rounding apart


def test_grouped_and_w8a8_weights_stay_off_the_xla_dot():
    """Grouped scales, zero points, int4 and W8A8 keep their kernels: XLA would materialize dequantized weights."""
    w = jnp.ones((256, 128), jnp.float32)
    for wq in (quantize_weights(w, bits=8, group_size=32), quantize_weights(w, bits=4, group_size=32),
               quantize_weights(w, bits=4, group_size=32, zero_point=True),
               quantize_weights(w, bits=8, fp8=True, w8a8=True)):
        assert not gpu.xla_takes(wq)


@pytest.mark.parametrize("m, bits, group, zp", [(385, 8, None, False), (512, 8, 32, False), (193, 4, 32, True),
                                                 (256, 4, 128, False)])
def test_many_rows_dequantize_then_dot(rng, m, bits, group, zp):
    """From DEQUANTIZE_FROM_M rows the GPU path dequantizes (one XLA fusion) and runs XLA's dot, which is plain
    jnp, so CPU runs the very code a GPU does; below it the kernel runs (not lowered here: no GPU)."""
    assert gpu.dequantize_from_m(quantize_weights(jnp.ones((64, 64)), bits=bits)) <= m
    x, w = _inputs(rng, m, 576, 256, jnp.bfloat16)
    wq = quantize_weights(w, bits=bits, group_size=group, zero_point=zp)
    got = jax.jit(lambda x, wq: quantized_matmul(x, wq, impl="gpu"))(x, wq)
    want = quantized_matmul(x, wq, impl="reference")
    assert got.shape == (m, 256) and got.dtype == jnp.bfloat16
    assert _rel(got, want.astype(jnp.float32)) < 1e-2
    lowered = jax.jit(lambda x, wq: quantized_matmul(x, wq, impl="gpu")).lower(x, wq).as_text()
    assert "mosaic_gpu" not in lowered  # the kernel stays out of the many-row path


@pytest.mark.skipif(not _has_mosaic_gpu_bindings(),
                    reason="needs the Mosaic GPU bindings (jax-cuda13-plugin) to lower for CUDA")
@pytest.mark.parametrize("name", [*GPU_CASES, "llama_up_int4", "llama_down_int8", "w8a8_prefill"])
def test_gpu_kernel_lowers_for_cuda(name):
    """Mosaic GPU's Python passes (layout inference, wgmma operand and swizzle checks, TMA boxes,
    SMEM limits) run when lowering for CUDA, so this checks a kernel without a GPU (see
    test_ragged_paged_attention_gpu.test_gpu_kernel_lowers_for_cuda for the bindings)."""
    shapes = {"llama_up_int4": (1, 4096, 14336, 4, 128, False), "llama_down_int8": (64, 14336, 4096, 8, None, False),
              "w8a8_prefill": (4096, 4096, 14336, 8, None, "w8a8")}
    m, k, n, bits, group, mode = shapes.get(name) or GPU_CASES[name]
    wq = jax.eval_shape(lambda w: _quantize(w, bits, group, mode), jax.ShapeDtypeStruct((k, n), jnp.float32))
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    # Per-channel 8-bit weights go to XLA's dot on the GPU path (gpu.xla_takes); the kernel still takes them.
    call = gpu.quantized_matmul if gpu.xla_takes(wq) else lambda x, wq: quantized_matmul(x, wq, impl="gpu")
    lowered = jax.jit(call).trace(x, wq).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.skipif(not _has_mosaic_gpu_bindings(),
                    reason="needs the Mosaic GPU bindings (jax-cuda13-plugin) to lower for CUDA")
@pytest.mark.parametrize("name", [*ZEROS_CASES, "llama_up_int4_g32"])
def test_gpu_kernel_with_zero_points_inside_lowers_for_cuda(name):
    m, k, n, bits, group, mode, kw = ZEROS_CASES.get(name) or (1, 4096, 14336, 4, 32, "natural_zp", {})
    wq = jax.eval_shape(lambda w: _quantize(w, bits, group, mode), jax.ShapeDtypeStruct((k, n), jnp.float32))
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    call = lambda x, wq: gpu.quantized_matmul(x, wq, zeros_in_kernel=True, **kw)
    lowered = jax.jit(call).trace(x, wq).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in lowered


@pytest.mark.skipif(not _has_mosaic_gpu_bindings(),
                    reason="needs the Mosaic GPU bindings (jax-cuda13-plugin) to lower for CUDA")
@pytest.mark.parametrize("name", [*UNPADDED_CASES, "llama_up_2_rows"])
def test_gpu_kernel_with_unpadded_rows_lowers_for_cuda(name):
    """Mosaic GPU takes a TMA block of more rows than the activations have (its GMEM strides stay 16-byte
    multiples: K bf16 columns)."""
    m, k, n, bits, group, mode = UNPADDED_CASES.get(name) or (2, 4096, 14336, 8, None, False)
    wq = jax.eval_shape(lambda w: _quantize(w, bits, group, mode), jax.ShapeDtypeStruct((k, n), jnp.float32))
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    call = lambda x, wq: gpu.quantized_matmul(x, wq, unpadded_rows=True)
    lowered = jax.jit(call).trace(x, wq).lower(lowering_platforms=("cuda",)).as_text()
    kp, m8 = wq.padded_in_features, -(-m // 8) * 8
    tile_m = gpu.plan(wq, m).tile_m
    mp = -(-m8 // tile_m) * tile_m  # the rows the wrapper pads to when it pads
    assert "mosaic_gpu" in lowered and f"tensor<{m}x{kp}xbf16>" in lowered
    assert (f"tensor<{mp}x{kp}xbf16>" in lowered) == (m % 8 != 0 and m > 8)  # only odd row counts past 8 are padded


@pytest.mark.gpu
@pytest.mark.parametrize("name", [*UNPADDED_CASES, "llama_up_2_rows", "llama_down_1_row"])
def test_gpu_kernel_reads_unpadded_rows(rng, name):
    """gpu.UNPADDED_ROWS on the GPU: the product equals the padded call's, whatever the copy brings past row M."""
    m, k, n, bits, group, mode = UNPADDED_CASES.get(name) or {
        "llama_up_2_rows": (2, 4096, 14336, 8, None, False),
        "llama_down_1_row": (1, 14336, 4096, 4, 32, "natural_zp")}[name]
    x, w = _inputs(rng, m, k, n, jnp.bfloat16)
    wq = _quantize(w, bits, group, mode)
    unpadded = gpu.quantized_matmul(x, wq, unpadded_rows=True)
    padded = gpu.quantized_matmul(x, wq, unpadded_rows=False)
    np.testing.assert_array_equal(np.asarray(unpadded, np.float32), np.asarray(padded, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("m, k, n, bits, group, fp8", [
    (1, 4096, 1024, 8, None, False), (13, 1000, 512, 8, None, False),
    (64, 4096, 512, 4, 128, False), (5, 640, 256, 4, None, False), (8, 1024, 512, 8, None, True),
    (3, 768, 256, 4, 128, False), (1, 14336, 512, 4, 128, False),  # int4 steps of 2 and 4 chunks
    # Wide M with N = 264 tiles (no split-K): a full 4-stage pipeline of wide activation tiles in SMEM.
    (64, 4096, 16896, 4, 128, False), (128, 4096, 16896, 8, None, False),
    # GGUF layouts: groups of 16 / 32 / 64, zero points, K = 576.
    (1, 576, 1536, 8, 32, False), (4, 1536, 576, 8, 16, False), (1, 576, 1536, 4, 32, "zp"),
    (8, 2048, 640, 4, 64, False),
    # fp8 W8A8: decode (cols) and prefill (rows, warp-specialized).
    (1, 4096, 14336, 8, None, "w8a8"), (64, 4096, 1024, 8, None, "w8a8"), (512, 4096, 14336, 8, None, "w8a8"),
    (300, 1024, 384, 8, None, "w8a8"),
    # Many rows: dequantize + XLA's dot (gpu.DEQUANTIZE_FROM_M).
    (512, 4096, 1024, 8, None, False), (256, 4096, 1024, 4, 32, "zp"),
    # int4 in plain order (pack 2): Mosaic's int4 loads and conversion, groups in bf16.
    (1, 4096, 14336, 4, 32, "natural_zp"), (64, 4096, 1024, 4, 128, "natural"), (5, 640, 256, 4, None, "natural"),
    (1, 576, 1536, 4, 32, "natural_zp"), (8, 2048, 640, 4, 64, "natural"), (128, 4096, 16896, 4, 32, "natural_zp"),
    (256, 4096, 1024, 4, 32, "natural_zp")])
def test_gpu_kernel_matches_reference(rng, m, k, n, bits, group, fp8):
    x, w = _inputs(rng, m, k, n, jnp.bfloat16)
    wq = _quantize(w, bits, group, fp8)
    want = quantized_matmul(x, wq, impl="reference")
    got = quantized_matmul(x, wq, impl="gpu")
    assert got.dtype == jnp.bfloat16
    assert _rel(got, want.astype(jnp.float32)) < 1e-2
    if gpu.xla_takes(wq):  # the GPU path ran XLA's dot (gpu.convert_matmul): the kernel, which still takes them
        assert _rel(gpu.quantized_matmul(x, wq), want.astype(jnp.float32)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("name", [*ZEROS_CASES, "llama_up", "llama_down_g128", "rows_64"])
def test_gpu_kernel_adds_zero_points_in_the_kernel(rng, name):
    """gpu.ZEROS_IN_KERNEL's path on the GPU, held to the interpret-mode test's bound."""
    m, k, n, bits, group, mode, kw = ZEROS_CASES.get(name) or {
        "llama_up": (1, 4096, 14336, 4, 32, "natural_zp", {}),
        "llama_down_g128": (1, 14336, 4096, 4, 128, "natural_zp", {}),
        "rows_64": (64, 4096, 1024, 4, 32, "natural_zp", {})}[name]
    x, w = _inputs(rng, m, k, n, jnp.bfloat16)
    wq = _quantize(w * 0.1 + 0.5, bits, group, mode)
    want = quantized_matmul(x, wq, impl="reference").astype(jnp.float32)
    rounded_once = x.astype(jnp.float32) @ dequantize_weights(wq)[:k].astype(jnp.bfloat16).astype(jnp.float32)
    got = gpu.quantized_matmul(x, wq, zeros_in_kernel=True, **kw)
    assert _rel(got, want) < 3 * _rel(rounded_once, want) + 1e-3


@pytest.mark.gpu
def test_gpu_kernels_carry_their_names_into_profiles(rng):
    """The weight-only and fp8 kernels are named (kernel_name), so the bench's kernel classes count them as
    matmuls rather than as anonymous Mosaic GPU kernels it took for attention."""
    from jaxinfer.bench.measure import device_spans, kernel_class

    x, w = _inputs(rng, 1, 1024, 512, jnp.bfloat16)
    wq8, wq_fp8 = _quantize(w, 8, None, False), _quantize(w, 8, None, "w8a8")
    xs = jnp.asarray(rng.standard_normal((256, 1024), dtype=np.float32)).astype(jnp.bfloat16)
    _, spans = device_spans(lambda: (gpu.quantized_matmul(x, wq8), quantized_matmul(xs, wq_fp8, impl="gpu")))
    names = " ".join(spans)
    assert "quantized_matmul" in names and "fp8_matmul" in names, names
    # Only Mosaic kernels count: the profiler's own timing kernels live in C++ anonymous namespaces.
    assert not [n for n in spans if "mosaic_gpu" in n and "anonymous" in n], names
    assert {kernel_class(n) for n in spans if "quantized_matmul" in n or "fp8_matmul" in n} == {"matmul"}
