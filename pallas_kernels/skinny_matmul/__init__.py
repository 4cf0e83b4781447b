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


__all__ = ["reference"]
