"""Prometheus metrics of one server, in their own registry (several apps in one process never collide).

Gauges of the engine (running and waiting requests, KV-cache usage, prefix-cache hit rate, preemptions) are
read at scrape time from the snapshot the engine thread publishes after every step (`AsyncLLM.engine_stats`),
so a scrape never waits for the device. Token counters and latency histograms are updated on the event loop
as outputs arrive: prompt tokens when a request finishes, generated tokens with every output, time to first
token with the first one, and inter-token latencies and end-to-end latency when the request finishes
(sequence 0's token arrival times on the host; with multi-step decode several tokens arrive together).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from jaxinfer.outputs import RequestOutput

PREFIX = "jaxinfer:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0)


class _EngineGauges(Collector):
    def __init__(self, async_llm: Any, model: str) -> None:
        self.llm, self.model = async_llm, model

    def collect(self) -> Iterator[Any]:
        s = self.llm.engine_stats()
        labels = ["model_name"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            g.add_metric([self.model], value)
            return g

        yield gauge("num_requests_running", "Sequences in the running batch.", s["num_running"])
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled (preempted ones included).",
                    s["num_waiting"])
        used = s["total_pages"] - s["free_pages"]
        yield gauge("kv_cache_usage_perc", "Share of KV-cache pages in use, 0 to 1 (cached, unreferenced pages "
                    "count as free).", used / s["total_pages"] if s["total_pages"] else 0.0)
        yield gauge("prefix_cache_hit_rate", "Share of prompt tokens whose KV came from the prefix cache.",
                    s["prefix_cache_hit_rate"])
        c = CounterMetricFamily(PREFIX + "num_preemptions", "Sequences preempted (to be recomputed) so far.",
                                labels=labels)
        c.add_metric([self.model], s["num_preemptions"])
        yield c
        steps = CounterMetricFamily(PREFIX + "engine_steps", "Engine steps (device calls) so far.", labels=labels)
        steps.add_metric([self.model], s["num_steps"])
        yield steps
        piped = CounterMetricFamily(PREFIX + "engine_pipelined_steps", "Single steps whose forward was launched "
                                    "before the previous step's tokens were read.", labels=labels)
        piped.add_metric([self.model], s["num_pipelined_steps"])
        yield piped
        phases = CounterMetricFamily(PREFIX + "engine_step_seconds", "Wall seconds of the engine loop per phase "
                                     "(schedule, prepare, device, apply).", labels=[*labels, "phase"])
        for phase, seconds in s["step_time_s"].items():
            phases.add_metric([self.model, phase], seconds)
        yield phases


class ServerMetrics:
    def __init__(self, async_llm: Any, model: str) -> None:
        disable_created_metrics()  # no *_created series: scrapers of this server do not use them
        self.registry = CollectorRegistry()
        self.model = model
        self.registry.register(_EngineGauges(async_llm, model))
        kw = {"labelnames": ["model_name"], "registry": self.registry}
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", **kw)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", **kw)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to first token.",
                              buckets=TTFT_BUCKETS, **kw)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between two tokens of a sequence.",
                             buckets=ITL_BUCKETS, **kw)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to finish of a request.",
                             buckets=E2E_BUCKETS, **kw)
        self._first_seen: set[str] = set()
        # The one label set this server uses, looked up once: on_outputs runs for every streamed step.
        self._prompt, self._generated = self.prompt_tokens.labels(model), self.generation_tokens.labels(model)
        self._ttft, self._itl, self._e2e = self.ttft.labels(model), self.itl.labels(model), self.e2e.labels(model)

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        """Called on the event loop with each step's outputs (AsyncLLM.on_outputs)."""
        new = 0
        for out in outputs:
            new += sum(len(c.delta_token_ids) for c in out.outputs)
            m = out.metrics or {}
            if out.request_id not in self._first_seen and m.get("ttft_s") is not None:
                self._first_seen.add(out.request_id)
                self._ttft.observe(m["ttft_s"])
            if out.finished:
                self._finished(out, m)
        if new:
            self._generated.inc(new)

    def _finished(self, out: RequestOutput, m: dict[str, Any]) -> None:
        self._first_seen.discard(out.request_id)
        self._prompt.inc(len(out.prompt_token_ids))
        for gap in out.inter_token_latencies:
            self._itl.observe(gap)
        if m.get("arrival_time") is not None:
            self._e2e.observe(max(0.0, time.time() - m["arrival_time"]))

    def render(self) -> bytes:
        return generate_latest(self.registry)
