"""Host-side state of one request after sampling: detokenized text, stop checks, logprobs, metrics.

The scheduler owns token ids and pages; this module owns what the user sees. Stopping follows vLLM:
  * once min_tokens are out, a sequence stops on EOS (unless `ignore_eos`), on a `stop_token_ids` id, or
    when its text contains a `stop` string (matched on the detokenized text, so it may span tokens);
  * the stop string is cut from the text, and a stop token's own text is left out, unless
    `include_stop_str_in_output`; `stop_reason` is the stop string or stop id (None for EOS and length);
  * text that might be the start of a stop string is held back until it is clear (streaming never shows
    text that is cut later).
A request that fails alone (an exception while handling its output) is finished with "error" and the
message (`fail`); nothing here is shared with other requests, so they are unaffected.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from jaxinfer.config import SamplingParams
from jaxinfer.engine.detokenize import IncrementalDetokenizer
from jaxinfer.engine.sequence import FinishReason as SeqFinishReason
from jaxinfer.outputs import CompletionOutput, FinishReason, Logprob, RequestMetrics, RequestOutput
from jaxinfer.validation import RequestOutputKind

_USER_REASON = {
    SeqFinishReason.STOP: FinishReason.STOP,
    SeqFinishReason.LENGTH: FinishReason.LENGTH,
    SeqFinishReason.ABORT: FinishReason.ABORT,
}


@dataclasses.dataclass
class SeqOutput:
    """What one of the request's n sequences has produced so far."""

    detok: IncrementalDetokenizer | None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    pending_text: str = ""  # held back: might be the start of a stop string
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    stopped_on_string: bool = False
    delta_start: int = 0  # len(text) at the last stream report
    delta_tokens_start: int = 0
    matcher: Any = None  # structured output: this sequence's grammar matcher (jaxinfer.engine.grammar)


