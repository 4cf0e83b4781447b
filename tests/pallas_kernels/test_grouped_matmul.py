"""Grouped matmul (MoE experts): reference vs a float64 oracle, TPU kernel (interpret mode) and GPU
kernels (Mosaic GPU interpret mode, and lowered for CUDA on CPU) vs the reference, the work-item
tables, and real-GPU cases marked `gpu`.

Every case draws fresh random inputs from the per-test seeded `rng` fixture; group sizes are
ragged, with empty groups, groups off the tile grid and rows past sum(group_sizes). Interpret
modes fill fresh memory with NaN, so a row the kernel forgets to write fails the comparison.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.grouped_matmul import (GpuTiling, QuantizedExperts, TpuTiling, dequantize, gather_matmul,
                                           grouped_matmul, quantize_experts, resolve_impl, swiglu_experts, tuning)
from pallas_kernels.grouped_matmul import gpu, gpu_swiglu, tpu

QWEN_EXPERTS = 128  # Qwen3-30B-A3B: 128 experts, top-8, hidden 2048, moe_intermediate_size 768
QWEN_SHAPES = {"gate_up": (2048, 768), "down": (768, 2048)}  # (K, N)


def _sizes(rng, total: int, groups: int, *, empty: int = 0) -> np.ndarray:
    """Random ragged group sizes summing to `total`, with `empty` groups forced to zero."""
    p = rng.dirichlet(np.full(groups, 0.7))
    if empty:
        p[rng.choice(groups, size=empty, replace=False)] = 0.0
        p /= p.sum()
    return rng.multinomial(total, p).astype(np.int32)


def _inputs(rng, m, k, n, sizes, dtype, quant=None):
    """lhs [M, K] in dtype, rhs [G, K, N] (dtype, or QuantizedExperts), group_sizes."""
    x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32)).astype(dtype)
    w = jnp.asarray(rng.standard_normal((len(sizes), k, n), dtype=np.float32) / np.sqrt(k))
    rhs = w.astype(dtype) if quant is None else quantize_experts(w, fp8=quant == "fp8")
    return x, rhs, jnp.asarray(sizes, jnp.int32)


def _rel(actual, expected) -> float:
    a = np.asarray(jnp.asarray(actual).astype(jnp.float32), np.float64)
    e = np.asarray(jnp.asarray(expected).astype(jnp.float32), np.float64)
    return float(np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30))


def _oracle(x, rhs, sizes) -> np.ndarray:
    """Float64 group by group, straight from the definition; rows past the groups are zeros."""
    w = dequantize(rhs) if isinstance(rhs, QuantizedExperts) else rhs
    x64 = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    w64 = np.asarray(jnp.asarray(w, jnp.float32), np.float64)
    out = np.zeros((x64.shape[0], w64.shape[2]))
    start = 0
    for g, size in enumerate(np.asarray(sizes)):
        out[start:start + size] = x64[start:start + size] @ w64[g]
        start += size
    return out


def _check_rows(out, want, sizes, tol):
    """Relative error over all rows, and exact zeros past sum(group_sizes)."""
    total = int(np.sum(sizes))
    assert out.shape == want.shape
    assert _rel(out, want) < tol, _rel(out, want)
    assert not np.any(np.asarray(jnp.asarray(out[total:], jnp.float32))), "rows past the groups"


# ----------------------------------------------------------------------------- reference


@pytest.mark.parametrize("quant", [None, "int8", "fp8"])
def test_reference_matches_float64_oracle(rng, quant):
    sizes = np.array([3, 0, 17, 1, 0, 9], np.int32)  # 30 of 34 rows, empty groups inside
    x, rhs, gs = _inputs(rng, 34, 48, 40, sizes, jnp.float32, quant)
    out = grouped_matmul(x, rhs, gs, impl="reference")
    assert out.dtype == jnp.float32
    _check_rows(out, _oracle(x, rhs, sizes), sizes, 1e-6)


@pytest.mark.parametrize("fp8", [False, True])
def test_quantize_experts_error_is_within_one_step(rng, fp8):
    w = jnp.asarray(rng.standard_normal((3, 96, 40), dtype=np.float32))
    wq = quantize_experts(w, fp8=fp8)
    assert wq.values.shape == (3, 40, 96) and wq.scales.shape == (3, 40)
    assert wq.shape == (3, 96, 40) and wq.fp8 == fp8
    err = np.abs(np.asarray(dequantize(wq)) - np.asarray(w))  # [G, K, N]
    if fp8:  # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 relative (plus the subnormal floor)
        bound = np.abs(np.asarray(w)) * 2.0**-4 + np.asarray(wq.scales)[:, None, :] * 2.0**-10
    else:  # half a quantization step per weight
        bound = np.asarray(wq.scales)[:, None, :] / 2 + 1e-7
    assert np.all(err <= bound)


@pytest.mark.parametrize("quant", [None, "int8", "fp8"])
def test_device_reference_of_the_gpu_tests_matches_the_spec(rng, quant):
    sizes = np.array([5, 0, 20, 9, 0], np.int32)
    x, rhs, gs = _inputs(rng, 40, 64, 32, sizes, jnp.bfloat16, quant)
    want = grouped_matmul(x, rhs, gs, impl="reference", preferred_element_type=jnp.float32)
    _check_rows(_device_reference(x, rhs, gs), want, sizes, 1e-5)


def test_quantized_experts_is_a_pytree(rng):
    wq = quantize_experts(jnp.asarray(rng.standard_normal((2, 64, 64), dtype=np.float32)))
    assert len(jax.tree_util.tree_leaves(wq)) == 2
    copy = jax.tree_util.tree_map(lambda a: a + 0, wq)
    assert isinstance(copy, QuantizedExperts) and copy.values.dtype == jnp.int8


@pytest.mark.parametrize("args, match", [
    (((4, 8), (2, 8, 16), (2,)), None),
    (((4, 8, 1), (2, 8, 16), (2,)), r"lhs must be \[M, K\]"),
    (((4, 8), (8, 16), (2,)), r"rhs must be \[G, K, N\]"),
    (((4, 9), (2, 8, 16), (2,)), "K = 9 columns but rhs has K = 8"),
    (((4, 8), (2, 8, 16), (3,)), r"group_sizes must be an integer array of shape \(2,\)"),
])
def test_bad_arguments_name_the_field(args, match):
    (xs, ws, gs) = args
    call = lambda: grouped_matmul(jnp.ones(xs), jnp.ones(ws), jnp.ones(gs, jnp.int32), impl="reference")
    if match is None:
        assert call().shape == (4, 16)
    else:
        with pytest.raises(ValueError, match=match):
            call()


def test_auto_routing():
    auto = resolve_impl("auto")
    assert auto == {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(jax.default_backend(), "reference")
    assert resolve_impl("auto", gpu_supported=False) in ("pallas_tpu", "reference")
    bf = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    assert gpu.supported(bf(8, 128), bf(4, 128, 64))
    assert not gpu.supported(jax.ShapeDtypeStruct((8, 128), jnp.float32), bf(4, 128, 64))
    assert not gpu.supported(bf(8, 96), bf(4, 96, 64))  # K off the 64 grid
    assert gpu.supported(bf(8, 128), QuantizedExperts(jax.ShapeDtypeStruct((4, 64, 128), jnp.int8),
                                                       jax.ShapeDtypeStruct((4, 64), jnp.float32)))
    with pytest.raises(ValueError, match="impl must be one of"):
        resolve_impl("triton")


# ----------------------------------------------------------------------------- work-item tables


def _rows_of_items(meta):
    group, row0, lo, hi = meta
    return [(g, r0, lo_, hi_) for g, r0, lo_, hi_ in zip(group, row0, lo, hi) if hi_ > lo_]


def _random_sizes(rng, m: int, groups: int) -> np.ndarray:
    """Ragged sizes with a random total <= m and a random number of empty groups."""
    return _sizes(rng, int(rng.integers(0, m + 1)), groups, empty=int(rng.integers(0, groups)))


@pytest.mark.parametrize("tile_m, m, groups", [(8, 13, 20), (16, 203, 9), (64, 300, 17), (128, 96, 3)])
def test_gpu_work_items_cover_every_row_once(rng, tile_m, m, groups):
    mp = -(-m // 8) * 8
    bound = gpu.max_work_items(mp, groups, tile_m)
    table = jax.jit(lambda s: gpu.work_items(s, mp, tile_m, bound, zero_tail=True))
    for _ in range(6):  # same shapes: one compile
        sizes = _random_sizes(rng, m, groups)
        items = table(jnp.asarray(sizes))
        meta = np.asarray(items.meta)
        owner = np.full(mp, -2)
        for grp, r0, lo, hi in _rows_of_items(meta):
            assert r0 % 8 == 0 and r0 <= lo < hi <= r0 + tile_m, (r0, lo, hi)
            assert np.all(owner[lo:hi] == -2), "a row written twice"
            owner[lo:hi] = grp
        want = np.repeat(np.arange(groups), sizes)
        np.testing.assert_array_equal(owner[:len(want)], want)
        assert np.all(owner[len(want):] == -1), "the tail must belong to the zero pseudo-group"
        # A group's items are consecutive and start at its first row rounded down to 8.
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        for grp in np.flatnonzero(sizes):
            w = int(items.first_item[grp])
            assert meta[0, w] == grp and meta[1, w] == starts[grp] // 8 * 8


@pytest.mark.parametrize("tile_m, m, groups", [(8, 61, 12), (32, 190, 7)])
def test_tpu_tile_items_visit_tiles_in_order_and_cover_every_row(rng, tile_m, m, groups):
    tiles = -(-m // tile_m)
    table = jax.jit(lambda s: tpu.tile_items(s, m, tiles, tile_m, tiles + min(groups, m)))
    for _ in range(6):
        sizes = _random_sizes(rng, m, groups)
        tile, group, lo, hi, first = np.asarray(table(jnp.asarray(sizes)))
        assert np.all(np.diff(tile) >= 0), "revisits of an output tile must be consecutive"
        assert set(tile) == set(range(tiles)), "every output tile needs at least one item"
        np.testing.assert_array_equal(first, np.r_[1, np.diff(tile) != 0])
        owner = np.full(tiles * tile_m, -1)
        for t, grp, a, b in zip(tile, group, lo, hi):
            assert a == b or t * tile_m <= a < b <= (t + 1) * tile_m
            assert np.all(owner[a:b] == -1)
            owner[a:b] = grp
        want = np.repeat(np.arange(groups), sizes)
        np.testing.assert_array_equal(owner[:len(want)], want)
        assert np.all(owner[len(want):] == -1)


# ----------------------------------------------------------------------------- TPU kernel


# name: (M, K, N, group sizes or (total, groups, empty), lhs dtype, quant, tiling)
TPU_CASES = {
    "f32_ragged_partial_tiles": (100, 256, 256, (93, 7, 2), jnp.float32, None, TpuTiling(16, 128, 128)),
    "bf16_ragged": (64, 256, 128, (64, 5, 1), jnp.bfloat16, None, TpuTiling(16, 128, 128)),
    "one_group_holds_all": (40, 128, 128, [0, 40, 0], jnp.float32, None, TpuTiling(16, 128, 128)),
    "all_groups_empty": (24, 128, 128, [0, 0], jnp.float32, None, TpuTiling(16, 128, 128)),
    "int8_experts": (72, 256, 256, (61, 6, 2), jnp.float32, "int8", TpuTiling(32, 128, 128)),
    "fp8_experts_bf16_lhs": (48, 128, 256, (48, 4, 1), jnp.bfloat16, "fp8", None),
}


def _case_sizes(rng, spec):
    if isinstance(spec, list):
        return np.asarray(spec, np.int32)
    return _sizes(rng, spec[0], spec[1], empty=spec[2])


@pytest.mark.parametrize("name", list(TPU_CASES))
def test_tpu_kernel_matches_reference(rng, name):
    m, k, n, spec, dtype, quant, tiling = TPU_CASES[name]
    sizes = _case_sizes(rng, spec)
    x, rhs, gs = _inputs(rng, m, k, n, sizes, dtype, quant)
    got = grouped_matmul(x, rhs, gs, impl="pallas_tpu", interpret=pltpu.InterpretParams(), tiling=tiling)
    want = grouped_matmul(x, rhs, gs, impl="reference")
    assert got.dtype == dtype
    _check_rows(got, want, sizes, 1e-5 if dtype == jnp.float32 else 4e-3)


def test_tpu_kernel_preferred_element_type(rng):
    sizes = _sizes(rng, 30, 3)
    x, rhs, gs = _inputs(rng, 32, 128, 128, sizes, jnp.bfloat16)
    got = grouped_matmul(x, rhs, gs, impl="pallas_tpu", interpret=True,
                         preferred_element_type=jnp.float32, tiling=TpuTiling(16, 128, 128))
    assert got.dtype == jnp.float32
    _check_rows(got, _oracle(x, rhs, sizes), sizes, 1e-5)


# ----------------------------------------------------------------------------- GPU kernels on CPU


# name: (M, K, N, sizes spec, quant, out dtype, tiling). Small, since the interpreter is slow.
GPU_INTERPRET_CASES = {
    "rows_bf16_f32_out": (100, 256, 128, (90, 5, 1), None, jnp.float32, GpuTiling("rows", 64, 64, 64, 2)),
    "rows_int8": (77, 256, 128, (70, 4, 1), "int8", jnp.bfloat16, GpuTiling("rows", 64, 128, 64, 2)),
    "cols_bf16_split_k": (44, 256, 128, (40, 6, 2), None, jnp.float32,
                          GpuTiling("cols", 16, 64, 64, 2, k_splits=2)),
    "cols_fp8": (21, 256, 128, [3, 0, 9, 1, 8], "fp8", jnp.bfloat16, GpuTiling("cols", 8, 64, 128, 2)),
    "cols_int8_split_k": (30, 256, 128, (26, 4, 1), "int8", jnp.bfloat16,
                          GpuTiling("cols", 8, 64, 64, 2, k_splits=2)),
    "rows_ws_bf16": (300, 256, 256, (280, 5, 1), None, jnp.bfloat16, GpuTiling("rows_ws", 128, 128, 64, 3)),
}


@pytest.mark.parametrize("name", list(GPU_INTERPRET_CASES))
def test_gpu_kernel_in_interpret_mode_matches_reference(rng, name):
    m, k, n, spec, quant, out_dtype, tiling = GPU_INTERPRET_CASES[name]
    sizes = _case_sizes(rng, spec)
    x, rhs, gs = _inputs(rng, m, k, n, sizes, jnp.bfloat16, quant)
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    # The race detector follows TMA copies, barriers and SMEM accesses (wgmma runs synchronously
    # in the interpreter, so an early slot release would not show here; see gpu.py).
    params = plgpu.InterpretGPUParams(detect_races=True)
    got = gpu.grouped_matmul(x, rhs, gs, preferred_element_type=out_dtype, tiling=tiling, interpret=params)
    assert not interpret_pallas_call.get_races().races_found
    want = grouped_matmul(x, rhs, gs, impl="reference", preferred_element_type=jnp.float32)
    assert got.dtype == out_dtype
    # f32 out: only the fp32 summation order differs; bf16 out: one rounding of the result.
    _check_rows(got, want, sizes, 1e-5 if out_dtype == jnp.float32 else 4e-3)


def _abstract_call(m, k, n, weights, groups=QWEN_EXPERTS):
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    if weights == "bf16":
        rhs = jax.ShapeDtypeStruct((groups, k, n), jnp.bfloat16)
    else:
        dtype = jnp.int8 if weights == "int8" else jnp.float8_e4m3fn
        rhs = QuantizedExperts(jax.ShapeDtypeStruct((groups, n, k), dtype),
                               jax.ShapeDtypeStruct((groups, n), jnp.float32))
    return x, rhs, jax.ShapeDtypeStruct((groups,), jnp.int32)


@pytest.mark.parametrize("tokens, weights, shape", [
    (1, "bf16", "gate_up"), (256, "bf16", "down"), (4096, "bf16", "gate_up"),
    (8, "int8", "down"), (64, "fp8", "gate_up"), (4096, "int8", "down"), (4096, "fp8", "gate_up"),
    (4096, "bf16 rows_ws", "down"),
])
def test_gpu_kernel_lowers_for_cuda_at_qwen3_moe_shapes(tokens, weights, shape):
    """Mosaic GPU's Python passes (layout inference, transforms, TMA and wgmma checks, the 227 KB
    shared-memory limit) run at lowering time, so lowering for CUDA on a CPU-only machine catches
    everything short of ptxas and the hardware itself."""
    k, n = QWEN_SHAPES[shape]
    weights, _, path = weights.partition(" ")
    tiling = GpuTiling(path, 128, 256, 64, 3) if path else None
    args = _abstract_call(tokens * 8, k, n, weights)
    call = lambda x, w, gs: gpu.grouped_matmul(x, w, gs, tiling=tiling)
    lowered = jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


def test_gpu_tilings_fit_shared_memory():
    for tokens in (1, 8, 64, 256, 4096):
        for k, n in QWEN_SHAPES.values():
            for wdtype in (jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn):
                for out in (jnp.bfloat16, jnp.float32):
                    t = gpu.choose_tiling(tokens * 8, k, n, QWEN_EXPERTS, jnp.bfloat16, wdtype, out)
                    gpu.check_tiling(t, k, n, quantized=wdtype != jnp.bfloat16)
                    assert gpu.smem_bytes(t, jnp.bfloat16, wdtype, out) <= tuning.SMEM_BUDGET, t
                    assert (t.path == "cols") == (tokens <= 256), t


def test_gpu_bad_tiling_is_rejected():
    x, rhs, gs = (jnp.zeros((8, 128), jnp.bfloat16), jnp.zeros((2, 128, 64), jnp.bfloat16),
                  jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="wgmma M"):
        gpu.grouped_matmul(x, rhs, gs, tiling=GpuTiling("rows", 32, 64, 64, 2))
    with pytest.raises(ValueError, match="fp32 accumulator"):
        gpu.check_tiling(GpuTiling("rows", 128, 256, 64, 2), 128, 256)
    with pytest.raises(ValueError, match="register weight tile"):
        gpu.check_tiling(GpuTiling("cols", 8, 128, 256, 2), 256, 128, quantized=True)
    with pytest.raises(NotImplementedError, match="bf16/f16 lhs"):
        gpu.grouped_matmul(x.astype(jnp.float32), rhs, gs)


# ----------------------------------------------------------------------------- real GPU


def _routed_sizes(rng, tokens: int, experts: int = QWEN_EXPERTS, top_k: int = 8) -> np.ndarray:
    """Group sizes of random top-k routing: each token picks top_k distinct experts."""
    picks = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    return np.bincount(picks.ravel(), minlength=experts).astype(np.int32)


def _device_inputs(rng, m, k, n, sizes, quant=None):
    """Like _inputs (bf16 lhs), drawn on the device: Qwen-sized experts are 200M weights."""
    kx, kw = jax.random.split(jax.random.key(int(rng.integers(2**31))))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = jax.random.normal(kw, (len(sizes), k, n), jnp.float32) * k**-0.5
    rhs = w.astype(jnp.bfloat16) if quant is None else quantize_experts(w, fp8=quant == "fp8")
    return x, rhs, jnp.asarray(sizes, jnp.int32)


def _device_reference(x, rhs, gs):
    """The spec at Qwen scale on a GPU: the reference's fp32 HIGHEST ragged_dot would take minutes
    (and XLA may expand it to a dense dot over all experts). bf16 x bf16 products are exact in an
    fp32 accumulator, and so are int8 / e4m3 values as bf16, so this differs from the spec only in
    summation order; quantized experts get their scales per row afterwards, as in the kernels."""
    if not isinstance(rhs, QuantizedExperts):
        return jax.lax.ragged_dot(x, rhs, gs, preferred_element_type=jnp.float32)
    values = jnp.swapaxes(rhs.values.astype(jnp.float32).astype(x.dtype), 1, 2)  # [G, K, N]
    out = jax.lax.ragged_dot(x, values, gs, preferred_element_type=jnp.float32)  # [M, N]
    rows = jnp.arange(x.shape[0])
    grp = jnp.minimum(jnp.searchsorted(jnp.cumsum(gs), rows, side="right"), gs.shape[0] - 1)
    return out * rhs.scales[grp]  # rows past the groups are already zeros


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["gate_up", "down"])
def test_gpu_rows_ws_matches_reference_at_qwen3_prefill(rng, shape):
    k, n = QWEN_SHAPES[shape]
    sizes = _routed_sizes(rng, 4096)
    x, rhs, gs = _device_inputs(rng, 4096 * 8, k, n, sizes)
    got = gpu.grouped_matmul(x, rhs, gs, tiling=GpuTiling("rows_ws", 128, 256, 64, 3))
    _check_rows(got, _device_reference(x, rhs, gs), sizes, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64, 256, 2048])
@pytest.mark.parametrize("weights", [None, "int8", "fp8"])
@pytest.mark.parametrize("shape", ["gate_up", "down"])
def test_gpu_kernel_matches_reference_at_qwen3_moe_shapes(rng, tokens, weights, shape):
    k, n = QWEN_SHAPES[shape]
    sizes = _routed_sizes(rng, tokens)
    x, rhs, gs = _device_inputs(rng, tokens * 8, k, n, sizes, weights)
    got = grouped_matmul(x, rhs, gs, impl="pallas_gpu")
    assert got.dtype == jnp.bfloat16
    _check_rows(got, _device_reference(x, rhs, gs), sizes, 1e-2)


GPU_EDGE_CASES = {  # (M, K, N, sizes spec, quant, tiling or None)
    "rows_sum_below_m_odd_m": (1003, 512, 256, (900, 16, 5), None, GpuTiling("rows", 128, 128, 64, 4)),
    "rows_one_group": (640, 256, 512, [0, 0, 640, 0], "int8", GpuTiling("rows", 128, 128, 64, 4)),
    "rows_fp8_f32_out": (515, 512, 256, (500, 8, 3), "fp8", GpuTiling("rows", 64, 256, 64, 3)),
    "rows_tile_n_64": (300, 1024, 192, (290, 9, 2), None, GpuTiling("rows", 64, 64, 128, 4)),
    "cols_all_empty": (16, 256, 128, [0, 0, 0], None, None),
    "cols_k_splits_int8": (37, 2048, 256, (30, 12, 4), "int8", GpuTiling("cols", 16, 64, 256, 4, k_splits=4)),
    "cols_tile_n_128_bf16": (150, 1024, 256, (140, 20, 6), None, GpuTiling("cols", 32, 128, 128, 3)),
    "cols_tile_m_64_fp8": (200, 512, 128, (200, 4, 0), "fp8", GpuTiling("cols", 64, 64, 128, 4)),
    "cols_one_step": (40, 64, 64, (40, 3, 0), None, GpuTiling("cols", 8, 64, 64, 2)),
    "rows_ws_128x256": (2000, 1024, 512, (1900, 24, 6), None, GpuTiling("rows_ws", 128, 256, 64, 3)),
    "rows_ws_f32_out": (1001, 512, 256, (990, 10, 2), None, GpuTiling("rows_ws", 128, 128, 64, 4)),
    "rows_ws_one_step": (260, 64, 128, (250, 4, 0), None, GpuTiling("rows_ws", 128, 128, 64, 2)),
}


@pytest.mark.parametrize("name", list(GPU_EDGE_CASES))
def test_gpu_edge_cases_lower_for_cuda(name):
    """The real-GPU cases below, lowered on CPU (so a layout or SMEM error shows up in CI)."""
    m, k, n, _, quant, tiling = GPU_EDGE_CASES[name]
    out_dtype = jnp.float32 if name.endswith("f32_out") else jnp.bfloat16
    x, rhs, gs = _abstract_call(m, k, n, quant or "bf16", groups=4)
    call = lambda x, w, gs: gpu.grouped_matmul(x, w, gs, tiling=tiling, preferred_element_type=out_dtype)
    jax.jit(call).trace(x, rhs, gs).lower(lowering_platforms=("cuda",))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_EDGE_CASES))
def test_gpu_kernel_edge_cases(rng, name):
    m, k, n, spec, quant, tiling = GPU_EDGE_CASES[name]
    sizes = _case_sizes(rng, spec)
    out_dtype = jnp.float32 if name.endswith("f32_out") else jnp.bfloat16
    x, rhs, gs = _inputs(rng, m, k, n, sizes, jnp.bfloat16, quant)
    got = gpu.grouped_matmul(x, rhs, gs, tiling=tiling, preferred_element_type=out_dtype)
    want = grouped_matmul(x, rhs, gs, impl="reference", preferred_element_type=jnp.float32)
    assert got.dtype == out_dtype
    _check_rows(got, want, sizes, 1e-5 if out_dtype == jnp.float32 else 1e-2)


@pytest.mark.gpu
def test_gpu_rows_and_cols_agree_on_the_same_call(rng):
    """Both kernels on one decode-sized call (and the auto route picks the GPU kernel)."""
    assert resolve_impl("auto") == "pallas_gpu"
    sizes = _routed_sizes(rng, 64)
    x, rhs, gs = _device_inputs(rng, 512, 2048, 768, sizes)
    cols = gpu.grouped_matmul(x, rhs, gs, tiling=GpuTiling("cols", 16, 64, 128, 4))
    rows = gpu.grouped_matmul(x, rhs, gs, tiling=GpuTiling("rows", 64, 128, 64, 4))
    rows_ws = gpu.grouped_matmul(x, rhs, gs, tiling=GpuTiling("rows_ws", 128, 256, 64, 3))
    auto = grouped_matmul(x, rhs, gs)
    assert _rel(cols, rows) < 1e-2 and _rel(rows_ws, rows) < 1e-2 and _rel(auto, cols) < 1e-2


# ----------------------------------------------------------------------------- per-pair form (gather_matmul)


def _pairs(rng, tokens: int, top_k: int, experts: int, *, skip: float = 0.25):
    """Rows and experts of `tokens` x `top_k` pairs (distinct experts per token), a share of them skipped
    (expert -1, as padding tokens and other devices' experts are) and one pair given an expert past G."""
    picks = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]  # [T, k]
    picks = np.where(rng.random(picks.shape) < skip, -1, picks).astype(np.int32)
    picks.ravel()[rng.integers(picks.size)] = experts  # outside [0, G): also skipped
    rows = np.repeat(np.arange(tokens, dtype=np.int32), top_k)
    return jnp.asarray(rows), jnp.asarray(picks.ravel())


