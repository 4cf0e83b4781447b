"""Issue 16's GPU acceptance in one command: the server against offline, and the cost of structured output.

  1. `jaxinfer serve` on random weights of --model (Llama-3-8B shape) with the engine flags below, and a
     tokenizer for structured output (--tokenizer: a directory with tokenizer.json; SmolLM2's works, its
     49k ids being a subset of the model's vocabulary);
  2. bench-serve at concurrency 64 with a JSON schema (`long_list`: 40 integers), then other prompts without a
     schema, twice: every request at the structured run's mean length (the uniform twin of earlier runs), and
     each request at its structured counterpart's length (the twin the cost is measured against: the same
     token counts request by request, so the two runs differ only by the schema);
  3. bench-serve at concurrency 64 on --workload (plain, ignore_eos);
  4. the server stopped, the same engine in this process: offline throughput on the same prompts
     (jaxinfer.bench.workloads draws both from the same seed).
Acceptance: server >= 90% of offline output tok/s; structured >= 90% of the per-request twin's output tok/s.
Written to --out (docs/benchmarks/serve.json in the repo) with every sweep in full.

    PYTHONPATH=$PWD python3 scripts/bench_serve_gpu.py --tokenizer /path/to/smollm2-tokenizer --out $OUT/serve.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ENGINE = {"max_num_seqs": 64, "max_num_batched_tokens": 4096, "max_model_len": 2048, "decode_steps_per_call": 8,
          "memory_fraction": 0.9, "dtype": "bfloat16"}


def flags(engine: dict[str, Any]) -> list[str]:
    return [x for k, v in engine.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def start_server(args: argparse.Namespace, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jaxinfer.cli", "serve", "--model", args.model, "--random-weights", "--port",
           str(args.port), "--served-model-name", "bench", "--stream-interval", str(args.stream_interval),
           *flags(ENGINE), "--engine-process" if args.engine_process else "--no-engine-process"]
    if args.tokenizer:
        cmd += ["--tokenizer", args.tokenizer]
    print("starting:", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=os.environ.copy())
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; see {log}")
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=2).status == 200:
                return proc
        except OSError:
            time.sleep(1)
    proc.kill()
    raise RuntimeError(f"the server did not start in {args.start_timeout} s; see {log}")


def bench(args: argparse.Namespace, workload: str, structured: str | None, label: str, seed: int,
          output_lens: Path | None = None) -> dict[str, Any]:
    """One bench-serve run at concurrency 64, with what the server's engine did meanwhile (`engine`: steps,
    pipelined steps and wall seconds per phase of the engine loop, from /metrics before and after)."""
    from jaxinfer.bench import serve_bench

    p = argparse.ArgumentParser()
    serve_bench.add_arguments(p)
    argv = ["--base-url", f"http://127.0.0.1:{args.port}", "--workload", workload, "--num-prompts",
            str(args.num_prompts), "--concurrency", "64", "--label", label, "--seed", str(seed)]
    if structured:
        argv += ["--structured", structured]
    if output_lens is not None:
        argv += ["--output-lens", str(output_lens)]
    before = engine_counters(args.port)
    result = asyncio.run(serve_bench.run_all(p.parse_args(argv)))
    after = engine_counters(args.port)
    result["engine"] = {k: after[k] - before[k] for k in after}
    return result


def engine_counters(port: int) -> dict[str, float]:
    """The engine loop's counters on the server's /metrics: steps, pipelined steps, seconds per phase."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("jaxinfer:engine_steps_total", "jaxinfer:engine_pipelined_steps_total"):
                out[sample.name.removeprefix("jaxinfer:engine_").removesuffix("_total")] = sample.value
            elif sample.name == "jaxinfer:engine_step_seconds_total":
                out[f"{sample.labels['phase']}_s"] = sample.value
    return out


def offline(args: argparse.Namespace, workload_name: str, seed: int) -> dict[str, Any]:
    from jaxinfer import LLM
    from jaxinfer.bench import measure
    from jaxinfer.bench.workloads import parse

    llm = LLM(args.model, random_weights=True, use_tqdm=False, **ENGINE)
    return measure.offline_throughput(llm, parse(workload_name, args.num_prompts, seed), seed)


