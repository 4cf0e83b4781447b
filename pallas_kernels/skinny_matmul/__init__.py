"""Dense products of a decode step's few token rows: x [T, K] @ w [K, N] as float32 partials over slices of K, or
added into a float32 residual. `reference` is the jnp form; the GPU kernel (gpu.py, Mosaic GPU) reads each weight
once at the copy rate where XLA's GEMMs stream it at ~80%."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def reference(x: jax.Array, w: jax.Array, residual: jax.Array | None = None, *, splits: int) -> jax.Array:
    """The specification: [S, T, N] float32 partial products over S consecutive slices of K, or residual + their
    sum ([T, N] float32) given a residual."""
    t, k = x.shape
    xs = x.reshape(t, splits, k // splits)  # [T, S, K/S]
    ws = w.reshape(splits, k // splits, w.shape[1])  # [S, K/S, N]
    parts = jnp.einsum("tsk,skn->stn", xs, ws, preferred_element_type=jnp.float32)  # [S, T, N]
    return parts if residual is None else residual + parts.sum(axis=0)


def normed_reference(x: jax.Array, norm_weight: jax.Array, w: jax.Array, *, splits: int) -> jax.Array:
    """The normed form's specification: the [S, T, N] float32 partials of bf16(x * norm_weight) @ w for a float32 x
    [T, K] (an RMSNorm's product without its per-row 1/rms)."""
    return reference((x * norm_weight.astype(jnp.float32)).astype(w.dtype), w, splits=splits)


__all__ = ["normed_reference", "reference"]