@dataclasses.dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seeds: list[int]
    seqs: list[SeqOutput]
    eos_ids: frozenset[int]
    max_tokens: int  # params.max_tokens, or what max_model_len leaves when that is None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # bad_words as token sequences (for the sampler)
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)  # sequence 0's token arrival times
    itl_sum: float = 0.0  # running inter-token latency stats, so per-step metrics stay O(1)
    itl_max: float = 0.0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_done: bool = False  # set once; a recompute after preemption does not redo them
    prompt_logprobs_sent: bool = False  # DELTA outputs carry them once
    num_cached_tokens: int = 0
    error: str | None = None
    _wall_offset: float = dataclasses.field(default_factory=lambda: time.time() - time.monotonic())

    @property
    def finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:  # the common case, asked several times per output of every streamed step
            return seqs[0].finish_reason is not None
        return all(s.finish_reason is not None for s in seqs)

    @property
    def num_generated(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def has_grammar(self) -> bool:
        return self.seqs[0].matcher is not None

    @property
    def has_multi_token_bad_words(self) -> bool:
        return any(len(w) > 1 for w in self.bad_words_ids)

    def on_token(self, index: int, token: int, logprob: float,
                 top: dict[int, Logprob] | None) -> SeqFinishReason | None:
        """Record a sampled token; returns a finish reason when the engine must stop this sequence."""
        self._record_time(index)
        out = self.seqs[index]
        out.token_ids.append(token)
        out.cumulative_logprob += logprob
        if top is not None:
            out.logprobs = (out.logprobs or []) + [top]
        may_stop = len(out.token_ids) >= self.params.min_tokens
        stop_token = may_stop and self._is_stop_token(token)
        if stop_token:
            out.stop_reason = token if token in self.params.stop_token_ids and token not in self._eos() else None
            out.finish_reason = FinishReason.STOP
        elif out.matcher is not None and self._advance_grammar(out.matcher, token):
            out.finish_reason = FinishReason.STOP
        if out.detok is not None and (not stop_token or self.params.include_stop_str_in_output):
            self._extend_text(out, token, check_stops=may_stop and not stop_token)
        return SeqFinishReason.STOP if out.finish_reason is FinishReason.STOP else None

    @staticmethod
    def _advance_grammar(matcher: Any, token: int) -> bool:
        """Advance the sequence's grammar by `token`; True when the grammar is complete (nothing may follow).
        A token the grammar refuses (the mask should make that impossible) fails this request alone."""
        if not matcher.consume_token(token) or matcher.is_error():
            raise RuntimeError(f"structured output: token {token} is not allowed here ({matcher.get_error()})")
        return matcher.is_stopped()

    def _record_time(self, index: int) -> None:
        now = time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = now
        if index != 0:
            return
        if self.token_times:
            gap = now - self.token_times[-1]
            self.itl_sum, self.itl_max = self.itl_sum + gap, max(self.itl_max, gap)
        self.token_times.append(now)

    def _eos(self) -> frozenset[int]:
        return frozenset() if self.params.ignore_eos else self.eos_ids

    def _is_stop_token(self, token: int) -> bool:
        return token in self.params.stop_token_ids or token in self._eos()

    def _extend_text(self, out: SeqOutput, token: int, check_stops: bool) -> None:
        out.pending_text += out.detok.push(token)
        hit = self._find_stop(out.pending_text) if check_stops else None
        if hit is not None:
            pos, stop = hit
            cut = pos + len(stop) if self.params.include_stop_str_in_output else pos
            out.text += out.pending_text[:cut]
            out.pending_text = ""
            out.finish_reason, out.stop_reason, out.stopped_on_string = FinishReason.STOP, stop, True
            return
        keep = self._stop_prefix_len(out.pending_text) if check_stops else 0
        out.text += out.pending_text[: len(out.pending_text) - keep]
        out.pending_text = out.pending_text[len(out.pending_text) - keep :]

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The earliest stop string in `text` (the first listed wins a tie) and where it starts."""
        hits = [(i, n, s) for n, s in enumerate(self.params.stop) if (i := text.find(s)) >= 0]
        return (min(hits)[0], min(hits)[2]) if hits else None

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that could still grow into a stop string."""
        best = 0
        for stop in self.params.stop:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best

    def stop_ids(self) -> list[int]:
        """Token ids that end a sequence once min_tokens are generated: stop_token_ids, and EOS unless
        ignore_eos (what `_is_stop_token` checks, for the device to stop early in multi-step decode)."""
        return list(dict.fromkeys([*self.params.stop_token_ids, *sorted(self._eos())]))

    def finish(self, index: int, reason: SeqFinishReason) -> None:
        """Close sequence `index`: keep the first reason, flush held-back text unless a stop string cut it."""
        out = self.seqs[index]
        out.finish_reason = out.finish_reason or _USER_REASON[reason]
        if out.detok is not None and not out.stopped_on_string:
            out.text += out.pending_text + out.detok.finish()
            out.pending_text = ""
        if self.finished:
            self.finished_time = time.monotonic()

    def fail(self, message: str) -> None:
        """Finish every unfinished sequence with "error"; the detokenizer is not touched (it may be what broke)."""
        self.error = self.error or message
        for out in self.seqs:
            if out.finish_reason is None:
                out.finish_reason, out.pending_text = FinishReason.ERROR, ""
        self.finished_time = self.finished_time or time.monotonic()

    def to_output(self) -> RequestOutput:
        """The output to report now, as the request's output_kind asks (DELTA: only what is new)."""
        delta = self.output_kind is RequestOutputKind.DELTA
        outputs = [self._completion(i, s, delta) for i, s in enumerate(self.seqs)]
        prompt_logprobs = self.prompt_logprobs
        if delta and self.prompt_logprobs_sent:
            prompt_logprobs = None
        self.prompt_logprobs_sent = self.prompt_logprobs_sent or prompt_logprobs is not None
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            prompt_logprobs=prompt_logprobs,
            metrics=self.metrics(),
            num_cached_tokens=self.num_cached_tokens,
            error=self.error,
            # The full list only once: building it every step would make streaming quadratic in length.
            inter_token_latencies=self.inter_token_latencies() if self.finished else [],
        )

    def error_output(self) -> RequestOutput:
        """The output of a failed request when building its normal output raised too: ids and the error."""
        outputs = [CompletionOutput(i, s.text, list(s.token_ids), FinishReason.ERROR) for i, s in enumerate(self.seqs)]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, finished=True,
                             error=self.error)

    def _completion(self, index: int, s: SeqOutput, delta: bool) -> CompletionOutput:
        new_text, new_ids = s.text[s.delta_start :], s.token_ids[s.delta_tokens_start :]
        logprobs = s.logprobs
        if delta and logprobs is not None:
            logprobs = logprobs[s.delta_tokens_start :]
        out = CompletionOutput(
            index=index,
            text=new_text if delta else s.text,
            token_ids=list(new_ids) if delta else list(s.token_ids),
            finish_reason=s.finish_reason,
            logprobs=logprobs,
            cumulative_logprob=s.cumulative_logprob,
            stop_reason=s.stop_reason,
            delta_text=new_text,
            delta_token_ids=list(new_ids),
        )
        s.delta_start, s.delta_tokens_start = len(s.text), len(s.token_ids)
        return out

    def metrics(self) -> RequestMetrics:
        wall = lambda t: None if t is None else t + self._wall_offset  # noqa: E731
        m = RequestMetrics(
            arrival_time=wall(self.arrival_time), first_scheduled_time=wall(self.scheduled_time),
            first_token_time=wall(self.first_token_time),
            last_token_time=wall(self.token_times[-1] if self.token_times else None),
            finished_time=wall(self.finished_time),
        )
        if self.scheduled_time is not None:
            m["time_in_queue"] = m["queue_time_s"] = self.scheduled_time - self.arrival_time
        if self.first_token_time is not None:
            m["ttft_s"] = self.first_token_time - self.arrival_time
        if len(self.token_times) > 1:
            m["mean_itl_s"] = self.itl_sum / (len(self.token_times) - 1)
            m["max_itl_s"] = self.itl_max
        return m

    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]
