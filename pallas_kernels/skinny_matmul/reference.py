"""The specification of the skinny product: RMSNorm of a few rows (optional), then the rows times a whole weight.

    out [T, N] (x.dtype) = normed_matmul(x [T, K], w [K, N], norm [K] | None, eps)

The norm is the engine's (jaxinfer.models.common.rms_norm): float32 mean of squares over K, the normed rows
rounded back to x's dtype before the product; the product accumulates in float32 and rounds to x's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_normed(x: jax.Array, norm: jax.Array | None, eps: float) -> jax.Array:
    """x [T, K] RMS-normed over K with weight norm [K] (x itself when norm is None), in x's dtype."""
    if norm is None:
        return x
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)  # [T, 1]
    return (x32 * inv * norm.astype(jnp.float32)).astype(x.dtype)


def normed_matmul_parts(x: jax.Array, w: jax.Array, norm: jax.Array | None, eps: float, splits: int) -> jax.Array:
    """[S, T, N] float32 partial products over S consecutive slices of K; they sum to the normed product."""
    t, k = x.shape
    xs = rms_normed(x, norm, eps).reshape(t, splits, k // splits)  # [T, S, K/S]
    ws = w.reshape(splits, k // splits, w.shape[1])  # [S, K/S, N]
    return jnp.einsum("tsk,skn->stn", xs, ws, preferred_element_type=jnp.float32)  # [S, T, N]


def normed_matmul(x: jax.Array, w: jax.Array, norm: jax.Array | None = None, eps: float = 1e-6) -> jax.Array:
    """[T, N] in x's dtype: rms_normed(x) @ w with float32 accumulation."""
    return jnp.einsum("tk,kn->tn", rms_normed(x, norm, eps), w,
                      preferred_element_type=jnp.float32).astype(x.dtype)  # [T, K] x [K, N] -> [T, N]