def _pair_oracle(x, rhs, rows, experts) -> np.ndarray:
    w = dequantize(rhs) if isinstance(rhs, QuantizedExperts) else rhs
    x64 = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    w64 = np.asarray(jnp.asarray(w, jnp.float32), np.float64)
    out = np.zeros((len(rows), w64.shape[2]))
    for p, (r, e) in enumerate(zip(np.asarray(rows), np.asarray(experts))):
        if 0 <= e < w64.shape[0]:
            out[p] = x64[r] @ w64[e]
    return out


@pytest.mark.parametrize("quant", [None, "int8"])
def test_gather_matmul_reference_matches_float64_oracle(rng, quant):
    rows, experts = _pairs(rng, 5, 3, 6)
    x, rhs, _ = _inputs(rng, 5, 48, 40, np.zeros(6, np.int32), jnp.float32, quant)
    got = gather_matmul(x, rhs, rows, experts, impl="reference")
    assert _rel(got, _pair_oracle(x, rhs, rows, experts)) < 1e-6


GATHER_INTERPRET_CASES = {  # tokens, top_k, experts, K, N, quant, tiling or None (pair_tiling's)
    "bf16_default": (13, 4, 9, 256, 128, None, None),
    "bf16_k_splits_4": (6, 2, 5, 512, 64, None, GpuTiling("cols", 8, 64, 64, 2, k_splits=4)),
    "int8": (9, 3, 7, 256, 128, "int8", None),
    "fp8_tile_n_128": (4, 2, 3, 128, 256, "fp8", GpuTiling("cols", 8, 128, 64, 2, k_splits=1)),
}


