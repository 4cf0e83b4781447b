"""Sampler logprob arrays -> vLLM's `{token_id: Logprob(logprob, rank, decoded_token)}` dicts (host side).

Per generated token: the request's top `logprobs` alternatives with ranks 1..k, and the sampled token with
its own rank in the model's distribution (so it is always present, rank 1 when it was the most likely).
Per prompt position (prompt_logprobs): the same for the actual next prompt token; position 0 has no context
and stays None. Logprobs are of the raw model distribution, before any sampling knob (vLLM's default).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxinfer.engine.request import RequestState
from jaxinfer.engine.sampling import PromptLogprobs, SamplerOutput
from jaxinfer.engine.step_plan import ScheduledSeq
from jaxinfer.outputs import Logprob

TokenText = Callable[[int], str | None]


class TokenTexts:
    """Each token's text on its own (`Logprob.decoded_token`), decoded once per id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text

    def for_request(self, state: RequestState) -> TokenText:
        return self if state.params.detokenize else _no_text


def _no_text(token: int) -> None:
    return None


def _top_dict(ids: Any, logprobs: Any, text: TokenText) -> dict[int, Logprob]:
    return {int(i): Logprob(float(lp), r + 1, text(int(i))) for r, (i, lp) in enumerate(zip(ids, logprobs))}


def sample_logprobs(out: SamplerOutput, row: int, token: int, k: int, text: TokenText) -> dict[int, Logprob]:
    """Row `row` of the sampler's output: top k alternatives and the sampled `token`."""
    top = _top_dict(out.top_ids[row][:k], out.top_logprobs[row][:k], text)
    top[token] = Logprob(float(out.logprobs[row]), int(out.ranks[row]), text(token))
    return top


def collect_prompt_logprobs(state: RequestState, entry: ScheduledSeq, out: PromptLogprobs, offset: int,
                            text: TokenText) -> None:
    """Fill state.prompt_logprobs for the prompt positions this step computed (entry's tokens start at row
    `offset` of `out`); a recompute after preemption does not redo them."""
    k = state.params.prompt_logprobs
    if k is None or entry.key[1] != 0 or state.prompt_logprobs_done:
        return
    prompt = state.prompt_token_ids
    if state.prompt_logprobs is None:
        state.prompt_logprobs = [None] * len(prompt)
    for j in range(len(entry.token_ids)):
        pos = entry.start_pos + j
        if pos + 1 < len(prompt):
            row, actual = offset + j, prompt[pos + 1]
            top = _top_dict(out.top_ids[row][:k], out.top_logprobs[row][:k], text)
            top[actual] = Logprob(float(out.logprobs[row]), int(out.ranks[row]), text(actual))
            state.prompt_logprobs[pos + 1] = top
    state.prompt_logprobs_done = entry.start_pos + len(entry.token_ids) >= len(prompt) - 1
