"""Ragged paged attention: one entry point, three implementations with the same semantics.

`impl="auto"` picks the Pallas TPU kernel on TPU, the Pallas GPU kernel on GPU and the jnp reference
on CPU. `interpret=True` runs a Pallas kernel in Pallas interpret mode (works on CPU).
"""

from __future__ import annotations

from typing import Literal

import jax

from pallas_kernels.ragged_paged_attention import reference

Impl = Literal["auto", "reference", "pallas_tpu", "pallas_gpu"]
_IMPLS = ("auto", "reference", "pallas_tpu", "pallas_gpu")


def resolve_impl(impl: Impl, *, gpu_supported: bool = True) -> str:
    """The concrete implementation for `impl` on the default backend.

    gpu_supported: whether the GPU kernel takes the call's configuration (gpu.supported_config:
    no int8/fp8 KV yet); "auto" falls back to the reference on GPU otherwise.
    """
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    chosen = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(jax.default_backend(), "reference")
    return "reference" if chosen == "pallas_gpu" and not gpu_supported else chosen


def ragged_paged_attention(
    q: jax.Array,  # [T, N, H]
    k_pages: jax.Array,  # [P, R, K, H]
    v_pages: jax.Array,  # [P, R, K, H]
    kv_lens: jax.Array,  # [S] int32
    page_indices: jax.Array,  # [S, M] int32
    cu_q_lens: jax.Array,  # [S+1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    impl: Impl = "auto",
    interpret: bool = False,
) -> jax.Array:
    """Attention of ragged new tokens over a paged KV cache (docs/ARCHITECTURE.md); [T, N, H]."""
    args = (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    kwargs = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                  k_scale=k_scale, v_scale=v_scale)
    from pallas_kernels.ragged_paged_attention import gpu
    chosen = resolve_impl(impl, gpu_supported=gpu.supported_config(q, k_pages))
    if chosen == "reference":
        return reference.ragged_paged_attention(*args, **kwargs)
    if chosen == "pallas_tpu":
        from pallas_kernels.ragged_paged_attention import tpu
        return tpu.ragged_paged_attention(*args, **kwargs, interpret=interpret)
    return gpu.ragged_paged_attention(*args, **kwargs, interpret=interpret)


__all__ = ["ragged_paged_attention", "resolve_impl", "reference"]
