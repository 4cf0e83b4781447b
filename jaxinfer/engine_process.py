"""The engine in a process of its own, for servers: `EngineClient` is `AsyncLLM`'s twin whose engine runs in a
child process, so the server's event loop (HTTP, one SSE event per stream per token) and the engine's host
work (settling rows, grammar masks, placing the next step's arrays) never share one interpreter lock.

Why (Llama-3-8B shape, 64 streams under a JSON schema, docs/PERFORMANCE.md "Serving", eighth session): on an
H200, where the device step is short and the host's share of it large, the engine on a thread of the server
decoded 2,579 tok/s against 2,852 and 2,812 in a process of its own, same lease; on an H100 the two measure the
same. And a server whose engine dies stays up to say so (/health 503, `engine_dead` errors).

    client = EngineClient("smollm2-135m-instruct", max_num_seqs=64)   # LLM's arguments; blocks until loaded
    async for out in client.generate("Hello", SamplingParams(max_tokens=8)):
        ...

The wire: two pipes, one JSON message per line (jaxinfer.engine_wire; no pickle). The server side sends
`add`, `abort`, `abort_all`, `stats`, `shutdown`; each but the last carries a `seq` the engine side answers in
a `reply`. The engine side sends `ready` (or `failed`) once loaded, then `outputs` (a step's outputs, handed
over when the engine next waits on the device, as AsyncLLM does), `stats` (the scheduler gauges after every
turn of its loop) and `dead` if its loop fails. The engine side is AsyncLLM's own engine-thread loop, run on
the child's main thread, with its hand-off to the event loop replaced by a write to the pipe.

The child ignores SIGINT and SIGTERM (a Ctrl-C, or a service manager's stop, reaches the whole process group:
the server drains its requests, then stops the engine) and exits when told to, or when its command pipe closes
because the server is gone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

from jaxinfer import engine_wire as wire
from jaxinfer.async_llm import AsyncLLM, EngineDead, StreamFront
from jaxinfer.errors import InvalidInput
from jaxinfer.outputs import RequestOutput

log = logging.getLogger("jaxinfer.engine_process")

SHUTDOWN_WAIT_S = 60.0  # how long the server waits for the child to exit after `shutdown` before killing it


# ------------------------------------------------------------------------------------------- engine side

class _Writer:
    """Messages to the pipe from a thread of their own: a step never waits on a full pipe or a slow reader."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="jaxinfer-engine-writer", daemon=True)
        self._thread.start()

    def send(self, message: dict[str, Any]) -> None:
        self._queue.put(wire.dumps(message))

    def _run(self) -> None:
        while (data := self._queue.get()) is not None:
            try:
                _write_all(self._fd, data)
            except OSError:  # the server is gone; the command pipe's end stops the loop
                return

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)


class _EngineSide(AsyncLLM):
    """AsyncLLM's engine loop with the pipe as its event loop: `_post` writes what AsyncLLM would hand over."""

    def __init__(self, llm: Any, writer: _Writer, stream_interval: int) -> None:
        self.writer = writer
        self._prompt_sent: set[str] = set()  # requests whose prompt went out with an earlier output
        self._sent_stats: dict[str, Any] | None = None
        super().__init__(llm=llm, stream_interval=stream_interval)

    def _encode(self, out: RequestOutput, *, first: bool | None = None) -> dict[str, Any]:
        rid = out.request_id
        if first is None:
            first = rid not in self._prompt_sent
        self._prompt_sent.add(rid)
        if out.finished:
            self._prompt_sent.discard(rid)
        return wire.encode_output(out, with_prompt=first)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        if fn == self._deliver:
            self.writer.send({"op": "outputs", "outputs": [self._encode(o) for o in args[0]]})
        elif fn == self._fail_all:
            self.writer.send({"op": "dead", "error": wire.encode_error(args[0])})

    def _publish_stats(self) -> None:
        super()._publish_stats()
        if self._stats != self._sent_stats:
            self._sent_stats = self._stats
            self.writer.send({"op": "stats", "stats": self._stats})

    def serve_commands(self, pipe: Any) -> None:
        """Read the server's commands until its pipe closes, each run on the engine loop between steps; the
        loop stops after that (or after a message that cannot be read, which leaves nothing to trust)."""
        try:
            with pipe:
                for line in pipe:
                    msg = wire.loads(line)
                    if msg["op"] == "shutdown":
                        break
                    self._command(msg)
        finally:
            self._stop.set()

    def _command(self, msg: dict[str, Any]) -> None:
        seq = msg["seq"]
        try:
            future = self._call(self._handler(msg))
        except BaseException as e:  # noqa: BLE001 - a refusal (bad params, engine stopped) is the reply
            self._reply(seq, error=e)
            return
        future.add_done_callback(lambda f: self._reply(seq, error=f.exception(), result=None if f.exception()
                                                       else f.result()))

    def _handler(self, msg: dict[str, Any]) -> Callable[[], Any]:
        op = msg["op"]
        if op == "add":  # parameters decoded here, so a refusal names its field in the reply
            params = wire.decode_params(msg["params"])

            def add() -> None:
                self.engine.add_request(msg["prompt"], params, request_id=msg["request_id"], priority=msg["priority"])

            return add
        if op == "abort":
            return lambda: self._abort_encoded(msg["request_id"])
        if op == "abort_all":
            return lambda: [o for rid in [r for e in self._engines for r in list(e.requests)]
                            if (o := self._abort_encoded(rid)) is not None]
        if op == "stats":
            return self.engine.stats
        raise ValueError(f"unknown engine command {op!r}")

    def _abort_encoded(self, rid: str) -> dict[str, Any] | None:
        out = self.engine.abort(rid)
        return None if out is None else self._encode(out, first=True)

    def _reply(self, seq: int, *, error: BaseException | None = None, result: Any = None) -> None:
        msg: dict[str, Any] = {"op": "reply", "seq": seq}
        if error is not None:
            msg["error"] = wire.encode_error(error)
        else:
            msg["result"] = result
        self.writer.send(msg)


