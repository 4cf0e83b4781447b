"""Beam search over the engine, with HF transformers' semantics (`LLM.beam_search`).

Each step asks the engine for one token of every live beam as an ordinary request: the beam's prompt plus
the tokens chosen so far, `max_tokens=1`, the top `K` logprobs of the raw model distribution. Those requests
share their prompt's KV through the prefix cache (full pages are hash-chained by content), so a beam costs
the recompute of at most one partial page per step, never a copy of the prompt's KV; this is also how vLLM
builds `LLM.beam_search`. Everything the engine does for a request (paging, preemption, replicas, TP) is
unchanged, and a beam never sees another beam's tokens.

The bookkeeping follows `transformers.GenerationMixin._beam_search` (5.x) exactly, per prompt:
  * K = max(2, 1 + number of EOS ids) * beam_width candidates per step, best first, over every live beam's
    top K continuations (the global top K is inside the union of each beam's own top K);
  * a candidate "hits" when its token is an EOS id or it reaches max_tokens; hits never continue, and only
    hits among the first beam_width candidates become finished hypotheses, scored
    cum_logprob / generated_length ** length_penalty (the EOS counts in the length);
  * early_stopping=True stops a prompt once beam_width hypotheses are finished; False and "never" stop when
    the best live beam, scored at the current length (False) or, for "never" with a positive length penalty,
    at max_tokens, cannot beat the worst finished hypothesis;
  * the answer is the finished hypotheses, best score first.
Stopping is decided per prompt, so a prompt's beams do not depend on what else is in the batch (HF batches
keep stepping finished rows, which can change their result; with one prompt the two agree).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from jaxinfer.config import SamplingParams
from jaxinfer.errors import InvalidInput, InvalidInputType
from jaxinfer.validation import MAX_LOGPROBS, finite, is_int, is_real

EARLY_STOPPING = (True, False, "never")


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams, plus HF's `early_stopping`. `temperature` is accepted for vLLM code and must
    stay 0.0: the search is deterministic."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False  # keep the EOS token's text in `text`
    early_stopping: bool | str = False  # HF's: True, False or "never"

    def __post_init__(self) -> None:
        if not is_int(self.beam_width) or self.beam_width < 1:
            raise _bad("beam_width", self.beam_width, "an integer >= 1")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise _bad("max_tokens", self.max_tokens, "an integer >= 1")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "True or False", type_error=True)
        if not is_real(self.temperature) or self.temperature != 0.0:
            raise _bad("temperature", self.temperature, "0.0 (beam search here is deterministic)")
        if not is_real(self.length_penalty) or not finite(float(self.length_penalty)):
            raise _bad("length_penalty", self.length_penalty, "a finite number")
        if not any(self.early_stopping is v or (isinstance(self.early_stopping, str) and self.early_stopping == v)
                   for v in EARLY_STOPPING):
            raise _bad("early_stopping", self.early_stopping, "True, False or 'never'")


def _bad(field: str, value: Any, accepted: str, *, type_error: bool = False) -> InvalidInput:
    return (InvalidInputType if type_error else InvalidInput).of("BeamSearchParams.", field, value, accepted)


@dataclasses.dataclass
class BeamSearchSequence:
    """One beam: `tokens` is prompt + generated (as vLLM's), `token_ids` the generated part (with the EOS it
    ended on, as HF returns it), `logprobs` each generated token's logprob, `score` the length-penalised
    cum_logprob that ranks the beams (HF's `sequences_scores`)."""

    tokens: list[int]
    token_ids: list[int]
    logprobs: list[float]
    cum_logprob: float
    score: float
    text: str | None
    finish_reason: str  # "stop" (ended on an EOS id) or "length" (max_tokens)


@dataclasses.dataclass
class BeamSearchOutput:
    """One prompt's beams, best first."""

    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]


@dataclasses.dataclass
class _Beam:
    tokens: list[int]  # generated so far
    logprobs: list[float]
    cum: float  # sum of logprobs (HF's running beam score)


@dataclasses.dataclass
class _Finished:
    beam: _Beam
    score: float  # cum / len ** length_penalty


