"""jaxinfer: LLM inference on JAX/XLA for TPUs and GPUs.

The public API is small on purpose: `LLM` to load and generate, `SamplingParams` per request, and the
output types. Everything else is importable from its module but not promised stable.
"""

from jaxinfer.config import SamplingParams
from jaxinfer.llm import LLM
from jaxinfer.outputs import CompletionOutput, FinishReason, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "FinishReason"]
__version__ = "0.1.0"
