"""End-to-end engine benchmark on full-size shapes with random weights (first slice of issue 6).

Measures, in one run on one device:
  ceilings     device copy bandwidth (best of a jnp copy and a jnp add, bytes read + written) and the bf16
               matmul rate (8192^3), so every figure is a ratio to something measured beside it;
  warmup       seconds to compile every bucket, and compiles after warmup (must be 0);
  decode MBU   at batch 1 and 64: (weight bytes + KV bytes attended per step) / step time / copy bandwidth,
               from the engine's own step loop (host scheduling included);
  prefill MFU  one 4k-token prompt: model FLOPs (2 * params * T + causal attention) / time / matmul rate.

    PYTHONPATH=$PWD python3 scripts/bench.py --model llama-3-8b --out $OUT/bench_engine.json

Full offline-throughput grids, the concurrency sweep and the HF transformers baseline are still to come.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _median_time(fn: Any, repeats: int = 10) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def copy_bandwidth(gib: float = 4.0) -> float:
    """Bytes moved per second by the best of two plain XLA passes over a large bf16 array."""
    n = int(gib * (1 << 30) // 2)
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    copy = jax.jit(lambda a: a * jnp.bfloat16(1.0001))
    add = jax.jit(lambda a: a + jnp.bfloat16(1))
    best = min(_median_time(lambda: copy(x)), _median_time(lambda: add(x)))
    return 2 * n * 2 / best  # read + write


def matmul_rate(n: int = 8192) -> float:
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: x @ y)
    return 2 * n**3 / _median_time(lambda: f(a, b))


def build(model: str, batch: int, max_len: int, tokens: int, warmup: bool = True, decode_steps: int = 1) -> Any:
    from jaxinfer import LLM

    t = time.perf_counter()
    llm = LLM(model, random_weights=True, dtype="bfloat16", max_num_seqs=batch, max_model_len=max_len,
              max_num_batched_tokens=tokens, page_size=16, memory_fraction=0.6, use_tqdm=False, warmup=warmup,
              decode_steps_per_call=decode_steps)
    return llm, time.perf_counter() - t


def _generated(engine: Any) -> int:
    return sum(len(s.token_ids) for r in engine.requests.values() for s in r.seqs)


def decode_mbu(llm: Any, batch: int, ctx: int, steps: int, copy_bw: float) -> dict[str, float]:
    """Prefill `batch` prompts of `ctx` tokens, then time decoding until each has `steps` more tokens.

    A "step" is one token for every sequence; with decode_steps_per_call > 1 one engine call makes several.
    """
    from jaxinfer import SamplingParams

    engine = llm.engine
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=2 * steps + 8, ignore_eos=True, temperature=0.0)
    for _ in range(batch):
        engine.add_request(list(rng.integers(0, 1000, ctx)), params)
    while any(len(s.seqs[0].token_ids) == 0 for s in engine.requests.values()):
        engine.step()
    start_tokens, calls = _generated(engine), 0
    t = time.perf_counter()
    while _generated(engine) - start_tokens < steps * batch:
        engine.step()
        calls += 1
    elapsed = time.perf_counter() - t
    step_s = elapsed / ((_generated(engine) - start_tokens) / batch)
    while engine.has_unfinished():
        engine.step()
    cfg = llm.model_config
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(llm.weights))
    kv_bytes = batch * (ctx + steps // 2) * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_size * 2
    return {"step_ms": step_s * 1e3, "tok_s": batch / step_s, "engine_calls": calls,
            "mbu": (weight_bytes + kv_bytes) / step_s / copy_bw}


def prefill_mfu(llm: Any, tokens: int, rate: float) -> dict[str, float]:
    from jaxinfer import SamplingParams

    cfg = llm.model_config
    prompt = list(np.random.default_rng(1).integers(0, 1000, tokens))
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)  # same bucket, warm
    t = time.perf_counter()
    llm.generate([prompt[::-1]], SamplingParams(max_tokens=1), use_tqdm=False)  # different tokens: no prefix hit
    elapsed = time.perf_counter() - t
    params = sum(x.size for x in jax.tree.leaves(llm.weights))
    attn = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_size * tokens * tokens / 2  # QK^T and PV, causal
    flops = 2 * params * tokens + attn
    return {"prefill_s": elapsed, "tflops": flops / elapsed / 1e12, "mfu": flops / elapsed / rate}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--ctx", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--decode-steps-per-call", type=int, default=1)
    parser.add_argument("--prefill-tokens", type=int, default=4096)
    parser.add_argument("--copy-gib", type=float, default=4.0)
    parser.add_argument("--matmul-n", type=int, default=8192)
    parser.add_argument("--out", default="bench_engine.json")
    args = parser.parse_args()
    result: dict[str, Any] = {"device": jax.devices()[0].device_kind, "model": args.model, "command": " ".join(
        ["python3 scripts/bench.py", f"--model {args.model}", f"--ctx {args.ctx}", f"--steps {args.steps}", f"--prefill-tokens {args.prefill_tokens}",
         "--batches " + " ".join(map(str, args.batches)), f"--decode-steps-per-call {args.decode_steps_per_call}"])}
    print("measuring ceilings", flush=True)
    result["copy_bw_gbs"] = copy_bandwidth(args.copy_gib) / 1e9
    result["matmul_tflops"] = matmul_rate(args.matmul_n) / 1e12
    print(json.dumps({k: result[k] for k in ("device", "copy_bw_gbs", "matmul_tflops")}), flush=True)
    for batch in args.batches:
        llm, warm = build(args.model, batch, args.ctx + args.steps + 16, 512,
                          decode_steps=args.decode_steps_per_call)
        result[f"warmup_s_batch{batch}"] = warm
        result[f"decode_batch{batch}"] = decode_mbu(llm, batch, args.ctx, args.steps, result["copy_bw_gbs"] * 1e9)
        result[f"recompiles_after_warmup_batch{batch}"] = llm.engine_stats()["num_compiles_after_warmup"]
        print(json.dumps({k: v for k, v in result.items() if str(batch) in k}), flush=True)
        del llm
    t = args.prefill_tokens
    if t <= 0:
        _write(result, args.out)
        return
    llm, _ = build(args.model, 1, t + 16, t, warmup=False)  # only the top bucket is used: compile it alone
    result[f"prefill_{t}"] = prefill_mfu(llm, t, result["matmul_tflops"] * 1e12)
    _write(result, args.out)


def _write(result: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
