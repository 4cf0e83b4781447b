"""The flash-decoding merge of a decode step (one-token tiles) as one Pallas Triton kernel.

    out [T, K, G, H] = merge_decode_splits(o_parts [S, K, T, rows, H], lse_parts [S, K, T, 64] f32, real_end [1])

For token t, kv head k and q head g < G of it: the S splits' outputs weighted by 2^(lse_s - max_s lse_s), divided
by the sum of those weights (base-2 log-sum-exps, as the attention kernel stores them), times `scale` (the value
scale of an 8-bit cache, else 1), zero for tokens t >= real_end (bucket padding), in o_parts' dtype. The same
function as gpu._combine_splits followed by gpu._decode_rows, in the same float32 arithmetic.

Why a kernel: XLA ran that merge as two kernels in every layer, the max over the splits' LSEs ([K, T, rows]) and
then the weighted sum with the rows' transpose back to [T, N, H]; it would not fuse the first into the second,
whose H threads per row would each have redone the chain of S maxima (one H200, Qwen3-30B-A3B's batch-1 decode, 32
splits: 1.5 + 2.5 us a layer; with 8 splits XLA did fuse them). Here one program per (kv head, token, q head) holds
its [S, H] slice and [S] LSEs in registers: one launch, each input read once, the output written in the layout the
output projection reads.

Triton blocks are powers of two, so the kernel takes power-of-two S and H (`takes`); gpu.default_num_splits rounds a
decode step's split count down to one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# One program's [S, H] slice is summed in float32 registers; past this many elements it would spill.
_MAX_SLICE = 8192
NUM_WARPS = 4  # per program (read when the kernel is traced)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def takes(num_splits: int, head_dim: int) -> bool:
    """Whether the kernel takes a merge of `num_splits` splits of `head_dim`-wide rows."""
    return num_splits > 1 and _pow2(num_splits) and _pow2(head_dim) and num_splits * head_dim <= _MAX_SLICE


def _kernel(end_ref, lse_ref, o_ref, out_ref, *, scale: float):
    # end_ref [1] i32: tokens from it on are padding; lse_ref [S] f32, o_ref [S, H]: one q row's splits;
    # out_ref [H].
    import jax.experimental.pallas as pl

    token = pl.program_id(1)
    lse = lse_ref[...]  # [S]
    weights = jnp.exp2(lse - jnp.max(lse))  # [S]; empty splits (lse -1e30) weigh 0
    acc = jnp.sum(weights[:, None] * o_ref[...].astype(jnp.float32), axis=0)  # [H]
    out = acc / jnp.sum(weights)
    if scale != 1.0:
        out = out * scale
    out_ref[...] = jnp.where(token < end_ref[0], out, 0.0).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("group", "scale", "interpret"))
def merge_decode_splits(o_parts: jax.Array, lse_parts: jax.Array, real_end: jax.Array, *, group: int,
                        scale: float = 1.0, interpret: bool = False) -> jax.Array:
    """o_parts [S, K, T, rows, H] and lse_parts [S, K, T, 64] of the one-warpgroup kernel's one-token tiles, real_end
    [1] int32 (the step's real tokens) -> [T, K, G, H] in o_parts' dtype (module docstring)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as plt

    num_splits, kv_heads, num_tokens, _, head_dim = o_parts.shape
    if not takes(num_splits, head_dim):
        raise ValueError(f"the decode merge takes power-of-two splits and head dims with splits x head dim <= "
                         f"{_MAX_SLICE}, got {num_splits} splits of head dim {head_dim}")
    return pl.pallas_call(
        functools.partial(_kernel, scale=float(scale)),
        out_shape=jax.ShapeDtypeStruct((num_tokens, kv_heads, group, head_dim), o_parts.dtype),
        grid=(kv_heads, num_tokens, group),
        in_specs=[pl.BlockSpec((1,), lambda k, t, g: (0,)),
                  pl.BlockSpec((num_splits, None, None, None), lambda k, t, g: (0, k, t, g)),  # [S]
                  pl.BlockSpec((num_splits, None, None, None, head_dim), lambda k, t, g: (0, k, t, g, 0))],  # [S, H]
        out_specs=pl.BlockSpec((None, None, None, head_dim), lambda k, t, g: (t, k, g, 0)),  # [H]
        compiler_params=plt.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret, name="decode_merge",
    )(real_end.reshape(1).astype(jnp.int32), lse_parts, o_parts)
