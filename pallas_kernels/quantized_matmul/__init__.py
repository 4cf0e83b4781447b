"""Weight-only quantized matmul (int8 per channel, int4 grouped, fp8 e4m3 per channel).

    wq = quantize_weights(w, bits=8 | 4, group_size=None | 128)   # w: [K, N]
    y = quantized_matmul(x, wq, impl="auto" | "reference" | "tpu" | "gpu", interpret=False)

`impl="auto"` picks the TPU kernel on TPU, the GPU kernel on GPU and the reference on CPU.
"""

from __future__ import annotations

from typing import Literal

import jax

from pallas_kernels.quantized_matmul import reference
from pallas_kernels.quantized_matmul.reference import (QuantizedWeights, dequantize_weights,
                                                        quantize_weights)

Impl = Literal["auto", "reference", "tpu", "gpu"]
_IMPLS = ("auto", "reference", "tpu", "gpu")


def resolve_impl(impl: Impl) -> str:
    """The concrete implementation for `impl` on the default backend."""
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    return {"tpu": "tpu", "gpu": "gpu"}.get(jax.default_backend(), "reference")


def quantized_matmul(x: jax.Array, wq: QuantizedWeights, *, impl: Impl = "auto",
                     interpret: bool = False) -> jax.Array:
    """x [M, K] @ wq ([K, N] quantized) -> [M, N] in x.dtype, fp32 accumulation."""
    chosen = resolve_impl(impl)
    if chosen == "reference":
        return reference.quantized_matmul(x, wq)
    if chosen == "tpu":
        from pallas_kernels.quantized_matmul import tpu
        return tpu.quantized_matmul(x, wq, interpret=interpret)
    from pallas_kernels.quantized_matmul import gpu
    return gpu.quantized_matmul(x, wq, interpret=interpret)


__all__ = ["QuantizedWeights", "dequantize_weights", "quantize_weights", "quantized_matmul",
           "resolve_impl"]
