"""jaxinfer: LLM inference on JAX/XLA for TPUs and GPUs.

The public API is small on purpose and shaped like vLLM's offline API: `LLM` to load and generate (`AsyncLLM`, its asyncio twin, for servers),
`SamplingParams` per request, the prompt dicts, the output types, and `InvalidInput` (what every front door
raises for bad input, naming the field). Everything else is importable from its module but not promised stable.
"""

from jaxinfer.async_llm import AsyncLLM
from jaxinfer.config import SamplingParams
from jaxinfer.errors import ConfigError, InvalidInput, InvalidInputType, Notice
from jaxinfer.inputs import TextPrompt, TokensPrompt
from jaxinfer.llm import LLM
from jaxinfer.outputs import CompletionOutput, FinishReason, Logprob, RequestMetrics, RequestOutput
from jaxinfer.validation import RequestOutputKind

__all__ = [
    "LLM", "AsyncLLM", "SamplingParams", "RequestOutputKind", "TextPrompt", "TokensPrompt", "RequestOutput", "CompletionOutput",
    "Logprob", "RequestMetrics", "FinishReason", "InvalidInput", "InvalidInputType", "ConfigError", "Notice",
]
__version__ = "0.1.0"
