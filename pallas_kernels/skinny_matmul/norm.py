"""The RMSNorm in front of a decode step's skinny product, as a Pallas Triton kernel that lets the product start.

    h [T, D] = rms_norm(x [T, D] float32, weight [D], eps=eps)     # in the weight's dtype

h is models.common.rms_norm(x, weight, eps) rounded to the weight's dtype, the same float32 arithmetic. One
program a token row; each starts with griddepcontrol.launch_dependents (pallas_kernels.dependent_launch), so the
skinny_matmul kernel behind it, launched with PDL, streams its weight while the norm runs, where behind XLA's norm
fusion it could start only once that had finished. Takes a power-of-two D (a Triton block) and at most
skinny_matmul's 8 rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.dependent_launch import released_zero
from pallas_kernels.skinny_matmul.gpu import MAX_TOKENS

NUM_WARPS = 4  # per program


def takes(x: jax.Array, weight: jax.Array) -> bool:
    """Whether the kernel takes a float32 x [T <= MAX_TOKENS, D] and a 16-bit weight [D], D a power of two."""
    if not all(isinstance(a, jax.Array | jax.ShapeDtypeStruct) for a in (x, weight)):
        return False
    d = x.shape[-1]
    return (x.ndim == 2 and x.dtype == jnp.float32 and 1 <= x.shape[0] <= MAX_TOKENS and weight.shape == (d,)
            and weight.dtype in (jnp.bfloat16, jnp.float16) and d > 0 and d & (d - 1) == 0)


def _kernel(x_ref, w_ref, h_ref, *, eps: float, release: bool):
    # x_ref [T, D] f32; w_ref [D]; h_ref [T, D] in the weight's dtype. This program: row program_id(0).
    import jax.experimental.pallas as pl

    row = pl.program_id(0) + (released_zero() if release else 0)  # the trigger ahead of the first load
    x = x_ref[pl.ds(row, 1), :]  # [1, D]
    inv = jax.lax.rsqrt(jnp.sum(x * x) / x.shape[1] + eps)
    h_ref[pl.ds(row, 1), :] = (x * inv * w_ref[...].astype(jnp.float32)[None, :]).astype(h_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def rms_norm(x: jax.Array, weight: jax.Array, *, eps: float, interpret: bool = False) -> jax.Array:
    """RMSNorm(x) [T, D] in the weight's dtype for a float32 residual stream x [T, D] (module docstring)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as plt

    if not takes(x, weight):
        raise ValueError(f"the skinny norm takes float32 x [T <= {MAX_TOKENS}, D] and a 16-bit weight [D], D a power "
                         f"of two; got x {x.shape} {x.dtype}, weight {weight.shape} {weight.dtype}")
    t = x.shape[0]
    return pl.pallas_call(
        functools.partial(_kernel, eps=float(eps), release=not interpret),
        out_shape=jax.ShapeDtypeStruct(x.shape, weight.dtype),
        grid=(t,),
        compiler_params=plt.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret, name="skinny_norm",
    )(x, weight)
