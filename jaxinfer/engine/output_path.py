"""The output path: one iteration's sampled tokens -> request states, the scheduler, and RequestOutputs.

A collaborator of `Engine`, kept apart because it is where a request can fail alone: an exception while one
request's output is handled (detokenizing, stop matching, logprobs, building its output) finishes that
request with finish_reason "error" and frees its pages, before the scheduler hears of its token, so every
other request proceeds exactly as it would have.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jaxinfer.engine.logprobs import collect_prompt_logprobs, sample_logprobs
from jaxinfer.engine.request import RequestState
from jaxinfer.engine.sampling import PromptLogprobs, SamplerOutput
from jaxinfer.engine.step_plan import ScheduledSeq, StepPlan
from jaxinfer.engine.sequence import FinishReason, SeqKey
from jaxinfer.outputs import Logprob, RequestOutput
from jaxinfer.validation import RequestOutputKind

if TYPE_CHECKING:
    from jaxinfer.engine.engine import Engine


class OutputPath:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def apply(
        self, plan: StepPlan, out: SamplerOutput, prompt: PromptLogprobs | None, rows: Sequence[int]
    ) -> dict[str, RequestState]:
        """Hand one iteration's results (entry j of the plan is row rows[j] of `out`) to the request states
        and the scheduler; returns the requests that advanced.

        Failure isolation: an exception while one request's output is handled (detokenizing, stop matching,
        logprobs) fails that request alone (`fail`: aborted in the scheduler, so `update` skips it and its
        pages are freed) before the scheduler hears of its token; every other request proceeds exactly as
        it would have."""
        sampled: dict[SeqKey, int] = {}
        finished: dict[SeqKey, FinishReason] = {}
        touched: dict[str, RequestState] = {}
        offset = 0
        for row, entry in zip(rows, plan.seqs):
            state = self.engine.requests[entry.key[0]]
            touched[state.request_id] = state
            start, offset = offset, offset + len(entry.token_ids)
            if state.error is not None:
                continue
            try:
                if prompt is not None:
                    self._collect_prompt_logprobs(state, entry, prompt, start)
                if not entry.sample:
                    continue
                token = int(out.tokens[row])
                top = self._top(state, out, row, token)
                reason = state.on_token(entry.key[1], token, float(out.logprobs[row]), top)
            except Exception as e:  # noqa: BLE001
                self.fail(state, e)
                continue
            sampled[entry.key] = token
            if reason is not None:
                finished[entry.key] = reason
        self._update(plan, sampled, finished)
        return touched

    def apply_verified(
        self, plan: StepPlan, out: SamplerOutput, num_emitted: Sequence[int], rows: Sequence[int]
    ) -> dict[str, RequestState]:
        """`apply` for a speculative verification step: row rows[j] of out [S, K + 1] emitted
        num_emitted[rows[j]] tokens (accepted proposals, then one more). They reach the request one by one, as
        if decoded in turn; a stop (EOS, stop id or string) drops the tokens after it, and the scheduler hears
        of the tokens kept (its rollback frees the KV of the rest)."""
        sampled: dict[SeqKey, int | tuple[int, ...]] = {}
        finished: dict[SeqKey, FinishReason] = {}
        touched: dict[str, RequestState] = {}
        positions = [SamplerOutput(*(a[:, j] for a in out)) for j in range(out.tokens.shape[1])]  # [S] each
        for row, entry in zip(rows, plan.seqs):
            state = self.engine.requests[entry.key[0]]
            touched[state.request_id] = state
            if state.error is not None or not entry.sample:
                continue
            tokens: list[int] = []
            try:
                for at in positions[: int(num_emitted[row])]:
                    token = int(at.tokens[row])
                    top = self._top(state, at, row, token)
                    reason = state.on_token(entry.key[1], token, float(at.logprobs[row]), top)
                    tokens.append(token)
                    if reason is not None:
                        finished[entry.key] = reason
                        break
            except Exception as e:  # noqa: BLE001
                self.fail(state, e)
                continue
            sampled[entry.key] = tuple(tokens) if entry.num_draft else tokens[0]
        self._update(plan, sampled, finished)
        return touched

    def _update(self, plan: StepPlan, sampled: dict[SeqKey, Any], finished: dict[SeqKey, FinishReason]) -> None:
        """Tell the scheduler what the step produced; finish the sequences it stopped."""
        for key in self.engine.scheduler.update(plan, sampled, finished):
            self.engine.slots.release(key)
            state = self.engine.requests[key[0]]
            try:
                state.finish(key[1], finished.get(key, FinishReason.LENGTH))
            except Exception as e:  # noqa: BLE001
                self.fail(state, e)

    def fail(self, state: RequestState, error: BaseException) -> None:
        """Finish one request with "error" and free its pages; the others never notice."""
        for key in self.engine.scheduler.abort(state.request_id):
            self.engine.slots.release(key)
        state.fail(f"{type(error).__name__}: {error}")

    def _top(self, state: RequestState, out: SamplerOutput, row: int, token: int) -> dict[int, Logprob] | None:
        k = state.params.logprobs
        return None if k is None else sample_logprobs(out, row, token, k, self.engine._token_texts.for_request(state))

    def _collect_prompt_logprobs(
        self, state: RequestState, entry: ScheduledSeq, out: PromptLogprobs, offset: int
    ) -> None:
        collect_prompt_logprobs(state, entry, out, offset, self.engine._token_texts.for_request(state))

    def emit(self, touched: dict[str, RequestState]) -> list[RequestOutput]:
        """Outputs of the requests that advanced (FINAL_ONLY ones only when finished; streamed ones as
        `Engine.stream_interval` allows); finished ones leave."""
        outputs = []
        interval = self.engine.stream_interval
        for rid, state in touched.items():
            finished = state.finished
            if finished or (state.output_kind is not RequestOutputKind.FINAL_ONLY
                            and (interval == 1 or _stream_output_due(state, interval))):
                outputs.append(self.output(state))
                finished = state.finished  # building the output can fail the request
            if finished:
                del self.engine.requests[rid]
        return outputs

    def output(self, state: RequestState) -> RequestOutput:
        try:
            return state.to_output()
        except Exception as e:  # noqa: BLE001
            self.fail(state, e)
            return state.error_output()


def _stream_output_due(state: RequestState, interval: int) -> bool:
    """A streamed request's output is due: its first token (time to first token is not traded), or `interval`
    tokens since the last output, whose building left each sequence's `delta_tokens_start` at its length then."""
    sent = sum(s.delta_tokens_start for s in state.seqs)
    new = state.num_generated - sent
    return new > 0 and (sent == 0 or new >= interval)
