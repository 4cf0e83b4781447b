"""Issue 15's GPU acceptance in one command: quantized weights and KV beside bf16 on one H100, Llama-3-8B shape,
random weights.

    PYTHONPATH=$PWD python3 scripts/bench_quantized.py --out $OUT/quantized.json

or, to stay inside a 10-minute call, one section group per call on the same --out (each adds its keys):

    PYTHONPATH=$PWD python3 scripts/bench_quantized.py --sections ceilings,kernels --out $OUT/quantized.json
    PYTHONPATH=$PWD python3 scripts/bench_quantized.py --sections decode --out $OUT/quantized.json
    PYTHONPATH=$PWD python3 scripts/bench_quantized.py --sections offline --out $OUT/quantized.json

Sections, in order (`--sections` picks some; the JSON is rewritten after each, so a run cut short keeps what
it measured, and a second call with `--sections ... --out` of the same file adds to it):
  ceilings  copy bandwidth (best of plain XLA passes and a plain copy) and the bf16 8192^3 matmul rate;
  kernels   the Llama-3-8B weight set (32 layers of qkv, o, gate, up, down) streamed through one matvec
            each in one jit, M = 1, for bf16 / int8 (per channel) / int4 (groups of 32 with zero points, as
            quantization="int4" stores it; and groups of 128): int8's % of copy bandwidth and int4's tokens/s
            over int8's; fp8 W8A8 against bf16 at M = 256, 1024, 4096 on
            4096 x 14336 (each against the same bf16 product and against the 8192^3 rate);
  decode    engine decode at batch 1 (ctx 512, 128 steps) for bf16, int8, int4 (groups of 32) and int4:128
            weights: step time and the speedup over bf16;
  offline   1000/1000 (512 prompts) with int8 weights + fp8 KV, and 128/128 (2048 prompts) with fp8 weights
            (+ fp8 KV): output tok/s, and any kernel that fell back to the jnp reference (`fallbacks`).
Acceptance (issue 15): decode_b1_int8_speedup >= 1.8, decode_b1_int4_speedup >= 2.8,
offline_1000_int8w_fp8kv_tok_s >= 16000, offline_128_fp8_tok_s >= 30000, int8_m1_pct_of_copy_bw >= 80,
int4_over_int8_m1_tok_s >= 1.6, fp8_over_bf16_matmul_rate >= 1.6.

`--smoke` runs every section on CPU with a tiny model and tiny shapes (the code path, not the numbers).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxinfer.bench.measure import copy_bandwidth, matmul_rate, median_time, offline_throughput
from jaxinfer.bench.workloads import fixed

SECTIONS = ("ceilings", "kernels", "decode", "offline")


def sizes(smoke: bool) -> dict[str, Any]:
    """Every size the sections use: the real ones, or tiny ones for --smoke on CPU."""
    if smoke:
        return dict(model="smollm2-135m", int4_wide="int4:64", layers=2, d=256, qkv=384, f=512, fp8_k=256, fp8_n=512, fp8_m=(256,),
                    bw_gib=0.05, matmul_n=256, ctx=32, steps=8, offline_1000=(32, 32, 4), offline_128=(16, 16, 4),
                    engine=dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=128, num_pages=64,
                                warmup=False))  # CPU: compile only the buckets used
    return dict(model="llama-3-8b", int4_wide="int4:128", layers=32, d=4096, qkv=6144, f=14336, fp8_k=4096, fp8_n=14336,
                fp8_m=(256, 1024, 4096), bw_gib=4.0, matmul_n=8192, ctx=512, steps=128,
                offline_1000=(1000, 1000, 512), offline_128=(128, 128, 2048),
                engine=dict(max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=8192,
                            gpu_memory_utilization=0.9))


# ----------------------------------------------------------------------------- ceilings


def ceilings(s: dict[str, Any]) -> dict[str, Any]:
    rates = copy_bandwidth(s["bw_gib"])
    n = int(s["bw_gib"] * (1 << 30) // 2)
    x = jax.random.normal(jax.random.key(3), (n,), jnp.bfloat16)
    rates["jax_copy"] = 2 * x.nbytes / median_time(lambda: jax.jit(jnp.copy)(x))
    return {"copy_bw_by_method": rates, "copy_bw": max(rates.values()), "bf16_matmul_rate": matmul_rate(s["matmul_n"])}


# ----------------------------------------------------------------------------- kernels


def weight_set(s: dict[str, Any], quantize: Callable[[jax.Array], Any]) -> list[Any]:
    """One decode token's matrices, [K, N] each: per layer qkv [D, QKV], o [D, D], gate/up [D, F], down [F, D]."""
    shapes = [(s["d"], s["qkv"]), (s["d"], s["d"]), (s["d"], s["f"]), (s["d"], s["f"]), (s["f"], s["d"])]
    out = []
    for layer in range(s["layers"]):
        for i, (k, n) in enumerate(shapes):
            w = jax.random.normal(jax.random.key(layer * 8 + i), (k, n), jnp.bfloat16) * 0.02
            out.append(quantize(w))
    return out


