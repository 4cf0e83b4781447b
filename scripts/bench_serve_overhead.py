"""What the server layer costs a streamed token, on any machine: `jaxinfer serve`'s app (uvicorn, the routes,
SSE, AsyncLLM's hand-off to the event loop) over a stand-in engine that keeps a GPU's pace, driven by
`jaxinfer bench-serve` from another process.

The stand-in engine has no model. Each step it holds the GIL for --host-ms of Python work (the real engine
thread builds masks, places arrays, detokenizes and checks stops: ~9 ms per step at batch 64 on the H100),
then waits for the rest of --step-ms without the GIL, as a thread blocked on the device does; every running
request gains --tokens-per-step tokens per step (1: a constrained row's single steps; 8: plain multi-step
calls). The server's own work (one SSE event per stream per step, AsyncLLM's queues) competes with that host
work for the GIL: the slower it is, the more the steps stretch. The figure is the served output tok/s as a
share of the engine's pace alone (no server), for each setting:

    .venv/bin/python scripts/bench_serve_overhead.py --out bench_results/serve_overhead.json

One line of JSON per setting; the stand-in engine is jaxinfer.bench.stand_in's (the interface AsyncLLM drives).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from jaxinfer.bench.stand_in import StandInEngine, StandInLLM


def serve(args: argparse.Namespace) -> None:
    """The server process: the real app over the stand-in engine."""
    import uvicorn

    from jaxinfer.async_llm import AsyncLLM
    from jaxinfer.serve.app import build_app
    from jaxinfer.serve.state import ServeConfig

    engine = StandInEngine(args.step_ms, args.host_ms, args.tokens_per_step, args.max_num_seqs)
    llm = AsyncLLM.from_llm(StandInLLM(engine), stream_interval=args.stream_interval)
    app = build_app(llm, ServeConfig(served_model_name="fake"))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", **_uvicorn_kwargs(args.stack))


def _uvicorn_kwargs(stack: str) -> dict[str, str]:
    return {"plain": {"loop": "asyncio", "http": "h11"}, "auto": {}}[stack]


def engine_alone(args: argparse.Namespace, num_prompts: int, output_len: int) -> float:
    """Output tok/s of the stand-in engine driven with no server, at the same load (closed loop)."""
    engine = StandInEngine(args.step_ms, args.host_ms, args.tokens_per_step, args.max_num_seqs)
    params = type("P", (), {"max_tokens": output_len, "output_kind": None})()
    sent, t = 0, time.perf_counter()
    while sent < num_prompts or engine.requests:
        while sent < num_prompts and len(engine.requests) < args.concurrency:
            engine.add_request({"prompt_token_ids": [1]}, params, f"r{sent}")
            sent += 1
        engine.step()
    return num_prompts * output_len / (time.perf_counter() - t)


def run_setting(args: argparse.Namespace) -> dict[str, Any]:
    from jaxinfer.bench import serve_bench

    cmd = [sys.executable, __file__, "--serve", "--port", str(args.port), "--step-ms", str(args.step_ms),
           "--host-ms", str(args.host_ms), "--tokens-per-step", str(args.tokens_per_step), "--stream-interval",
           str(args.stream_interval), "--max-num-seqs", str(args.max_num_seqs), "--stack", args.stack]
    proc = subprocess.Popen(cmd, env=os.environ.copy())
    try:
        for _ in range(200):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        p = argparse.ArgumentParser()
        serve_bench.add_arguments(p)
        bench_args = p.parse_args(["--base-url", f"http://127.0.0.1:{args.port}", "--workload",
                                   f"8x{args.output_len}", "--num-prompts", str(args.num_prompts), "--concurrency",
                                   str(args.concurrency), "--plot", "none"])
        cpu_before = _cpu_s(proc.pid)
        served = asyncio.run(serve_bench.run_all(bench_args))["sweep"][0]
        server_cpu_s = _cpu_s(proc.pid) - cpu_before
    finally:
        proc.terminate()
        proc.wait(30)
    alone = engine_alone(args, args.num_prompts, args.output_len)
    return {"stack": args.stack, "tokens_per_step": args.tokens_per_step, "stream_interval": args.stream_interval,
            "step_ms": args.step_ms, "host_ms": args.host_ms, "concurrency": args.concurrency,
            "served_tok_s": served["output_throughput"], "engine_alone_tok_s": alone,
            "served_fraction": served["output_throughput"] / alone, "itl_median_ms": served["itl"]["median_ms"],
            "itl_p90_ms": served["itl"]["p90_ms"], "failed": served["failed"],
            # the server process's CPU time (event loop and engine thread) per streamed token
            "server_cpu_us_per_token": 1e6 * server_cpu_s / max(1, served["output_tokens"])}


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=8799)
    p.add_argument("--step-ms", type=float, default=13.0, help="device time per token step")
    p.add_argument("--host-ms", type=float, default=9.0, help="GIL-holding host work per engine step")
    p.add_argument("--tokens-per-step", type=int, default=1)
    p.add_argument("--stream-interval", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=192)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--stack", choices=["plain", "auto"], default="auto",
                   help="uvicorn's event loop and HTTP parser: plain (asyncio, h11) or auto (uvloop, httptools "
                        "when installed)")
    p.add_argument("--settings", nargs="*", default=None,
                   help="tokens_per_step:stream_interval:stack triples to run in turn (default: a sweep)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.serve:
        return serve(args)
    settings = args.settings or ["1:1:plain", "1:1:auto", "1:8:auto", "8:1:auto"]
    results = []
    for s in settings:
        tps, interval, stack = s.split(":")
        run = argparse.Namespace(**{**vars(args), "tokens_per_step": int(tps), "stream_interval": int(interval),
                                    "stack": stack})
        results.append(run_setting(run))
        print(json.dumps(results[-1]), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