class PromptBeams:
    """One prompt's search state (pure Python, no model): `live` asks for the next-token top-K of each live
    beam, `advance` takes them and moves the search one token on."""

    def __init__(self, params: BeamSearchParams, eos_ids: Sequence[int]) -> None:
        self.params = params
        self.eos_ids = frozenset(() if params.ignore_eos else eos_ids)
        self.k = candidates_per_step(params.beam_width, len(self.eos_ids))
        self.live: list[_Beam] = [_Beam([], [], 0.0)]  # HF starts with one real beam (the others at -1e9)
        self.finished: list[_Finished] = []
        self.improvable = True  # HF's is_early_stop_heuristic_unsatisfied
        self.done = False

    def advance(self, tops: Sequence[Sequence[tuple[int, float]]]) -> None:
        """`tops[i]`: (token, logprob) of live beam i's K most likely next tokens."""
        p, width = self.params, self.params.beam_width
        length = len(self.live[0].tokens) + 1  # generated tokens once this step's token is appended
        cands = [(beam.cum + lp, i, tok, lp) for i, (beam, top) in enumerate(zip(self.live, tops, strict=True))
                 for tok, lp in top]
        # Best first; ties keep the lower beam and then the more likely token (as a stable top-k would).
        cands = sorted(cands, key=lambda c: -c[0])[: self.k]
        hits = [tok in self.eos_ids or length >= p.max_tokens for _, _, tok, _ in cands]
        full = len(self.finished) == width
        if not (full and (p.early_stopping is True or not self.improvable)):
            penalty = length ** p.length_penalty
            new = [_Finished(self._extend(i, tok, lp, total), total / penalty)
                   for (total, i, tok, lp), hit in zip(cands[:width], hits[:width]) if hit]
            self.finished = sorted(self.finished + new, key=lambda f: -f.score)[:width]
        self.live = [self._extend(i, tok, lp, total) for (total, i, tok, lp), hit in zip(cands, hits)
                     if not hit][:width]
        self._update_done(length)

    def _extend(self, i: int, tok: int, lp: float, total: float) -> _Beam:
        beam = self.live[i]
        return _Beam(beam.tokens + [tok], beam.logprobs + [lp], total)

    def _update_done(self, length: int) -> None:
        p, width = self.params, self.params.beam_width
        full = len(self.finished) == width
        if full and self.improvable:
            # Can the best live beam still beat the worst finished hypothesis? HF scores it at the current
            # length, or at max_tokens for "never" with a positive penalty (longer can only score higher).
            best_len = p.max_tokens if (p.early_stopping == "never" and p.length_penalty > 0) else length
            best = self.live[0].cum / best_len ** p.length_penalty if self.live else -math.inf
            self.improvable = best > self.finished[-1].score
        self.done = not self.live or not self.improvable or (full and p.early_stopping is True)

    def result(self, prompt: str | None, prompt_ids: list[int], tokenizer: Any) -> BeamSearchOutput:
        seqs = []
        for f in self.finished:
            ids = f.beam.tokens
            stopped = bool(ids) and ids[-1] in self.eos_ids
            seqs.append(BeamSearchSequence(
                tokens=prompt_ids + ids, token_ids=list(ids), logprobs=list(f.beam.logprobs), cum_logprob=f.beam.cum,
                score=f.score, text=self._text(ids, stopped, tokenizer), finish_reason="stop" if stopped else "length"))
        return BeamSearchOutput(prompt=prompt, prompt_token_ids=prompt_ids, sequences=seqs)

    def _text(self, ids: list[int], stopped: bool, tokenizer: Any) -> str | None:
        """Generated text without special tokens (HF's decode(skip_special_tokens=True)); the EOS text is
        appended when include_stop_str_in_output asks for it."""
        if tokenizer is None:
            return None
        text = tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=True)
        if stopped and self.params.include_stop_str_in_output:
            text += tokenizer.decode(ids[-1:], skip_special_tokens=False)
        return text


