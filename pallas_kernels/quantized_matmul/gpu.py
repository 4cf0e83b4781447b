"""Weight-only quantized matmul for Hopper as a Pallas Mosaic GPU kernel (wgmma, TMA pipeline).

At decode sizes (M = 1..64) the product is bound by reading the weights, so the kernel computes
`y^T [N, M] = W [N, K] @ x^T [K, M]`: a 64-row weight tile is the wgmma M operand, dequantized from
SMEM into registers (int8 / fp8 / int4 -> bf16 exactly; grouped scales multiplied in on the way),
and the few activation rows are the narrow wgmma N dimension (padded to a multiple of
8 only). Each CTA owns 64 output channels and one K slice (split-K, sized so the grid covers every
SM a few times); `plgpu.emit_pipeline` keeps a few weight/activation tiles in flight. Split-K
partials (fp32, [splits, N, Mp]) are summed and per-channel scales applied in the wrapper, which is
a few hundred KB of traffic next to the megabytes of weights.

Blocks and parts. A pipeline step covers `tile_k` of K and brings its weights in as SMEM blocks, each
a BlockSpec of its own, so no swizzled tile is ever sliced in SMEM:
* 8-bit and int4 in natural order (pack 2): one `[64, tile_k]` block per step. int8 widens to bf16 by
  Mosaic GPU's conversion, int4 too (the packed bytes are handed to the kernel as an int4 array; eight
  codes become four bf16 pairs with a few logic ops and a subtraction, no int -> float instructions).
  Grouped weights (GGUF Q8_0 / Q5_* / Q6_K repacks, int4 groups) are then sliced in registers into
  one part per group, each multiplied by its scale row in bf16. A block per group
  instead (16-byte rows for int4 groups of 32) took a TMA copy and a barrier per 1-2 KB: the pipeline
  alone, with no arithmetic, streamed int4 at 45% of copy bandwidth against int8's 86%.
* int4 in chunk halves (pack 32/64/128, what a CPU or TPU stores): one
  `[64, pack / 2]`-byte block per packing chunk, unpacked through int32 and f32 into two halves of
  pack / 2 elements; each half lies inside one group (reference.default_pack), so it takes one scale row.
  Natural order streams the 8B weight set 1.29x faster (H200, M = 1), and one iteration of the engine's
  decode loop at batch 1 took 4.67 ms against 5.76 ms, so it is what the engine stores on a GPU. The
  uint8 -> int4 view below compiles to a bitcast: the loop's kernels summed to its time, no copy among them.
The activation tile is swizzled at the width of one part so each part's columns are a whole number
of swizzle tiles. Zero points (GGUF mins, int4's offsets) are added to each dequantized part inside the
kernel (ZEROS_IN_KERNEL; False adds them in the wrapper, `xsum @ zeros`, which cost a Llama-3-8B step 0.9 ms).

Tiling. At decode (M <= 8) a step is 256 wide, 2 steps are in flight and split-K covers the SMs four
times: smaller CTAs, more of them per SM, hide more latency. H200, one Llama-3-8B layer at M = 1, device
time: int4 in groups of 32 157 us under the older tiling (512/256-wide steps, 4 in flight, two covers),
109 us under this one, 88 us with one block per step as well; int8 per channel 88 -> 83 us
(docs/PERFORMANCE.md, issue 15). Wider M keeps the older tiling, which was measured there.

Interpret mode (CPU): the interpreter's wgmma reads only SMEM operands, so with interpret=True each
dequantized piece is staged through an SMEM buffer first; everything else is the kernel's code.

GPU-only modules are imported inside the functions so this file imports on CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax._src import dtypes

from pallas_kernels.quantized_matmul.reference import (NATURAL_PACK, QuantizedWeights, dequantize_weights,
                                                        pad_activations, zero_point_term)

_TILE_N = 64  # wgmma M: output channels per CTA
_TILE_K_INT4 = 512  # int4 at M > 8: 16 KB of weights per pipeline step
_TILE_K_8BIT = 256  # int8/fp8 at M > 8: 16 KB of weights per step
_TILE_K_DECODE = 256  # every format at M <= 8 (module docstring: Tiling)
_MAX_TILE_M = 128
_STAGES = 4  # steps in flight at M > 8
_STAGES_DECODE = 2  # at M <= 8
_SM_COVERS = 2  # split-K makes the grid about this many CTAs per SM at M > 8
_SM_COVERS_DECODE = 4
_NUM_SMS = 132
_SMEM_BUDGET = 220 * 1024  # of the 227 KB a Hopper block may use, leaving room for Mosaic's barriers
# Grouped zero points (int4 "int4", GGUF Q4_1 / Q4_K / Q5_1 / Q5_K repacks) are added to each dequantized part in
# the kernel, one bf16 add per weight, rather than by the wrapper's `xsum @ zeros`: an fp32 dot over [M, G] x [G, N]
# plus the group sums, four XLA GEMM fusions a product. H200, same lease (scripts/gpu_session.sh q_zeros): one
# Llama-3-8B layer's five products at M = 1, int4 in groups of 32, 91.6 -> 79.5 us (groups of 128 78.3 -> 70.0);
# batch-1 decode end to end 4.84 -> 3.95 ms a token, the multi-step iteration 4.64 -> 3.78 ms. False restores the
# wrapper's term (bench_quantized's int4_zeros_outside decode row).
ZEROS_IN_KERNEL = True
# The activation rows go to the kernel as they are (M < 8 or a multiple of 8), and the TMA copy of each
# [tile_m, tile_k] block reads past the last row (what it brings there only reaches output columns past M, which
# are sliced off), instead of a jnp.pad to a multiple of 8 first. Exact in interpret mode and on an H200 (its
# gpu-marked tests pass), but no faster there: int8's batch-1 loop iteration took 3.812 ms against 3.814 with the
# pad (docs/PERFORMANCE.md, issue 15), so it stays off.
UNPADDED_ROWS = False


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static shape of one call: step width, SMEM blocks per step and their K widths."""

    tile_m: int
    tile_k: int
    piece_k: int  # K elements of one SMEM weight block
    halves: int  # dequantized halves per block: 2 for chunk-halves int4 (low/high nibbles), 1 otherwise
    scale_rows: int  # scale rows one step reads (0: per channel, applied by the wrapper)
    group: int  # K elements per scale row
    stages: int = _STAGES  # pipeline steps in flight
    zeros: bool = False  # grouped zero points added to each part in the kernel (else the wrapper's xsum @ zeros)

    @property
    def pieces(self) -> int:
        return self.tile_k // self.piece_k

    @property
    def part_k(self) -> int:
        """K elements of one dequantized part (the activation swizzle follows it): a group of a wide
        grouped block, half a chunk-halves block, else the block."""
        if self.halves == 1 and self.scale_rows and self.group < self.piece_k:
            return self.group
        return self.piece_k // self.halves


