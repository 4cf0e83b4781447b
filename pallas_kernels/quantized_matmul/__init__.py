"""Quantized matmul: int8 / int4 weights with per-channel or grouped scales (and GGUF-style zero
points), fp8 e4m3 weights weight-only or W8A8.

    wq = quantize_weights(w, bits=8 | 4, group_size=None | 16..128 | k*128, fp8=False, w8a8=False)
    y = quantized_matmul(x, wq, impl="auto" | "reference" | "tpu" | "gpu", interpret=False)

`impl="auto"` picks the TPU kernel on TPU, the GPU kernel on GPU and the reference on CPU. On a GPU,
"auto" runs the reference for weights the GPU kernel does not take (`gpu_unsupported_reason`:
N not a multiple of 64, ...), with one warning per reason; `impl="gpu"` raises instead.
Weight-only int8/int4 on a GPU with "auto": from `gpu.DEQUANTIZE_FROM_M` rows on (prefill chunks) the
weights are dequantized to 16 bits by one XLA fusion and XLA's dot runs (`gpu.dequantize_matmul`): the
kernel streams the weights once per 128 rows and was 4.5x the bf16 dot at 8,192 rows, dequantize + dot 1.08x
(H100, measured beside each other); "gpu" does the same. `gpu.quantized_matmul` is the kernel at any M.
Per-channel 8-bit weight-only weights (int8, e4m3) on a GPU go to XLA's own dot instead, at every M, with the
codes widened inside its GEMM fusion (`gpu.convert_matmul`, `gpu.XLA_PER_CHANNEL_8BIT`): 95% of the copy rate at
2-8 rows against the kernel's 76-85% with its split-K epilogue, and faster at many rows too (H100, measured beside
each other); the kernel keeps grouped scales, zero points and int4.
fp8 W8A8 weights (`wq.w8a8`) quantize the activations per row first (reference.quantize_rows) on
every path; on GPU they run on fp8 wgmma (gpu_fp8.py), on TPU through the weight-only kernel on the
quantized rows (e4m3 values are exact in bf16).
"""

from __future__ import annotations

import warnings
from typing import Literal

import jax
import jax.numpy as jnp

from pallas_kernels.quantized_matmul import reference
from pallas_kernels.quantized_matmul.reference import (QuantizedWeights, dequantize_weights, from_codes,
                                                        quantize_rows, quantize_weights)

Impl = Literal["auto", "reference", "tpu", "gpu"]
_IMPLS = ("auto", "reference", "tpu", "gpu")
_WARNED: set[str] = set()


def resolve_impl(impl: Impl) -> str:
    """The concrete implementation for `impl` on the default backend."""
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    return {"tpu": "tpu", "gpu": "gpu"}.get(jax.default_backend(), "reference")


def gpu_unsupported_reason(wq: QuantizedWeights) -> str | None:
    """None when the GPU kernels take these weights; else one sentence why not."""
    if wq.w8a8:
        from pallas_kernels.quantized_matmul import gpu_fp8
        return gpu_fp8.unsupported_reason(wq.out_features, wq.padded_in_features)
    from pallas_kernels.quantized_matmul import gpu
    return gpu.unsupported_reason(wq)


def _warn_once(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"quantized_matmul(impl='auto'): the GPU kernel does not take these weights ({reason}); "
                      "running the jnp reference instead. This is reported once.", RuntimeWarning, stacklevel=3)


def quantized_matmul(x: jax.Array, wq: QuantizedWeights, *, impl: Impl = "auto",
                     interpret: bool = False) -> jax.Array:
    """x [M, K] @ wq ([K, N] quantized) -> [M, N] in x.dtype, fp32 accumulation."""
    from pallas_kernels.quantized_matmul import gpu

    chosen = resolve_impl(impl)
    if chosen == "gpu" and not interpret and gpu.xla_takes(wq):  # per-channel 8-bit: XLA's dot on the widened codes
        return gpu.convert_matmul(x, wq)
    if chosen == "gpu" and impl == "auto":
        reason = gpu_unsupported_reason(wq)
        if reason is not None:
            _warn_once(reason)
            chosen = "reference"
    if chosen == "reference":
        return reference.quantized_matmul(x, wq)
    if chosen == "tpu":
        from pallas_kernels.quantized_matmul import tpu
        if wq.w8a8:  # the quantized rows are exact in bf16; their scales multiply the output rows
            xq, sx = quantize_rows(reference.pad_activations(x, wq))
            xq = xq.astype(jnp.float32 if x.dtype == jnp.float32 else jnp.bfloat16)
            plain = QuantizedWeights(wq.values, wq.scales, None, 8, wq.group_size, xq.shape[1], True, wq.pack)
            y = tpu.quantized_matmul(xq, plain, interpret=interpret).astype(jnp.float32) * sx[:, None]
            return y.astype(x.dtype)
        return tpu.quantized_matmul(x, wq, interpret=interpret)
    if wq.w8a8:
        from pallas_kernels.quantized_matmul import gpu_fp8
        xp = reference.pad_activations(x, wq)
        compute = jnp.float16 if x.dtype == jnp.float16 else jnp.bfloat16
        return gpu_fp8.w8a8_matmul(xp.astype(compute), wq.values, wq.scales[0],
                                   interpret=interpret).astype(x.dtype)
    if not interpret and x.shape[0] >= gpu.dequantize_from_m(wq):
        return gpu.dequantize_matmul(x, wq)  # prefill-sized M: the kernel is built for decode rows
    return gpu.quantized_matmul(x, wq, interpret=interpret)


__all__ = ["QuantizedWeights", "dequantize_weights", "from_codes", "gpu_unsupported_reason", "quantize_rows",
           "quantize_weights", "quantized_matmul", "reference", "resolve_impl"]
