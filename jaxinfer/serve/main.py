"""`jaxinfer serve --model M [--host --port --api-key --served-model-name --max-waiting ...]`.

Every engine knob of `LLM(...)` is a flag, generated from the one argument table (jaxinfer.llm_args:
`--max-model-len`, `--max-num-seqs`, `--enable-prefix-caching/--no-enable-prefix-caching`, ...), so the
server accepts exactly what the Python API accepts and refuses it with the same message. An optional value
takes `none` for None (`--compilation-cache-dir none`).

The engine runs in a child process by default (jaxinfer.engine_process: the HTTP event loop and the engine's host
work then never wait on each other for the interpreter lock); `--no-engine-process` keeps it on a thread of the
server's process (AsyncLLM), as before.

Shutdown (SIGTERM or Ctrl-C): the server stops accepting connections and answers 503 to new requests on open
ones; requests in flight get `--shutdown-timeout` seconds to finish, then are aborted (their streams end
with finish_reason "abort" and [DONE]); then the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
import typing
from typing import Any

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
SERVER_DEFAULTS = {"use_tqdm": False}  # LLM defaults that differ for a server (no progress bars in its log)
NOT_FLAGS = ("use_tqdm",)


def _optional(convert: Any) -> Any:
    def parse(text: str) -> Any:
        return None if text.lower() == "none" else convert(text)

    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


def _flag_type(annotation: Any) -> tuple[Any, bool]:
    """(argparse type, is_bool) of an LLMArgs field annotation (`int | None`, `bool`, `str`, ...)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = args[0] if args else annotation
    optional = type(None) in typing.get_args(annotation)
    if base is bool:
        return None, True
    convert = {int: int, float: float, str: str}.get(base, str)
    return (_optional(convert) if optional else convert), False


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """One flag per LLM argument (jaxinfer.llm_args.LLM_ARG_RULES); unset flags keep LLM's defaults."""
    from jaxinfer.llm_args import LLM_ARG_RULES, LLMArgs

    hints = typing.get_type_hints(LLMArgs)
    group = p.add_argument_group("engine (the arguments of LLM(...); see docs/RELIABILITY.md)")
    for rule in LLM_ARG_RULES:
        if rule.name in NOT_FLAGS:
            continue
        flag = "--" + rule.name.replace("_", "-")
        kind, is_bool = _flag_type(hints[rule.name])
        help_text = f"{rule.accepted} (default {rule.default!r})".replace("%", "%%")
        if is_bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        else:
            group.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=help_text, metavar=rule.name.upper())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a .gguf file, an HF or orbax directory, or a bundled alias")
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST}: this machine only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    p.add_argument("--max-waiting", type=int, default=None,
                   help="answer 503 when more requests than this would wait to be scheduled (default: no limit)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds requests in flight get to finish on SIGTERM before they are aborted")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in a process of its own, so HTTP work and the engine's host work never share "
                        "one interpreter lock (default; --no-engine-process keeps it on a thread of this process)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="tokens per streamed event of a request, besides its first and last (default 1: every token; "
                        "larger values cost less host time per token under load)")
    add_engine_flags(p)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from jaxinfer.llm_args import ARG_NAMES

    kwargs = {name: getattr(args, name) for name in ARG_NAMES if hasattr(args, name)}
    return {**SERVER_DEFAULTS, **kwargs}


def check_args(args: argparse.Namespace) -> None:
    """Server flags a user can get wrong, refused before the model loads (one line, exit 2)."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}.")
    if args.max_waiting is not None and args.max_waiting < 0:
        raise ValueError(f"--max-waiting must be >= 0, got {args.max_waiting}.")
    if args.api_key is not None and not args.api_key:
        raise ValueError("--api-key must not be empty.")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}.")
    if args.stream_interval < 1:
        raise ValueError(f"--stream-interval must be >= 1, got {args.stream_interval}.")


def serve(args: argparse.Namespace) -> int:
    """Load the model (compiling every bucket), then serve until SIGTERM/SIGINT."""
    import uvicorn

    from jaxinfer.async_llm import AsyncLLM
    from jaxinfer.llm_args import resolve_llm_args
    from jaxinfer.serve.app import build_app
    from jaxinfer.serve.state import ServeConfig

    check_args(args)
    resolve_llm_args(engine_kwargs(args))  # a bad engine flag fails before anything loads
    if args.engine_process:
        from jaxinfer.engine_process import EngineClient

        llm = EngineClient(args.model, stream_interval=args.stream_interval, **engine_kwargs(args))
    else:
        llm = AsyncLLM(args.model, stream_interval=args.stream_interval, **engine_kwargs(args))
    config = ServeConfig(served_model_name=args.served_model_name or str(args.model), api_key=args.api_key,
                         max_waiting=args.max_waiting, shutdown_timeout_s=args.shutdown_timeout)
    app = build_app(llm, config)
    uv = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                        timeout_graceful_shutdown=int(args.shutdown_timeout) + 10)
    server = GracefulServer(uv, llm, app.state.serve)
    logging.getLogger("jaxinfer").info("serving %s on http://%s:%d", config.served_model_name, args.host, args.port)
    server.run()
    return 0


def _uvicorn_server() -> type:
    import sse_starlette.sse as sse
    import uvicorn

    # sse-starlette cancels every stream at the first signal by default; this server drains them itself.
    sse.AppStatus.disable_automatic_graceful_drain()

    class _GracefulServer(uvicorn.Server):
        """uvicorn's server with the drain above: the first signal starts it, uvicorn's own shutdown (which
        waits for open connections) follows once streams have finished or been aborted."""

        def __init__(self, config: Any, llm: Any, state: Any) -> None:
            super().__init__(config)
            self.llm, self.serve_state = llm, state
            self._draining: asyncio.Task[None] | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self._draining is None:
                self.serve_state.draining = True
                loop = asyncio.get_event_loop()
                self._draining = loop.create_task(self._drain())
            else:  # a second signal: stop now
                sse.AppStatus.should_exit = True
                super().handle_exit(sig, frame)

        async def _drain(self) -> None:
            self.should_exit = True  # stop accepting connections; open ones finish below
            await self.llm.drain(self.serve_state.config.shutdown_timeout_s)
            await self.llm.abort_all()
            # The aborted streams send their last chunk and [DONE], including those of requests aborted while
            # they still waited, whose responses start only now: sse-starlette would drop them unsent once
            # told to exit.
            deadline = time.monotonic() + 5.0
            while (self.llm.num_streams or self.serve_state.open_streams) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            sse.AppStatus.should_exit = True

    return _GracefulServer


def GracefulServer(config: Any, llm: Any, state: Any) -> Any:  # noqa: N802 - a class built on first use
    return _uvicorn_server()(config, llm, state)
