"""The door of the engine: every check a request must pass before it touches the scheduler or the device.

`Gate.admit` turns (prompt, sampling_params, request_id, priority) into an `Admission`, or raises
`InvalidInput` naming the field; it changes nothing, so a refused request leaves the engine exactly as it
was, and `generate` can check a whole batch before queueing any of it. What it checks, in order:
  1. sampling_params is a SamplingParams (re-validated: a frozen dataclass can still be changed with
     object.__setattr__), and every field's type and model-independent range (jaxinfer.validation);
  2. the prompt's form (jaxinfer.inputs), then text is encoded and truncate_prompt_tokens applied;
  3. the ids against the model: non-empty, inside the vocabulary, shorter than max_model_len;
  4. the fields whose range depends on the model (token ids in logit_bias, stop_token_ids and
     allowed_token_ids, truncate_prompt_tokens, stop strings and bad words needing a tokenizer), and the
     bad words' token sequences against the sampler's width;
  5. a structured-output grammar compiles (once per distinct spec: jaxinfer.engine.grammar.GrammarCache).
The scheduler then checks what only it knows (pages, max_num_seqs, request ids in use).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from jaxinfer.config import SamplingParams
from jaxinfer.engine.grammar import GrammarCache
from jaxinfer.errors import InvalidInput, InvalidInputType
from jaxinfer.inputs import Prompt, parse_prompt
from jaxinfer.validation import (
    MAX_BAD_WORD_TOKENS,
    Limits,
    check_sampling_fields,
    fail,
    is_int,
)


class Admission(NamedTuple):
    """A request that passed every check at the door, ready to queue."""

    request_id: str | None
    prompt: str | None  # the text given, or the decoded ids
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens, or what max_model_len leaves after the prompt
    bad_words_ids: tuple[tuple[int, ...], ...]
    priority: int
    grammar: Any = None  # the compiled structured-output template (GrammarCache.compile), or None


def as_sampling_params(params: Any, field: str = "sampling_params") -> SamplingParams:
    """None -> the defaults; a SamplingParams -> a re-validated copy; anything else is a type error."""
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return dataclasses.replace(params)  # runs __post_init__ again, on whatever the fields hold now
    hint = "; build one with SamplingParams(**d)" if isinstance(params, dict) else ""
    raise InvalidInputType(f"{field} must be a SamplingParams (or a list of them, one per prompt){hint}, got "
                           f"{type(params).__name__}.", field=field, value=params, accepted="SamplingParams")


class Gate:
    """The model-dependent checks; one per engine."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, eos_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.limits = Limits(vocab_size=vocab_size, max_model_len=max_model_len, eos_ids=tuple(sorted(eos_ids)),
                             has_tokenizer=tokenizer is not None)
        self.grammars = None if tokenizer is None else GrammarCache(tokenizer, vocab_size, sorted(eos_ids))

    def admit(self, prompt: Any, params: Any, *, request_id: Any = None, priority: Any = 0,
              field: str = "prompt") -> Admission:
        params = as_sampling_params(params)
        _check_id_and_priority(request_id, priority)
        text, ids = self._prompt_ids(prompt, field)
        ids = self._truncate(ids, params.truncate_prompt_tokens)
        self._check_ids(ids, field)
        check_sampling_fields({f.name: getattr(params, f.name) for f in dataclasses.fields(params)}, self.limits)
        bad = self._bad_word_ids(params.bad_words)
        left = self.limits.max_model_len - len(ids)
        max_tokens = left if params.max_tokens is None else params.max_tokens
        grammar = None if params.structured is None else self.grammars.compile(params.structured)
        return Admission(request_id, text, ids, params, max_tokens, bad, int(priority), grammar)

    def _prompt_ids(self, prompt: Any, field: str) -> tuple[str | None, list[int]]:
        parsed = prompt if isinstance(prompt, Prompt) else parse_prompt(prompt, field)
        if parsed.token_ids is not None:
            ids = list(parsed.token_ids)
            text = parsed.text if parsed.text is not None else self._decode(ids)
            return text, ids
        if self.tokenizer is None:
            raise InvalidInputType(f"{field}: this model has no tokenizer, so text cannot be encoded; pass token "
                                   "ids.", field=field, value=parsed.text, accepted="a list of token ids")
        return parsed.text, list(self.tokenizer.encode(parsed.text))

    def _decode(self, ids: list[int]) -> str | None:
        """The text of token ids, to report as RequestOutput.prompt (ids outside the vocabulary are refused
        later with a better message than the tokenizer's)."""
        vocab = self.limits.vocab_size
        if self.tokenizer is None or any(not 0 <= t < min(vocab, self.tokenizer.vocab_size) for t in ids):
            return None
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _truncate(self, ids: list[int], keep: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: keep the last `keep` ids (-1: as many as max_model_len allows)."""
        if keep is None:
            return ids
        keep = self.limits.max_model_len - 1 if keep == -1 else keep
        return ids[-keep:]

    def _check_ids(self, ids: list[int], field: str) -> None:
        vocab, max_len = self.limits.vocab_size, self.limits.max_model_len
        if not ids:
            raise InvalidInput(f"{field} is empty; it needs at least one token.", field=field, value=ids,
                               accepted="at least one token")
        for i, t in enumerate(ids):
            if not 0 <= t < vocab:
                raise InvalidInput(f"{field}[{i}] = {t} is outside the vocabulary; token ids must be in [0, {vocab}).",
                                   field=f"{field}[{i}]", value=t, accepted=f"a token id in [0, {vocab})")
        if len(ids) >= max_len:
            raise InvalidInput(
                f"{field} has {len(ids)} tokens; max_model_len={max_len} leaves no room to generate (at most "
                f"{max_len - 1} prompt tokens, or set truncate_prompt_tokens).", field=field, value=len(ids),
                accepted=f"at most {max_len - 1} tokens")

    def _bad_word_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Each bad word as token sequences: as written (leading spaces stripped) and after a space, so it is
        banned at the start of the text and inside it (vLLM's convention)."""
        seqs: list[tuple[int, ...]] = []
        for word in words:
            stripped = word.lstrip()
            for text in (stripped, " " + stripped):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if len(ids) > MAX_BAD_WORD_TOKENS:
                    raise fail("bad_words", word, f"words of at most {MAX_BAD_WORD_TOKENS} tokens ({text!r} is "
                                                  f"{len(ids)})")
                if ids and ids not in seqs:
                    seqs.append(ids)
        return tuple(seqs)


def _check_id_and_priority(request_id: Any, priority: Any) -> None:
    if request_id is not None and (not isinstance(request_id, str) or not request_id):
        raise InvalidInputType.of("", "request_id", request_id, "None or a non-empty string")
    if not is_int(priority):
        raise InvalidInputType.of("", "priority", priority, "an integer (lower runs first)")


def per_prompt(field: str, value: Any, count: int, default: Any = None) -> list[Any]:
    """One value for every prompt, or a list with one per prompt."""
    if not isinstance(value, list | tuple):
        return [default if value is None else value] * count
    if len(value) != count:
        raise InvalidInput(f"got {len(value)} {field} for {count} prompts; pass one or one per prompt.", field=field,
                           value=len(value), accepted=f"one, or a list of {count}")
    return list(value)


def in_batch(error: InvalidInput, index: int, count: int) -> InvalidInput:
    """The same error, saying which prompt of a batch it is about."""
    if count == 1:
        return error
    return type(error)(f"prompt {index}: {error}", field=error.field, value=error.value, accepted=error.accepted)
