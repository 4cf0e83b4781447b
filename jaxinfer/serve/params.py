"""OpenAI request fields -> `SamplingParams` (the one place their names and defaults are translated).

Ranges are SamplingParams' own checks; its `InvalidInput` comes back as a 400 whose `param` is the request's
name for the field (`RENAME_CHAT`: the chat endpoint's `top_logprobs` is SamplingParams.logprobs, ...).
Structured output comes from `response_format` (json_object, json_schema), vLLM's `structured_outputs`
object, or one of the older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields; at
most one of these may be set.
"""

from __future__ import annotations

from typing import Any

from jaxinfer.config import SamplingParams
from jaxinfer.errors import InvalidInput
from jaxinfer.serve.errors import APIError, bad_request, from_invalid_input
from jaxinfer.serve.protocol import ChatRequest, CompletionRequest, _Sampling
from jaxinfer.validation import RequestOutputKind

RENAME_CHAT = {"logprobs": "top_logprobs", "structured": "response_format"}
RENAME_COMPLETION = {"structured": "response_format"}
OPTIONAL_KNOBS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "seed")
PASSED_THROUGH = ("n", "logit_bias", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "include_stop_str_in_output",
                  "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
                  "allowed_token_ids", "bad_words")


def structured_from(req: _Sampling) -> tuple[dict[str, Any] | None, str | None]:
    """The request's structured-output constraint as a StructuredOutputs dict, and the parameter it came from."""
    found: list[tuple[str, dict[str, Any] | None]] = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        found.append(("response_format", _response_format(rf)))
    if req.structured_outputs is not None:
        found.append(("structured_outputs", dict(req.structured_outputs)))
    guided = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
    for name, kind in guided.items():
        value = getattr(req, name)
        if value is not None:
            found.append((name, {kind: value}))
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise bad_request(f"Set at most one structured-output parameter; got {names}.", param=found[1][0])
    return (found[0][1], found[0][0]) if found else (None, None)


def engine_rename(req: _Sampling) -> dict[str, str]:
    """Request names of what the engine's door may refuse (a grammar that does not compile, ...)."""
    param = structured_from(req)[1]
    rename = dict(RENAME_CHAT if isinstance(req, ChatRequest) else RENAME_COMPLETION)
    return {**rename, "structured": param} if param is not None else rename


def _response_format(rf: Any) -> dict[str, Any]:
    if rf.type == "json_object":
        return {"json_object": True}
    schema = (rf.json_schema or {}).get("schema")
    if schema is None:
        raise bad_request("response_format of type json_schema needs json_schema.schema (a JSON schema).",
                          param="response_format.json_schema.schema")
    return {"json": schema}


def _common(req: _Sampling) -> dict[str, Any]:
    fields: dict[str, Any] = {k: getattr(req, k) for k in PASSED_THROUGH}
    fields.update({k: getattr(req, k) for k in OPTIONAL_KNOBS if getattr(req, k) is not None})
    if req.prompt_logprobs is not None:
        fields["prompt_logprobs"] = req.prompt_logprobs
    return fields


def _build(fields: dict[str, Any], rename: dict[str, str], structured_param: str | None) -> SamplingParams:
    if structured_param is not None:
        rename = {**rename, "structured": structured_param}
    try:
        return SamplingParams(**fields)
    except InvalidInput as e:
        raise from_invalid_input(e, rename) from None


def completion_params(req: CompletionRequest, stream: bool) -> SamplingParams:
    if req.suffix is not None:
        raise bad_request("suffix is not supported (no fill-in-the-middle).", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of is not supported; leave it unset (or equal to n).", param="best_of")
    structured, param = structured_from(req)
    fields = _common(req)
    fields.update(max_tokens=req.max_tokens, logprobs=req.logprobs, structured=structured,
                  output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)
    if req.echo and req.logprobs is not None and req.prompt_logprobs is None:
        fields["prompt_logprobs"] = req.logprobs  # echo shows the prompt's tokens with their logprobs
    return _build(fields, RENAME_COMPLETION, param)


def chat_params(req: ChatRequest, stream: bool) -> SamplingParams:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true.", param="top_logprobs")
    if req.max_tokens is not None and req.max_completion_tokens is not None and req.max_tokens != req.max_completion_tokens:
        raise bad_request("max_tokens and max_completion_tokens differ; set one of them.", param="max_tokens")
    structured, param = structured_from(req)
    fields = _common(req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    fields.update(max_tokens=max_tokens, logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                  structured=structured,
                  output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)
    rename = dict(RENAME_CHAT)
    if req.max_completion_tokens is not None:
        rename["max_tokens"] = "max_completion_tokens"
    return _build(fields, rename, param)


def check_tool_choice(req: ChatRequest) -> None:
    """Tools reach the chat template; tool calls are not parsed out of the text, so only "none" and "auto"."""
    if req.tool_choice not in (None, "none", "auto"):
        raise APIError(400, "tool_choice may be 'none' or 'auto' (tool calls are not parsed by this server).",
                       param="tool_choice", code="invalid_parameter")
