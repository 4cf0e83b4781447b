"""`jaxinfer bench-serve`: load generator against any OpenAI-compatible server (jaxinfer's, vLLM's, ...).

Closed loop (`--concurrency C ...`): at most C requests in flight, a new one sent as one finishes, every
prompt sent at once otherwise. Open loop (`--request-rate R`): requests arrive as a Poisson process of R per
second whatever the server's state (with `--concurrency` as a cap on those in flight). Every request streams
(SSE, `stream_options.include_usage`), so the client sees each token arrive:
  TTFT  send -> first token; TPOT  (e2e - TTFT) / (tokens - 1); ITL  gaps between text chunks
  (a chunk carrying several tokens counts one gap); e2e  send -> last byte.
Prompts are the random token-id workloads of `jaxinfer bench` (`--workload 1024x128`, or `sharegpt`), sent
as token ids to /v1/completions (`--endpoint chat` sends them decoded as text through `/detokenize`, for
servers that take no token prompts use `--endpoint chat --text-prompts`). `--structured NAME` constrains
each request to a schema of jaxinfer.bench.schemas (or `long_list`, a fixed-length JSON list).

The result is the `sweep` section of `jaxinfer bench`'s JSON (request and token throughput, TTFT, TPOT, ITL
and e2e mean/median/p90/p99 per concurrency), written to --out with a plot beside it.

    jaxinfer bench-serve --base-url http://127.0.0.1:8000 --workload 1024x128 --num-prompts 256 \\
        --concurrency 1 8 64 --out bench_results/serve.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxinfer.bench.schemas import SCHEMAS
from jaxinfer.bench.workloads import Workload, parse, prompts

LONG_LIST = {"type": "object", "properties": {"values": {"type": "array", "items": {"type": "integer", "minimum": 0,
             "maximum": 999}, "minItems": 40, "maxItems": 40}}, "required": ["values"], "additionalProperties": False}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (its /v1 routes)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--workload", default="1024x128", help="INxOUT tokens per request, or sharegpt")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--concurrency", type=int, nargs="+", default=[64], help="closed-loop limits, one run each")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second (inf: all)")
    p.add_argument("--vocab-limit", type=int, default=32000, help="prompt token ids are drawn below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (for servers without vLLM's extra fields)")
    p.add_argument("--output-lens", default=None,
                   help="a JSON file with one output length per prompt, in place of the workload's (e.g. another "
                        "run's per_request_tokens: the same token counts request by request)")
    p.add_argument("--structured", default=None, help=f"a schema name: {', '.join([*SCHEMAS, 'long_list'])}")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--label", default=None, help="a name for this run in the JSON")
    p.add_argument("--out", default="bench_results/serve.json")
    p.add_argument("--plot", default=None, help="PNG path (default: beside --out); 'none' skips it")


def summary(values_s: list[float]) -> dict[str, float]:
    """mean / median / p90 / p99 in ms (the keys of `jaxinfer bench`'s sweep, plus p90)."""
    a = np.asarray(values_s, float) * 1e3
    if a.size == 0:
        return {k: float("nan") for k in ("mean_ms", "median_ms", "p90_ms", "p99_ms")}
    return {"mean_ms": float(a.mean()), "median_ms": float(np.median(a)), "p90_ms": float(np.percentile(a, 90)),
            "p99_ms": float(np.percentile(a, 99))}


class Client:
    def __init__(self, args: argparse.Namespace, session: Any) -> None:
        self.args, self.session = args, session
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.model = args.model

    async def resolve_model(self) -> None:
        if self.model is None:
            async with self.session.get(f"{self.args.base_url}/v1/models", headers=self.headers) as r:
                self.model = (await r.json())["data"][0]["id"]

    def body(self, prompt: Any, max_tokens: int) -> tuple[str, dict[str, Any]]:
        a = self.args
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "temperature": a.temperature,
                                "stream": True, "stream_options": {"include_usage": True}}
        if a.ignore_eos:
            body["ignore_eos"] = True
        if a.structured:
            schema = LONG_LIST if a.structured == "long_list" else SCHEMAS[a.structured]
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": a.structured, "schema": schema}}
        if a.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
            return "/v1/chat/completions", body
        body["prompt"] = prompt
        return "/v1/completions", body

    async def one(self, prompt: Any, max_tokens: int) -> dict[str, Any]:
        """Send one streamed request; its timings (seconds) and token count, or its error."""
        path, body = self.body(prompt, max_tokens)
        start = time.perf_counter()
        chunks: list[float] = []
        tokens = None
        async with self.session.post(self.args.base_url + path, json=body, headers=self.headers) as r:
            if r.status != 200:
                return {"error": f"HTTP {r.status}: {(await r.text())[:300]}"}
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                data = json.loads(line[5:])
                if data.get("usage"):
                    tokens = data["usage"]["completion_tokens"]
                if any(_has_text(c) for c in data.get("choices", [])):
                    chunks.append(time.perf_counter())
        end = time.perf_counter()
        return {"start": start, "chunks": chunks, "end": end, "tokens": tokens if tokens is not None else len(chunks)}


def _has_text(choice: dict[str, Any]) -> bool:
    return bool(choice.get("text") or (choice.get("delta") or {}).get("content"))


async def run_level(client: Client, batch: list[Any], workload: Workload, concurrency: int,
                    rate: float, seed: int) -> dict[str, Any]:
    """One load level: every prompt sent (closed loop at `concurrency`, Poisson arrivals at `rate`)."""
    gate = asyncio.Semaphore(concurrency)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(batch)) if np.isfinite(rate) else None

    async def send(i: int) -> dict[str, Any]:
        async with gate:
            return await client.one(batch[i], workload.output_lens[i])

    start = time.perf_counter()
    tasks = []
    for i in range(len(batch)):
        tasks.append(asyncio.create_task(send(i)))
        if gaps is not None:
            await asyncio.sleep(float(gaps[i]))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    return level_result(results, workload, concurrency, rate, duration)


