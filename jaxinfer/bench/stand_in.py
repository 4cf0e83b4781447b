"""A stand-in for the engine, with no model, for measuring and testing what sits in front of it (AsyncLLM, the
server): `step()` holds the GIL for `host_ms` of Python work, as the real engine thread's host work does,
calls `on_device_wait` and then waits without the GIL for the rest of `step_ms` per token, as a thread blocked
on the device does; every running request gains `tokens_per_step` tokens ("t", id 7) a step and finishes at
its max_tokens. scripts/bench_serve_overhead.py drives the server over it.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable
from typing import Any

from jaxinfer.outputs import CompletionOutput, FinishReason, RequestMetrics, RequestOutput


class StandInScheduler:
    def __init__(self, engine: StandInEngine) -> None:
        self.engine = engine

    def stats(self) -> dict[str, Any]:
        n = len(self.engine.requests)
        return {"num_running": min(n, self.engine.max_num_seqs), "num_waiting": max(0, n - self.engine.max_num_seqs),
                "free_pages": 1000, "total_pages": 1000, "num_preemptions": 0, "prefix_cache_hit_rate": 0.0}


class StandInEngine:
    """The engine's interface as AsyncLLM drives it, with the pace of a real one (module docstring)."""

    max_model_len = 4096

    def __init__(self, step_ms: float, host_ms: float, tokens_per_step: int, max_num_seqs: int) -> None:
        self.step_s, self.host_s = step_ms / 1e3, host_ms / 1e3
        self.tokens_per_step, self.max_num_seqs = tokens_per_step, max_num_seqs
        self.requests: dict[str, dict[str, Any]] = {}
        self.scheduler = StandInScheduler(self)
        self.stream_interval = 1
        self.on_device_wait: Callable[[], None] | None = None
        self.num_steps = 0
        self.pipeline = types.SimpleNamespace(num_pipelined_steps=0)
        self.times = types.SimpleNamespace(seconds={"device": 0.0})

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def add_request(self, prompt: Any, params: Any, request_id: str, priority: int = 0) -> str:
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else list(range(8))
        self.requests[request_id] = {"ids": ids, "max": params.max_tokens, "n": 0, "since": 0, "arrival": time.time()}
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        r = self.requests.pop(request_id, None)
        return None if r is None else self._output(request_id, r, 0, FinishReason.ABORT)

    def _output(self, rid: str, r: dict[str, Any], new: int, reason: FinishReason | None) -> RequestOutput:
        c = CompletionOutput(0, "t" * r["n"], [7] * r["n"], reason, delta_text="t" * new, delta_token_ids=[7] * new)
        return RequestOutput(rid, None, r["ids"], [c], finished=reason is not None,
                             metrics=RequestMetrics(arrival_time=r["arrival"], ttft_s=0.01))

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        while time.perf_counter() < start + self.host_s:  # Python work: holds the GIL as host work does
            sum(range(50))
        outs = []
        for rid, r in list(self.requests.items())[: self.max_num_seqs]:
            new = min(self.tokens_per_step, r["max"] - r["n"])
            r["n"] += new
            r["since"] += new
            done = r["n"] >= r["max"]
            if done or r["since"] >= self.stream_interval * self.tokens_per_step:
                outs.append(self._output(rid, r, r["since"], FinishReason.LENGTH if done else None))
                r["since"] = 0
            if done:
                del self.requests[rid]
        self.num_steps += 1
        if self.on_device_wait is not None:
            self.on_device_wait()
        time.sleep(max(0.0, self.step_s * self.tokens_per_step - (time.perf_counter() - start)))
        return outs

    def stats(self) -> dict[str, Any]:
        return {"num_steps": self.num_steps}


class StandInLLM:
    def __init__(self, engine: StandInEngine) -> None:
        self.engine, self.tokenizer = engine, None
        self.model_config = type("Config", (), {"vocab_size": 32000})()
