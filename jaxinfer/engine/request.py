"""Host-side state of one request after sampling: detokenized text, stop checks, logprobs, metrics.

The scheduler owns token ids and pages; this module owns what the user sees. A sequence finishes here
when it samples EOS (unless `ignore_eos`), a `stop_token_ids` id, or produces a `stop` string; the stop
string is cut from the text (matched on the detokenized text, so it may span token boundaries).
"""

from __future__ import annotations

import dataclasses
import time

from jaxinfer.config import SamplingParams
from jaxinfer.engine.detokenize import IncrementalDetokenizer
from jaxinfer.engine.sequence import FinishReason
from jaxinfer.outputs import CompletionOutput, FinishReason as UserFinishReason, RequestOutput

_USER_REASON = {
    FinishReason.STOP: UserFinishReason.STOP,
    FinishReason.LENGTH: UserFinishReason.LENGTH,
    FinishReason.ABORT: UserFinishReason.ABORT,
}


@dataclasses.dataclass
class SeqOutput:
    """What one of the request's n sequences has produced so far."""

    detok: IncrementalDetokenizer | None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    pending_text: str = ""  # held back: might be the start of a stop string
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: FinishReason | None = None
    stopped_on_string: bool = False
    delta_start: int = 0  # len(text) at the last stream report
    delta_tokens_start: int = 0


@dataclasses.dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seeds: list[int]
    seqs: list[SeqOutput]
    eos_ids: frozenset[int]
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)  # sequence 0's token arrival times
    itl_sum: float = 0.0  # running inter-token latency stats, so per-step metrics stay O(1)
    itl_max: float = 0.0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprobs_done: bool = False  # set once; a recompute after preemption does not redo them

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)

    def on_token(self, index: int, token: int, logprob: float, top: dict[int, float] | None) -> FinishReason | None:
        """Record a sampled token; returns a finish reason when the engine must stop this sequence."""
        now = time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = now
        if index == 0:
            if self.token_times:
                gap = now - self.token_times[-1]
                self.itl_sum, self.itl_max = self.itl_sum + gap, max(self.itl_max, gap)
            self.token_times.append(now)
        out = self.seqs[index]
        out.token_ids.append(token)
        out.cumulative_logprob += logprob
        if top is not None:
            out.logprobs = (out.logprobs or []) + [top]
        self._extend_text(out, token)
        return self._stop_reason(out, token)

    def _extend_text(self, out: SeqOutput, token: int) -> None:
        if out.detok is None:
            return
        out.pending_text += out.detok.push(token)
        stop_hit = self._find_stop(out.pending_text)
        if stop_hit is not None:
            out.text += out.pending_text[:stop_hit]
            out.pending_text = ""
            out.finish_reason = FinishReason.STOP
            out.stopped_on_string = True
            return
        keep = self._stop_prefix_len(out.pending_text)
        out.text += out.pending_text[: len(out.pending_text) - keep]
        out.pending_text = out.pending_text[len(out.pending_text) - keep :]

    def _find_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.params.stop) if i >= 0]
        return min(hits) if hits else None

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that could still grow into a stop string."""
        best = 0
        for stop in self.params.stop:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best

    def _stop_reason(self, out: SeqOutput, token: int) -> FinishReason | None:
        if out.finish_reason is not None:  # a stop string
            return out.finish_reason
        generated = len(out.token_ids)
        if generated < self.params.min_tokens:
            return None
        if token in self.params.stop_token_ids or (not self.params.ignore_eos and token in self.eos_ids):
            return FinishReason.STOP
        return None

    def stop_ids(self) -> list[int]:
        """Token ids that end a sequence once min_tokens are generated: stop_token_ids, and EOS unless
        ignore_eos (what `_stop_reason` checks, for the device to stop early in multi-step decode)."""
        eos = () if self.params.ignore_eos else sorted(self.eos_ids)
        return list(dict.fromkeys([*self.params.stop_token_ids, *eos]))

    def finish(self, index: int, reason: FinishReason) -> None:
        """Close sequence `index`: keep the first reason, flush held-back text unless a stop string cut it."""
        out = self.seqs[index]
        out.finish_reason = out.finish_reason or reason
        if out.detok is not None and not out.stopped_on_string:
            out.text += out.pending_text + out.detok.finish()
            out.pending_text = ""

    def to_output(self) -> RequestOutput:
        outputs = []
        for i, s in enumerate(self.seqs):
            outputs.append(
                CompletionOutput(
                    index=i,
                    text=s.text,
                    token_ids=list(s.token_ids),
                    finish_reason=_USER_REASON.get(s.finish_reason) if s.finish_reason else None,
                    logprobs=s.logprobs,
                    cumulative_logprob=s.cumulative_logprob,
                    delta_text=s.text[s.delta_start :],
                    delta_token_ids=s.token_ids[s.delta_tokens_start :],
                )
            )
            s.delta_start, s.delta_tokens_start = len(s.text), len(s.token_ids)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            prompt_logprobs=self.prompt_logprobs,
            metrics=self.metrics(),
            # The full list only once: building it every step would make streaming quadratic in length.
            inter_token_latencies=self.inter_token_latencies() if self.finished else [],
        )

    def metrics(self) -> dict[str, float]:
        m: dict[str, float] = {"arrival_time": self.arrival_time}
        if self.scheduled_time is not None:
            m["queue_time_s"] = self.scheduled_time - self.arrival_time
        if self.first_token_time is not None:
            m["ttft_s"] = self.first_token_time - self.arrival_time
        if len(self.token_times) > 1:
            m["mean_itl_s"] = self.itl_sum / (len(self.token_times) - 1)
            m["max_itl_s"] = self.itl_max
        return m

    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]