def candidates_per_step(beam_width: int, num_eos: int) -> int:
    """HF's beams_to_keep: enough candidates that beam_width of them survive even if every EOS id is among them."""
    return max(2, 1 + num_eos) * beam_width


def check_capacity(params: BeamSearchParams, num_eos: int, max_num_seqs: int) -> None:
    """The limits that depend on the engine: every beam of a prompt must fit in one batch, and the K
    candidates per beam must fit the sampler's logprob width."""
    factor = candidates_per_step(1, 0 if params.ignore_eos else num_eos)
    limit = min(max_num_seqs, MAX_LOGPROBS // factor)
    if params.beam_width > limit:
        why = (f"max_num_seqs={max_num_seqs}" if max_num_seqs < MAX_LOGPROBS // factor else
               f"each beam needs its top {factor} x beam_width next tokens and the sampler returns at most "
               f"{MAX_LOGPROBS}")
        raise InvalidInput(f"BeamSearchParams.beam_width must be at most {limit} here ({why}), got "
                           f"{params.beam_width}.", field="beam_width", value=params.beam_width,
                           accepted=f"an integer in [1, {limit}]")


def step_params(k: int) -> SamplingParams:
    """The request each live beam makes per step: one greedy token, the top k raw logprobs, no text."""
    return SamplingParams(max_tokens=1, temperature=0.0, logprobs=k, detokenize=False)


def top_candidates(logprobs: dict[int, Any], k: int) -> list[tuple[int, float]]:
    """A step's logprob dict (top k plus the sampled token) as the k best (token, logprob), best first."""
    ranked = sorted(((int(t), float(lp)) for t, lp in logprobs.items()), key=lambda c: -c[1])
    return ranked[:k]


def run_beam_search(engine: Any, gate: Any, tokenizer: Any, prompts: Any, params: BeamSearchParams, *,
                    max_num_seqs: int, use_tqdm: bool = False) -> list[BeamSearchOutput]:
    """Beam search for every prompt at once: each step is one `engine.generate` call over every live beam of
    every prompt still searching. `gate` is the engine's admission gate (prompt forms, ids, max_model_len)."""
    from tqdm.auto import tqdm

    from jaxinfer.engine.admission import in_batch
    from jaxinfer.inputs import parse_prompts

    if not isinstance(params, BeamSearchParams):
        raise InvalidInputType.of("", "params", params, "a BeamSearchParams")
    eos_ids = gate.limits.eos_ids
    check_capacity(params, len(eos_ids), max_num_seqs)
    parsed = parse_prompts(prompts)
    searches = [PromptBeams(params, eos_ids) for _ in parsed]
    k = searches[0].k if searches else 0
    step = step_params(k)
    admitted = []
    for i, prompt in enumerate(parsed):  # every prompt is checked before any runs
        try:
            admitted.append(gate.admit(prompt, step))
        except InvalidInput as e:
            raise in_batch(e, i, len(parsed)) from None
        room = gate.limits.max_model_len - len(admitted[-1].prompt_token_ids)
        if params.max_tokens > room:
            raise in_batch(InvalidInput(
                f"BeamSearchParams.max_tokens={params.max_tokens} does not fit: the prompt has "
                f"{len(admitted[-1].prompt_token_ids)} tokens and max_model_len={gate.limits.max_model_len} leaves "
                f"{room}.", field="max_tokens", value=params.max_tokens, accepted=f"at most {room}"), i, len(parsed))
    with tqdm(total=params.max_tokens, desc="beam search", disable=not use_tqdm) as bar:
        while active := [(s, a) for s, a in zip(searches, admitted) if not s.done]:
            beams = [{"prompt_token_ids": a.prompt_token_ids + beam.tokens} for s, a in active for beam in s.live]
            outs = engine.generate(beams, step, use_tqdm=False)
            tops = [top_candidates(out.outputs[0].logprobs[0], k) for out in outs]
            start = 0
            for s, _ in active:
                count = len(s.live)
                s.advance(tops[start: start + count])
                start += count
            bar.update(1)
    return [s.result(a.prompt, a.prompt_token_ids, tokenizer) for s, a in zip(searches, admitted)]