def stream_time(weights: list[Any], apply: Callable[[jax.Array, Any], jax.Array], dtype: Any = jnp.bfloat16) -> float:
    """Seconds for one jit that multiplies a [1, K] row by every matrix (the decode weight traffic)."""

    @jax.jit
    def run(ws: list[Any]) -> jax.Array:
        total = jnp.zeros((), jnp.float32)
        for w in ws:
            k = w.in_features if hasattr(w, "in_features") else w.shape[0]
            x = jnp.full((1, k), 0.01, dtype)  # [1, K]
            total += apply(x, w)[0, 0].astype(jnp.float32)  # one element keeps every product alive
        return total

    return median_time(lambda: run(weights), repeats=20)


def nbytes(tree: Any) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(tree))


def m1_kernels(s: dict[str, Any], copy_bw: float) -> dict[str, Any]:
    """The weight set at M = 1 for bf16, int8 per channel and int4 with zero points in groups of 32 / 128."""
    from pallas_kernels.quantized_matmul import quantize_weights, quantized_matmul

    formats = {"bf16": None, "int8": dict(bits=8), "int4": dict(bits=4, group_size=32, zero_point=True),
               "int4_g128": dict(bits=4, group_size=128, zero_point=True)}
    out = {}
    for name, fmt in formats.items():
        ws = weight_set(s, (lambda w: w) if fmt is None else (lambda w, f=fmt: quantize_weights(w, **f)))
        apply = (lambda x, w: x @ w) if fmt is None else (lambda x, w: quantized_matmul(x, w))
        t = stream_time(ws, apply)
        out[name] = {"weight_bytes": nbytes(ws), "time_ms": t * 1e3, "tok_s": 1 / t,
                     "pct_of_copy_bw": 100 * nbytes(ws) / t / copy_bw}
        del ws
        gc.collect()
    return out


def fp8_kernels(s: dict[str, Any], bf16_rate: float) -> dict[str, Any]:
    """fp8 W8A8 [M, K] x [K, N] against the bf16 product of the same shape and the bf16 ceiling rate."""
    from pallas_kernels.quantized_matmul import quantize_weights, quantized_matmul

    k, n = s["fp8_k"], s["fp8_n"]
    w = jax.random.normal(jax.random.key(5), (k, n), jnp.bfloat16) * 0.02
    wq = quantize_weights(w, fp8=True, w8a8=True)
    fp8, bf16 = jax.jit(lambda x, w: quantized_matmul(x, w)), jax.jit(lambda x, w: x @ w)
    out = {}
    for m in s["fp8_m"]:
        x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
        flops = 2 * m * k * n
        t_fp8, t_bf16 = median_time(lambda: fp8(x, wq)), median_time(lambda: bf16(x, w))
        out[str(m)] = {"fp8_tflops": flops / t_fp8 / 1e12, "bf16_tflops": flops / t_bf16 / 1e12,
                       "over_same_bf16": t_bf16 / t_fp8, "over_bf16_ceiling": flops / t_fp8 / bf16_rate}
    return out


def kernels(s: dict[str, Any], ceil: dict[str, Any]) -> dict[str, Any]:
    m1 = m1_kernels(s, ceil["copy_bw"])
    fp8 = fp8_kernels(s, ceil["bf16_matmul_rate"])
    return {"m1": m1, "fp8_w8a8": fp8,
            "int8_m1_pct_of_copy_bw": m1["int8"]["pct_of_copy_bw"],
            "int4_over_int8_m1_tok_s": m1["int4"]["tok_s"] / m1["int8"]["tok_s"],
            "int4g128_over_int8_m1_tok_s": m1["int4_g128"]["tok_s"] / m1["int8"]["tok_s"],
            "fp8_over_bf16_matmul_rate": min(r["over_bf16_ceiling"] for r in fp8.values())}


# ----------------------------------------------------------------------------- engine


def build(s: dict[str, Any], smoke: bool, **kwargs: Any) -> Any:
    from jaxinfer import LLM

    dtype = "float32" if smoke else "bfloat16"
    return LLM(s["model"], random_weights=True, dtype=dtype, use_tqdm=False, **s["engine"], **kwargs)


def free(llm: Any) -> None:
    """Drop an engine's device arrays before the next one is built (each holds an 8B model and a cache)."""
    del llm
    gc.collect()
    jax.clear_caches()