def offline_structured(args: argparse.Namespace) -> dict[str, Any]:
    """The engine alone (no server): the structured run's prompts under the schema, then each request again
    without it at the length the schema gave, in one process; with the engine counters of each run."""
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.bench.measure import prompts
    from jaxinfer.bench.serve_bench import LONG_LIST
    from jaxinfer.bench.workloads import parse

    llm = LLM(args.model, random_weights=True, tokenizer=args.tokenizer, use_tqdm=False, **ENGINE)

    def timed(params: list[Any], seed: int) -> tuple[list[int], dict[str, Any]]:
        batch = prompts(parse("1024x512", args.num_prompts, seed), llm.model_config.vocab_size, seed)
        before = llm.engine_stats()
        t = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        after = llm.engine_stats()
        lengths = [len(o.token_ids) for o in outs]
        return lengths, {"output_tok_s": sum(lengths) / elapsed, "elapsed_s": elapsed, "output_tokens": sum(lengths),
                         "steps": after["num_steps"] - before["num_steps"],
                         "pipelined_steps": after["num_pipelined_steps"] - before["num_pipelined_steps"],
                         "prefix_cache_hit_tokens": after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"],
                         "phase_s": {k: v - before["step_time_s"][k] for k, v in after["step_time_s"].items()}}

    schema = {"json": LONG_LIST}
    lengths, structured = timed([SamplingParams(max_tokens=512, temperature=0.0, ignore_eos=True, structured=schema)
                                 for _ in range(args.num_prompts)], seed=0)
    # Other prompts of the same lengths (seed 1): these would otherwise prefill from the prefix cache.
    _, plain = timed([SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths], seed=1)
    return {"structured": structured, "plain_same_length": plain,
            "structured_cost": 1 - structured["output_tok_s"] / plain["output_tok_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (needed for the structured run)")
    p.add_argument("--workload", default="1024x256")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--out", default="bench_results/serve.json")
    p.add_argument("--stream-interval", type=int, default=1, help="the server's --stream-interval")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="the server's --engine-process (default: on, as `jaxinfer serve`)")
    p.add_argument("--structured-only", action="store_true",
                   help="only the structured run and its plain twin (no server-vs-offline comparison)")
    p.add_argument("--server-only", action="store_true",
                   help="with --structured-only: the two server runs, not the engine-alone pair after them")
    args = p.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"command": "python3 scripts/bench_serve_gpu.py " + " ".join(sys.argv[1:]),
                              "model": args.model, "engine": ENGINE, "workload": args.workload,
                              "num_prompts": args.num_prompts, "stream_interval": args.stream_interval,
                              "engine_process": args.engine_process}

    def save() -> None:
        out.write_text(json.dumps(result, indent=1) + "\n")

    server = start_server(args, out.with_suffix(".server.log"))
    try:
        if args.tokenizer:
            # Each run draws its own prompts (seed): a run on prompts the server already saw would prefill
            # them from the prefix cache and look faster than it is.
            structured = bench(args, "1024x512", "long_list", "structured c64", seed=0)
            result["structured"] = structured
            length = round(structured["sweep"][0]["output_tokens"] / structured["sweep"][0]["completed"])
            result["plain_same_length"] = bench(args, f"1024x{length}", None, f"plain c64, {length} tokens", seed=1)
            # The twin that differs from the structured run only by the schema: each request as long as its
            # structured counterpart (the uniform twin above finishes all its rows in the same step, in waves
            # of 64, where the structured rows finish one by one).
            lens = out.with_suffix(".lens.json")
            lens.write_text(json.dumps(structured["sweep"][0]["per_request_tokens"]))
            result["plain_per_request"] = bench(args, "1024x512", None, "plain c64, lengths of the structured run",
                                                seed=3, output_lens=lens)
            save()
        if not args.structured_only:
            result["server"] = bench(args, args.workload, None, "plain c64", seed=2)
            save()
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(120)
    if args.structured_only:
        if not args.server_only:
            result["offline_structured"] = offline_structured(args)
    else:
        result["offline"] = offline(args, args.workload, seed=2)
    result.update(verdicts(result))
    save()
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}, indent=1))


def verdicts(result: dict[str, Any]) -> dict[str, Any]:
    v: dict[str, Any] = {}
    if "offline" in result:
        served = result["server"]["sweep"][0]["output_throughput"]
        offline_tok_s = result["offline"]["output_tok_s"]
        v.update(server_c64_output_tok_s=served, offline_output_tok_s=offline_tok_s,
                 server_fraction_of_offline=served / offline_tok_s)
        v["server_ok"] = v["server_fraction_of_offline"] >= 0.9
    if "structured" in result:
        s = result["structured"]["sweep"][0]["output_throughput"]
        plain = result["plain_same_length"]["sweep"][0]["output_throughput"]
        v.update(structured_output_tok_s=s, plain_same_length_output_tok_s=plain,
                 structured_cost_vs_uniform=1 - s / plain)
        if "plain_per_request" in result:
            twin = result["plain_per_request"]["sweep"][0]["output_throughput"]
            v.update(plain_per_request_output_tok_s=twin, structured_cost=1 - s / twin,
                     structured_ok=1 - s / twin <= 0.10)
    return v


if __name__ == "__main__":
    main()
