"""What a request's structured output may be: `SamplingParams(structured=StructuredOutputs(...))`.

Exactly one of:
  * `json`: a JSON schema (a dict, or its JSON text); `json_object=True`: any JSON object;
  * `regex`: a regular expression the whole output must match (Rust regex syntax, as llguidance takes it);
  * `choice`: a list of strings, the output being exactly one of them;
  * `grammar`: an EBNF grammar in Lark syntax (llguidance's dialect; llama.cpp's GBNF is accepted too).
A plain dict with one of those keys is accepted wherever a StructuredOutputs is (`{"json": schema}`).

Pure Python and checked at the door like every other field: the form here, the grammar itself when the
request is admitted (jaxinfer.engine.grammar compiles it once per distinct spec, with the model's
tokenizer, and refuses one that does not compile with an `InvalidInput` naming `structured.<kind>`). JSON
output is compact-but-readable (`", "` and `": "` separators, no other whitespace), so the model cannot pad it.
"""

from __future__ import annotations

import dataclasses
import json as _json
from collections.abc import Mapping, Sequence
from typing import Any

from jaxinfer.errors import InvalidInput, InvalidInputType

KINDS = ("json", "regex", "choice", "grammar", "json_object")
ACCEPTED = ("None, a StructuredOutputs, or a dict with exactly one of 'json' (a JSON schema), 'regex', 'choice' "
            "(a list of strings), 'grammar' (Lark/EBNF text) or 'json_object': True")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StructuredOutputs:
    """One structured-output constraint (vLLM's StructuredOutputsParams names); see the module docstring."""

    json: str | None = None  # the schema's JSON text (a dict given here is serialized, its key order kept)
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            object.__setattr__(self, "json", _schema_text(self.json))
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))
        for name in ("regex", "grammar", "json"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise InvalidInputType.of("SamplingParams.", f"structured.{name}", value, "a non-empty string")
        if self.json is not None:
            _check_schema_text(self.json)
        if not isinstance(self.json_object, bool):
            raise InvalidInputType.of("SamplingParams.", "structured.json_object", self.json_object, "True or False")
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidInput(f"SamplingParams.structured must set exactly one of {', '.join(KINDS)}; got "
                               f"{', '.join(given) or 'none'}.", field="structured", value=given, accepted=ACCEPTED)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text: with `kind`, the key of the compiled-grammar cache."""
        kind = self.kind
        if kind == "choice":
            return _json.dumps(list(self.choice))
        if kind == "json_object":
            return '{"type": "object"}'
        return getattr(self, kind)


def _schema_text(schema: Any) -> str:
    if not isinstance(schema, Mapping | bool):
        raise InvalidInputType.of("SamplingParams.", "structured.json", schema, "a JSON schema (a dict or JSON text)")
    try:
        return _json.dumps(schema)
    except (TypeError, ValueError) as e:
        raise InvalidInput.of("SamplingParams.", "structured.json", schema, f"JSON-serializable ({e})") from None


def _check_schema_text(text: str) -> None:
    try:
        schema = _json.loads(text)
    except ValueError as e:
        raise InvalidInput.of("SamplingParams.", "structured.json", text, f"a JSON schema in valid JSON ({e})") from None
    if not isinstance(schema, dict | bool):
        raise InvalidInput.of("SamplingParams.", "structured.json", text, "a JSON schema (an object or a boolean)")


def _choices(value: Any) -> tuple[str, ...]:
    ok = isinstance(value, Sequence) and not isinstance(value, str) and value
    if not ok or not all(isinstance(c, str) and c for c in value):
        raise InvalidInputType.of("SamplingParams.", "structured.choice", value, "a non-empty list of non-empty strings")
    return tuple(value)


def as_structured(value: Any) -> StructuredOutputs | None:
    """The normalizer of SamplingParams.structured: None, a StructuredOutputs, or a dict of its fields."""
    if value is None or isinstance(value, StructuredOutputs):
        return value
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(KINDS), key=str)
        if unknown:
            raise InvalidInput(f"SamplingParams.structured: unknown key {unknown[0]!r}; it takes one of "
                               f"{', '.join(KINDS)}.", field=f"structured.{unknown[0]}", value=value[unknown[0]],
                               accepted=ACCEPTED)
        return StructuredOutputs(**value)
    raise InvalidInputType.of("SamplingParams.", "structured", value, ACCEPTED)
