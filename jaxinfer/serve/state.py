"""What every endpoint shares: the AsyncLLM, the server settings, the door checks, running the requests.

The door, in order: the model name (404), the sampling parameters (400, naming the field), the prompt's
length against the context (413), shutting down or more than `max_waiting` requests waiting (503). Then the
request runs through `AsyncLLM.generate`; an `InvalidInput` the engine raises at its own door (a token id
outside the vocabulary, a grammar that does not compile, ...) is a 400 too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request

from jaxinfer.async_llm import EngineDead
from jaxinfer.errors import InvalidInput
from jaxinfer.outputs import FinishReason, RequestOutput
from jaxinfer.serve import errors
from jaxinfer.serve.metrics import ServerMetrics


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeConfig:
    served_model_name: str
    api_key: str | None = None
    max_waiting: int | None = None  # None: no limit
    shutdown_timeout_s: float = 30.0


class ServerState:
    def __init__(self, async_llm: Any, config: ServeConfig) -> None:
        self.llm = async_llm
        self.config = config
        self.tokenizer = async_llm.tokenizer
        self.max_model_len: int = async_llm.max_model_len
        self.metrics = ServerMetrics(async_llm, config.served_model_name)
        async_llm.on_outputs = self.metrics.on_outputs
        self.draining = False
        self.open_streams = 0  # streamed responses handed to the ASGI server and not yet ended (`stream`)
        self.created = int(time.time())

    async def start_stream(self, gens: list[AsyncIterator[RequestOutput]],
                           rename: dict[str, str] | None = None) -> list[tuple[RequestOutput | None, bool]]:
        """`start_all` for a streamed response, counted in `open_streams` from here until its events end
        (`stream`): a shutdown waits for it, since the response of a request aborted while it still waited
        starts only after the abort."""
        self.open_streams += 1
        try:
            return await start_all(gens, rename)
        except BaseException:
            self.open_streams -= 1
            raise

    def stream(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """A streamed response's events; their end closes the count `start_stream` opened."""

        async def counted() -> AsyncIterator[str]:
            try:
                async for event in events:
                    yield event
            except EngineDead as e:  # the engine stopped mid-stream: say so, then end the stream as usual
                yield dumps(errors.engine_dead(e).body())
                yield "[DONE]"
            finally:
                self.open_streams -= 1

        return counted()

    def check_model(self, model: str | None) -> None:
        """An absent model means the served one (as vLLM); any other name is a 404."""
        if model is not None and model != self.config.served_model_name:
            raise errors.model_not_found(model, self.config.served_model_name)

    def check_length(self, ids: list[int], param: str, truncate: int | None) -> None:
        if truncate is None and len(ids) >= self.max_model_len:
            raise errors.context_too_long(len(ids), self.max_model_len, param)

    def check_load(self, adding: int = 1) -> None:
        if self.draining:
            raise errors.shutting_down()
        limit = self.config.max_waiting
        if limit is None:
            return
        waiting = self.llm.engine_stats()["num_waiting"] + self.llm.pending_adds
        if waiting + adding > limit:
            raise errors.overloaded(waiting, limit)

    async def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise errors.bad_request("This model has no tokenizer; send token ids.", param="prompt")
        return await asyncio.to_thread(self.tokenizer.encode, text)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


async def first_output(gen: AsyncIterator[RequestOutput],
                       rename: dict[str, str] | None = None) -> tuple[RequestOutput | None, bool]:
    """Start a request: the engine's door runs on the first step of the generator, so its InvalidInput is
    turned into a 400 here, before any response byte is sent. Returns (first output, more may follow)."""
    try:
        out = await gen.__anext__()
    except StopAsyncIteration:
        return None, False
    except InvalidInput as e:
        raise errors.from_invalid_input(e, rename) from None
    return out, not out.finished


async def start_all(gens: list[AsyncIterator[RequestOutput]],
                    rename: dict[str, str] | None = None) -> list[tuple[RequestOutput | None, bool]]:
    """Start every request at once (each waits for its first output); if one is refused, the others are
    aborted and the refusal is raised."""
    starts = await asyncio.gather(*(first_output(g, rename) for g in gens), return_exceptions=True)
    failed = [s for s in starts if isinstance(s, BaseException)]
    if failed:
        for gen in gens:
            await gen.aclose()
        raise failed[0]
    return starts  # type: ignore[return-value]


async def run_to_end(gens: list[AsyncIterator[RequestOutput]],
                     rename: dict[str, str] | None = None) -> list[RequestOutput]:
    """Every request's final output (each generator yields FINAL_ONLY outputs)."""

    async def finish(start: tuple[RequestOutput | None, bool], gen: AsyncIterator[RequestOutput]) -> RequestOutput:
        out, more = start
        async for out in gen:
            pass
        return out

    starts = await start_all(gens, rename)
    return list(await asyncio.gather(*(finish(s, g) for s, g in zip(starts, gens))))


async def merged(starts: list[tuple[RequestOutput | None, bool]],
                 gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several started streams, in arrival order."""
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                await queue.put((i, out))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    for i, (out, _) in enumerate(starts):
        if out is not None:
            yield i, out
    live = [i for i, (_, more) in enumerate(starts) if more]
    if len(gens) == 1:  # the common case: no task and queue between the stream and its reader
        try:
            if live:
                async for out in gens[0]:
                    yield 0, out
        finally:
            await gens[0].aclose()
        return
    tasks = [asyncio.create_task(pump(i, gens[i])) for i in live]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for gen in gens:
            await gen.aclose()


async def until_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`; if the client goes away first, cancel it (which aborts its requests and frees their pages)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task not in done:
        task.cancel()
        raise asyncio.CancelledError("the client disconnected")
    return task.result()


def finish_reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else str(reason)


def check_errors(outs: list[RequestOutput]) -> None:
    """A request that failed inside the engine (finish_reason "error") is a 500 for a non-streamed reply."""
    for out in outs:
        if out.error is not None or any(c.finish_reason == FinishReason.ERROR for c in out.outputs):
            raise errors.APIError(500, f"The request failed during generation: {out.error}", type="server_error",
                                  code="generation_failed")


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


Starter = Callable[[], AsyncIterator[RequestOutput]]