def level_result(results: list[dict[str, Any]], workload: Workload, concurrency: int, rate: float,
                 duration: float) -> dict[str, Any]:
    ok = [r for r in results if "error" not in r]
    ttfts = [r["chunks"][0] - r["start"] for r in ok if r["chunks"]]
    itls = [b - a for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
    tpots = [(r["end"] - r["chunks"][0]) / (r["tokens"] - 1) for r in ok if r["chunks"] and r["tokens"] > 1]
    out_tokens = sum(r["tokens"] for r in ok)
    in_tokens = sum(n for n, r in zip(workload.input_lens, results) if "error" not in r)
    return {
        "concurrency": concurrency, "request_rate": rate if np.isfinite(rate) else "inf",
        "num_prompts": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if "error" in r})[:5],
        "duration_s": duration, "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration, "output_tokens": out_tokens,
        "ttft": summary(ttfts), "tpot": summary(tpots), "itl": summary(itls),
        "e2e": summary([r["end"] - r["start"] for r in ok]),
        "per_request_tokens": [r.get("tokens") for r in results],  # in prompt order; None where it failed
    }


def level_prompts(workload: Workload, vocab_limit: int, seed: int, level: int) -> list[list[int]]:
    """The token prompts of the sweep's `level`-th load level: the workload's lengths, each level drawing its own
    ids (seed + 1 + level), so no level finds an earlier level's prompts in the server's prefix cache."""
    return prompts(workload, vocab_limit, seed + 1 + level)


async def _text_prompts(client: Client, batch: list[list[int]]) -> list[str]:
    """Token prompts as text, decoded by the server itself (/detokenize), for the chat endpoint."""
    out = []
    for ids in batch:
        async with client.session.post(f"{client.args.base_url}/detokenize", json={"tokens": ids},
                                       headers=client.headers) as r:
            out.append((await r.json())["prompt"])
    return out


def with_output_lens(workload: Workload, path: str | Path) -> Workload:
    """`workload` with the output lengths read from `path` (a JSON list, one per prompt)."""
    lens = json.loads(Path(path).read_text())
    if not isinstance(lens, list) or len(lens) != workload.num_prompts or not all(isinstance(n, int) for n in lens):
        raise ValueError(f"--output-lens {path}: expected a JSON list of {workload.num_prompts} integers "
                         f"(one per prompt), got {str(lens)[:80]}")
    return Workload(f"{workload.name}, output lengths from {Path(path).name}", workload.input_lens, tuple(lens))


async def run_all(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    workload = parse(args.workload, args.num_prompts, args.seed)
    if args.output_lens:
        workload = with_output_lens(workload, args.output_lens)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        client = Client(args, session)
        await client.resolve_model()
        result = {"command": "jaxinfer bench-serve", "label": args.label, "base_url": args.base_url,
                  "model": client.model, "endpoint": args.endpoint, "workload": workload.name,
                  "structured": args.structured, "temperature": args.temperature,
                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "sweep": []}
        # Warm the connection and the server's first-request paths on a prompt no level sends.
        await client.one(prompts(workload, args.vocab_limit, args.seed)[0], 4)
        for k, c in enumerate(args.concurrency):
            batch: list[Any] = level_prompts(workload, args.vocab_limit, args.seed, k)
            if args.endpoint == "chat":
                batch = await _text_prompts(client, batch)
            level = await run_level(client, batch, workload, c, args.request_rate, args.seed)
            result["sweep"].append(level)
            print(json.dumps({k: v for k, v in level.items() if not isinstance(v, dict | list)}), flush=True)
    return result


def plot(result: dict[str, Any], path: str | Path) -> Path:
    """Output throughput and TTFT/TPOT medians against concurrency (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = result["sweep"]
    conc = [s["concurrency"] for s in sweep]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].plot(conc, [s["output_throughput"] for s in sweep], "o-")
    axes[0].set(xscale="log", xlabel="max concurrency", ylabel="output tokens / s", title="throughput")
    for key, style in (("ttft", "o-"), ("tpot", "s--"), ("itl", "^:")):
        axes[1].plot(conc, [s[key]["median_ms"] for s in sweep], style, label=f"{key.upper()} p50")
        axes[1].plot(conc, [s[key]["p99_ms"] for s in sweep], style, alpha=0.4, label=f"{key.upper()} p99")
    axes[1].set(xscale="log", yscale="log", xlabel="max concurrency", ylabel="ms", title="latency")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"bench-serve {result.get('model')} {result.get('workload')} {result.get('structured') or ''}")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def execute(args: argparse.Namespace) -> int:
    if args.structured and args.structured not in SCHEMAS and args.structured != "long_list":
        raise ValueError(f"--structured must be one of {', '.join([*SCHEMAS, 'long_list'])}, got {args.structured!r}.")
    if min(args.concurrency) < 1 or args.num_prompts < 1:
        raise ValueError("--concurrency and --num-prompts must be at least 1.")
    result = asyncio.run(run_all(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    if args.plot != "none":
        try:
            print("wrote", plot(result, args.plot or out.with_suffix(".png")))
        except ImportError:
            print("matplotlib is not installed: no plot")
    print("wrote", out)
    return 0 if all(s["failed"] == 0 for s in result["sweep"]) else 1
