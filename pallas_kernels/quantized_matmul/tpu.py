"""Weight-only quantized matmul as a Pallas TPU kernel (runs in interpret mode on CPU).

Grid (M blocks, N blocks, K blocks), K innermost and sequential so one fp32 VMEM accumulator per
(M, N) tile collects the K sum; Pallas pipelines the x / weight / scale block copies. Weight blocks
are dequantized in VMEM to the activation dtype (exact for int8, int4 and e4m3 into bf16), so the
MXU runs a plain bf16 x bf16 -> fp32 matmul and HBM traffic stays at the packed weight bytes.
Per-group scales multiply each group's partial product (fp32, after the matmul), per-channel scales
multiply the finished tile once.

Odd M is padded to the M block, K was already padded to a multiple of 128 at quantization, and the
K block is chosen to divide it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.quantized_matmul.reference import (PACK_CHUNK, QuantizedWeights,
                                                        pad_activations, unpack_int4)

_MAX_BLOCK_M = 128
_BLOCK_N_CHOICES = (512, 256, 128)
_BLOCK_K_CHOICES = (2048, 1024, 512, 256, 128)


def pick_block_k(padded_k: int, group_size: int) -> int:
    """Largest preferred K block that divides Kp and holds whole groups (or sits inside one)."""
    for bk in _BLOCK_K_CHOICES:
        if padded_k % bk == 0 and (bk % group_size == 0 or group_size % bk == 0):
            return bk
    return PACK_CHUNK


def pick_block_n(n: int) -> int:
    """A lane-aligned N block dividing N, or all of N when N is not a multiple of 128."""
    return next((bn for bn in _BLOCK_N_CHOICES if n % bn == 0), n)


def _unpacked_block(w_ref, bits: int, dtype) -> jax.Array:
    """The weight block as [bn, bk] in the compute dtype (int4 chunks unpacked in VMEM)."""
    w = w_ref[...]
    if bits == 4:
        w = unpack_int4(w)  # [bn, bk]
    return w.astype(dtype)


def _qmm_kernel(x_ref, w_ref, s_ref, o_ref, acc_ref, *, bits, groups_per_block, per_channel):
    # x_ref [bm, bk], w_ref [bn, bk] (int4: [bn, bk/2]), s_ref [groups, bn], o_ref [bm, bn]
    k_step = pl.program_id(2)

    @pl.when(k_step == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    x = x_ref[...]
    w = _unpacked_block(w_ref, bits, x.dtype)  # [bn, bk]
    group = x.shape[1] // groups_per_block
    for g in range(groups_per_block):
        cols = slice(g * group, (g + 1) * group)
        part = jax.lax.dot_general(x[:, cols], w[:, cols], (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)  # [bm, bn]
        acc_ref[...] += part if per_channel else part * s_ref[g:g + 1, :]

    @pl.when(k_step == pl.num_programs(2) - 1)
    def _():
        out = acc_ref[...] * s_ref[0:1, :] if per_channel else acc_ref[...]
        o_ref[...] = out.astype(o_ref.dtype)


def _scale_spec(wq: QuantizedWeights, block_k: int, block_n: int) -> pl.BlockSpec:
    """Scales block: all groups of the K block (or the one group it sits in) x the N block."""
    if wq.group_size == wq.padded_in_features:
        return pl.BlockSpec((1, block_n), lambda i, j, k: (0, j))
    if block_k >= wq.group_size:
        rows = block_k // wq.group_size
        return pl.BlockSpec((rows, block_n), lambda i, j, k: (k, j))
    blocks_per_group = wq.group_size // block_k
    return pl.BlockSpec((1, block_n), lambda i, j, k: (k // blocks_per_group, j))


@functools.partial(jax.jit, static_argnames=("interpret", "block_m", "block_n", "block_k"))
def quantized_matmul(x: jax.Array, wq: QuantizedWeights, *, interpret: bool = False,
                     block_m: int | None = None, block_n: int | None = None,
                     block_k: int | None = None) -> jax.Array:
    """x [M, K] @ wq -> [M, N] in x.dtype (Pallas TPU)."""
    m = x.shape[0]
    n, kp = wq.out_features, wq.padded_in_features
    block_m = block_m or min(_round_up(m, 8), _MAX_BLOCK_M)
    block_n = block_n or pick_block_n(n)
    block_k = block_k or pick_block_k(kp, wq.group_size)
    mp = _round_up(m, block_m)
    xp = jnp.pad(pad_activations(x, wq), ((0, mp - m), (0, 0)))  # [Mp, Kp]
    per_channel = wq.group_size == kp
    kernel = functools.partial(
        _qmm_kernel, bits=wq.bits, per_channel=per_channel,
        groups_per_block=1 if per_channel else max(block_k // wq.group_size, 1))
    w_cols = block_k // 2 if wq.bits == 4 else block_k
    out = pl.pallas_call(
        kernel,
        grid=(mp // block_m, n // block_n, kp // block_k),
        in_specs=[
            pl.BlockSpec((block_m, block_k), lambda i, j, k: (i, k)),
            pl.BlockSpec((block_n, w_cols), lambda i, j, k: (j, k)),
            _scale_spec(wq, block_k, block_n),
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j, k: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, n), x.dtype),
        scratch_shapes=[pltpu.VMEM((block_m, block_n), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(xp, wq.values, wq.scales)
    return out[:m]


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m
