"""Ragged paged attention: one entry point, four implementations with the same semantics.

`impl="auto"` picks the Pallas TPU kernel on TPU, the Pallas GPU kernel on GPU and the jnp `xla` version on
CPU (xla.py: the reference's work reordered so that decode rows are batched over sequences). "reference" is
the specification every other implementation is tested against. `interpret=True` runs a Pallas kernel in
Pallas interpret mode (works on CPU).

On a GPU, "auto" never raises for a layout the reference can run: a call the GPU kernel does not
take (`gpu.supported_config`: fp32 KV, an unusual page size or head dim, a quantized cache with pages under
32 tokens) runs on the
reference, and a warning names the reason once per process and reason, not once per layer or step.
"""

from __future__ import annotations

import warnings
from typing import Literal

import jax

from pallas_kernels.ragged_paged_attention import reference

Impl = Literal["auto", "reference", "xla", "pallas_tpu", "pallas_gpu"]
_IMPLS = ("auto", "reference", "xla", "pallas_tpu", "pallas_gpu")


def _backend() -> str:
    """The default JAX backend ("cpu", "gpu", "tpu"); one seam for tests to pose as a GPU."""
    return jax.default_backend()


def resolve_impl(impl: Impl, *, gpu_supported: bool = True) -> str:
    """The concrete implementation for `impl` on the default backend.

    gpu_supported: whether the GPU kernel takes the call's configuration (gpu.supported_config);
    "auto" falls back to the reference on GPU otherwise.
    """
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    chosen = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(_backend(), "xla")
    return "reference" if chosen == "pallas_gpu" and not gpu_supported else chosen


_WARNED: set[str] = set()  # fallback reasons already reported (one warning per reason)


def _warn_fallback_once(reason: str) -> None:
    """Reports a GPU call that runs on the reference, once per reason.

    The call sits inside every layer of every traced step, so the warning is deduplicated here
    rather than left to the `warnings` filters (which tests and servers often set to "always").
    """
    if reason in _WARNED:
        return
    _WARNED.add(reason)
    warnings.warn(
        f"ragged_paged_attention(impl='auto'): the GPU kernel does not take this call ({reason}); "
        "running the jnp reference instead, which is much slower. This is reported once.",
        RuntimeWarning, stacklevel=3)


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
    one_token_per_seq: bool = False,
) -> jax.Array:
    """Attention of ragged new tokens over a paged KV cache (docs/ARCHITECTURE.md); [T, N, H].

    one_token_per_seq: a hint that no sequence has more than one new token (a decode step); the GPU kernel then
    lays one token per tile (gpu.tile_layout). The results are the same either way."""
    args = (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    kwargs = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                  k_scale=k_scale, v_scale=v_scale)
    from pallas_kernels.ragged_paged_attention import gpu
    reason = gpu.unsupported_reason(q, k_pages)  # gpu.supported_config's decision, with its why
    chosen = resolve_impl(impl, gpu_supported=reason is None)
    if impl == "auto" and reason is not None and resolve_impl("auto") == "pallas_gpu":
        _warn_fallback_once(reason)  # chosen is the reference
    if chosen == "reference":
        return reference.ragged_paged_attention(*args, **kwargs)
    if chosen == "xla":
        from pallas_kernels.ragged_paged_attention import xla
        return xla.ragged_paged_attention(*args, **kwargs)
    if chosen == "pallas_tpu":
        from pallas_kernels.ragged_paged_attention import tpu
        return tpu.ragged_paged_attention(*args, **kwargs, interpret=interpret)
    return gpu.ragged_paged_attention(*args, **kwargs, interpret=interpret, one_token_per_seq=one_token_per_seq)


__all__ = ["ragged_paged_attention", "resolve_impl", "reference"]
