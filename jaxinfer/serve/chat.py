"""POST /v1/chat/completions: the conversation rendered with the checkpoint's chat template (or the request's
`chat_template`), then n completions of it.

Streamed, each choice first gets a chunk with `{"role": "assistant", "content": ""}`, then one chunk per
output with the new text (and its logprobs), then a chunk with an empty delta and the finish_reason; with
`stream_options.include_usage` every chunk has `"usage": null` and a last chunk with no choices has it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from jaxinfer.chat import chat_prompts
from jaxinfer.errors import InvalidInput
from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.serve.errors import bad_request, from_invalid_input
from jaxinfer.serve.params import engine_rename, chat_params, check_tool_choice
from jaxinfer.serve.protocol import ChatRequest
from jaxinfer.serve.state import (
    ServerState,
    check_errors,
    dumps,
    finish_reason,
    merged,
    new_id,
    run_to_end,
    until_disconnected,
    usage,
)


async def render(state: ServerState, req: ChatRequest) -> dict[str, Any]:
    """The conversation as {"prompt_token_ids", "prompt"}; template errors are 400s naming `messages`."""
    if state.tokenizer is None:
        raise bad_request("This model has no tokenizer, so it cannot render a chat.", param="messages")
    messages = [m.model_dump(exclude_none=False) for m in req.messages]

    def run() -> list[dict[str, Any]]:
        return chat_prompts(state.tokenizer, messages, chat_template=req.chat_template,
                            add_generation_prompt=req.add_generation_prompt,
                            continue_final_message=req.continue_final_message,
                            chat_template_kwargs=req.chat_template_kwargs, tools=req.tools, documents=req.documents)

    try:
        (prompt,) = await asyncio.to_thread(run)
    except InvalidInput as e:
        raise from_invalid_input(e) from None
    return prompt


async def create_chat(state: ServerState, req: ChatRequest, request: Request) -> Any:
    state.check_model(req.model)
    check_tool_choice(req)
    params = chat_params(req, stream=req.stream)
    prompt = await render(state, req)
    state.check_length(prompt["prompt_token_ids"], "messages", req.truncate_prompt_tokens)
    state.check_load()
    rid = req.request_id or new_id("chatcmpl")
    gens = [state.llm.generate(prompt, params, request_id=rid)]
    if req.stream:
        starts = await state.start_stream(gens, engine_rename(req))
        return EventSourceResponse(state.stream(_stream(state, req, rid, starts, gens)), sep="\n", ping=0)
    (out,) = await until_disconnected(request, run_to_end(gens, engine_rename(req)))
    check_errors([out])
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": _logprobs(state, req, c.token_ids, c.logprobs), "finish_reason": finish_reason(c.finish_reason),
                "stop_reason": c.stop_reason} for c in out.outputs]
    body = {"id": rid, "object": "chat.completion", "created": state.created, "model": state.config.served_model_name,
            "choices": choices,
            "usage": usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs))}
    return JSONResponse(body)


def _entry(state: ServerState, token: int, lp: Any) -> dict[str, Any]:
    text = lp.decoded_token if lp is not None and lp.decoded_token is not None else (
        state.tokenizer.decode([token], skip_special_tokens=False) if state.tokenizer else str(token))
    return {"token": text, "logprob": float(lp) if lp is not None else None, "bytes": list(text.encode("utf-8"))}


def _logprobs(state: ServerState, req: ChatRequest, token_ids: list[int], entries: Any) -> dict[str, Any] | None:
    """{"content": [{token, logprob, bytes, top_logprobs: [...]}]}: the top_logprobs alternatives by rank."""
    if not req.logprobs:
        return None
    k = req.top_logprobs or 0
    content = []
    for token, entry in zip(token_ids, entries or []):
        top = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k),
                     key=lambda tl: tl[1].rank)
        item = _entry(state, token, entry.get(token))
        item["top_logprobs"] = [_entry(state, t, lp) for t, lp in top]
        content.append(item)
    return {"content": content}


async def _stream(state: ServerState, req: ChatRequest, rid: str, starts: list[Any],
                  gens: list[Any]) -> AsyncIterator[str]:
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    base = {"id": rid, "object": "chat.completion.chunk", "created": state.created,
            "model": state.config.served_model_name}

    def chunk(choices: list[dict[str, Any]], use: Any = None) -> str:
        return dumps({**base, "choices": choices, **({"usage": use} if include_usage else {})})

    yield chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                 for j in range(req.n)])
    done: set[int] = set()
    prompt_tokens = completion_tokens = 0
    async for _, out in merged(starts, gens):
        choices = [ch for c in out.outputs if c.index not in done for ch in _delta_choices(state, req, c, done)]
        completion_tokens += sum(len(c.delta_token_ids) for c in out.outputs)
        if out.finished:
            prompt_tokens = len(out.prompt_token_ids)
            if out.error is not None:
                yield dumps({"error": {"message": f"The request failed during generation: {out.error}",
                                       "type": "server_error", "param": None, "code": "generation_failed"}})
        if choices:
            yield chunk(choices)
    if include_usage:
        yield chunk([], usage(prompt_tokens, completion_tokens))
    yield "[DONE]"


def _delta_choices(state: ServerState, req: ChatRequest, c: CompletionOutput, done: set[int]) -> list[dict[str, Any]]:
    """The chunk choices for one sequence's new output: its text, then (once) its finish_reason."""
    out = []
    if c.delta_text or c.delta_token_ids:
        out.append({"index": c.index, "delta": {"content": c.delta_text},
                    "logprobs": _logprobs(state, req, c.delta_token_ids, c.logprobs), "finish_reason": None})
    if c.finish_reason is not None:
        done.add(c.index)
        out.append({"index": c.index, "delta": {}, "logprobs": None, "finish_reason": finish_reason(c.finish_reason),
                    "stop_reason": c.stop_reason})
    return out


__all__ = ["create_chat", "render", "RequestOutput"]
