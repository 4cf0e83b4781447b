"""POST /v1/completions: one or several prompts (text or token ids), n completions each.

Choice `i * n + j` is completion j of prompt i (OpenAI's order). `echo` puts the prompt before the text (and,
with `logprobs`, the prompt's tokens and logprobs before the completion's). Streamed, each SSE event is a
`text_completion` chunk with what one choice gained since the last; the last chunk of a choice carries its
finish_reason; with `stream_options.include_usage` a final chunk with no choices carries the usage.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.serve.errors import bad_request
from jaxinfer.serve.params import engine_rename, completion_params
from jaxinfer.serve.protocol import CompletionRequest
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


async def _prompts(state: ServerState, req: CompletionRequest) -> list[dict[str, Any]]:
    """Each prompt as {"prompt_token_ids", "prompt"}: the server encodes text itself, to check its length."""
    raw = req.prompt
    if isinstance(raw, str):
        items: list[Any] = [raw]
    elif raw and all(isinstance(t, int) for t in raw):
        items = [raw]
    else:
        items = list(raw)
    if not items:
        raise bad_request("prompt is empty.", param="prompt")
    prompts = []
    for i, item in enumerate(items):
        param = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            ids = await state.encode(item)
            prompts.append({"prompt_token_ids": ids, "prompt": item})
        else:
            ids = list(item)
            prompts.append({"prompt_token_ids": ids})
        state.check_length(ids, param, req.truncate_prompt_tokens)
    return prompts


async def create_completion(state: ServerState, req: CompletionRequest, request: Request) -> Any:
    state.check_model(req.model)
    params = completion_params(req, stream=req.stream)
    prompts = await _prompts(state, req)
    state.check_load(len(prompts))
    rid = req.request_id or new_id("cmpl")
    rids = [rid if len(prompts) == 1 else f"{rid}-{i}" for i in range(len(prompts))]
    gens = [state.llm.generate(p, params, request_id=r) for p, r in zip(prompts, rids)]
    if req.stream:
        starts = await state.start_stream(gens, engine_rename(req))
        events = _stream(state, req, rid, starts, gens)
        return EventSourceResponse(state.stream(events), sep="\n", ping=0)
    outs = await until_disconnected(request, run_to_end(gens, engine_rename(req)))
    check_errors(outs)
    return JSONResponse(_response(state, req, rid, outs))


def _response(state: ServerState, req: CompletionRequest, rid: str, outs: list[RequestOutput]) -> dict[str, Any]:
    choices = []
    for i, out in enumerate(outs):
        for c in out.outputs:
            choices.append(_choice(state, req, out, c, i * req.n + c.index, c.text, c.token_ids, c.logprobs,
                                   echo=req.echo))
    completion_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"id": rid, "object": "text_completion", "created": state.created, "model": state.config.served_model_name,
            "choices": choices, "usage": usage(sum(len(o.prompt_token_ids) for o in outs), completion_tokens)}


def _choice(state: ServerState, req: CompletionRequest, out: RequestOutput, c: CompletionOutput, index: int,
            text: str, token_ids: list[int], logprobs: Any, *, echo: bool) -> dict[str, Any]:
    prompt_text = (out.prompt or "") if echo else ""
    lp = None
    if req.logprobs is not None:
        lp = _logprobs(state, out if echo else None, token_ids, logprobs or [], 0)
    return {"index": index, "text": prompt_text + text, "logprobs": lp,
            "finish_reason": finish_reason(c.finish_reason), "stop_reason": c.stop_reason}


def _token_text(state: ServerState, token: int, entry: dict[int, Any] | None) -> str:
    if entry is not None and token in entry and entry[token].decoded_token is not None:
        return entry[token].decoded_token
    return state.tokenizer.decode([token], skip_special_tokens=False) if state.tokenizer else str(token)


def _logprobs(state: ServerState, echo_of: RequestOutput | None, token_ids: list[int],
              entries: list[dict[int, Any]], offset: int) -> dict[str, Any]:
    """OpenAI's legacy logprobs object; with echo, the prompt's tokens come first (its first has none)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    pairs: list[tuple[int, dict[int, Any] | None]] = []
    if echo_of is not None:
        prompt_lps = echo_of.prompt_logprobs or [None] * len(echo_of.prompt_token_ids)
        pairs += list(zip(echo_of.prompt_token_ids, prompt_lps))
    pairs += list(zip(token_ids, entries))
    for token, entry in pairs:
        text = _token_text(state, token, entry)
        tokens.append(text)
        token_lps.append(float(entry[token]) if entry and token in entry else None)
        tops.append({_token_text(state, t, entry): float(lp) for t, lp in entry.items()} if entry else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


async def _stream(state: ServerState, req: CompletionRequest, rid: str, starts: list[Any],
                  gens: list[Any]) -> AsyncIterator[str]:
    model, created = state.config.served_model_name, state.created
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    prompt_tokens, completion_tokens = 0, 0
    offsets: dict[int, int] = {}
    echoed: set[int] = set()
    done: set[int] = set()  # choices whose finish_reason was sent (DELTA outputs repeat finished ones)

    def chunk(choices: list[dict[str, Any]], use: Any = None) -> str:
        body = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
        if include_usage:
            body["usage"] = use
        return dumps(body)

    async for i, out in merged(starts, gens):
        choices = []
        for c in out.outputs:
            index = i * req.n + c.index
            if index in done:
                continue
            if c.finish_reason is not None:
                done.add(index)
            echo = req.echo and index not in echoed
            echoed.add(index)
            if not c.delta_text and not c.delta_token_ids and c.finish_reason is None and not echo:
                continue
            choice = _choice(state, req, out, c, index, c.delta_text, c.delta_token_ids, c.logprobs, echo=echo)
            if choice["logprobs"] is not None:
                choice["logprobs"]["text_offset"] = [o + offsets.get(index, 0) for o in choice["logprobs"]["text_offset"]]
            offsets[index] = offsets.get(index, 0) + len(choice["text"])
            choices.append(choice)
            completion_tokens += len(c.delta_token_ids)
        if out.finished:
            prompt_tokens += len(out.prompt_token_ids)
            if out.error is not None:
                yield dumps({"error": {"message": f"The request failed during generation: {out.error}",
                                       "type": "server_error", "param": None, "code": "generation_failed"}})
        if choices:
            yield chunk(choices)
    if include_usage:
        yield chunk([], usage(prompt_tokens, completion_tokens))
    yield "[DONE]"