def _transforms(dtype, minor: int):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    bits = dtypes.itemsize_bits(dtype)
    swizzle = plgpu.find_swizzle(minor * bits)
    if swizzle == 16:  # 16-byte rows (8-bit groups of 16) take no swizzle, only the 8-row tiling
        return (plgpu.TilingTransform((8, 16 * 8 // bits)),)
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def _chunk_halves(wq: QuantizedWeights) -> bool:
    """int4 packed in chunk halves (unpacked by hand) rather than natural order (Mosaic's int4 loads)."""
    return wq.bits == 4 and wq.pack != NATURAL_PACK


def _piece_k(wq: QuantizedWeights, tile_k: int) -> int:
    return wq.pack if _chunk_halves(wq) else tile_k


def _unit(wq: QuantizedWeights) -> int:
    """A K step must be a multiple of this: the packing chunk, the group (up to 128) or 32."""
    if _chunk_halves(wq):
        return wq.pack
    return 32 if wq.per_channel else min(wq.group_size, 128)


def smem_bytes(wq: QuantizedWeights, tile_m: int, tile_k: int, interpret: bool = False,
               stages: int = _STAGES) -> int:
    """Shared memory of one CTA: `stages` x (weights + activations + scale rows) plus the output
    tile (and, in interpret mode, the staging buffer)."""
    weight_bytes = _TILE_N * tile_k * wq.bits // 8
    scale_rows = 0 if wq.per_channel else max(1, tile_k // wq.group_size)
    row_blocks = 1 if wq.zeros is None else 2  # the zero points' rows may come beside the scales'
    per_stage = weight_bytes + tile_m * tile_k * 2 + row_blocks * max(scale_rows, 1) * _TILE_N * 4
    staging = _TILE_N * _piece_k(wq, tile_k) * 2 if interpret else 0
    return stages * per_stage + _TILE_N * tile_m * 4 + staging


def _decode(tile_m: int) -> bool:
    return tile_m <= 8


def default_stages(m: int) -> int:
    """Steps in flight for M rows (or a tile of them): M <= 8 is decode."""
    return _STAGES_DECODE if _decode(m) else _STAGES


def step_k(wq: QuantizedWeights, tile_m: int = 8, preferred: int | None = None, stages: int | None = None) -> int:
    """K per pipeline step: the preferred size, halved until it divides Kp, holds whole pieces and
    groups (or lies inside one), and the pipeline fits in shared memory (wide activation tiles, M >= 32,
    take most)."""
    kp = wq.padded_in_features
    unit = _unit(wq)
    stages = stages or default_stages(tile_m)
    tile_k = preferred or (_TILE_K_DECODE if _decode(tile_m) else _TILE_K_INT4 if wq.bits == 4 else _TILE_K_8BIT)
    group = wq.group_size
    while tile_k > unit and (kp % tile_k or tile_k % unit or (group % tile_k and tile_k % group)
                             or smem_bytes(wq, tile_m, tile_k, stages=stages) > _SMEM_BUDGET):
        tile_k //= 2
    if kp % tile_k or tile_k % unit:
        raise NotImplementedError(f"GPU kernel: no K step divides Kp={kp} in whole pieces of {unit}")
    return tile_k


def plan(wq: QuantizedWeights, m: int, tile_k: int | None = None, stages: int | None = None,
         zeros_in_kernel: bool | None = None) -> Plan:
    """The call's static shape; `tile_k` / `stages` override the preferred K step (still fitted to Kp and
    SMEM) and the steps in flight, `zeros_in_kernel` ZEROS_IN_KERNEL (grouped zero points only)."""
    mp = -(-m // 8) * 8
    tile_m = min(mp, _MAX_TILE_M)
    stages = stages or default_stages(m)
    tile_k = step_k(wq, tile_m, tile_k, stages)
    scale_rows = 0 if wq.per_channel else max(1, tile_k // wq.group_size)
    zeros = ZEROS_IN_KERNEL if zeros_in_kernel is None else zeros_in_kernel
    return Plan(tile_m, tile_k, _piece_k(wq, tile_k), 2 if _chunk_halves(wq) else 1, scale_rows, wq.group_size,
                stages, zeros=bool(zeros and wq.zeros is not None and scale_rows))


def _dequantized_parts(w_refs, s_smem, z_smem, p: Plan, dtype):
    """The step's weights in registers as [(tile [64, part_k], k offset in the step)], grouped
    scales multiplied in and (z_smem not None) zero points added (each part sits inside one group)."""
    parts = []
    for c, w_ref in enumerate(w_refs):
        base = c * p.piece_k
        if p.halves == 2:
            # Mosaic GPU does no arithmetic on 8-bit registers: widen before unpacking the nibbles. Each
            # nibble is a two's complement code: shift it to the top of the word, then back down with sign.
            packed = w_ref[...].astype(jnp.int32)  # [64, pack/2]: element j low, j + pack/2 high
            parts += [(((packed << 28) >> 28).astype(jnp.float32), base),
                      (((packed << 24) >> 28).astype(jnp.float32), base + p.part_k)]
            continue
        w = w_ref[...]  # [64, piece_k]
        if w.dtype == jnp.float8_e4m3fn:
            # ptxas of CUDA 13.0 converts e4m3 only to f16 directly; through f32 is exact too.
            w = w.astype(jnp.float32)
        # int8 / int4 codes convert exactly (Mosaic widens them with bit tricks, no int -> float ops).
        w = w.astype(dtype)
        if p.part_k == p.piece_k:
            parts.append((w, base))
        else:  # a part per group, sliced in registers
            parts += [(w[:, j:j + p.part_k], base + j) for j in range(0, p.piece_k, p.part_k)]
    out = []
    for w, off in parts:
        w = w.astype(dtype)
        if p.scale_rows:
            # One bf16 multiply per weight: the scale rounded to bf16, then the product (the reference
            # rounds only the fp32 product; the difference is one more bf16 rounding).
            row = off // p.group if p.group <= p.tile_k else 0
            scale = s_smem[row, :].astype(dtype)  # [64]
            w = w * jax.lax.broadcast_in_dim(scale, (_TILE_N, p.part_k), [0])
            if z_smem is not None:  # q x s + z, the dequantized weight, rounded to bf16 once more
                w = w + jax.lax.broadcast_in_dim(z_smem[row, :].astype(dtype), (_TILE_N, p.part_k), [0])
        out.append((w, off))
    return out


def _qmm_kernel(*refs, p: Plan, k_steps_per_split):
    # x_gmem [Mp, Kp] bf16 ([M, Kp] with unpadded_rows: the last block reads past row M),
    # w_gmem [N, Kp] (int8 / e4m3 / natural int4; chunk-halves int4: [N, Kp/2] uint8),
    # s_gmem [G, N], z_gmem [G, N] (p.zeros only),
    # o_gmem [splits, N, Mp] f32 (transposed partial products), o_smem [64, tile_m] f32,
    # stage (interpret mode only): [64, part_k] in the activation dtype.
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    x_gmem, w_gmem, s_gmem = refs[:3]
    z_gmem = refs[3] if p.zeros else None
    o_gmem, o_smem, *stage = refs[3 + p.zeros:]

    group = p.group
    ni, ks, mi = (jax.lax.axis_index(a) for a in ("n", "k", "m"))
    k0 = ks * k_steps_per_split
    w_cols = p.piece_k // p.halves  # elements of w_gmem in one piece per row

    def step(_, *refs, acc_ref):
        w_refs, x_smem, s_smem = refs[:p.pieces], refs[p.pieces], refs[p.pieces + 1]
        z_smem = refs[p.pieces + 2] if p.zeros else None
        for w, off in _dequantized_parts(w_refs, s_smem, z_smem, p, x_smem.dtype):
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
            in_specs=[*w_specs, x_spec, s_spec] + [s_spec] * p.zeros,  # zero points: the scales' blocks
            max_concurrent_steps=p.stages,
        )(*[w_gmem] * p.pieces, x_gmem, s_gmem, *[z_gmem] * p.zeros)
        return acc_ref[...]

    acc = pl.run_scoped(acc_scope, plgpu.ACC((_TILE_N, p.tile_m), jnp.float32))
    o_smem[...] = acc
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[ks, pl.ds(ni * _TILE_N, _TILE_N),
                                              pl.ds(mi * p.tile_m, p.tile_m)])
    plgpu.wait_smem_to_gmem(0)


def default_k_splits(n_tiles: int, k_steps: int, covers: int = _SM_COVERS) -> int:
    """Split K until the grid covers every SM about `covers` times, keeping whole steps per split."""
    want = max(1, -(-covers * _NUM_SMS // n_tiles))
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


# Per-channel 8-bit weight-only products (int8, e4m3) go to XLA's own dot at every M: the codes widen to bf16
# inside its GEMM fusion (Triton) and the per-channel scale multiplies the output. H100, one joined Llama-3-8B
# layer (qkv, o, gate/up, down), device time with the wrapper's kernels (bench_quantized.py --sections xla_m1,
# xla_paths; docs/PERFORMANCE.md, issue 15):
#   rows               2     4     8    16    32    64   128   256   512  (us)
#   int8 kernel      107   110    99   101   116   134   191   338   668
#   int8 XLA dot      88    89    90   101   113   132   180   321   573   (95% of the copy rate at 2-8 rows)
#   bf16 dot         151   153   154   156   162   175   182   204   312
# The kernel loses at decode to its split-K epilogue (sum, transpose, scale: separate XLA kernels) and at many rows
# to its one warpgroup per 128 rows. At one row XLA's dot is slower (107 us, the kernel 104; padded to 8 rows 97),
# so a single row is padded to two (the engine's smallest decode bucket; not timed at one row since). Grouped
# scales and zero points (GGUF Q8_0 / Q4_K, int4) stay on the kernel: XLA materializes the dequantized weights for
# them (452 us for int4 in groups of 128 at one row).
XLA_PER_CHANNEL_8BIT = True


def xla_takes(wq: QuantizedWeights) -> bool:
    """Whether quantized_matmul on a GPU hands these weights to convert_matmul (XLA_PER_CHANNEL_8BIT)."""
    return XLA_PER_CHANNEL_8BIT and wq.bits == 8 and not wq.w8a8 and wq.per_channel and wq.zeros is None


def convert_matmul(x: jax.Array, wq: QuantizedWeights) -> jax.Array:
    """x [M, K] @ per-channel 8-bit wq by XLA's dot on the codes widened to 16 bits (exact), fp32 accumulation, the
    per-channel scale on the fp32 output: the kernel's arithmetic, with XLA fusing the widening into its GEMM."""
    compute = jnp.float16 if x.dtype == jnp.float16 else jnp.bfloat16
    m = x.shape[0]
    xp = pad_activations(x, wq).astype(compute)  # [M, Kp]
    if m == 1:  # XLA tiles one row slower than two (107 against 88 us a layer above): a second, zero row
        xp = jnp.pad(xp, ((0, 1), (0, 0)))  # [2, Kp]
    y = jax.lax.dot_general(xp, wq.values.astype(compute), (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)  # [M, Kp] . [N, Kp] -> [M, N]
    return (y[:m] * wq.scales[0].astype(jnp.float32)[None, :]).astype(x.dtype)


def unsupported_reason(wq: QuantizedWeights) -> str | None:
    """None when the kernel takes these weights; else one sentence why not."""
    if wq.out_features % _TILE_N:
        return f"GPU kernel needs N % {_TILE_N} == 0, got {wq.out_features}"
    if wq.bits == 4 and wq.pack not in (NATURAL_PACK, 32, 64, 128):
        return f"GPU kernel takes int4 packing chunks of {NATURAL_PACK}, 32, 64 or 128, got {wq.pack}"
    if _chunk_halves(wq) and not wq.per_channel and wq.group_size < wq.pack // 2:
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


def quantized_matmul(x: jax.Array, wq: QuantizedWeights, *, interpret: bool = False,
                     k_splits: int | None = None, tile_k: int | None = None,
                     stages: int | None = None, zeros_in_kernel: bool | None = None,
                     unpadded_rows: bool | None = None) -> jax.Array:
    """x [M, K] @ wq -> [M, N] in x.dtype (Mosaic GPU, Hopper). k_splits / tile_k / stages override
    the split-K count, the K step and the pipeline depth (the defaults above; the tiling sweeps in
    scripts/bench_quantized.py time alternatives); zeros_in_kernel and unpadded_rows override ZEROS_IN_KERNEL
    and UNPADDED_ROWS, which are read here, outside the jit, so setting them changes every product traced
    afterwards."""
    zeros = ZEROS_IN_KERNEL if zeros_in_kernel is None else zeros_in_kernel
    unpadded = UNPADDED_ROWS if unpadded_rows is None else unpadded_rows
    return _quantized_matmul(x, wq, interpret=interpret, k_splits=k_splits, tile_k=tile_k, stages=stages,
                             zeros_in_kernel=bool(zeros), unpadded_rows=bool(unpadded))


@functools.partial(jax.jit, static_argnames=("interpret", "k_splits", "tile_k", "stages", "zeros_in_kernel",
                                             "unpadded_rows"))
def _quantized_matmul(x: jax.Array, wq: QuantizedWeights, *, interpret: bool, k_splits: int | None,
                      tile_k: int | None, stages: int | None, zeros_in_kernel: bool,
                      unpadded_rows: bool) -> jax.Array:
    import jax.experimental.pallas.mosaic_gpu as plgpu

    _check_supported(wq)
    m, n, kp = x.shape[0], wq.out_features, wq.padded_in_features
    compute_dtype = jnp.float16 if x.dtype == jnp.float16 else jnp.bfloat16
    p = plan(wq, m, tile_k, stages, zeros_in_kernel)
    mp = -(-(-(-m // 8) * 8) // p.tile_m) * p.tile_m  # the output's rows: its TMA stores need 16-byte row strides
    xp = pad_activations(x, wq).astype(compute_dtype)  # [M, Kp]
    # Mosaic GPU's 8-row tiling of the block takes an array of fewer than 8 rows or a multiple of 8 (decode buckets
    # are 2, 4, 8, 16, ... rows); other row counts are padded either way.
    if not (unpadded_rows and (m < 8 or m % 8 == 0)):
        xp = jnp.pad(xp, ((0, mp - m), (0, 0)))  # [Mp, Kp]
    k_steps = kp // p.tile_k
    k_splits = k_splits or default_k_splits(n // _TILE_N, k_steps,
                                            _SM_COVERS_DECODE if _decode(p.tile_m) else _SM_COVERS)
    kernel = functools.partial(_qmm_kernel, p=p, k_steps_per_split=k_steps // k_splits)
    values = wq.values
    if not _chunk_halves(wq) and wq.bits == 4:  # the same bytes as int4 [N, Kp]: two codes a byte, low first
        values = jax.lax.bitcast_convert_type(values, jnp.int4).reshape(n, kp)  # [N, Kp/2, 2] -> [N, Kp]
    scratch = [plgpu.SMEM((_TILE_N, p.tile_m), jnp.float32)]
    if interpret:
        scratch.append(plgpu.SMEM((_TILE_N, p.part_k), compute_dtype,
                                  transforms=_transforms(compute_dtype, p.part_k)))
    partials = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((k_splits, n, mp), jnp.float32),
        scratch_types=scratch,
        grid=(n // _TILE_N, k_splits, mp // p.tile_m), grid_names=("n", "k", "m"),
        kernel_name="quantized_matmul",  # profiles name it, not anonymous_mosaic_gpu_kernel
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(xp, values, wq.scales, *[wq.zeros] * p.zeros)
    y = partials.sum(axis=0).T[:m]  # [M, N] f32
    if wq.per_channel:
        y = y * wq.scales[0].astype(jnp.float32)[None, :]
    if wq.zeros is not None and not p.zeros:
        y = y + zero_point_term(xp[:m], wq)
    return y.astype(x.dtype)
