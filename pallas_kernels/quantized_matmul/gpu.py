"""Weight-only quantized matmul for Hopper as a Pallas Mosaic GPU kernel (wgmma, TMA pipeline).

At decode sizes (M = 1..64) the product is bound by reading the weights, so the kernel computes
`y^T [N, M] = W [N, K] @ x^T [K, M]`: a 64-row weight tile is the wgmma M operand, dequantized from
SMEM into registers (int8 / fp8 -> bf16 exactly; int4 nibbles -> bf16; grouped scales multiplied in
on the way), and the few activation rows are the narrow wgmma N dimension (padded to a multiple of
8 only). Each CTA owns 64 output channels and one K slice (split-K, sized so the grid covers every
SM twice); `plgpu.emit_pipeline` keeps `_STAGES` weight/activation tiles in flight. Split-K
partials (fp32, [splits, N, Mp]) are summed and per-channel scales applied in the wrapper, which is
a few hundred KB of traffic next to the megabytes of weights.

Pieces. A pipeline step covers `tile_k` of K. Its weights arrive as one or more SMEM blocks, each a
BlockSpec of its own, so no swizzled tile is ever sliced:
* 8-bit per channel: one `[64, tile_k]` block;
* 8-bit grouped (GGUF Q8_0 / Q5_* / Q6_K repacks, groups 16-128): one `[64, min(group, 128)]`
  block per piece, dequantized with its group's scale row;
* int4: one `[64, pack / 2]`-byte block per packing chunk, unpacked into two halves of pack / 2
  elements; each half lies inside one group (reference.default_pack), so it takes one scale row.
The activation tile is swizzled at the width of one piece so each piece's columns are a whole
number of swizzle tiles. Zero points (GGUF mins) are added by the wrapper: `xsum @ zeros`.

Interpret mode (CPU): the interpreter's wgmma reads only SMEM operands, so with interpret=True each
dequantized piece is staged through an SMEM buffer first; everything else is the kernel's code.

GPU-only modules are imported inside the functions so this file imports on CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.quantized_matmul.reference import (QuantizedWeights, dequantize_weights,
                                                        pad_activations, zero_point_term)

_TILE_N = 64  # wgmma M: output channels per CTA
_TILE_K_INT4 = 512  # int4: 16 KB of weights per pipeline step; a 128-wide step was bound by its
                    # fixed per-step cost (copy wait, barrier, wgmma wait), not by the weight bytes
_TILE_K_8BIT = 256  # int8/fp8: 16 KB of weights per step
_MAX_PIECE = 128  # widest 8-bit grouped piece (and int4 packing chunk)
_MAX_TILE_M = 128
_STAGES = 4
_NUM_SMS = 132
_SMEM_BUDGET = 220 * 1024  # of the 227 KB a Hopper block may use, leaving room for Mosaic's barriers


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static shape of one call: step width, SMEM pieces per step and their K widths."""

    tile_m: int
    tile_k: int
    piece_k: int  # K elements of one SMEM weight block
    halves: int  # dequantized parts per block: 2 for int4 (low/high nibbles), 1 otherwise
    scale_rows: int  # scale rows one step reads (0: per channel, applied by the wrapper)
    stages: int = _STAGES  # pipeline steps in flight

    @property
    def pieces(self) -> int:
        return self.tile_k // self.piece_k

    @property
    def part_k(self) -> int:
        """K elements of one dequantized part (the activation swizzle follows it)."""
        return self.piece_k // self.halves


