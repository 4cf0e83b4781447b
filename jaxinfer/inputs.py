"""The accepted forms of a prompt and of chat messages, checked at the door (pure Python, no model needed).

A prompt is one of:
  * a string (valid Unicode: a lone surrogate such as "\\ud800" is refused, no tokenizer could encode it);
  * token ids: a list or tuple of integers (Python or NumPy), or a 1-D NumPy integer array;
  * `TextPrompt` {"prompt": str} or `TokensPrompt` {"prompt_token_ids": ids} (vLLM's dict forms).
Float ids (504.0 included), booleans, None and nested lists are refused: silently truncating 504.7 to 504
would generate from a prompt the caller never wrote. `prompts` given to generate/stream may be one prompt or
a list (or tuple) of them; a list of integers is one token prompt, and a 2-D integer array is one prompt per
row. Which ids exist and how long a prompt may be depend on the model, so the engine checks those at admission.

Chat messages are a list of mappings with a non-empty string "role" and a "content" that is a string, None
(an assistant turn carrying only tool calls) or a list of {"type": "text", "text": str} parts, which are
joined with newlines as vLLM does for templates that expect a string. Other keys (name, tool_calls,
tool_call_id, ...) reach the template untouched.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, NotRequired, TypedDict

from jaxinfer.errors import InvalidInput, InvalidInputType
from jaxinfer.validation import encodable, is_int

PROMPT_FORMS = ("a string, a list of token ids (ints or a 1-D integer array), {'prompt': str} or "
                "{'prompt_token_ids': [int, ...]}")
MESSAGE_FORMS = ("a mapping with a non-empty string 'role' and a 'content' that is a string, None or a list of "
                 "{'type': 'text', 'text': str} parts")


class TextPrompt(TypedDict):
    """vLLM's text prompt dict."""

    prompt: str


