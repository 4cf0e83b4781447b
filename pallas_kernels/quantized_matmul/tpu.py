"""Weight-only quantized matmul as a Pallas TPU kernel (runs in interpret mode on CPU).

Grid (M blocks, N blocks, K blocks), K innermost and sequential so one fp32 VMEM accumulator per
(M, N) tile collects the K sum; Pallas pipelines the x / weight / scale block copies. Weight blocks
are converted in VMEM to the activation dtype (exact for int8, int4 and e4m3 into bf16), so the
MXU runs a plain bf16 x bf16 -> fp32 matmul and HBM traffic stays at the packed weight bytes.

Scales, by group size:
* per channel: the finished tile is multiplied once;
* groups of 128 or more: each group's partial product (fp32) is multiplied by its scale row, so
  the products stay exact;
* groups of 16-64 (GGUF blocks): one matmul per group would be 16-64 deep, far below the MXU's
  width, so the block is dequantized in VMEM instead (codes x broadcast scales, then the activation
  dtype) and multiplied once.
Zero points (`wq.zeros`) are added in the wrapper: `xsum [M, G] @ zeros [G, N]` (reference.py).

Odd M is padded to the M block, K was already padded at quantization, and the K block is chosen to
divide it (`pick_block_k`, the tile table).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.quantized_matmul.reference import (QuantizedWeights, pad_activations,
                                                        unpack_int4, zero_point_term)

# The tile table: preferred blocks, largest first. M blocks are the rows rounded up to 8 (at most
# _MAX_BLOCK_M); a K block must divide Kp and hold whole groups and int4 packing chunks.
_MAX_BLOCK_M = 128
_BLOCK_N_CHOICES = (512, 256, 128)
_BLOCK_K_CHOICES = (2048, 1024, 512, 256, 128)
_WHOLE_K_LIMIT = 8192  # a Kp none of the choices divides (e.g. 576) is taken whole up to this


def _k_unit(wq: QuantizedWeights) -> int:
    """A K block must be a multiple of this: the group when it is small, the int4 packing chunk."""
    unit = 1 if wq.per_channel or wq.group_size >= 128 else wq.group_size
    return math.lcm(unit, wq.pack) if wq.bits == 4 else unit


def pick_block_k(wq: QuantizedWeights) -> int:
    """Largest preferred K block that divides Kp and holds whole groups (or sits inside one)."""
    kp, group, unit = wq.padded_in_features, wq.group_size, _k_unit(wq)
    for bk in _BLOCK_K_CHOICES:
        if kp % bk == 0 and bk % unit == 0 and (wq.per_channel or bk % group == 0 or group % bk == 0):
            return bk
    if kp <= _WHOLE_K_LIMIT:
        return kp
    return max(d for d in range(unit, _BLOCK_K_CHOICES[0] + 1, unit) if kp % d == 0)


def pick_block_n(n: int) -> int:
    """A lane-aligned N block dividing N, or all of N when N is not a multiple of 128."""
    return next((bn for bn in _BLOCK_N_CHOICES if n % bn == 0), n)


def _codes_block(w_ref, bits: int, pack: int) -> jax.Array:
    """The weight block's codes as [bn, bk] (int4 chunks unpacked in VMEM)."""
    w = w_ref[...]
    return unpack_int4(w, pack) if bits == 4 else w


