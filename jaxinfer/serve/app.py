"""The ASGI app: OpenAI's routes, /tokenize, /detokenize, /health and /metrics over one `AsyncLLM`.

With an API key, every /v1 route and /tokenize, /detokenize need `Authorization: Bearer <key>`; the key is
compared in constant time (`hmac.compare_digest`), so the time of a refusal says nothing about the key.
/health and /metrics stay open (load balancers and scrapers carry no key). /health answers 503 while the server
drains and once the engine has stopped (failed, or its process died); requests then get a 503 envelope with code
"engine_dead".
"""

from __future__ import annotations

import contextlib
import hmac
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from jaxinfer.async_llm import EngineDead
from jaxinfer.chat import encode_rendered
from jaxinfer.serve import errors
from jaxinfer.serve.chat import create_chat, render
from jaxinfer.serve.completions import create_completion
from jaxinfer.serve.protocol import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from jaxinfer.serve.state import ServeConfig, ServerState

PROTECTED = ("/v1/", "/tokenize", "/detokenize")


def build_app(async_llm: Any, config: ServeConfig) -> FastAPI:
    """The app; its lifespan starts the engine thread and, on shutdown, finishes or aborts what is in flight."""
    state = ServerState(async_llm, config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_llm.start()
        yield
        state.draining = True
        await async_llm.shutdown(timeout_s=0)

    app = FastAPI(title="jaxinfer", lifespan=lifespan)
    app.state.serve = state
    app.add_exception_handler(errors.APIError, errors.api_error_handler)
    app.add_exception_handler(EngineDead, errors.engine_dead_handler)
    app.add_exception_handler(RequestValidationError, errors.validation_error_handler)

    app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)

    _routes(app, state)
    return app


class ApiKeyMiddleware:
    """The API key check, as plain ASGI: starlette's `@app.middleware("http")` would pass every chunk of every
    streamed response through a memory stream between two tasks (measured with scripts/bench_serve_overhead.py,
    a good share of the event loop's time per SSE event), and a check at the door needs none of that."""

    def __init__(self, app: Any, api_key: str | None) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.api_key is not None and scope["path"].startswith(PROTECTED):
            header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), "")
            if not _key_ok(header, self.api_key):
                await errors.unauthorized().response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _key_ok(header: str, key: str) -> bool:
    scheme, _, given = header.partition(" ")
    # Compare bytes of the full header against the expected one: no early exit on the first differing byte.
    expected = f"bearer {key}".encode()
    return hmac.compare_digest(f"{scheme.lower()} {given.strip()}".encode(), expected)


def _routes(app: FastAPI, state: ServerState) -> None:
    name = state.config.served_model_name

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if state.draining or state.llm.dead else 200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": name, "object": "model", "created": state.created, "owned_by": "jaxinfer", "root": name,
                "max_model_len": state.max_model_len}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await create_completion(state, body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Any:
        return await create_chat(state, body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Any:
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise errors.bad_request("Send exactly one of prompt and messages.", param="prompt")
        if body.prompt is not None:
            ids = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            chat = ChatRequest(messages=body.messages, add_generation_prompt=body.add_generation_prompt)
            ids = (await render(state, chat))["prompt_token_ids"]
        return JSONResponse({"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Any:
        state.check_model(body.model)
        vocab = state.llm.model_config.vocab_size
        for i, t in enumerate(body.tokens):
            if not 0 <= t < vocab:
                raise errors.bad_request(f"tokens[{i}] = {t} is outside the vocabulary [0, {vocab}).",
                                         param=f"tokens[{i}]")
        return JSONResponse({"prompt": state.tokenizer.decode(body.tokens, skip_special_tokens=False)})


__all__ = ["build_app", "ServeConfig", "encode_rendered"]
