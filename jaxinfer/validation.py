"""The one table of what a request's sampling settings may hold, and the checks generated from it.

Every front end goes through the same two functions: `normalized_sampling_fields` (types: lists become
tuples, numpy scalars Python numbers, `None` for a list field means empty) runs when a `SamplingParams` is
built; `check_sampling_fields` (ranges) runs there with what is known without a model, and again at
admission with the model's limits (`Limits`: vocabulary, max_model_len, EOS ids, whether a tokenizer exists).
A failure is an `InvalidInput` naming the field, the value and the accepted range, worded from the same
`accepted` text that docs/RELIABILITY.md prints (tests/test_reliability_doc.py keeps them equal).

Pure Python: `jaxinfer.config` imports this at construction time, and the sampler sizes its per-request
arrays from the widths defined here (MAX_LOGIT_BIAS, MAX_STOP_IDS, ...), so a limit changes in one place.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

from jaxinfer.errors import InvalidInput, InvalidInputType

# Static widths of the sampler's per-request arrays (jaxinfer.engine.sampling_rows) and other request limits.
MAX_N = 16  # completions per request
MAX_LOGIT_BIAS = 16  # B: logit_bias entries per request (width of bias_ids/bias_values)
MAX_STOP_IDS = 8  # E: EOS + stop_token_ids suppressed while fewer than min_tokens are generated
MAX_LOGPROBS = 20  # Kmax: top alternatives returned per token (vLLM's default max_logprobs)
MAX_ALLOWED_TOKEN_IDS = 256  # A: allowed_token_ids per request
MAX_BAD_WORDS = 16  # bad_words per request; each becomes up to 2 token sequences (with/without a leading space)
MAX_BAD_WORD_TOKENS = 8  # L: tokens per bad word; the device keeps the last L - 1 generated tokens per row
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's bound on logit_bias values
PENALTY_LIMIT = 2.0  # OpenAI's bound on presence/frequency penalties


class RequestOutputKind(enum.IntEnum):
    """What each streamed output of a request carries (vLLM's names and values).

    CUMULATIVE: everything so far; DELTA: only what is new since the last output; FINAL_ONLY: one output,
    when the request finishes. `LLM.generate` always returns the complete final output."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclasses.dataclass(frozen=True)
class Limits:
    """What admission knows beyond the request: the model's vocabulary and context, its EOS ids, and whether
    text can be matched (a tokenizer exists). None means unknown, and the range check is skipped."""

    vocab_size: int | None = None
    max_model_len: int | None = None
    eos_ids: tuple[int, ...] = ()
    has_tokenizer: bool = True
    max_n: int = MAX_N
    max_logprobs: int = MAX_LOGPROBS
    max_logit_bias: int = MAX_LOGIT_BIAS
    max_stop_ids: int = MAX_STOP_IDS

    def template_values(self) -> dict[str, Any]:
        return {
            "vocab_size": "vocab_size" if self.vocab_size is None else self.vocab_size,
            "max_model_len": "max_model_len" if self.max_model_len is None else self.max_model_len,
            "max_n": self.max_n, "max_logit_bias": self.max_logit_bias, "max_stop_ids": self.max_stop_ids,
            "max_logprobs": self.max_logprobs, "max_allowed": MAX_ALLOWED_TOKEN_IDS, "max_bad_words": MAX_BAD_WORDS,
            "max_bad_word_tokens": MAX_BAD_WORD_TOKENS, "bias_limit": f"{LOGIT_BIAS_LIMIT:g}",
            "penalty_limit": f"{PENALTY_LIMIT:g}",
        }


class Reject(Exception):
    """A normalizer met a value of the wrong type."""


# ------------------------------------------------------------------------------------------ normalizers


def is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def as_int(v: Any) -> int:
    if not is_int(v):
        raise Reject
    return int(v)


def as_opt_int(v: Any) -> int | None:
    return None if v is None else as_int(v)


def _real(v: Any) -> float:
    if not is_real(v):
        raise Reject
    return float(v)


def _bool(v: Any) -> bool:
    if not isinstance(v, bool) and type(v).__name__ != "bool_":  # numpy's bool too
        raise Reject
    return bool(v)


def _is_sequence(v: Any) -> bool:
    """A list, a tuple or a 1-D array; not a string, a mapping or a set (unordered)."""
    if isinstance(v, str | bytes | Mapping | set | frozenset):
        return False
    return isinstance(v, list | tuple) or (hasattr(v, "ndim") and getattr(v, "ndim") == 1)


def token_id_tuple(v: Any) -> tuple[int, ...]:
    """Token ids as a tuple of Python ints; a float, a bool, a string or None inside is a type error."""
    if not _is_sequence(v):
        raise Reject
    return tuple(as_int(t) for t in v)


def _id_list(v: Any) -> tuple[int, ...]:
    return () if v is None else token_id_tuple(v)


def _opt_id_list(v: Any) -> tuple[int, ...] | None:
    return None if v is None else token_id_tuple(v)


def _strings(v: Any) -> tuple[str, ...]:
    """None -> (), "x" -> ("x",), a list of strings -> a tuple."""
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    if not _is_sequence(v) or not all(isinstance(s, str) for s in v):
        raise Reject
    return tuple(v)


def _logit_bias(v: Any) -> dict[int, float] | None:
    """JSON objects have string keys, so "50256" is token 50256 (as in OpenAI's API)."""
    if v is None:
        return None
    if not isinstance(v, Mapping):
        raise Reject
    out: dict[int, float] = {}
    for key, value in v.items():
        if isinstance(key, str) and key.lstrip("-").isdigit():
            key = int(key)
        out[as_int(key)] = _real(value)
    return out


def _output_kind(v: Any) -> RequestOutputKind:
    if isinstance(v, str) and v.upper() in RequestOutputKind.__members__:
        return RequestOutputKind[v.upper()]
    if is_int(v) and int(v) in tuple(RequestOutputKind):
        return RequestOutputKind(int(v))
    raise Reject


def _structured(v: Any) -> Any:
    from jaxinfer.structured import as_structured  # its own checks raise InvalidInput naming structured.<kind>

    return as_structured(v)


def _extra_args(v: Any) -> dict[str, Any] | None:
    if v is None:
        return None
    if not isinstance(v, Mapping) or not all(isinstance(k, str) for k in v):
        raise Reject
    return dict(v)


# ------------------------------------------------------------------------------------------ range checks


def finite(v: float) -> bool:
    return math.isfinite(v)


def encodable(s: str) -> bool:
    """Valid Unicode text: a lone surrogate ("\\ud800") cannot become UTF-8 and breaks every tokenizer."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _ids_in_vocab(ids: tuple[int, ...], limits: Limits) -> bool:
    top = limits.vocab_size
    return all(0 <= t and (top is None or t < top) for t in ids)


def _check_bias(v: dict[int, float] | None, _: Mapping[str, Any], limits: Limits) -> bool:
    if v is None:
        return True
    values_ok = all(finite(x) and abs(x) <= LOGIT_BIAS_LIMIT for x in v.values())
    return len(v) <= limits.max_logit_bias and _ids_in_vocab(tuple(v), limits) and values_ok


def _check_stop(v: tuple[str, ...], p: Mapping[str, Any], limits: Limits) -> bool:
    if not v:
        return True
    return p["detokenize"] and limits.has_tokenizer and all(s and encodable(s) for s in v)


def stop_ids_under_min_tokens(p: Mapping[str, Any], eos_ids: tuple[int, ...]) -> list[int]:
    """Ids the sampler bans while fewer than min_tokens are out: EOS (unless ignore_eos) and stop_token_ids."""
    eos = () if p["ignore_eos"] else eos_ids
    return list(dict.fromkeys((*eos, *p["stop_token_ids"])))


def _check_stop_ids(v: tuple[int, ...], p: Mapping[str, Any], limits: Limits) -> bool:
    if not _ids_in_vocab(v, limits):
        return False
    return p["min_tokens"] == 0 or len(stop_ids_under_min_tokens(p, limits.eos_ids)) <= limits.max_stop_ids


def _check_min_tokens(v: int, p: Mapping[str, Any], _: Limits) -> bool:
    return v >= 0 and (p["max_tokens"] is None or v <= p["max_tokens"])


def _check_truncate(v: int | None, _: Mapping[str, Any], limits: Limits) -> bool:
    if v is None or v == -1:
        return True
    return v >= 1 and (limits.max_model_len is None or v < limits.max_model_len)


def _check_allowed(v: tuple[int, ...] | None, _: Mapping[str, Any], limits: Limits) -> bool:
    return v is None or (0 < len(v) <= MAX_ALLOWED_TOKEN_IDS and _ids_in_vocab(v, limits))


def _check_bad_words(v: tuple[str, ...], _: Mapping[str, Any], limits: Limits) -> bool:
    if not v:
        return True
    return limits.has_tokenizer and len(v) <= MAX_BAD_WORDS and all(s.strip() and encodable(s) for s in v)


def _check_logprobs(v: int | None, _: Mapping[str, Any], limits: Limits) -> bool:
    return v is None or 0 <= v <= limits.max_logprobs


def _always(*_: Any) -> bool:
    return True


# ------------------------------------------------------------------------------------------ the table


Check = Callable[[Any, Mapping[str, Any], Limits], bool]


@dataclasses.dataclass(frozen=True)
class FieldRule:
    """One SamplingParams field: its default, what it accepts (a sentence fragment; `{names}` are filled from
    `Limits.template_values`), how a given value is normalized and how its range is checked."""

    name: str
    default: Any
    accepted: str
    normalize: Callable[[Any], Any]
    check: Check = _always

    def accepted_text(self, limits: Limits) -> str:
        return self.accepted.format(**limits.template_values())


def _rule(name: str, default: Any, accepted: str, normalize: Callable[[Any], Any],
          check: Check | Callable[[Any], bool] = _always) -> FieldRule:
    """`check` may take just the value when the range depends on nothing else."""
    if check is not _always and check.__code__.co_argcount == 1:
        simple = check
        check = lambda v, p, limits: simple(v)  # noqa: E731
    return FieldRule(name, default, accepted, normalize, check)  # type: ignore[arg-type]


SAMPLING_RULES: tuple[FieldRule, ...] = (
    _rule("n", 1, "an integer in [1, {max_n}]", as_int, lambda v, p, limits: 1 <= v <= limits.max_n),
    _rule("max_tokens", 16, "None (up to max_model_len) or an integer >= 1", as_opt_int, lambda v: v is None or v >= 1),
    _rule("min_tokens", 0, "an integer in [0, max_tokens]", as_int, _check_min_tokens),
    _rule("temperature", 1.0, "a finite number >= 0 (0 is greedy)", _real, lambda v: finite(v) and v >= 0),
    _rule("top_k", -1, "-1 or 0 (off) or an integer >= 1", as_int, lambda v: v >= -1),
    _rule("top_p", 1.0, "a number in (0, 1]", _real, lambda v: 0 < v <= 1),
    _rule("min_p", 0.0, "a number in [0, 1]", _real, lambda v: 0 <= v <= 1),
    _rule("repetition_penalty", 1.0, "a finite number > 0", _real, lambda v: finite(v) and v > 0),
    _rule("presence_penalty", 0.0, "a number in [-{penalty_limit}, {penalty_limit}]", _real,
          lambda v: abs(v) <= PENALTY_LIMIT),
    _rule("frequency_penalty", 0.0, "a number in [-{penalty_limit}, {penalty_limit}]", _real,
          lambda v: abs(v) <= PENALTY_LIMIT),
    _rule("logit_bias", None, "None or a mapping of at most {max_logit_bias} token ids in [0, {vocab_size}) to "
          "numbers in [-{bias_limit}, {bias_limit}]", _logit_bias, _check_bias),
    _rule("seed", None, "None or an integer (taken modulo 2**64)", as_opt_int),
    _rule("stop", (), "None, a string or a list of non-empty strings (matching stop strings needs "
          "detokenize=True and a tokenizer)", _strings, _check_stop),
    _rule("stop_token_ids", (), "None or a list of token ids in [0, {vocab_size}); with min_tokens > 0, at most "
          "{max_stop_ids} ids together with the EOS ids", _id_list, _check_stop_ids),
    _rule("include_stop_str_in_output", False, "True or False", _bool),
    _rule("ignore_eos", False, "True or False", _bool),
    _rule("logprobs", None, "None or an integer in [0, {max_logprobs}]", as_opt_int, _check_logprobs),
    _rule("prompt_logprobs", None, "None or an integer in [0, {max_logprobs}]", as_opt_int, _check_logprobs),
    _rule("detokenize", True, "True or False", _bool),
    _rule("skip_special_tokens", True, "True or False", _bool),
    _rule("spaces_between_special_tokens", True, "True or False", _bool),
    _rule("truncate_prompt_tokens", None, "None, -1 (keep the last max_model_len - 1 tokens) or an integer in "
          "[1, {max_model_len})", as_opt_int, _check_truncate),
    _rule("allowed_token_ids", None, "None or a non-empty list of at most {max_allowed} token ids in "
          "[0, {vocab_size})", _opt_id_list, _check_allowed),
    _rule("bad_words", (), "None or a list of at most {max_bad_words} words, each with a non-space character and at "
          "most {max_bad_word_tokens} tokens (needs a tokenizer)", _strings, _check_bad_words),
    _rule("output_kind", RequestOutputKind.CUMULATIVE, "a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY) "
          "or its name", _output_kind),
    _rule("structured", None, "None, or a StructuredOutputs / a dict with exactly one of 'json' (a JSON schema), "
          "'regex', 'choice' (a list of strings), 'grammar' (Lark/EBNF) or 'json_object': True (needs a tokenizer)",
          _structured, lambda v, p, limits: v is None or limits.has_tokenizer),
    _rule("extra_args", None, "None or a dict with string keys", _extra_args),
    _rule("speculative", True, "True or False (False: this request never speculates, on an LLM with speculative "
          "decoding)", _bool),
)
RULES_BY_NAME = {r.name: r for r in SAMPLING_RULES}


def normalized_sampling_fields(p: Any) -> dict[str, Any]:
    """Every field of `p` (a SamplingParams, or any object with such attributes; missing ones take their
    defaults) in its canonical type; InvalidInputType naming the first field of the wrong type."""
    values: dict[str, Any] = {}
    for rule in SAMPLING_RULES:
        raw = getattr(p, rule.name, rule.default)
        try:
            values[rule.name] = rule.normalize(raw)
        except Reject:
            raise InvalidInputType.of("SamplingParams.", rule.name, raw, rule.accepted_text(Limits())) from None
    return values


def check_sampling_fields(values: Mapping[str, Any], limits: Limits = Limits()) -> None:
    """Range checks of normalized values (see `normalized_sampling_fields`); InvalidInput naming the first
    field out of range, with the range the model's `limits` allow."""
    for rule in SAMPLING_RULES:
        if not rule.check(values[rule.name], values, limits):
            raise InvalidInput.of("SamplingParams.", rule.name, values[rule.name], rule.accepted_text(limits))


def fail(field: str, value: Any, accepted: str, where: str = "SamplingParams.") -> InvalidInput:
    """The error for a check made outside the table (e.g. a bad word that encodes to too many tokens)."""
    return InvalidInput.of(where, field, value, accepted)
