"""Weight-only quantized matmul for Hopper as a Pallas Mosaic GPU kernel (wgmma, TMA pipeline).

At decode sizes (M = 1..64) the product is bound by reading the weights, so the kernel computes
`y^T [N, M] = W [N, K] @ x^T [K, M]`: a 64-row weight tile is the wgmma M operand, dequantized from
SMEM into registers (int8 / fp8 -> bf16 exactly; int4 nibbles -> bf16 then times the group scale),
and the few activation rows are the narrow wgmma N dimension (padded to a multiple of 8 only).
Each CTA owns 64 output channels and one K slice (split-K, sized so the grid covers every SM
twice); `plgpu.emit_pipeline` keeps `_STAGES` weight/activation tiles in flight. Split-K partials
(fp32, [splits, N, Mp]) are summed and per-channel scales applied in the wrapper, which is a few
hundred KB of traffic next to the megabytes of weights.

GPU-only modules are imported inside the functions so this file imports on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.quantized_matmul.reference import PACK_CHUNK, QuantizedWeights, pad_activations

_TILE_N = 64  # wgmma M: output channels per CTA
_GROUP = PACK_CHUNK  # 128: the int4 packing chunk, and the one group size the kernel takes
_TILE_K_INT4 = 512  # int4: 4 chunks (16 KB of weights) per pipeline step; a 128-wide step was bound by its
                    # fixed per-step cost (copy wait, barrier, wgmma wait), not by the weight bytes
_TILE_K_8BIT = 256  # int8/fp8: 16 KB of weights per step
_MAX_TILE_M = 128
_STAGES = 4
_NUM_SMS = 132


def _transforms(dtype, minor: int):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor * bits)
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def _dequantized_parts(w_refs, s_smem, bits, grouped, dtype):
    """The step's weight tile in registers as [(tile, k offset)]: one [64, tile_k] tile for 8-bit, two
    [64, 64] halves per 128-wide int4 chunk (one SMEM buffer each) otherwise."""
    if bits == 8:
        w = w_refs[0][...]
        if w.dtype == jnp.float8_e4m3fn:
            # ptxas of CUDA 13.0 converts e4m3 only to f16 directly; through f32 is exact too.
            w = w.astype(jnp.float32)
        return [(w.astype(dtype), 0)]
    parts = []
    for c, w_ref in enumerate(w_refs):
        # Mosaic GPU does no arithmetic on 8-bit registers: widen before unpacking the nibbles.
        packed = w_ref[...].astype(jnp.int32)  # [64, 64]: element j low nibble, j + 64 high nibble
        halves = [((packed & 0xF).astype(jnp.float32) - 8.0, c * _GROUP),
                  (((packed >> 4) & 0xF).astype(jnp.float32) - 8.0, c * _GROUP + _GROUP // 2)]
        if grouped:
            scale = jax.lax.broadcast_in_dim(s_smem[c, :], (_TILE_N, _GROUP // 2), [0])  # [64] -> [64, 64]
            halves = [(h * scale, off) for h, off in halves]
        parts += [(h.astype(dtype), off) for h, off in halves]
    return parts


def _qmm_kernel(x_gmem, w_gmem, s_gmem, o_gmem, o_smem, *, bits, grouped, k_steps_per_split,
                tile_m, tile_k):
    # x_gmem [Mp, Kp] bf16, w_gmem [N, Kp] (int4: [N, Kp/2]), s_gmem [G, N] f32,
    # o_gmem [splits, N, Mp] f32 (transposed partial products), o_smem [64, tile_m] f32.
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    ni, ks, mi = (jax.lax.axis_index(a) for a in ("n", "k", "m"))
    k0 = ks * k_steps_per_split
    # int4: one [64, 64]-byte weight block (one 128-wide chunk) per buffer, `chunks` of them per step.
    chunks = tile_k // _GROUP if bits == 4 else 1
    w_cols = _GROUP // 2 if bits == 4 else tile_k

    def step(_, *refs, acc_ref):
        w_refs, x_smem, s_smem = refs[:chunks], refs[chunks], refs[chunks + 1]
        for w, off in _dequantized_parts(w_refs, s_smem, bits, grouped, x_smem.dtype):
            cols = w.shape[1]
            plgpu.wgmma(acc_ref, w, x_smem.at[:, pl.ds(off, cols)].transpose((1, 0)))
        plgpu.wgmma_wait(0)

    w_specs = [plgpu.BlockSpec((_TILE_N, w_cols), lambda k, c=c: (ni, (k0 + k) * chunks + c),
                               transforms=_transforms(w_gmem.dtype, w_cols)) for c in range(chunks)]
    x_spec = plgpu.BlockSpec((tile_m, tile_k), lambda k: (mi, k0 + k), transforms=_transforms(x_gmem.dtype, tile_k))
    # Grouped int4: the step's `chunks` group scales; otherwise one row (applied in the wrapper).
    s_spec = (plgpu.BlockSpec((chunks, _TILE_N), lambda k: (k0 + k, ni)) if grouped
              else plgpu.BlockSpec((1, _TILE_N), lambda k: (0, ni)))

    def acc_scope(acc_ref):
        plgpu.emit_pipeline(
            functools.partial(step, acc_ref=acc_ref),
            grid=(k_steps_per_split,),
            in_specs=[*w_specs, x_spec, s_spec],
            max_concurrent_steps=_STAGES,
        )(*[w_gmem] * chunks, x_gmem, s_gmem)
        return acc_ref[...]

    acc = pl.run_scoped(acc_scope, plgpu.ACC((_TILE_N, tile_m), jnp.float32))
    o_smem[...] = acc
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[ks, pl.ds(ni * _TILE_N, _TILE_N),
                                              pl.ds(mi * tile_m, tile_m)])
    plgpu.wait_smem_to_gmem(0)


_SMEM_BUDGET = 220 * 1024  # of the 227 KB a Hopper block may use, leaving room for Mosaic's barriers


def _smem_bytes(bits: int, tile_m: int, tile_k: int) -> int:
    """Shared memory of one CTA: `_STAGES` x (weights + activations + scale rows) plus the output tile."""
    scale_rows = tile_k // _GROUP if bits == 4 else 1  # grouped int4: one row per chunk (the most it uses)
    per_stage = _TILE_N * tile_k * bits // 8 + tile_m * tile_k * 2 + scale_rows * _TILE_N * 4
    return _STAGES * per_stage + _TILE_N * tile_m * 4


def step_k(bits: int, kp: int, tile_m: int = 8) -> int:
    """K per pipeline step: the preferred size, halved (not below 128) until it divides Kp and the
    pipeline fits in shared memory (wide activation tiles, M >= 32, take most of it)."""
    tile_k = _TILE_K_INT4 if bits == 4 else _TILE_K_8BIT
    while tile_k > _GROUP and (kp % tile_k or _smem_bytes(bits, tile_m, tile_k) > _SMEM_BUDGET):
        tile_k //= 2
    return tile_k


def default_k_splits(n_tiles: int, k_steps: int) -> int:
    """Split K until the grid covers every SM about twice, keeping whole steps per split."""
    want = max(1, -(-2 * _NUM_SMS // n_tiles))
    return max(d for d in range(1, min(want, k_steps) + 1) if k_steps % d == 0)


def _check_supported(x, wq: QuantizedWeights) -> None:
    if wq.out_features % _TILE_N:
        raise NotImplementedError(f"GPU kernel needs N % {_TILE_N} == 0, got {wq.out_features}")
    grouped = wq.group_size != wq.padded_in_features
    if grouped and (wq.bits != 4 or wq.group_size != _GROUP):
        raise NotImplementedError(
            f"GPU kernel supports per-channel int8/fp8 and int4 with group_size {_GROUP} "
            f"or per channel; got bits={wq.bits}, group_size={wq.group_size}")


@functools.partial(jax.jit, static_argnames=("interpret", "k_splits"))
def quantized_matmul(x: jax.Array, wq: QuantizedWeights, *, interpret: bool = False,
                     k_splits: int | None = None) -> jax.Array:
    """x [M, K] @ wq -> [M, N] in x.dtype (Mosaic GPU, Hopper)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    _check_supported(x, wq)
    m, n, kp = x.shape[0], wq.out_features, wq.padded_in_features
    compute_dtype = jnp.float16 if x.dtype == jnp.float16 else jnp.bfloat16
    mp = -(-m // 8) * 8
    tile_m = min(mp, _MAX_TILE_M)
    mp = -(-mp // tile_m) * tile_m
    xp = jnp.pad(pad_activations(x, wq), ((0, mp - m), (0, 0))).astype(compute_dtype)  # [Mp, Kp]
    grouped = wq.group_size != kp
    tile_k = step_k(wq.bits, kp, tile_m)
    k_steps = kp // tile_k
    k_splits = k_splits or default_k_splits(n // _TILE_N, k_steps)
    kernel = functools.partial(_qmm_kernel, bits=wq.bits, grouped=grouped,
                               k_steps_per_split=k_steps // k_splits, tile_m=tile_m,
                               tile_k=tile_k)
    partials = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((k_splits, n, mp), jnp.float32),
        scratch_types=[plgpu.SMEM((_TILE_N, tile_m), jnp.float32)],
        grid=(n // _TILE_N, k_splits, mp // tile_m), grid_names=("n", "k", "m"),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(xp, wq.values, wq.scales)
    y = partials.sum(axis=0).T[:m]  # [M, N] f32
    if not grouped:
        y = y * wq.scales[0][None, :]
    return y.astype(x.dtype)