def child_main(fd_in: int, fd_out: int) -> int:
    """The engine process: read the config line, load, say ready, then run the engine loop until stopped."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # a signal to the whole group: the server drains, then stops us
        signal.signal(sig, signal.SIG_IGN)
    writer = _Writer(fd_out)
    pipe = os.fdopen(fd_in, "rb")
    config = wire.loads(pipe.readline())
    try:
        from jaxinfer.llm import LLM

        llm = LLM(config["model"], **config["kwargs"])
        side = _EngineSide(llm, writer, config["stream_interval"])
    except BaseException as e:  # noqa: BLE001 - the server reports it and exits
        writer.send({"op": "failed", "error": wire.encode_error(e)})
        writer.close()
        return 1
    writer.send({"op": "ready", "max_model_len": side.max_model_len, "vocab_size": llm.model_config.vocab_size,
                 "stats": side.engine_stats()})
    threading.Thread(target=side.serve_commands, args=(pipe,), name="jaxinfer-engine-commands", daemon=True).start()
    side._run()
    writer.close()
    return 0


# ------------------------------------------------------------------------------------------- server side

class _ModelInfo:
    """What the server reads of `llm.model_config` (the vocabulary size, for /detokenize's check)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size


class EngineClient(StreamFront):
    """`AsyncLLM`'s interface over an engine in a child process (see the module docstring). Building it starts
    the child and blocks until the model is loaded and compiled; a load that fails raises its error here."""

    def __init__(self, model: Any, *, stream_interval: int = 1, **kwargs: Any) -> None:
        from jaxinfer.llm import load_model_tokenizer, resolve_model_name, resolve_source

        if not isinstance(model, str | os.PathLike):
            raise InvalidInput(f"EngineClient's model must be a name or a path (it is sent to the engine process), "
                               f"got {type(model).__name__}; use AsyncLLM for a ModelConfig.", field="model",
                               value=type(model).__name__, accepted="a model name or path")
        self._init_front()
        self._send_lock = threading.Lock()
        kwargs.setdefault("use_tqdm", False)
        self._proc, self._out_fd, in_fd = _spawn()
        self._lines = os.fdopen(in_fd, "rb")
        try:
            self._send({"model": str(model), "kwargs": kwargs, "stream_interval": stream_interval})
            # The tokenizer is built here too (the server renders chats and counts tokens), while the child loads.
            checkpoint, _ = resolve_source(resolve_model_name(model))
            tokenizer_arg = kwargs.get("tokenizer")
            self.tokenizer = (None if checkpoint is None and tokenizer_arg is None
                              else load_model_tokenizer(checkpoint, tokenizer_arg))
            ready = self._read_ready()
        except BaseException:
            self._proc.kill()
            self._proc.wait()
            os.close(self._out_fd)
            self._lines.close()
            raise
        self.max_model_len: int = ready["max_model_len"]
        self.model_config = _ModelInfo(ready["vocab_size"])
        self._stats = ready["stats"]
        self._seq = itertools.count()
        self._replies: dict[int, concurrent.futures.Future[Any]] = {}
        self._lock = threading.Lock()  # the replies table, used by the event loop and the reader thread
        self._prompts = wire.PromptCache()
        self._reader = threading.Thread(target=self._read, name="jaxinfer-engine-reader", daemon=True)
        self._reader.start()

    def _send(self, message: dict[str, Any]) -> None:
        data = wire.dumps(message)
        with self._send_lock:  # a long prompt is written in pieces: no other message may come between them
            _write_all(self._out_fd, data)

    def _read_ready(self) -> dict[str, Any]:
        line = self._lines.readline()
        if not line:
            code = self._proc.wait()
            raise EngineDead(f"the engine process exited with {code} before it was ready (see its log above)")
        msg = wire.loads(line)
        if msg["op"] == "failed":
            self._proc.wait()
            raise wire.decode_error(msg["error"])
        return msg

    def _read(self) -> None:
        """The reader thread: decode each message, resolve replies, hand outputs to the event loop."""
        try:
            for line in self._lines:
                self._handle(wire.loads(line))
        except Exception as e:  # noqa: BLE001 - a message this side cannot read: nothing after it can be trusted
            log.exception("unreadable message from the engine process")
            self._proc.kill()
            self._died(e)
            return
        if not self._stop.is_set():
            self._died(EngineDead(f"the engine process exited with {self._proc.wait()}"))

    def _handle(self, msg: dict[str, Any]) -> None:
        op = msg["op"]
        if op == "outputs":
            outputs = [o for m in msg["outputs"] if (o := self._prompts.decode(m)) is not None]
            if outputs:
                self._post(self._deliver, outputs)
        elif op == "stats":
            self._stats = msg["stats"]
        elif op == "reply":
            self._resolve(msg)
        elif op == "dead":
            self._died(wire.decode_error(msg["error"]))

    def _resolve(self, msg: dict[str, Any]) -> None:
        with self._lock:
            future = self._replies.pop(msg["seq"], None)
        if future is None:
            return
        if "error" in msg:
            future.set_exception(wire.decode_error(msg["error"]))
        else:
            future.set_result(msg["result"])

    def _died(self, error: BaseException) -> None:
        self._dead = error
        with self._lock:
            futures, self._replies = list(self._replies.values()), {}
        for future in futures:
            future.set_exception(EngineDead(f"the engine stopped: {error}"))
        self._post(self._fail_all, error)

    def _request(self, op: str, **fields: Any) -> concurrent.futures.Future[Any]:
        if self._dead is not None or self._stop.is_set():
            raise EngineDead("the engine is not running (it was shut down or failed)")
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            seq = next(self._seq)
            self._replies[seq] = future
        self._send({"op": op, "seq": seq, **fields})
        return future

    # ------------------------------------------------------------------------------------ event-loop side

    def start(self) -> None:
        """Bind to the running event loop (each call: a client may outlive one `asyncio.run`, unlike AsyncLLM's
        engine thread there is nothing to start)."""
        self._loop = asyncio.get_running_loop()

    async def _add(self, prompt: Any, params: Any, rid: str, priority: int) -> None:
        from jaxinfer.engine.admission import as_sampling_params  # the door's type check, here as in LLM

        self.pending_adds += 1
        try:
            params = as_sampling_params(params)
            fields = {"request_id": rid, "prompt": prompt, "params": wire.encode_params(params),
                      "priority": priority}
            await asyncio.wrap_future(self._request("add", **fields))
        finally:
            self.pending_adds -= 1

    def _abort_soon(self, rid: str) -> None:
        self._prompts.forget(rid)
        if self._dead is None and not self._stop.is_set():
            self._request("abort", request_id=rid)

    async def abort(self, request_id: str) -> None:
        """Stop a request now (its pages are freed before the engine's next step); its consumer gets the final
        output, with finish_reason "abort", and its loop ends."""
        self.start()
        msg = await asyncio.wrap_future(self._request("abort", request_id=request_id))
        self._finish_stream(msg)

    def _finish_stream(self, msg: dict[str, Any] | None) -> None:
        if msg is None:
            return
        out = self._prompts.decode(msg)
        stream = self._streams.pop(msg["request_id"], None)
        if stream is not None and out is not None:
            stream.put_nowait(out)

    async def abort_all(self) -> int:
        """Abort every request the engine holds; returns how many (0 once the engine is shut down)."""
        if self._dead is not None or self._stop.is_set():
            return 0
        self.start()
        msgs = await asyncio.wrap_future(self._request("abort_all"))
        for msg in msgs:
            self._finish_stream(msg)
        return len(msgs)

    async def full_engine_stats(self) -> dict[str, Any]:
        """`LLM.engine_stats()` read in the engine process (compiles, phase times, ...)."""
        self.start()
        return await asyncio.wrap_future(self._request("stats"))

    async def shutdown(self, timeout_s: float = 0.0) -> None:
        """Let requests finish for up to `timeout_s`, abort the rest, then stop the engine process. Idempotent."""
        if self._stop.is_set():
            return
        if timeout_s > 0:
            await self.drain(timeout_s)
        if self._dead is None:
            await self.abort_all()
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Stop the engine process now (what is in flight is dropped); waits for it to exit."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self._send({"op": "shutdown"})
        except OSError:
            pass  # already gone
        os.close(self._out_fd)
        try:
            self._proc.wait(SHUTDOWN_WAIT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def _write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is out (a pipe takes a long message in pieces)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _spawn() -> tuple[subprocess.Popen, int, int]:
    """The child (`python -m jaxinfer.engine_process IN OUT`) and this side's ends of its two pipes. The child
    keeps this process's stdout and stderr, so its log lines land in the server's log."""
    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    cmd = [sys.executable, "-m", "jaxinfer.engine_process", str(to_child_r), str(from_child_w)]
    proc = subprocess.Popen(cmd, pass_fds=(to_child_r, from_child_w))
    os.close(to_child_r)
    os.close(from_child_w)
    return proc, to_child_w, from_child_r


if __name__ == "__main__":
    sys.exit(child_main(int(sys.argv[1]), int(sys.argv[2])))
