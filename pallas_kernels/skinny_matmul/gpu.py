"""A decode step's dense products, y = x @ W for a few token rows, as one Mosaic GPU kernel (Hopper).

    parts [S, T, N] f32 = skinny_matmul(x [T, K], w [K, N], splits=S)
    out [T, N] f32      = skinny_matmul(x, w, splits=S, residual=r [T, N] f32)   # r + x @ w

At batch 1 a product like Qwen3-30B-A3B's q/k/v ([2, 2048] x [2048, 5120]) or its output projection
([2, 4096] x [4096, 2048]) is bound by reading W once. Inside that model's batch-1 decode loop on an H200 XLA's
GEMMs took 7.2 and 6.3 us a layer and this kernel 6.7 and 5.8, although standalone XLA's were the faster
(docs/PERFORMANCE.md, "Thirty-fifth session"). It is the expert kernel's gate/up orientation (gpu_swiglu, "cols")
for one dense weight: a CTA owns `tile_n` output channels and one of S slices of K, and computes
`acc^T [tile_n, 8] = W[k slice, n tile]^T @ x[0:8, k slice]^T`: the weight tile is wgmma's transposed A operand,
straight from the TMA pipeline's SMEM, and only the 8-row block of x is staged (the TMA fills rows past T with
zeros). Grid (S, N / tile_n): S splits K until the CTAs cover the SMs (at 8 slices, 640 CTAs for the q/k/v product
above and 256 for the output projection; 4 slices were as fast or slower).

Each CTA then picks its T token columns out of the accumulator (masked row sums in registers), lays them as
[T, tile_n] rows in SMEM and sends them with one TMA store: to its slice's partial in `parts`, or, given a
residual, as a TMA reduce-add into the residual's buffer (aliased, updated in place), so the caller needs no
kernel to sum the slices or add the residual. The reduce-adds of the S slices land in any order, so that sum's
last float32 bits may differ between runs.

16-bit x and W of one dtype, T <= 8 (Mosaic's TMA tiling takes fewer than 8 rows, or 8), K a multiple of
S * tile_k and N of tile_n (`takes`). Interpret mode (CPU) adds the rows with a load and a store (the interpreter
has no TMA reductions and runs the CTAs one after another).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul.gpu import _ROW_ALIGN, _interpret_params, _transforms

MAX_TOKENS = _ROW_ALIGN  # the x block's rows: one 8-row TMA tile


@dataclasses.dataclass(frozen=True)
class SkinnyTiling:
    tile_n: int = 64  # output channels per CTA: wgmma's M side is 64
    tile_k: int = 128  # K per pipeline step
    stages: int = 4  # pipeline depth


def plan(k: int, n: int, most_splits: int) -> tuple[int, SkinnyTiling] | None:
    """(splits, tiling) for a [K, N] weight: 128-wide K steps where K allows (64 otherwise), and the most K slices
    up to `most_splits` (a power of two) that K divides into whole steps; None where N is not a multiple of 64 or
    K of 64."""
    if n % 64 or k % 64:
        return None
    t = SkinnyTiling(tile_k=128 if k % 128 == 0 else 64)
    splits = 1
    while splits * 2 <= most_splits and k % (splits * 2 * t.tile_k) == 0:
        splits *= 2
    return splits, t


def takes(x, w, splits: int, t: SkinnyTiling = SkinnyTiling()) -> bool:
    """Whether the kernel takes x [T, K] @ w [K, N] in `splits` K slices (module docstring)."""
    if not all(isinstance(a, jax.Array | jax.ShapeDtypeStruct) for a in (x, w)):  # tracers are jax.Arrays
        return False
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0] or splits < 1:
        return False
    k, n = w.shape
    return (x.dtype in (jnp.bfloat16, jnp.float16) and w.dtype == x.dtype and 1 <= x.shape[0] <= MAX_TOKENS
            and k % (splits * t.tile_k) == 0 and n % t.tile_n == 0)


def _kernel(x_gmem, w_gmem, o_gmem, o_smem, *, t: SkinnyTiling, k_steps: int, accumulate: bool, interpret: bool):
    # x_gmem [T, K]; w_gmem [K, N]; o_gmem [S, T, N] f32 partials, or (accumulate) the residual [T, N] f32;
    # o_smem [T, tile_n] f32 (unswizzled: its rows go out in one TMA store).
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    ks, ni = jax.lax.axis_index("k"), jax.lax.axis_index("n")
    lag = min(1, k_steps - 1)  # one wgmma stays in flight; its slots are released a step late

    def product(acc_ref):
        x_spec = plgpu.BlockSpec((pl.Element(_ROW_ALIGN), t.tile_k), lambda k: (0, ks * k_steps + k),
                                 transforms=_transforms(x_gmem.dtype, t.tile_k), delay_release=lag)  # rows 0..7
        w_spec = plgpu.BlockSpec((t.tile_k, t.tile_n), lambda k: (ks * k_steps + k, ni),
                                 transforms=_transforms(w_gmem.dtype, t.tile_n), delay_release=lag)

        def step(_, x_smem, w_smem):
            plgpu.wgmma(acc_ref, w_smem.T, x_smem.T)  # [tn, tk] (M-major A) @ [tk, 8]
            plgpu.wgmma_wait(lag)

        plgpu.emit_pipeline(step, grid=(k_steps,), in_specs=[x_spec, w_spec],
                            max_concurrent_steps=t.stages)(x_gmem, w_gmem)
        return acc_ref[...]  # waits for the last wgmma

    acc = pl.run_scoped(product, plgpu.ACC((t.tile_n, _ROW_ALIGN), jnp.float32))  # [tn, 8]: column j is token j
    col = plgpu.broadcasted_iota(jnp.int32, acc.shape, 1, layout=plgpu.Layout.WGMMA)
    tokens = o_smem.shape[0]
    for j in range(tokens):
        o_smem.at[j][...] = jnp.sum(jnp.where(col == j, acc, 0.0), axis=1)  # [tn]: token j's row
    cols = pl.ds(ni * t.tile_n, t.tile_n)
    dst = o_gmem.at[:, cols] if accumulate else o_gmem.at[ks, :, cols]  # [T, tn]
    if accumulate and interpret:
        dst[...] = dst[...] + o_smem[...]
        return
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, dst, reduction_op="add" if accumulate else None)
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("splits", "tiling", "interpret"))
def skinny_matmul(x: jax.Array, w: jax.Array, residual: jax.Array | None = None, *, splits: int,
                  tiling: SkinnyTiling | None = None, interpret: bool = False) -> jax.Array:
    """[S, T, N] float32 partial products of x [T, K] @ w [K, N] over S slices of K, or with a float32 residual
    [T, N], residual + x @ w [T, N] float32 (module docstring)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    t = tiling or SkinnyTiling()
    if not takes(x, w, splits, t):
        raise ValueError(f"skinny_matmul takes 16-bit x [T <= {MAX_TOKENS}, K] and w [K, N] of its dtype with K a "
                         f"multiple of splits * tile_k = {splits * t.tile_k} and N of {t.tile_n}; got x {x.shape} "
                         f"{x.dtype}, w {w.shape} {w.dtype}")
    tokens, k = x.shape
    n = w.shape[1]
    accumulate = residual is not None
    if accumulate and (residual.shape != (tokens, n) or residual.dtype != jnp.float32):
        raise ValueError(f"the residual must be float32 [{tokens}, {n}], got {residual.shape} {residual.dtype}")
    launch = functools.partial(
        plgpu.kernel,
        functools.partial(_kernel, t=t, k_steps=k // t.tile_k // splits, accumulate=accumulate,
                          interpret=bool(interpret)),
        scratch_types=[plgpu.SMEM((tokens, t.tile_n), jnp.float32)],
        grid=(splits, n // t.tile_n), grid_names=("k", "n"), kernel_name="skinny_matmul",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=_interpret_params(interpret))
    if not accumulate:
        return launch(out_type=jax.ShapeDtypeStruct((splits, tokens, n), jnp.float32))(x, w)
    # The residual goes in as a Ref the kernel writes: its buffer is the kernel's output (aliased, updated in place).
    return pl.run_state(lambda out_ref: launch(out_type=())(x, w, out_ref))(residual)