@pytest.mark.parametrize("name", list(GATHER_INTERPRET_CASES))
def test_gather_matmul_gpu_kernel_in_interpret_mode_matches_reference(rng, name):
    """Pairs whose rows sit anywhere in their 8-row tile, shared and skipped experts, K splits; interpret mode
    fills fresh memory with NaN, so a skipped pair that leaked a tile would fail."""
    tokens, top_k, groups, k, n, quant, tiling = GATHER_INTERPRET_CASES[name]
    rows, experts = _pairs(rng, tokens, top_k, groups)
    x, rhs, _ = _inputs(rng, tokens, k, n, np.zeros(groups, np.int32), jnp.bfloat16, quant)
    got = gather_matmul(x, rhs, rows, experts, impl="pallas_gpu", interpret=True, tiling=tiling)
    want = gather_matmul(x, rhs, rows, experts, impl="reference", preferred_element_type=jnp.float32)
    assert got.shape == (tokens * top_k, n) and got.dtype == jnp.bfloat16
    assert _rel(got, want) < 4e-3, _rel(got, want)
    skipped = ~((experts >= 0) & (experts < groups))
    assert not np.any(np.asarray(got[skipped], np.float32)), "skipped pairs must be exact zeros"


def test_pair_tiling_splits_k_to_cover_the_sms_and_divides_the_steps():
    gate = gpu.pair_tiling(2048, 768, jnp.bfloat16)  # 12 N tiles x 8 live pairs = 96 CTAs < 132 SMs
    assert (gate.path, gate.tile_m, gate.k_splits) == ("cols", 8, 2)
    down = gpu.pair_tiling(768, 2048, jnp.bfloat16)  # 32 N tiles x 8 = 256 CTAs: no split
    assert down.k_splits == 1
    odd = gpu.pair_tiling(768, 2048, jnp.bfloat16, GpuTiling("cols", 8, 64, 128, 4, k_splits=4))
    assert odd.k_splits == 3  # 6 K steps: the largest divisor not above the 4 asked for