def _qmm_kernel(x_ref, w_ref, s_ref, o_ref, acc_ref, *, bits, pack, group, mode):
    # x_ref [bm, bk], w_ref [bn, bk] (int4: [bn, bk/2]), s_ref [groups, bn], o_ref [bm, bn]
    k_step = pl.program_id(2)

    @pl.when(k_step == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    x = x_ref[...]
    q = _codes_block(w_ref, bits, pack)  # [bn, bk]
    contract = (((1,), (1,)), ((), ()))
    if mode == "small_groups":  # dequantize in VMEM: codes times each group's scale, then one matmul
        bn, bk = q.shape
        scales = s_ref[...].astype(jnp.float32).T  # [bn, bk / group]
        w = (q.astype(jnp.float32).reshape(bn, bk // group, group) * scales[:, :, None]).reshape(bn, bk)
        acc_ref[...] += jax.lax.dot_general(x, w.astype(x.dtype), contract, preferred_element_type=jnp.float32)
    elif mode == "groups":  # each group's exact partial product times its scale row
        w = q.astype(x.dtype)
        for g in range(x.shape[1] // group if group <= x.shape[1] else 1):
            cols = slice(g * group, (g + 1) * group) if group <= x.shape[1] else slice(None)
            part = jax.lax.dot_general(x[:, cols], w[:, cols], contract, preferred_element_type=jnp.float32)
            acc_ref[...] += part * s_ref[g:g + 1, :].astype(jnp.float32)  # [bm, bn]
    else:
        acc_ref[...] += jax.lax.dot_general(x, q.astype(x.dtype), contract, preferred_element_type=jnp.float32)

    @pl.when(k_step == pl.num_programs(2) - 1)
    def _():
        out = acc_ref[...]
        if mode == "per_channel":
            out = out * s_ref[0:1, :].astype(jnp.float32)
        o_ref[...] = out.astype(o_ref.dtype)


def _scale_spec(wq: QuantizedWeights, block_k: int, block_n: int) -> pl.BlockSpec:
    """Scales block: all groups of the K block (or the one group it sits in) x the N block."""
    if wq.per_channel:
        return pl.BlockSpec((1, block_n), lambda i, j, k: (0, j))
    if block_k >= wq.group_size:
        rows = block_k // wq.group_size
        return pl.BlockSpec((rows, block_n), lambda i, j, k: (k, j))
    blocks_per_group = wq.group_size // block_k
    return pl.BlockSpec((1, block_n), lambda i, j, k: (k // blocks_per_group, j))


def _mode(wq: QuantizedWeights) -> str:
    if wq.per_channel:
        return "per_channel"
    return "groups" if wq.group_size >= 128 else "small_groups"


@functools.partial(jax.jit, static_argnames=("interpret", "block_m", "block_n", "block_k"))
def quantized_matmul(x: jax.Array, wq: QuantizedWeights, *, interpret: bool = False,
                     block_m: int | None = None, block_n: int | None = None,
                     block_k: int | None = None) -> jax.Array:
    """x [M, K] @ wq -> [M, N] in x.dtype (Pallas TPU)."""
    m = x.shape[0]
    n, kp = wq.out_features, wq.padded_in_features
    block_m = block_m or min(_round_up(m, 8), _MAX_BLOCK_M)
    block_n = block_n or pick_block_n(n)
    block_k = block_k or pick_block_k(wq)
    mp = _round_up(m, block_m)
    xp = jnp.pad(pad_activations(x, wq), ((0, mp - m), (0, 0)))  # [Mp, Kp]
    kernel = functools.partial(_qmm_kernel, bits=wq.bits, pack=wq.pack, group=wq.group_size, mode=_mode(wq))
    w_cols = block_k // 2 if wq.bits == 4 else block_k
    out_dtype = jnp.float32 if wq.zeros is not None else x.dtype
    out = pl.pallas_call(
        kernel,
        grid=(mp // block_m, n // block_n, kp // block_k),
        in_specs=[
            pl.BlockSpec((block_m, block_k), lambda i, j, k: (i, k)),
            pl.BlockSpec((block_n, w_cols), lambda i, j, k: (j, k)),
            _scale_spec(wq, block_k, block_n),
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j, k: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, n), out_dtype),
        scratch_shapes=[pltpu.VMEM((block_m, block_n), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(xp, wq.values, wq.scales)
    if wq.zeros is not None:
        out = out + zero_point_term(xp, wq)  # [Mp, N] fp32
    return out[:m].astype(x.dtype)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m
