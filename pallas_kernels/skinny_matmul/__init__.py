"""Decode-sized ("skinny") products: a few activation rows, optionally RMS-normed, against a whole weight matrix.

    parts [S, T, N] f32 = normed_matmul_parts(x [T, K], w [K, N], norm [K] | None, eps, impl="auto")
    out [T, N] = normed_matmul(x, w, norm, eps, impl="auto")          # the parts summed, in x's dtype

`reference` is the jnp specification (reference.py); `pallas_gpu` a Pallas Triton kernel (gpu.py) that folds the
norm into the product's prologue and splits K over the grid. impl="auto" takes the kernel on a GPU where it
`takes` the shape, the reference elsewhere. `interpret=True` runs the kernel in interpret mode (CPU tests).
"""

from __future__ import annotations

from typing import Literal

import jax

from pallas_kernels.skinny_matmul import reference
from pallas_kernels.skinny_matmul.gpu import Tiling, takes

Impl = Literal["auto", "reference", "pallas_gpu"]


def _chosen(impl: str, x: jax.Array, w: jax.Array, tiling: Tiling) -> str:
    if impl not in ("auto", "reference", "pallas_gpu"):
        raise ValueError(f"impl must be 'auto', 'reference' or 'pallas_gpu', got {impl!r}")
    if impl == "auto":
        gpu = jax.default_backend() == "gpu" and takes(x.shape[0], x.shape[1], w.shape[1], tiling)
        return "pallas_gpu" if gpu else "reference"
    return impl


def normed_matmul_parts(x: jax.Array, w: jax.Array, norm: jax.Array | None = None, eps: float = 1e-6, *,
                        impl: Impl = "auto", tiling: Tiling = Tiling(), interpret: bool = False) -> jax.Array:
    """[S, T, N] float32 partial products over S = tiling.splits slices of K (module docstring)."""
    if _chosen(impl, x, w, tiling) == "reference":
        return reference.normed_matmul_parts(x, w, norm, eps, tiling.splits)
    from pallas_kernels.skinny_matmul import gpu

    return gpu.normed_matmul_parts(x, w, norm, eps=eps, tiling=tiling, interpret=interpret)


def normed_matmul(x: jax.Array, w: jax.Array, norm: jax.Array | None = None, eps: float = 1e-6, *,
                  impl: Impl = "auto", tiling: Tiling = Tiling(), interpret: bool = False) -> jax.Array:
    """[T, N] in x's dtype: the normed rows times w (the partial products summed in float32)."""
    if _chosen(impl, x, w, tiling) == "reference":
        return reference.normed_matmul(x, w, norm, eps)
    parts = normed_matmul_parts(x, w, norm, eps, impl="pallas_gpu", tiling=tiling, interpret=interpret)
    return parts.sum(axis=0).astype(x.dtype)  # [T, N]


__all__ = ["Tiling", "normed_matmul", "normed_matmul_parts", "reference", "takes"]
