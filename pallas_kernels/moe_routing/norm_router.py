"""A decode step's MLP RMSNorm and its MoE router product in one Pallas Triton kernel (Qwen3-MoE on a GPU).

    h [T, D], logits [P, T, E] float32 = norm_router(x [T, D], weight [D], router [D, E], eps=eps)

h is models.common.rms_norm(x, weight, eps) (float32 arithmetic, rounded to the router's dtype: x may be a float32
residual stream, qwen3.f32_residual); the logits are h @ router
as P partial products over consecutive slices of D (the 16-bit products exact in float32, summed in float32), the
form the routing kernel (moe_routing.top_k_routing) takes and sums. Program p norms every token's row (its sum of
squares over all of D: 4 KB a token, cheap), stores its slice of h and multiplies that slice by its rows of the
router ([D / P, E], contiguous).

Why a kernel: in Qwen3-30B-A3B's batch-1 decode loop on an H200 XLA ran the MLP norm (1.75 us a layer) and the
router product, split 32 ways over D (1.87 us), as two kernels that each move a few KB besides the router's
512 KB; their cost is launches and dependent latency. This kernel took 3.4 us a layer there, the loop's device time
1.2-2.3% less and 48 launches an iteration fewer (docs/PERFORMANCE.md, "thirty-fourth session"). Split over the
experts instead (each program a [D, 8] column slice of the router: 16 bytes of every 256-byte row), it took
6.9-8.1 us.

Triton blocks are powers of two, so the kernel takes a power-of-two D and E, a 16-bit router, x of its dtype or
float32, and
at most MAX_TOKENS tokens (`takes`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.moe_routing import split_router_logits

MAX_TOKENS = 16  # decode buckets: a step of 16 tokens at top-8 is the per-pair path's largest (moe.PAIR_PATH_MAX_PAIRS)
ROWS_PER_PROGRAM = 64  # router rows a program multiplies ([64, E] of it in registers): D / 64 partials
NUM_WARPS = 4  # per program
_MAX_BLOCK = 16 * 1024  # rows_per_program * E a program holds


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def takes(x: jax.Array, weight: jax.Array, router: jax.Array, rows_per_program: int = ROWS_PER_PROGRAM) -> bool:
    """Whether the kernel takes these operands (module docstring)."""
    if not all(isinstance(a, jax.Array | jax.ShapeDtypeStruct) for a in (x, weight, router)):  # tracers included
        return False  # e.g. quantized weights
    if x.ndim != 2 or router.ndim != 2 or weight.shape != (x.shape[1],) or router.shape[0] != x.shape[1]:
        return False
    d, e = router.shape
    return (router.dtype in (jnp.bfloat16, jnp.float16) and x.dtype in (router.dtype, jnp.float32)
            and _pow2(d) and _pow2(e)
            and _pow2(rows_per_program) and rows_per_program <= d and rows_per_program * e <= _MAX_BLOCK
            and 1 <= x.shape[0] <= MAX_TOKENS)


def reference(x: jax.Array, weight: jax.Array, router: jax.Array, eps: float,
              rows_per_program: int = ROWS_PER_PROGRAM) -> tuple[jax.Array, jax.Array]:
    """The specification in jnp: (h [T, D] in the router's dtype, logits [D / rows_per_program, T, E] float32
    partials)."""
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)  # [T, 1]
    h = (x32 * inv * weight.astype(jnp.float32)).astype(router.dtype)  # [T, D]
    splits = x.shape[1] // rows_per_program
    return h, split_router_logits(h, router, splits)  # [P, T, E]


def _kernel(x_ref, w_ref, r_ref, h_ref, logits_ref, *, eps: float, rows: int):
    # One program per slice of `rows` of D: x_ref [T, D]; w_ref [D]; r_ref [D, E]; h_ref [T, D] (each program its
    # slice); logits_ref [P, T, E] f32 (each program its partial).
    import jax.experimental.pallas as pl

    p = pl.program_id(0)
    f32 = jnp.float32
    mine = pl.ds(p * rows, rows)
    num_tokens, d = x_ref.shape
    weight = w_ref[mine].astype(f32)  # [rows]
    router = r_ref[mine, :].astype(f32)  # [rows, E], read once for every token
    for t in range(num_tokens):
        row = pl.ds(t, 1)  # a one-row slice: the ref indexers take a slice or a traced index, not a Python int
        x = x_ref[row, :].astype(f32)  # [1, D]: the whole row, for its sum of squares
        inv = jax.lax.rsqrt(jnp.sum(x * x) / d + eps)
        h = (x_ref[row, mine].astype(f32) * inv * weight[None, :]).astype(h_ref.dtype)  # [1, rows], rounded as
        h_ref[row, mine] = h  # the model rounds its normed rows
        logits_ref[pl.ds(p, 1), row, :] = jnp.sum(h.astype(f32).reshape(rows, 1) * router, axis=0)[None, None, :]


@functools.partial(jax.jit, static_argnames=("eps", "rows_per_program", "num_warps", "interpret"))
def norm_router(x: jax.Array, weight: jax.Array, router: jax.Array, *, eps: float,
                rows_per_program: int = ROWS_PER_PROGRAM, num_warps: int = NUM_WARPS,
                interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """(h [T, D] in the router's dtype, logits [D / rows_per_program, T, E] float32 partials) for x [T, D] (16-bit,
    or a float32 residual stream), the norm's weight [D] and the router [D, E] (module docstring)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as plt

    if not takes(x, weight, router, rows_per_program):
        raise ValueError(f"norm_router takes x [T <= {MAX_TOKENS}, D] and a 16-bit router [D, E] of x's dtype (or x "
                         f"float32) with a "
                         f"power-of-two D and E, D at least {rows_per_program}; got x {x.shape} {x.dtype}, weight "
                         f"{weight.shape}, router {router.shape} {router.dtype}")
    num_tokens, d = x.shape
    splits = d // rows_per_program
    return pl.pallas_call(
        functools.partial(_kernel, eps=float(eps), rows=rows_per_program),
        out_shape=(jax.ShapeDtypeStruct((num_tokens, d), router.dtype),
                   jax.ShapeDtypeStruct((splits, num_tokens, router.shape[1]), jnp.float32)),
        grid=(splits,),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="norm_router",
    )(x, weight, router)


__all__ = ["MAX_TOKENS", "norm_router", "reference", "takes"]