def _transforms(dtype, minor: int):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor * bits)
    if swizzle == 16:  # 16-byte rows (8-bit groups of 16) take no swizzle, only the 8-row tiling
        return (plgpu.TilingTransform((8, 16 * 8 // bits)),)
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def _piece_k(wq: QuantizedWeights, tile_k: int) -> int:
    if wq.bits == 4:
        return wq.pack
    return tile_k if wq.per_channel else min(wq.group_size, _MAX_PIECE)


def smem_bytes(wq: QuantizedWeights, tile_m: int, tile_k: int, interpret: bool = False,
               stages: int = _STAGES) -> int:
    """Shared memory of one CTA: `stages` x (weights + activations + scale rows) plus the output
    tile (and, in interpret mode, the staging buffer)."""
    weight_bytes = _TILE_N * tile_k * wq.bits // 8
    scale_rows = 0 if wq.per_channel else max(1, tile_k // wq.group_size)
    per_stage = weight_bytes + tile_m * tile_k * 2 + max(scale_rows, 1) * _TILE_N * 4
    staging = _TILE_N * _piece_k(wq, tile_k) * 2 if interpret else 0
    return stages * per_stage + _TILE_N * tile_m * 4 + staging


def step_k(wq: QuantizedWeights, tile_m: int = 8, preferred: int | None = None, stages: int = _STAGES) -> int:
    """K per pipeline step: the preferred size, halved until it divides Kp, holds whole pieces and
    groups, and the pipeline fits in shared memory (wide activation tiles, M >= 32, take most)."""
    kp = wq.padded_in_features
    unit = wq.pack if wq.bits == 4 else (32 if wq.per_channel else min(wq.group_size, _MAX_PIECE))
    tile_k = preferred or (_TILE_K_INT4 if wq.bits == 4 else _TILE_K_8BIT)
    while tile_k > unit and (kp % tile_k or tile_k % unit
                             or smem_bytes(wq, tile_m, tile_k, stages=stages) > _SMEM_BUDGET):
        tile_k //= 2
    if kp % tile_k or tile_k % unit:
        raise NotImplementedError(f"GPU kernel: no K step divides Kp={kp} in whole pieces of {unit}")
    return tile_k


def plan(wq: QuantizedWeights, m: int, tile_k: int | None = None, stages: int = _STAGES) -> Plan:
    """The call's static shape; `tile_k` overrides the preferred K step (still fitted to Kp and SMEM)."""
    mp = -(-m // 8) * 8
    tile_m = min(mp, _MAX_TILE_M)
    tile_k = step_k(wq, tile_m, tile_k, stages)
    scale_rows = 0 if wq.per_channel else max(1, tile_k // wq.group_size)
    return Plan(tile_m, tile_k, _piece_k(wq, tile_k), 2 if wq.bits == 4 else 1, scale_rows, stages)


def _dequantized_parts(w_refs, s_smem, wq_meta, p: Plan, dtype):
    """The step's weights in registers as [(tile [64, part_k], k offset in the step)], grouped
    scales multiplied in (int4 halves and 8-bit pieces each sit inside one group)."""
    bits, group = wq_meta
    parts = []
    for c, w_ref in enumerate(w_refs):
        base = c * p.piece_k
        if bits == 8:
            w = w_ref[...]
            if w.dtype == jnp.float8_e4m3fn:
                # ptxas of CUDA 13.0 converts e4m3 only to f16 directly; through f32 is exact too.
                w = w.astype(jnp.float32)
            halves = [(w, base)]
        else:
            # Mosaic GPU does no arithmetic on 8-bit registers: widen before unpacking the nibbles.
            packed = w_ref[...].astype(jnp.int32)  # [64, pack/2]: element j low, j + pack/2 high
            halves = [((packed & 0xF).astype(jnp.float32) - 8.0, base),
                      (((packed >> 4) & 0xF).astype(jnp.float32) - 8.0, base + p.part_k)]
        for h, off in halves:
            if p.scale_rows:
                row = off // group if group <= p.tile_k else 0
                scale = s_smem[row, :].astype(jnp.float32)  # [64]
                h = h.astype(jnp.float32) * jax.lax.broadcast_in_dim(scale, (_TILE_N, p.part_k), [0])
            parts.append((h.astype(dtype), off))
    return parts


def _qmm_kernel(x_gmem, w_gmem, s_gmem, o_gmem, o_smem, *stage, wq_meta, p: Plan, k_steps_per_split):
    # x_gmem [Mp, Kp] bf16, w_gmem [N, Kp] (int4: [N, Kp/2]), s_gmem [G, N],
    # o_gmem [splits, N, Mp] f32 (transposed partial products), o_smem [64, tile_m] f32,
    # stage (interpret mode only): [64, part_k] in the activation dtype.
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    bits, group = wq_meta
    ni, ks, mi = (jax.lax.axis_index(a) for a in ("n", "k", "m"))
    k0 = ks * k_steps_per_split
    w_cols = p.piece_k // 2 if bits == 4 else p.piece_k  # bytes of one piece per row

    def step(_, *refs, acc_ref):
        w_refs, x_smem, s_smem = refs[:p.pieces], refs[p.pieces], refs[p.pieces + 1]
        for w, off in _dequantized_parts(w_refs, s_smem, wq_meta, p, x_smem.dtype):
            if stage:  # the interpreter's wgmma reads its A operand only from SMEM
                stage[0][...] = w
                plgpu.commit_smem()
                w = stage[0]
            plgpu.wgmma(acc_ref, w, x_smem.at[:, pl.ds(off, p.part_k)].transpose((1, 0)))
            plgpu.wgmma_wait(0)

    w_specs = [plgpu.BlockSpec((_TILE_N, w_cols), lambda k, c=c: (ni, (k0 + k) * p.pieces + c),
                               transforms=_transforms(w_gmem.dtype, w_cols)) for c in range(p.pieces)]
    x_spec = plgpu.BlockSpec((p.tile_m, p.tile_k), lambda k: (mi, k0 + k),
                             transforms=_transforms(x_gmem.dtype, min(p.part_k, p.tile_k)))
    if not p.scale_rows:  # per channel: one row, applied by the wrapper
        s_spec = plgpu.BlockSpec((1, _TILE_N), lambda k: (0, ni))
    elif group <= p.tile_k:  # the step's groups
        s_spec = plgpu.BlockSpec((p.scale_rows, _TILE_N), lambda k: (k0 + k, ni))
    else:  # the step lies inside one group
        s_spec = plgpu.BlockSpec((1, _TILE_N), lambda k: ((k0 + k) * p.tile_k // group, ni))

    def acc_scope(acc_ref):
        plgpu.emit_pipeline(
            functools.partial(step, acc_ref=acc_ref),
            grid=(k_steps_per_split,),
            in_specs=[*w_specs, x_spec, s_spec],
            max_concurrent_steps=p.stages,
        )(*[w_gmem] * p.pieces, x_gmem, s_gmem)
        return acc_ref[...]

    acc = pl.run_scoped(acc_scope, plgpu.ACC((_TILE_N, p.tile_m), jnp.float32))
    o_smem[...] = acc
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[ks, pl.ds(ni * _TILE_N, _TILE_N),
                                              pl.ds(mi * p.tile_m, p.tile_m)])
    plgpu.wait_smem_to_gmem(0)


def default_k_splits(n_tiles: int, k_steps: int) -> int:
    """Split K until the grid covers every SM about twice, keeping whole steps per split."""
    want = max(1, -(-2 * _NUM_SMS // n_tiles))
    return max(d for d in range(1, min(want, k_steps) + 1) if k_steps % d == 0)


# From this many rows on, dequantize_matmul beats the kernel (`dequantize_from_m`). The kernel streams the
# weights once per 128 activation rows through one warpgroup: right for decode, wrong for prefill. H100,
# one Llama-3-8B layer's five shapes, device time (scripts/bench_quantized.py --sections m_scale):
#   rows          16    64   128   256   512  2048   8192   (us)
#   bf16 dot     168   194   186   203   313  1213   4721
#   int8 kernel  107   145   204   372   719  2944  21147   dequantize + dot: 458 .. 499 to M=256, 603 at 512
#   int4 kernel  194   238   326   556  1074  4305  25294   dequantize + dot: 429 .. 472 to M=256, 575 at 512
# The crossings lie between the measured rows: int8 between 256 and 512, int4 between 128 and 256.
DEQUANTIZE_FROM_M = {8: 385, 4: 193}


def dequantize_from_m(wq: QuantizedWeights) -> int:
    """Rows from which quantized_matmul("auto") on a GPU dequantizes and lets XLA's dot run (DEQUANTIZE_FROM_M)."""
    return DEQUANTIZE_FROM_M[wq.bits]


def dequantize_matmul(x: jax.Array, wq: QuantizedWeights) -> jax.Array:
    """x [M, K] @ wq dequantized to x's dtype by one XLA fusion, then XLA's dot: the many-row path. It reads
    the quantized weights and writes a 16-bit copy per call (3 bytes per parameter for int8), which at
    prefill sizes is a few percent of the product itself."""
    w = dequantize_weights(wq).astype(x.dtype)  # [Kp, N]
    return pad_activations(x, wq) @ w  # [M, N]


def unsupported_reason(wq: QuantizedWeights) -> str | None:
    """None when the kernel takes these weights; else one sentence why not."""
    if wq.out_features % _TILE_N:
        return f"GPU kernel needs N % {_TILE_N} == 0, got {wq.out_features}"
    if wq.bits == 4 and wq.pack not in (32, 64, 128):
        return f"GPU kernel takes int4 packing chunks of 32, 64 or 128, got {wq.pack}"
    if wq.bits == 4 and not wq.per_channel and wq.group_size < wq.pack // 2:
        return f"GPU kernel needs int4 groups of at least half the packing chunk ({wq.pack // 2})"
    try:
        step_k(wq, 8)
    except NotImplementedError as e:
        return str(e)
    return None


def _check_supported(wq: QuantizedWeights) -> None:
    reason = unsupported_reason(wq)
    if reason is not None:
        raise NotImplementedError(reason)


@functools.partial(jax.jit, static_argnames=("interpret", "k_splits", "tile_k", "stages"))
def quantized_matmul(x: jax.Array, wq: QuantizedWeights, *, interpret: bool = False,
                     k_splits: int | None = None, tile_k: int | None = None,
                     stages: int = _STAGES) -> jax.Array:
    """x [M, K] @ wq -> [M, N] in x.dtype (Mosaic GPU, Hopper). k_splits / tile_k / stages override
    the split-K count, the K step and the pipeline depth (the defaults above; the tiling sweep in
    scripts/bench_quantized.py times alternatives)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    _check_supported(wq)
    m, n, kp = x.shape[0], wq.out_features, wq.padded_in_features
    compute_dtype = jnp.float16 if x.dtype == jnp.float16 else jnp.bfloat16
    p = plan(wq, m, tile_k, stages)
    mp = -(-(-(-m // 8) * 8) // p.tile_m) * p.tile_m
    xp = jnp.pad(pad_activations(x, wq), ((0, mp - m), (0, 0))).astype(compute_dtype)  # [Mp, Kp]
    k_steps = kp // p.tile_k
    k_splits = k_splits or default_k_splits(n // _TILE_N, k_steps)
    kernel = functools.partial(_qmm_kernel, wq_meta=(wq.bits, wq.group_size), p=p,
                               k_steps_per_split=k_steps // k_splits)
    scratch = [plgpu.SMEM((_TILE_N, p.tile_m), jnp.float32)]
    if interpret:
        scratch.append(plgpu.SMEM((_TILE_N, p.part_k), compute_dtype,
                                  transforms=_transforms(compute_dtype, p.part_k)))
    partials = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((k_splits, n, mp), jnp.float32),
        scratch_types=scratch,
        grid=(n // _TILE_N, k_splits, mp // p.tile_m), grid_names=("n", "k", "m"),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(xp, wq.values, wq.scales)
    y = partials.sum(axis=0).T[:m]  # [M, N] f32
    if wq.per_channel:
        y = y * wq.scales[0].astype(jnp.float32)[None, :]
    if wq.zeros is not None:
        y = y + zero_point_term(xp[:m], wq)
    return y.astype(x.dtype)