def decode_b1(s: dict[str, Any], smoke: bool) -> dict[str, Any]:
    from jaxinfer.bench.limits import ModelCost
    from jaxinfer.bench.measure import decode_mbu

    rows = {}
    for name in ("bf16", "int8", "int4", s["int4_wide"]):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            llm = build(s, smoke, quantization=None if name == "bf16" else name)
            cost = ModelCost.of(llm.model_config)
            r = decode_mbu(llm, cost, batch=1, ctx=s["ctx"], steps=s["steps"], copy_bw=1.0)
        rows[name] = {"step_ms": r["step_ms"], "tok_s": r["tok_s"], "weight_bytes": llm.engine_stats()["weight_bytes"],
                      "fallbacks": sorted({str(w.message) for w in caught if "reference" in str(w.message)})}
        free(llm)
    return {"by_format": rows,
            "decode_b1_int8_speedup": rows["bf16"]["step_ms"] / rows["int8"]["step_ms"],
            "decode_b1_int4_speedup": rows["bf16"]["step_ms"] / rows["int4"]["step_ms"],
            "decode_b1_int4g128_speedup": rows["bf16"]["step_ms"] / rows[s["int4_wide"]]["step_ms"]}


def offline(s: dict[str, Any], smoke: bool) -> dict[str, Any]:
    out = {}
    runs = {"offline_1000_int8w_fp8kv": (s["offline_1000"], dict(quantization="int8", kv_cache_dtype="fp8")),
            "offline_128_fp8": (s["offline_128"], dict(quantization="fp8", kv_cache_dtype="fp8"))}
    for key, ((inp, outp, n), kwargs) in runs.items():
        with warnings.catch_warnings(record=True) as caught:  # a kernel that falls back to the reference says so
            warnings.simplefilter("always")
            llm = build(s, smoke, **kwargs)
            offline_throughput(llm, fixed(inp, outp, min(n, 8)), seed=1)  # compile every bucket the run meets
            r = offline_throughput(llm, fixed(inp, outp, n))
        out[key] = {**kwargs, "num_prompts": n, "output_tok_s": r["output_tok_s"], "total_tok_s": r["total_tok_s"],
                    "elapsed_s": r["elapsed_s"], "kv_cache_bytes": llm.engine_stats()["kv_cache_bytes"],
                    "fallbacks": sorted({str(w.message) for w in caught if "reference" in str(w.message)})}
        out[f"{key}_tok_s"] = r["output_tok_s"]
        free(llm)
    return out


# ----------------------------------------------------------------------------- the run


HEADLINE = ("device", "offline_1000_int8w_fp8kv_tok_s", "offline_128_fp8_tok_s", "decode_b1_int8_speedup",
            "decode_b1_int4_speedup", "decode_b1_int4g128_speedup", "int8_m1_pct_of_copy_bw",
            "int4g128_over_int8_m1_tok_s", "int4_over_int8_m1_tok_s", "fp8_over_bf16_matmul_rate")


def run(args: argparse.Namespace) -> dict[str, Any]:
    s = sizes(args.smoke)
    result: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() and not args.fresh else {}
    result.update(device=jax.devices()[0].device_kind, smoke=args.smoke, command=args.command)

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")

    steps = {"ceilings": lambda: ceilings(s), "kernels": lambda: kernels(s, result["ceilings"]),
             "decode": lambda: decode_b1(s, args.smoke), "offline": lambda: offline(s, args.smoke)}
    for name in args.sections:
        if name == "kernels" and "ceilings" not in result:
            result["ceilings"] = ceilings(s)
        start = time.perf_counter()
        try:
            section = steps[name]()
        except Exception as e:  # noqa: BLE001 - one failing section is recorded; the others still run
            traceback.print_exc()
            section = {"error": f"{type(e).__name__}: {e}"}
        section["section_s"] = time.perf_counter() - start
        result[name] = section
        result.update({k: v for k, v in section.items() if k in HEADLINE})
        print(name, json.dumps(_brief(section)), flush=True)
        save()
    return result


def _brief(section: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in section.items() if not isinstance(v, dict)}


def main(argv: list[str] | None = None) -> int:
    import sys

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/quantized.json"))
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated: " + ", ".join(SECTIONS))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for CPU: the code path only")
    parser.add_argument("--fresh", action="store_true", help="start a new JSON instead of adding to --out")
    args = parser.parse_args(argv)
    args.sections = [x for x in args.sections.split(",") if x]
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    args.command = "python3 scripts/bench_quantized.py " + " ".join(sys.argv[1:] if argv is None else argv)
    result = run(args)
    print(json.dumps({k: result.get(k) for k in HEADLINE}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
