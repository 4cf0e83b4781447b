"""Grouped (ragged) matmul for MoE experts: one entry point, three implementations.

    out = grouped_matmul(lhs [M, K], rhs [G, K, N] | QuantizedExperts, group_sizes [G] int32,
                         impl="auto" | "reference" | "pallas_tpu" | "pallas_gpu")

Semantics are `jax.lax.ragged_dot` (reference.py). `impl="auto"` picks the Pallas TPU kernel on
TPU, the Pallas GPU kernel on GPU when it takes the call (`gpu.supported`: bf16/f16 lhs, rhs of
the same dtype or int8/fp8 experts, K and N multiples of 64) and the reference otherwise.
`interpret=True` runs a Pallas kernel in interpret mode (works on CPU). `tiling` overrides the
tuned tiles (`tuning.GpuTiling` / `tuning.TpuTiling`).

    out = gather_matmul(lhs [R, K], rhs, rows [P], experts [P], impl=...)   # out[p] = lhs[rows[p]] @ rhs[experts[p]]

is the per-pair form for MoE decode steps of a few tokens (no sort; GPU kernel, reference elsewhere), and

    parts = swiglu_experts(x [T, D], w_gate, w_up, w_down, experts [T, k], valid [T], expert_offset, impl=...)

the MoE decode step's fused form: each token's k whole SwiGLU experts, silu(x[t] @ Wg[e]) * (x[t] @ Wu[e]) @
Wd[e], as [S, k, T, D] float32 partial sums (add them over the first axis) in one GPU kernel (gpu_swiglu.py,
16-bit weights).
"""

from __future__ import annotations

from typing import Literal

import jax

from pallas_kernels.grouped_matmul import reference
from pallas_kernels.grouped_matmul.reference import QuantizedExperts, dequantize, quantize_experts
from pallas_kernels.grouped_matmul.tuning import GpuTiling, TpuTiling

Impl = Literal["auto", "reference", "pallas_tpu", "pallas_gpu"]
_IMPLS = ("auto", "reference", "pallas_tpu", "pallas_gpu")


def resolve_impl(impl: Impl, *, gpu_supported: bool = True) -> str:
    """The concrete implementation for `impl` on the default backend."""
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    chosen = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(jax.default_backend(), "reference")
    return "reference" if chosen == "pallas_gpu" and not gpu_supported else chosen


def grouped_matmul(lhs: jax.Array, rhs, group_sizes: jax.Array, *, impl: Impl = "auto",
                   interpret: bool = False, preferred_element_type=None,
                   tiling: GpuTiling | TpuTiling | None = None) -> jax.Array:
    """lhs [M, K] rows sorted by group times their group's [K, N] weights -> [M, N] (module doc)."""
    reference.check_args(lhs, rhs, group_sizes)
    from pallas_kernels.grouped_matmul import gpu
    chosen = resolve_impl(impl, gpu_supported=gpu.supported(lhs, rhs))
    kwargs = dict(preferred_element_type=preferred_element_type)
    if chosen == "reference":
        return reference.grouped_matmul(lhs, rhs, group_sizes, **kwargs)
    if chosen == "pallas_tpu":
        from pallas_kernels.grouped_matmul import tpu
        return tpu.grouped_matmul(lhs, rhs, group_sizes, **kwargs, tiling=tiling, interpret=interpret)
    return gpu.grouped_matmul(lhs, rhs, group_sizes, **kwargs, tiling=tiling, interpret=interpret)


def gather_matmul(lhs: jax.Array, rhs, rows: jax.Array, experts: jax.Array, *, impl: Impl = "auto",
                  interpret: bool = False, preferred_element_type=None, tiling: GpuTiling | None = None) -> jax.Array:
    """The per-pair form, out[p] = lhs[rows[p]] @ rhs[experts[p]] ([P, N], zeros where experts[p] is outside
    [0, G)): the MoE decode path for a few tokens, with no sort. Only the GPU has a kernel for it; elsewhere
    (and for calls the GPU kernel does not take) it runs the reference, which gathers a weight copy per pair."""
    from pallas_kernels.grouped_matmul import gpu
    chosen = resolve_impl(impl, gpu_supported=gpu.supported(lhs, rhs))
    if chosen == "pallas_gpu":
        return gpu.gather_matmul(lhs, rhs, rows, experts, preferred_element_type=preferred_element_type,
                                 tiling=tiling, interpret=interpret)
    return reference.gather_matmul(lhs, rhs, rows, experts, preferred_element_type=preferred_element_type)


def swiglu_experts(x: jax.Array, w_gate, w_up, w_down, experts: jax.Array, valid: jax.Array | None = None,
                   expert_offset: jax.Array | int = 0, *, impl: Impl = "auto", interpret: bool = False,
                   tiling=None) -> jax.Array:
    """[S, k, T, D] float32 partial sums of each token's k SwiGLU experts (module docstring). The GPU kernel
    leaves the rows of invalid tokens and of experts outside expert_offset .. + G - 1 unwritten (mask them);
    the reference writes zeros there. GPU kernel for 16-bit weights (`gpu_swiglu.supported`), the reference
    elsewhere."""
    from pallas_kernels.grouped_matmul import gpu_swiglu
    chosen = resolve_impl(impl, gpu_supported=gpu_swiglu.supported(x, w_gate, w_up, w_down))
    if chosen == "pallas_gpu":
        return gpu_swiglu.swiglu_experts(x, w_gate, w_up, w_down, experts, valid, expert_offset, tiling=tiling,
                                         interpret=interpret)
    return reference.swiglu_experts(x, w_gate, w_up, w_down, experts, valid, expert_offset)


__all__ = ["GpuTiling", "QuantizedExperts", "TpuTiling", "dequantize", "gather_matmul", "grouped_matmul",
           "quantize_experts", "reference", "resolve_impl", "swiglu_experts"]