class TokensPrompt(TypedDict):
    """vLLM's token prompt dict."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # optional text of the ids, reported back in RequestOutput.prompt


class Prompt(NamedTuple):
    """A prompt in its checked form: text to encode, or token ids (then `text` is whatever the caller gave
    alongside them, if anything)."""

    text: str | None
    token_ids: tuple[int, ...] | None


def _bad(field: str, value: Any, accepted: str = PROMPT_FORMS, *, wrong_type: bool = True) -> InvalidInput:
    return (InvalidInputType if wrong_type else InvalidInput).of("", field, value, accepted)


def _is_array(value: Any) -> bool:
    return hasattr(value, "ndim") and hasattr(value, "dtype") and not isinstance(value, str | bytes)


def _token_ids(value: Any, field: str) -> tuple[int, ...]:
    if _is_array(value):
        if value.ndim != 1 or value.dtype.kind not in "iu":
            raise _bad(field, value, "a 1-D integer array of token ids")
        return tuple(int(t) for t in value.tolist())
    # The common case, plain Python ints (bool is a subclass: `type` tells them apart), in one cheap pass: the
    # per-element check below took ~2 ms of a 4k-token prompt's time to first token. Anything else goes
    # through that check, which names the first bad position.
    if all(type(t) is int for t in value):
        return tuple(value)
    for i, t in enumerate(value):
        if not is_int(t):
            raise _bad(f"{field}[{i}]", t, "an integer token id (floats, booleans and None are refused)")
    return tuple(int(t) for t in value)


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise _bad(field, value, "a string")
    if not encodable(value):
        raise _bad(field, value, "valid Unicode text (it holds a lone surrogate)", wrong_type=False)
    return value


def parse_prompt(value: Any, field: str = "prompt") -> Prompt:
    """One prompt in any accepted form -> Prompt; InvalidInput naming `field` otherwise."""
    if isinstance(value, str):
        return Prompt(_text(value, field), None)
    if isinstance(value, Mapping):
        return _parse_prompt_dict(value, field)
    if _is_array(value) or isinstance(value, list | tuple):
        return Prompt(None, _token_ids(value, field))
    raise _bad(field, value)


def _parse_prompt_dict(value: Mapping[Any, Any], field: str) -> Prompt:
    unknown = sorted(set(value) - {"prompt", "prompt_token_ids"}, key=str)
    if unknown:
        raise InvalidInput(
            f"{field}: key {unknown[0]!r} is not supported (jaxinfer serves text-only models); a prompt dict "
            "holds 'prompt' or 'prompt_token_ids'.", field=f"{field}.{unknown[0]}", value=value[unknown[0]],
            accepted="'prompt' or 'prompt_token_ids'",
        )
    if "prompt_token_ids" in value:
        ids = value["prompt_token_ids"]
        if not (_is_array(ids) or isinstance(ids, list | tuple)):
            raise _bad(f"{field}.prompt_token_ids", ids, "a list of token ids")
        text = _text(value["prompt"], f"{field}.prompt") if "prompt" in value else None
        return Prompt(text, _token_ids(ids, f"{field}.prompt_token_ids"))
    if "prompt" in value:
        return Prompt(_text(value["prompt"], f"{field}.prompt"), None)
    raise InvalidInput(f"{field}: a prompt dict needs 'prompt' or 'prompt_token_ids'.", field=field, value=value,
                       accepted=PROMPT_FORMS)


def parse_prompts(prompts: Any) -> list[Prompt]:
    """One prompt or a list of them -> a list; the fields in errors are "prompts[i]" for lists."""
    if isinstance(prompts, str | Mapping):
        return [parse_prompt(prompts)]
    if _is_array(prompts):
        if prompts.ndim == 2:
            return [parse_prompt(row, f"prompts[{i}]") for i, row in enumerate(prompts)]
        return [parse_prompt(prompts)]
    if isinstance(prompts, list | tuple):
        if prompts and all(isinstance(t, numbers.Number) for t in prompts):
            return [parse_prompt(prompts)]  # one token prompt (a float in it is refused there, by position)
        return [parse_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
    raise _bad("prompts", prompts, f"one prompt ({PROMPT_FORMS}) or a list of them")


# ------------------------------------------------------------------------------------------ chat messages


def check_message(message: Any, field: str) -> dict[str, Any]:
    """One chat message -> a plain dict whose content is a string or None."""
    if not isinstance(message, Mapping):
        raise _bad(field, message, MESSAGE_FORMS)
    role = message.get("role")
    if not isinstance(role, str) or not role.strip():
        raise _bad(f"{field}.role", role, "a non-empty string such as 'system', 'user' or 'assistant'",
                   wrong_type=not isinstance(role, str))
    _text(role, f"{field}.role")
    if "content" not in message:
        raise InvalidInput(f"{field}: a message needs a 'content' (a string, None or a list of text parts).",
                           field=f"{field}.content", value=None, accepted="a string, None or text parts")
    out = dict(message)
    out["content"] = _content(message["content"], f"{field}.content")
    return out


def _content(content: Any, field: str) -> str | None:
    if content is None or isinstance(content, str):
        return None if content is None else _text(content, field)
    if not isinstance(content, list | tuple):
        raise _bad(field, content, "a string, None or a list of {'type': 'text', 'text': str} parts")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") != "text":
            raise _bad(f"{field}[{i}]", part, "a {'type': 'text', 'text': str} part (only text is supported)")
        texts.append(_text(part.get("text"), f"{field}[{i}].text"))
    return "\n".join(texts)


def check_conversation(messages: Any, field: str = "messages") -> list[dict[str, Any]]:
    """A list of chat messages -> a list of plain dicts (see the module docstring)."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise _bad(field, messages, f"a list of messages, each {MESSAGE_FORMS}")
    if not messages:
        raise InvalidInput(f"{field} is empty; a conversation needs at least one message.", field=field,
                           value=messages, accepted="a non-empty list of messages")
    return [check_message(m, f"{field}[{i}]") for i, m in enumerate(messages)]


def split_conversations(messages: Any) -> tuple[list[Any], bool]:
    """(conversations, was_batch): one conversation (a list of messages) or a list of conversations."""
    if isinstance(messages, Sequence) and not isinstance(messages, str | bytes) and messages:
        if all(isinstance(c, Sequence) and not isinstance(c, str | bytes | Mapping) for c in messages):
            return list(messages), True
    return [messages], False
