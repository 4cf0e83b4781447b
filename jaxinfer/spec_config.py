"""The `speculative` argument of `LLM(...)` (vLLM's `speculative_config`), checked at the door (pure Python).

    LLM(model, speculative={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})
    LLM(model, speculative={"method": "draft", "model": "smollm2-135m-instruct", "num_speculative_tokens": 4})
    jaxinfer generate|serve ... --speculative '{"method": "ngram", "num_speculative_tokens": 4}'   (JSON)
    batch-job YAML: engine: {speculative: {method: ngram, num_speculative_tokens: 4}}

`parse_speculative` turns the mapping into a `SpeculativeConfig`, or raises `InvalidInput` naming the key
(`speculative.num_speculative_tokens`, ...) with what it accepts. What needs the models (a draft whose
vocabulary differs from the target's, k against the token budget) is checked when the LLM is built, before
any weight of the target is used (jaxinfer.llm).
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxinfer.errors import InvalidInput, InvalidInputType
from jaxinfer.validation import is_int

MAX_SPECULATIVE_TOKENS = 16  # k: proposals verified per step; each costs a query row of every layer


class SpecMethod(enum.Enum):
    NGRAM = "ngram"  # prompt lookup: the tokens that followed the last n-gram where it occurred before
    DRAFT = "draft"  # a smaller model with the same vocabulary proposes k tokens


_METHOD_NAMES = {"ngram": SpecMethod.NGRAM, "draft": SpecMethod.DRAFT, "draft_model": SpecMethod.DRAFT}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Checked speculative-decoding settings (see the module doc for how to pass them)."""

    method: SpecMethod
    num_speculative_tokens: int
    prompt_lookup_min: int = 2  # n-gram: shortest suffix n-gram matched
    prompt_lookup_max: int = 4  # n-gram: longest suffix n-gram matched (longest match wins)
    model: str | None = None  # draft: a path, bundled alias or preset name (random weights with a preset)
    draft_tensor_parallel_size: int | None = None  # draft: 1 or the target's degree (None: the target's)
    draft_sampling: bool = True  # draft: sample proposals at the request's temperature (False: always greedy)
    quantization: str | None = None  # draft: its weights' quantization, as LLM(quantization=...) (None: auto)
    # No speculation in a step with at least this many running decodes (None: only the cost model decides).
    disable_by_batch_size: int | None = None

    @property
    def k(self) -> int:
        return self.num_speculative_tokens


KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
        "draft_tensor_parallel_size", "draft_sampling", "quantization", "disable_by_batch_size")
ACCEPTED = ("None, or a mapping with method 'ngram' (num_speculative_tokens, prompt_lookup_min, prompt_lookup_max) "
            "or 'draft' (model, num_speculative_tokens, draft_tensor_parallel_size, draft_sampling, quantization), and "
            "optionally "
            "disable_by_batch_size")


def parse_speculative(value: Any, where: str = "LLM argument ") -> SpeculativeConfig | None:
    """None, a SpeculativeConfig, or a mapping of the keys above -> a checked SpeculativeConfig."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str) and value.lstrip().startswith("{"):  # the CLI's --speculative '{"method": ...}'
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidInput(f"{where}speculative is not valid JSON ({e}).", field="speculative", value=value,
                               accepted="a JSON object") from None
    if not isinstance(value, Mapping):
        raise InvalidInputType.of(where, "speculative", value, ACCEPTED)
    unknown = [k for k in value if k not in KEYS]
    if unknown:
        raise InvalidInput(f"{where}speculative.{unknown[0]} is not a known key; accepted keys: {', '.join(KEYS)}.",
                           field=f"speculative.{unknown[0]}", value=value[unknown[0]], accepted=", ".join(KEYS))
    method = _method(value, where)
    k = _int_in(value, "num_speculative_tokens", None, 1, MAX_SPECULATIVE_TOKENS, where)
    common = dict(method=method, num_speculative_tokens=k,
                  disable_by_batch_size=_opt_int_in(value, "disable_by_batch_size", 1, where))
    if method is SpecMethod.NGRAM:
        _refuse(value, ("model", "draft_tensor_parallel_size", "draft_sampling", "quantization"), "'ngram'", where)
        high = _int_in(value, "prompt_lookup_max", 4, 1, 64, where)
        low = _int_in(value, "prompt_lookup_min", min(2, high), 1, high, where)
        return SpeculativeConfig(**common, prompt_lookup_min=low, prompt_lookup_max=high)
    _refuse(value, ("prompt_lookup_min", "prompt_lookup_max"), "'draft'", where)
    model = value.get("model")
    if not isinstance(model, str | Path) or not str(model):
        raise InvalidInput.of(where, "speculative.model", model, "a draft model: a checkpoint path, a bundled alias "
                              "or a preset name, with the target's vocabulary")
    tp = _opt_int_in(value, "draft_tensor_parallel_size", 1, where)
    sampling = value.get("draft_sampling", True)
    if not isinstance(sampling, bool):
        raise InvalidInputType.of(where, "speculative.draft_sampling", sampling, "True or False")
    return SpeculativeConfig(**common, model=str(model), draft_tensor_parallel_size=tp, draft_sampling=sampling,
                             quantization=_quantization(value, where))


def _quantization(value: Mapping[str, Any], where: str) -> str | None:
    """The draft's quantization, spelled as LLM(quantization=...) takes it ("int4:64" too)."""
    from jaxinfer.quantization import METHODS, QuantizationConfig

    raw = value.get("quantization")
    if raw is None:
        return None
    try:
        if not isinstance(raw, str):
            raise ValueError
        return str(QuantizationConfig.parse(raw))
    except ValueError:
        raise InvalidInput.of(where, "speculative.quantization", raw, f"None or one of {', '.join(METHODS)} (int8 "
                              "and int4 may add ':GROUP', e.g. 'int4:64')") from None


def _method(value: Mapping[str, Any], where: str) -> SpecMethod:
    raw = value.get("method", "draft" if "model" in value else None)
    method = _METHOD_NAMES.get(raw) if isinstance(raw, str) else None
    if method is None:
        raise InvalidInput.of(where, "speculative.method", raw, "'ngram' or 'draft' ('draft_model' too)")
    return method


def _int_in(value: Mapping[str, Any], key: str, default: int | None, low: int, high: int, where: str) -> int:
    raw = value.get(key, default)
    accepted = f"an integer in [{low}, {high}]"
    if not is_int(raw):
        raise (InvalidInput if raw is None else InvalidInputType).of(where, f"speculative.{key}", raw, accepted)
    if not low <= int(raw) <= high:
        raise InvalidInput.of(where, f"speculative.{key}", raw, accepted)
    return int(raw)


def _opt_int_in(value: Mapping[str, Any], key: str, low: int, where: str) -> int | None:
    raw = value.get(key)
    if raw is None:
        return None
    if not is_int(raw) or raw < low:
        raise InvalidInput.of(where, f"speculative.{key}", raw, f"None or an integer >= {low}")
    return int(raw)


def _refuse(value: Mapping[str, Any], keys: tuple[str, ...], method: str, where: str) -> None:
    for key in keys:
        if key in value:
            raise InvalidInput(f"{where}speculative.{key} does not apply to method {method}; remove it.",
                               field=f"speculative.{key}", value=value[key], accepted=f"absent with method {method}")
