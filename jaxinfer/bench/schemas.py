"""Named structured-output cases: JSON schemas (with one valid instance each), a regex and a choice list.

Shared by the grammar-backend measurement (scripts/measure_grammar_backends.py), the structured-output
benchmark of `jaxinfer bench-serve` and the tests. Every schema bounds what a sampled instance can grow to
(string lengths, array sizes, integer ranges, no free-form extra properties), so a sample at temperature 0.8
always finishes inside a modest max_tokens: a test may then demand that 100% of samples validate.
"""

from __future__ import annotations

from typing import Any

_NAME = {"type": "string", "minLength": 1, "maxLength": 12}

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "enum_color": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "shade": {"enum": ["light", "dark"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
    "bounded_ints": {
        "type": "object",
        "properties": {
            "x": {"type": "integer", "minimum": -5, "maximum": 5},
            "y": {"type": "integer", "minimum": 100, "maximum": 199},
            "z": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
        },
        "required": ["x", "y", "z"],
        "additionalProperties": False,
    },
    "string_array": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": _NAME, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "address": {
                        "type": "object",
                        "properties": {"city": _NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["id", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "optional_fields": {
        "type": "object",
        "properties": {"title": _NAME, "draft": {"type": "boolean"}, "pages": {"type": "integer", "minimum": 1,
                                                                                "maximum": 500}},
        "required": ["title"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                                   "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    "enum_array": {
        "type": "object",
        "properties": {"days": {"type": "array", "items": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
                                "minItems": 1, "maxItems": 5}},
        "required": ["days"],
        "additionalProperties": False,
    },
    "const_and_bool": {
        "type": "object",
        "properties": {"kind": {"const": "event"}, "public": {"type": "boolean"},
                       "priority": {"enum": [1, 2, 3]}},
        "required": ["kind", "public", "priority"],
        "additionalProperties": False,
    },
    "any_of": {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99},
                                           {"type": "string", "maxLength": 8}, {"type": "null"}]}},
        "required": ["value"],
        "additionalProperties": False,
    },
    "matrix": {
        "type": "object",
        "properties": {"rows": {"type": "array", "minItems": 1, "maxItems": 2,
                                "items": {"type": "array", "minItems": 1, "maxItems": 3,
                                          "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
        "required": ["rows"],
        "additionalProperties": False,
    },
    "top_level_array": {
        "type": "array",
        "minItems": 2,
        "maxItems": 4,
        "items": {"type": "integer", "minimum": 0, "maximum": 1000},
    },
}

# One valid instance per schema: the measurement walks the grammar along its tokens.
EXAMPLES: dict[str, Any] = {
    "person": {"name": "Ada", "age": 36},
    "enum_color": {"color": "blue", "shade": "dark"},
    "bounded_ints": {"x": -3, "y": 150, "z": 7},
    "string_array": {"tags": ["fast", "cheap"]},
    "nested": {"user": {"id": 42, "address": {"city": "Lima", "zip": "15001"}}},
    "optional_fields": {"title": "Notes", "pages": 12},
    "array_of_objects": {"items": [{"sku": "AB12", "qty": 3}, {"sku": "ZZ99", "qty": 1}]},
    "enum_array": {"days": ["mon", "fri"]},
    "const_and_bool": {"kind": "event", "public": True, "priority": 2},
    "any_of": {"value": "hi"},
    "matrix": {"rows": [[1, 2, 3], [4]]},
    "top_level_array": [3, 14, 159],
}

REGEX = r"[A-Z][a-z]{2,8} [0-9]{1,3}(\.[0-9])?"  # e.g. "Lima 42.5"
REGEX_EXAMPLE = "Lima 42.5"
CHOICES = ["yes", "no", "maybe"]
# A small EBNF (Lark syntax) grammar: a sum of one-digit numbers.
LARK_GRAMMAR = 'start: expr\nexpr: NUM (" + " NUM){0,3}\nNUM: /[0-9]/\n'
LARK_EXAMPLE = "1 + 2 + 3"
