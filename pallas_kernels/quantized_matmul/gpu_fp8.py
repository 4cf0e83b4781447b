"""fp8 W8A8 matmul for Hopper (Pallas Mosaic GPU): e4m3 activations x e4m3 weights on fp8 wgmma.

`y = (xq @ wq^T) * sx[m] * sw[n]` where xq [M, K] e4m3 is x quantized per row (dynamic: sx = row
absmax / 448, the wrapper computes it in one fused XLA pass) and wq [N, K] e4m3 per output channel
(sw). Hopper's fp8 wgmma runs at twice the bf16 rate and takes both operands from shared memory,
K-major, which is exactly how both are stored ([M, K] and [N, K], K contiguous), so no operand is
converted or restaged: the fp32 accumulator is scaled once in the epilogue.

Two kernels, by M:
* "cols" (M <= 128, decode): `y^T [64, tile_m] = W [64, K] @ xq^T`, the weight tile the wgmma M side
  and the activation rows the narrow N side, split-K over the SMs like the weight-only kernel;
  partials (fp32) summed and scaled by the wrapper.
* "rows" (M > 128, prefill): a CTA computes a [128, tile_n] output tile; warpgroup 2 only issues the
  TMA copies (emit_pipeline_warp_specialized), warpgroups 0 and 1 each own 64 rows against the
  whole weight tile. The epilogue multiplies by the rows' sx and the columns' sw (copied to SMEM by
  each compute warpgroup before its pipeline) and stores bf16 with TMA.

GPU-only modules are imported inside the functions so this file imports on CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.quantized_matmul.reference import quantize_rows

_E4M3 = jnp.float8_e4m3fn
_TILE_N_COLS = 64
_NUM_SMS = 132
_SMEM_BUDGET = 220 * 1024
ROWS_MIN_M = 129  # M from which the rows kernel runs


@dataclasses.dataclass(frozen=True)
class RowsTiling:
    tile_n: int = 256  # per CTA; each compute warpgroup holds a [64, tile_n] fp32 accumulator
    tile_k: int = 128  # 128 e4m3 = one 128-byte swizzle row
    stages: int = 3


def _transforms(dtype, minor: int):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor * bits)
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


# ----------------------------------------------------------------------------- cols (decode)


def _cols_kernel(x_gmem, w_gmem, o_gmem, o_smem, *, k_steps, tile_m, tile_k):
    # x_gmem [Mp, Kp] e4m3, w_gmem [N, Kp] e4m3, o_gmem [splits, N, Mp] f32, o_smem [64, tile_m] f32
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    ni, ks, mi = (jax.lax.axis_index(a) for a in ("n", "k", "m"))
    k0 = ks * k_steps
    lag = min(1, k_steps - 1)  # keep one wgmma in flight; its slots are released a step late

    def step(_, w_smem, x_smem, acc_ref):
        plgpu.wgmma(acc_ref, w_smem, x_smem.T)  # [64, tk] @ [tk, tm], both K-major
        plgpu.wgmma_wait(lag)

    def acc_scope(acc_ref):
        plgpu.emit_pipeline(
            functools.partial(step, acc_ref=acc_ref), grid=(k_steps,),
            in_specs=[
                plgpu.BlockSpec((_TILE_N_COLS, tile_k), lambda k: (ni, k0 + k),
                                transforms=_transforms(_E4M3, tile_k), delay_release=lag),
                plgpu.BlockSpec((tile_m, tile_k), lambda k: (mi, k0 + k),
                                transforms=_transforms(_E4M3, tile_k), delay_release=lag),
            ],
            max_concurrent_steps=4,
        )(w_gmem, x_gmem)
        return acc_ref[...]  # waits for the last wgmma

    acc = pl.run_scoped(acc_scope, plgpu.ACC((_TILE_N_COLS, tile_m), jnp.float32))
    o_smem[...] = acc
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[ks, pl.ds(ni * _TILE_N_COLS, _TILE_N_COLS),
                                              pl.ds(mi * tile_m, tile_m)])
    plgpu.wait_smem_to_gmem(0)


def cols_tile_k(kp: int) -> int:
    return next(t for t in (256, 128, 64, 32) if kp % t == 0)


def _run_cols(xq, w, interpret):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    m, kp = xq.shape
    n = w.shape[0]
    tile_m = min(-(-m // 8) * 8, 128)
    mp = -(-m // tile_m) * tile_m
    xq = jnp.pad(xq, ((0, mp - m), (0, 0)))
    tile_k = cols_tile_k(kp)
    k_steps = kp // tile_k
    n_tiles = n // _TILE_N_COLS
    want = max(1, -(-2 * _NUM_SMS // n_tiles))
    splits = max(d for d in range(1, min(want, k_steps) + 1) if k_steps % d == 0)
    parts = plgpu.kernel(
        functools.partial(_cols_kernel, k_steps=k_steps // splits, tile_m=tile_m, tile_k=tile_k),
        out_type=jax.ShapeDtypeStruct((splits, n, mp), jnp.float32),
        scratch_types=[plgpu.SMEM((_TILE_N_COLS, tile_m), jnp.float32)],
        grid=(n_tiles, splits, mp // tile_m), grid_names=("n", "k", "m"), kernel_name="fp8_matmul_cols",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(xq, w)
    return parts.sum(axis=0).T[:m]  # [M, N] f32


# ----------------------------------------------------------------------------- rows (prefill)


def _rows_kernel(x_gmem, w_gmem, sx_gmem, sw_gmem, o_gmem, o_smem, sx_smem, sw_smem, barriers, *,
                 tiling: RowsTiling):
    # x_gmem [Mp, Kp] e4m3, w_gmem [N, Kp] e4m3, sx_gmem [Mp] f32, sw_gmem [N] f32, o_gmem [Mp, N];
    # o_smem [128, tn] out dtype; sx_smem [2, 64], sw_smem [2, tn] f32 (one per compute warpgroup).
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    mi, ni, wg = (jax.lax.axis_index(a) for a in ("m", "n", "wg"))
    tn, tk = tiling.tile_n, tiling.tile_k
    k_steps = x_gmem.shape[1] // tk
    lag = min(1, k_steps - 1)
    mine = pl.ds(wg * 64, 64)  # this compute warpgroup's rows of the CTA tile
    row0, col0 = mi * 128, ni * tn

    def compute_context(eval_pipeline):
        barrier = barriers.at[wg]
        plgpu.copy_gmem_to_smem(sx_gmem.at[pl.ds(row0 + wg * 64, 64)], sx_smem.at[wg], barrier)
        plgpu.copy_gmem_to_smem(sw_gmem.at[pl.ds(col0, tn)], sw_smem.at[wg], barrier)

        def acc_scope(acc_ref):
            eval_pipeline(acc_ref)
            plgpu.barrier_wait(barrier)
            acc = acc_ref[...]  # [64, tn]
            acc = acc * jax.lax.broadcast_in_dim(sx_smem[wg, :], acc.shape, [0])
            acc = acc * jax.lax.broadcast_in_dim(sw_smem[wg, :], acc.shape, [1])
            o_smem.at[mine][...] = acc.astype(o_smem.dtype)

        pl.run_scoped(acc_scope, plgpu.ACC((64, tn), jnp.float32))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[mine], o_gmem.at[pl.ds(row0 + wg * 64, 64), pl.ds(col0, tn)])
        plgpu.wait_smem_to_gmem(0)

    def step(_, x_smem, w_smem, acc_ref):
        plgpu.wgmma(acc_ref, x_smem.at[mine], w_smem.T)  # [64, tk] @ [tk, tn], both K-major
        plgpu.wgmma_wait(lag)
        return acc_ref

    plgpu.emit_pipeline_warp_specialized(
        step, grid=(k_steps,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
        in_specs=[
            plgpu.BlockSpec((128, tk), lambda k: (mi, k), transforms=_transforms(_E4M3, tk),
                            delay_release=lag),
            plgpu.BlockSpec((tn, tk), lambda k: (ni, k), transforms=_transforms(_E4M3, tk),
                            delay_release=lag),
        ],
        max_concurrent_steps=tiling.stages, compute_context=compute_context,
    )(x_gmem, w_gmem)


def rows_tiling(n: int, kp: int) -> RowsTiling:
    tile_n = 256 if n % 256 == 0 else 128
    tile_k = 128 if kp % 128 == 0 else 64
    return RowsTiling(tile_n=tile_n, tile_k=tile_k, stages=3 if tile_n == 256 else 4)


def rows_smem_bytes(t: RowsTiling, out_itemsize: int = 2) -> int:
    return t.stages * (128 + t.tile_n) * t.tile_k + 128 * t.tile_n * out_itemsize + (128 + 2 * t.tile_n) * 4


def _run_rows(xq, w, sx, sw, out_dtype, interpret, tiling=None):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    m, kp = xq.shape
    n = w.shape[0]
    t = tiling or rows_tiling(n, kp)
    mp = -(-m // 128) * 128
    xq = jnp.pad(xq, ((0, mp - m), (0, 0)))
    sx = jnp.pad(sx, (0, mp - m), constant_values=1.0)
    out = plgpu.kernel(
        functools.partial(_rows_kernel, tiling=t),
        out_type=jax.ShapeDtypeStruct((mp, n), out_dtype),
        scratch_types=[plgpu.SMEM((128, t.tile_n), out_dtype, transforms=_transforms(out_dtype, t.tile_n)),
                       plgpu.SMEM((2, 64), jnp.float32), plgpu.SMEM((2, t.tile_n), jnp.float32),
                       plgpu.Barrier(num_arrivals=2, num_barriers=2)],
        grid=(mp // 128, n // t.tile_n), grid_names=("m", "n"), num_threads=3, thread_name="wg",
        kernel_name="fp8_matmul_rows",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(xq, w, sx, sw)
    return out[:m]


def unsupported_reason(n: int, kp: int) -> str | None:
    if n % 128:
        return f"fp8 W8A8 GPU kernel needs N % 128 == 0, got {n}"
    if kp % 64:
        return f"fp8 W8A8 GPU kernel needs Kp % 64 == 0, got {kp}"
    return None


def w8a8_matmul(xp: jax.Array, values: jax.Array, w_scales: jax.Array, *, interpret: bool = False,
                path: str | None = None) -> jax.Array:
    """xp [M, Kp] (16-bit) @ e4m3 values [N, Kp] with per-channel scales [N] -> [M, N] in xp.dtype."""
    reason = unsupported_reason(values.shape[0], values.shape[1])
    if reason is not None:
        raise NotImplementedError(reason)
    xq, sx = quantize_rows(xp)
    path = path or ("rows" if xp.shape[0] >= ROWS_MIN_M else "cols")
    if path == "rows":
        return _run_rows(xq, values, sx, w_scales.astype(jnp.float32), xp.dtype, interpret)
    y = _run_cols(xq, values, interpret)  # [M, N] f32
    return (y * sx[:, None] * w_scales.astype(jnp.float32)[None, :]).astype(xp.dtype)