@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_gather_matmul_lowers_for_cuda_at_qwen3_decode_shapes(weights):
    x, rhs, _ = _abstract_call(16, 2048, 768, weights)
    pairs = jax.ShapeDtypeStruct((128,), jnp.int32)
    lowered = jax.jit(lambda x, w, r, e: gpu.gather_matmul(x, w, r, e)).trace(x, rhs, pairs, pairs).lower(
        lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("weights", [None, "int8", "fp8"])
@pytest.mark.parametrize("shape", ["gate_up", "down"])
@pytest.mark.parametrize("tokens, live", [(16, 1), (16, 8), (16, 16)])
def test_gpu_gather_matmul_matches_reference_at_qwen3_decode(rng, tokens, live, weights, shape):
    """The engine's decode buckets: 16 tokens x top-8, `live` of them real (the rest skipped pairs)."""
    k, n = QWEN_SHAPES[shape]
    rows, experts = _pairs(rng, tokens, 8, QWEN_EXPERTS, skip=0.0)
    experts = jnp.where(rows < live, experts, -1)
    x, rhs, _ = _device_inputs(rng, tokens * 8 if shape == "down" else tokens, k, n,
                               np.zeros(QWEN_EXPERTS, np.int32), weights)
    if shape == "down":  # the down projection reads one row per pair
        rows = jnp.arange(tokens * 8, dtype=jnp.int32)
    got = gather_matmul(x, rhs, rows, experts, impl="pallas_gpu")
    # The grouped kernel's device reference, one group per pair: exact products, fp32 sums.
    ids = jnp.where((experts >= 0) & (experts < QWEN_EXPERTS), experts, QWEN_EXPERTS)  # skipped pairs last
    order = jnp.argsort(ids, stable=True)
    sizes = jnp.zeros((QWEN_EXPERTS,), jnp.int32).at[ids].add(1, mode="drop")
    sorted_out = _device_reference(x[rows[order]], rhs, sizes)  # [P, N], pairs in expert order
    want = jnp.zeros_like(sorted_out).at[order].set(sorted_out)
    assert _rel(got, want) < 1e-2, _rel(got, want)


# ----------------------------------------------------------------------------- fused MoE SwiGLU (swiglu_experts)


def _swiglu_weights(key, groups, d, f, dtype=jnp.bfloat16):
    """Gate, up and down weights scaled so the SwiGLU output stays O(1); drawn on the device."""
    kg, ku, kd = jax.random.split(key, 3)
    draw = lambda k, shape, fan_in: (jax.random.normal(k, shape, jnp.float32) * fan_in**-0.5).astype(dtype)  # noqa: E731
    return draw(kg, (groups, d, f), d), draw(ku, (groups, d, f), d), draw(kd, (groups, f, d), f)


def _routing(rng, tokens, top_k, experts, offset=0):
    """Global expert ids [T, k] (distinct per token) over experts + 2 * offset ids, so with an offset some land
    below and above the local range; valid [T] with the last quarter of the tokens (at least one) padding."""
    ids = np.argsort(rng.random((tokens, experts + 2 * offset)), axis=1)[:, :top_k].astype(np.int32)
    valid = np.arange(tokens) < max(1, tokens - max(1, tokens // 4))
    return jnp.asarray(ids), jnp.asarray(valid)


def _swiglu_oracle(x, wg, wu, wd, experts, valid, offset=0) -> np.ndarray:
    """float64, slot-major [k, T, D]: silu(x[t] @ Wg[e]) * (x[t] @ Wu[e]) @ Wd[e] per live pair, zeros elsewhere."""
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    x, wg, wu, wd = map(f64, (x, wg, wu, wd))
    tokens, top_k = experts.shape
    out = np.zeros((top_k, tokens, x.shape[1]))
    for t in range(tokens):
        for j in range(top_k):
            e = int(experts[t, j]) - offset
            if valid[t] and 0 <= e < wg.shape[0]:
                g, u = x[t] @ wg[e], x[t] @ wu[e]
                out[j, t] = (g / (1 + np.exp(-g)) * u) @ wd[e]
    return out


def _live(experts, valid, offset, groups) -> np.ndarray:
    """[k, T] bool: the pairs a kernel computes."""
    local = np.asarray(experts).T - offset
    return (local >= 0) & (local < groups) & np.asarray(valid)[None, :]


def test_swiglu_experts_reference_matches_float64_oracle(rng):
    experts, valid = _routing(rng, 5, 3, 6, offset=2)
    x = jnp.asarray(rng.standard_normal((5, 32)), jnp.float32)
    wg, wu, wd = _swiglu_weights(jax.random.key(int(rng.integers(2**31))), 6, 32, 24, jnp.float32)
    got = swiglu_experts(x, wg, wu, wd, experts, valid, 2, impl="reference")
    assert got.shape == (1, 3, 5, 32) and got.dtype == jnp.float32
    assert _rel(got[0], _swiglu_oracle(x, wg, wu, wd, experts, valid, 2)) < 1e-6


SWIGLU_INTERPRET_CASES = {  # tokens, top_k, experts, expert offset, D, F, tiling or None (the default)
    "default_tiles": (11, 3, 7, 0, 256, 128, None),  # 33 pairs: 128-channel slices
    "default_tiles_batch_1": (2, 8, 9, 0, 256, 128, None),  # 16 pairs: 64-channel slices
    "expert_offset": (6, 2, 4, 3, 256, 256, gpu_swiglu.SwigluTiling(tile_f=128, tile_k=64, tile_d=128, stages=2)),
    "one_k_step": (3, 4, 5, 0, 128, 64, gpu_swiglu.SwigluTiling(tile_f=64, tile_k=128, tile_d=64, stages=2)),
    "d256": (5, 2, 3, 0, 512, 64, gpu_swiglu.SwigluTiling(tile_f=64, tile_k=64, tile_d=256, stages=2)),
    "rows_down": (9, 3, 5, 0, 256, 128, gpu_swiglu.SwigluTiling(stages=2, down="rows")),
}


@pytest.mark.parametrize("name", list(SWIGLU_INTERPRET_CASES))
def test_swiglu_experts_gpu_kernel_in_interpret_mode_matches_oracle(rng, name):
    """Tokens anywhere in their 8-row tile (rows past the last one zero-filled by the TMA), padding tokens,
    experts held elsewhere (an offset), one and several K and D steps, both down orientations."""
    tokens, top_k, groups, offset, d, f, tiling = SWIGLU_INTERPRET_CASES[name]
    experts, valid = _routing(rng, tokens, top_k, groups, offset)
    x = jnp.asarray(rng.standard_normal((tokens, d)), jnp.bfloat16)
    wg, wu, wd = _swiglu_weights(jax.random.key(int(rng.integers(2**31))), groups, d, f)
    parts = swiglu_experts(x, wg, wu, wd, experts, valid, offset, impl="pallas_gpu", interpret=True, tiling=tiling)
    slices = f // (tiling or gpu_swiglu.default_tiling(tokens * top_k, f, d)).tile_f
    assert parts.shape == (slices, top_k, tokens, d) and parts.dtype == jnp.float32
    live = _live(experts, valid, offset, groups)
    assert 0 < live.sum() < live.size
    got = np.asarray(parts.sum(axis=0))[live]
    want = _swiglu_oracle(x, wg, wu, wd, experts, valid, offset)[live]
    assert np.isfinite(got).all() and _rel(got, want) < 1e-2, _rel(got, want)


def test_swiglu_experts_takes_16_bit_weights_only_and_checks_tilings():
    x = jax.ShapeDtypeStruct((2, 2048), jnp.bfloat16)
    wg = jax.ShapeDtypeStruct((128, 2048, 768), jnp.bfloat16)
    wd = jax.ShapeDtypeStruct((128, 768, 2048), jnp.bfloat16)
    assert gpu_swiglu.supported(x, wg, wg, wd)
    quantized = QuantizedExperts(jax.ShapeDtypeStruct((128, 768, 2048), jnp.int8),
                                 jax.ShapeDtypeStruct((128, 768), jnp.float32))
    assert not gpu_swiglu.supported(x, quantized, wg, wd)
    assert not gpu_swiglu.supported(jax.ShapeDtypeStruct((2, 2048), jnp.float32), wg, wg, wd)
    assert not gpu_swiglu.supported(x, jax.ShapeDtypeStruct((128, 2048, 96), jnp.bfloat16), wg, wd)
    with pytest.raises(ValueError, match="tile_f must be 64 or 128 and divide F=768"):
        gpu_swiglu.check_tiling(gpu_swiglu.SwigluTiling(tile_f=256), 2048, 768)
    with pytest.raises(ValueError, match="shared memory"):
        gpu_swiglu.check_tiling(gpu_swiglu.SwigluTiling(tile_f=128, tile_k=128, stages=3, down="rows"), 2048, 768)
    with pytest.raises(ValueError, match="down must be 'cols' or 'rows'"):
        gpu_swiglu.check_tiling(gpu_swiglu.SwigluTiling(down="sideways"), 2048, 768)


def test_swiglu_default_tiling_by_pairs():
    """64-channel slices for the batch-1 bucket's 16 pairs, 128 above it where F allows; both fit SMEM."""
    assert gpu_swiglu.default_tiling(16, 768, 2048).tile_f == 64
    assert gpu_swiglu.default_tiling(128, 768, 2048).tile_f == 128
    assert gpu_swiglu.default_tiling(128, 64 * 5, 2048).tile_f == 64  # 320 channels: no 128 slices
    assert gpu_swiglu.default_tiling(16, 768, 2048).tile_d == 256  # the batch-1 bucket's down steps, where D allows
    assert gpu_swiglu.default_tiling(16, 768, 128 * 3).tile_d == 128
    for pairs, f in ((16, 768), (128, 768), (128, 14336)):
        gpu_swiglu.check_tiling(gpu_swiglu.default_tiling(pairs, f, 2048), 2048, f)


@pytest.mark.parametrize("d, f, tiling", [
    (2048, 768, None),  # Qwen3-30B-A3B
    (4096, 14336, None),  # Mixtral-8x7B
    (2048, 768, gpu_swiglu.SwigluTiling(tile_f=128, tile_k=64, tile_d=128, stages=3)),
    (2048, 768, gpu_swiglu.SwigluTiling(down="rows")),
])
def test_swiglu_experts_lowers_for_cuda(d, f, tiling):
    x = jax.ShapeDtypeStruct((2, d), jnp.bfloat16)
    wg = jax.ShapeDtypeStruct((8, d, f), jnp.bfloat16)
    wd = jax.ShapeDtypeStruct((8, f, d), jnp.bfloat16)
    experts, valid = jax.ShapeDtypeStruct((2, 8), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.bool_)
    call = lambda *a: gpu_swiglu.swiglu_experts(*a, expert_offset=0, tiling=tiling)  # noqa: E731
    lowered = jax.jit(call).trace(x, wg, wg, wd, experts, valid).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("tiling", [None, gpu_swiglu.SwigluTiling(tile_f=128, tile_k=64, tile_d=128, stages=3),
                                    gpu_swiglu.SwigluTiling(down="rows")])
@pytest.mark.parametrize("tokens, live", [(2, 1), (16, 1), (16, 8), (16, 16)])
def test_gpu_swiglu_experts_matches_reference_at_qwen3_decode(rng, tokens, live, tiling):
    """The engine's decode buckets: `tokens` rows x top-8 of 128 experts, `live` of them real."""
    d, f = 2048, 768
    experts, _ = _routing(rng, tokens, 8, QWEN_EXPERTS)
    valid = jnp.arange(tokens) < live
    x = jax.random.normal(jax.random.key(int(rng.integers(2**31))), (tokens, d), jnp.bfloat16)
    wg, wu, wd = _swiglu_weights(jax.random.key(int(rng.integers(2**31))), QWEN_EXPERTS, d, f)
    parts = swiglu_experts(x, wg, wu, wd, experts, valid, impl="pallas_gpu", tiling=tiling)
    keep = _live(experts, valid, 0, QWEN_EXPERTS)
    got = np.asarray(parts.sum(axis=0))[keep]
    # The three-launch kernel path as the device reference: exact bf16 products, fp32 sums.
    local = jnp.where(jnp.asarray(keep), experts.T, -1).reshape(-1)  # [k*T], slot-major
    rows = jnp.tile(jnp.arange(tokens, dtype=jnp.int32), 8)
    gate = gather_matmul(x, wg, rows, local, impl="pallas_gpu", preferred_element_type=jnp.float32)
    up = gather_matmul(x, wu, rows, local, impl="pallas_gpu", preferred_element_type=jnp.float32)
    hidden = (jax.nn.silu(gate) * up).astype(jnp.bfloat16)
    want = gather_matmul(hidden, wd, jnp.arange(rows.shape[0], dtype=jnp.int32), local, impl="pallas_gpu",
                         preferred_element_type=jnp.float32).reshape(8, tokens, d)
    assert np.isfinite(got).all() and _rel(got, np.asarray(want)[keep]) < 1e-2
