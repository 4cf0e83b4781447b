"""What generation returns to the user (vLLM-shaped, with shortcuts for the single-completion case)."""

from __future__ import annotations

import dataclasses
import enum


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[dict[int, float]] | None = None  # per generated token: {token id: logprob}
    cumulative_logprob: float | None = None
    delta_text: str = ""  # new since the previous streamed output of this request
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[dict[int, float] | None] | None = None
    metrics: dict[str, float] | None = None
    inter_token_latencies: list[float] = dataclasses.field(default_factory=list)  # seconds, seq 0; set when finished

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.outputs[0].finish_reason
