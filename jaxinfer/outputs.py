"""What generation returns to the user: vLLM's `RequestOutput`/`CompletionOutput`/`Logprob`, plus shortcuts
for the single-completion case (`out.text`, `out.token_ids`, `out.finish_reason`) and streaming deltas.

Compatibility with what these types were before they matched vLLM: `FinishReason` is a `str` enum, so
`FinishReason.STOP == "stop"` and `is FinishReason.STOP` both hold; a `Logprob` is also a float equal to its
`.logprob`, so code that read logprobs as bare floats still works; `RequestMetrics` is also a dict holding
the older keys (`ttft_s`, `queue_time_s`, ...), so it serializes to JSON as before.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"
    ERROR = "error"  # this request failed alone (its message is in RequestOutput.error); the others ran on


class Logprob(float):
    """vLLM's Logprob: `logprob`, 1-based `rank` in the model's distribution, and `decoded_token` (None when
    the request set detokenize=False). It is also a float equal to `logprob`."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> Logprob:
        obj = super().__new__(cls, logprob)
        obj.rank = rank
        obj.decoded_token = decoded_token
        return obj

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Logprob, (float(self), self.rank, self.decoded_token))


SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


class RequestMetrics(dict):
    """Timing of one request. Attributes as in vLLM, wall-clock seconds since the epoch (time.time()):
    arrival_time, first_scheduled_time, first_token_time, last_token_time, finished_time (None until they
    happen), and time_in_queue (seconds). Also a dict with the durations jaxinfer reported before:
    queue_time_s, ttft_s (arrival to first token), mean_itl_s, max_itl_s (inter-token latency)."""

    _ATTRS = ("arrival_time", "first_scheduled_time", "first_token_time", "last_token_time", "finished_time",
              "time_in_queue")

    def __getattr__(self, name: str) -> Any:
        if name in self._ATTRS:
            return self.get(name)
        raise AttributeError(name)


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: SampleLogprobs | None = None  # per generated token: {token id: Logprob}, the sampled one included
    cumulative_logprob: float | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it; None for EOS/length
    delta_text: str = ""  # new since the previous streamed output of this request
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None  # the text given, or the decoded token ids (None only without a tokenizer)
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: PromptLogprobs | None = None  # [0] is None: the first token has no context
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    error: str | None = None  # why the request failed, when finish_reason is "error"
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
