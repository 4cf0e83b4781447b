"""jaxinfer: LLM inference on JAX/XLA for TPUs and GPUs.

The public API is small on purpose and shaped like vLLM's offline API: `LLM` to load and generate (`AsyncLLM`, its asyncio twin, for servers),
`SamplingParams` per request, the prompt dicts, the output types, and `InvalidInput` (what every front door
raises for bad input, naming the field). Everything else is importable from its module but not promised stable.
"""

import os

# JAX's GPU allocator takes 75% of the device at its first use unless told otherwise, which leaves a quarter
# of an H100 out of the KV cache that `memory_fraction` sizes (measured: 19,334 pages against 25,192 with
# 92%, and preemptions on 1000/1000). A process that imports an inference engine means it to have the
# device, so ask for 92% (the rest for cuBLAS/NCCL workspaces), unless the user set it. Too late only where
# JAX already started its GPU backend before this import.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

from jaxinfer.async_llm import AsyncLLM  # noqa: E402
from jaxinfer.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence  # noqa: E402
from jaxinfer.config import SamplingParams  # noqa: E402
from jaxinfer.errors import ConfigError, InvalidInput, InvalidInputType, Notice  # noqa: E402
from jaxinfer.inputs import TextPrompt, TokensPrompt  # noqa: E402
from jaxinfer.llm import LLM  # noqa: E402
from jaxinfer.outputs import CompletionOutput, FinishReason, Logprob, RequestMetrics, RequestOutput  # noqa: E402
from jaxinfer.validation import RequestOutputKind  # noqa: E402

__all__ = [
    "LLM", "AsyncLLM", "SamplingParams", "RequestOutputKind", "TextPrompt", "TokensPrompt", "RequestOutput", "CompletionOutput",
    "Logprob", "RequestMetrics", "FinishReason", "InvalidInput", "InvalidInputType", "ConfigError", "Notice",
    "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence",
]
__version__ = "0.1.0"
