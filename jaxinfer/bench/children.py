"""Bench measurements that need a process of their own: how long a start takes (cold, then warm from the
persistent compilation cache), and what `LLM(model)` with no engine settings does on the headline workload.

The bench runs them before its own JAX takes the device, one child process at a time, like the HF baseline:

    python -m jaxinfer.bench.children start SPEC.json      (prints one JSON record as its last line)
    python -m jaxinfer.bench.children defaults SPEC.json

A start's clock begins when the parent launches the child, so `first_token_s` includes the interpreter, the
JAX import and backend start-up: what a user waits for from `python serve.py` to the first token.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


# JAX's own timings of what a start spends on compilation, summed over every program it builds.
COMPILE_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
                  "/jax/core/compile/backend_compile_duration": "xla_compile",
                  "/jax/compilation_cache/cache_retrieval_time_sec": "cache_load"}


def _watch_compilation() -> dict[str, float]:
    """Seconds and counts per COMPILE_EVENTS entry (`trace_total_s`, `xla_compile_count`, ...), filled as JAX
    reports them."""
    import jax

    totals: dict[str, float] = {}

    def on_duration(event: str, duration: float, **_: Any) -> None:
        if (name := COMPILE_EVENTS.get(event)) is not None:
            totals[f"{name}_total_s"] = totals.get(f"{name}_total_s", 0.0) + duration
            totals[f"{name}_count"] = totals.get(f"{name}_count", 0) + 1

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    return totals


def start(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the engine with the spec's settings and generate one token; seconds since `spec["launched"]`."""
    from jaxinfer import LLM, SamplingParams

    compilation = _watch_compilation()
    imported = time.time()
    llm = LLM(spec["model"], random_weights=True, use_tqdm=False, compilation_cache_dir=spec["cache_dir"],
              **spec["engine"])
    built = time.time()
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1), use_tqdm=False)
    done = time.time()
    # What warmup left to the background (Engine.warmup) goes into the caches too, for the next start.
    llm.engine.wait_for_background_compile()
    background = time.time()
    cache = Path(spec["cache_dir"])
    return {"import_s": imported - spec["launched"], "engine_s": built - imported,
            "first_token_s": done - spec["launched"], "background_done_s": background - spec["launched"],
            **llm.engine.runner.precompile_times,
            "num_pages": llm.engine.runner.kv_cache.k[0].shape[0],  # pages allocated, the trash page included
            "cache_files": sum(1 for p in cache.rglob("*") if p.is_file()),
            "compiles_after_warmup": llm.engine_stats()["num_compiles_after_warmup"],
            "compilation": {k: round(v, 3) for k, v in compilation.items()}}


def defaults(spec: dict[str, Any]) -> dict[str, Any]:
    """`LLM(model, random_weights=True)` and nothing else, on one offline workload."""
    from jaxinfer import LLM
    from jaxinfer.bench.measure import offline_throughput
    from jaxinfer.bench.workloads import fixed

    from jaxinfer.platform import FIELDS

    llm = LLM(spec["model"], random_weights=True, use_tqdm=False)
    llm.engine.wait_for_background_compile()  # both sides measured at their steady speed
    chosen = {"dtype": str(llm.dtype), **{f: getattr(llm.args, f) for f in FIELDS},
              "max_model_len": llm.engine.max_model_len, "num_pages": llm.engine.runner.kv_cache.k[0].shape[0]}
    w = spec["workload"]
    return {"engine": chosen, **offline_throughput(llm, fixed(w["input_len"], w["output_len"], w["num_prompts"]))}


def run_child(kind: str, spec: dict[str, Any], timeout_s: float = 900) -> dict[str, Any]:
    """Run one measurement in a child process; its record, or {"error": ...} (the bench goes on)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "spec.json"
        path.write_text(json.dumps({**spec, "launched": time.time()}))
        try:
            proc = subprocess.run([sys.executable, "-m", "jaxinfer.bench.children", kind, str(path)],
                                  capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"error": f"{kind} took more than {timeout_s:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": f"{kind} exited with {proc.returncode}: {proc.stderr[-1500:]}"}
    return json.loads(lines[-1])


def start_times(model: str, engine: dict[str, Any], cache_dir: str | None = None) -> dict[str, Any]:
    """A cold start into a fresh compilation cache (unless `cache_dir` is given), then a warm one from it.
    The warm start reuses the cold one's page count, so its shapes, and so its cache keys, match exactly."""
    cache_dir = cache_dir or tempfile.mkdtemp(prefix="jaxinfer-xla-")
    cold = run_child("start", {"model": model, "engine": engine, "cache_dir": cache_dir})
    if "error" in cold:
        return {"cache_dir": cache_dir, "cold": cold}
    warm = run_child("start", {"model": model, "engine": {**engine, "num_pages": cold["num_pages"]},
                               "cache_dir": cache_dir})
    return {"cache_dir": cache_dir, "cold": cold, "warm": warm}


def main() -> None:
    kind, path = sys.argv[1], Path(sys.argv[2])
    spec = json.loads(path.read_text())
    record = {"start": start, "defaults": defaults}[kind](spec)
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
