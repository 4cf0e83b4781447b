"""Where the time of one MoE layer goes, at the engine's step shapes, on the GPU machine.

    JAX_PLATFORMS=cuda PYTHONPATH=$PWD python3 scripts/profile_moe_block.py --out $OUT/moe_block.json
    PYTHONPATH=$PWD python3 scripts/profile_moe_block.py --smoke          # CPU: tiny shapes, reference

Qwen3-30B-A3B's MoE layer (128 experts, top-8, hidden 2048, moe_intermediate_size 768, bf16, random
weights and routing) as `jaxinfer.models.moe.moe_block`, at the token buckets the engine runs: a
decode step of B sequences is a bucket of max(16, B) tokens of which B are real (the rest padding,
routed nowhere), a prefill chunk is all real. `--layers` distinct layers run back to back in one jit
program, as in a forward pass, so the figures include the gaps between kernels.

For each case and expert implementation (`engine`: as the runner builds it, with the per-pair path for
decode steps on a GPU, its experts one fused SwiGLU kernel; `engine_topk`: with the routing kernel
(pallas_kernels.moe_routing) instead of XLA's top-k; `pairs3`: the per-pair path with three `gather_matmul`
launches instead, the engine before the fused kernel; `grouped`: our grouped matmul at every step;
`ragged_dot`: XLA's) it reports:
- `us_per_layer`: wall time of the program over the layer count (median of batches of calls);
- `device_us_per_layer`: the device kernels' summed time per layer (from a profiler trace);
- `kernels_per_layer` and the kernels by device time, so the wrapper ops beside the grouped matmul show;
- `ideal_us`: the active experts' weight bytes over the copy bandwidth measured in the same run.
Prints a table last and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench_kernels import time_fn
from jaxinfer.bench.measure import device_events
from jaxinfer.models import moe
from jaxinfer.engine.runner import gpu_pair_kernel
from pallas_kernels.grouped_matmul import grouped_matmul
from pallas_kernels.grouped_matmul import gpu_swiglu as gmm_swiglu
from pallas_kernels.moe_routing import top_k_routing

QWEN3 = dict(experts=128, top_k=8, hidden=2048, ffn=768)
SMOKE = dict(experts=8, top_k=2, hidden=128, ffn=64)
# (token bucket, real tokens): decode at batch 1 (a GPU's smallest bucket is 2 rows), 8, 64 and a 4k prefill chunk.
CASES = ((2, 1), (16, 1), (16, 8), (64, 64), (4096, 4096))
SMOKE_CASES = ((16, 1), (32, 32))


def layer_weights(key, shape, dtype):
    e, d, f = shape["experts"], shape["hidden"], shape["ffn"]
    k1, k2, k3, k4 = jax.random.split(key, 4)
    scale = lambda fan_in: 1.0 / np.sqrt(fan_in)  # noqa: E731
    return moe.MoEWeights(
        router=(jax.random.normal(k1, (d, e), jnp.float32) * scale(d)).astype(dtype),
        w_gate=(jax.random.normal(k2, (e, d, f), jnp.float32) * scale(d)).astype(dtype),
        w_up=(jax.random.normal(k3, (e, d, f), jnp.float32) * scale(d)).astype(dtype),
        w_down=(jax.random.normal(k4, (e, f, d), jnp.float32) * scale(f)).astype(dtype),
    )


def make_program(layers, top_k, real, expert_matmul, pair_kernel):
    """x [T, D] through every layer's MoE block (residual added), as one program."""
    def program(weights, x):
        valid = jnp.arange(x.shape[0]) < real  # [T]
        for w in weights:
            out, _ = moe.moe_block(x, w, top_k=top_k, norm_topk_prob=True, valid=valid,
                                   expert_matmul=expert_matmul, pair_kernel=pair_kernel)
            x = x + out
        return x
    return jax.jit(program)


def trace_kernels(fn, calls):
    """(kernel count, {name: device us}) per call of `fn`, from a profiler trace of `calls` calls."""
    def run():
        out = None
        for _ in range(calls):
            out = fn()
        return out

    _, events = device_events(run)
    per_name = {}
    for name, ms in events:
        per_name[name] = per_name.get(name, 0.0) + ms * 1e3 / calls
    return len(events) / calls, per_name


def copy_bandwidth():
    """Bytes per second of a 2 GiB device copy, device time from a trace (bench_kernels' ceiling)."""
    n = 1 << 30
    xs = [(jnp.ones((n // 8192, 8192), jnp.bfloat16) * i,) for i in range(2)]
    return 2 * n * 2 / time_fn(jax.jit(lambda a: -a), xs, repeats=3, batch=3)["device"]


def active_expert_bytes(shape, tokens, dtype):
    """Expected bytes of the experts a step of `tokens` real tokens reaches (uniform routing)."""
    e, k = shape["experts"], shape["top_k"]
    reached = e * (1 - (1 - k / e) ** tokens)
    return reached * 3 * shape["hidden"] * shape["ffn"] * jnp.dtype(dtype).itemsize


def run_case(bucket, real, impl, shape, layers, dtype, sets, bw):
    expert_matmul, pair_kernel, name = jax.lax.ragged_dot, None, impl
    impl, _, tiles = impl.partition(":")  # engine:FxKxDxSTAGES times the fused kernel at another tiling
    topk = impl == "engine_topk"  # the engine with the routing kernel instead of XLA's top-k (a sort)
    impl = "engine" if topk else impl
    fields = tiles.split("x") if tiles else []
    tiling = gmm_swiglu.SwigluTiling(*map(int, fields[:4]), *fields[4:]) if fields else None  # ...xrows: down
    if impl in ("engine", "grouped"):
        expert_matmul = functools.partial(grouped_matmul, impl="auto")
    if impl in ("engine", "pairs3") and jax.default_backend() == "gpu":  # what the runner builds on a GPU
        pair_kernel = gpu_pair_kernel(swiglu_tiling=tiling)
        if impl == "pairs3":  # three gather_matmul launches
            pair_kernel = dataclasses.replace(pair_kernel, swiglu=None)
        elif topk:
            pair_kernel = dataclasses.replace(pair_kernel, select_top_k=top_k_routing)
    program = make_program(layers, shape["top_k"], real, expert_matmul, pair_kernel)
    xs = [jax.random.normal(jax.random.key(100 + i), (bucket, shape["hidden"]), jnp.float32).astype(dtype)
          for i in range(len(sets))]
    calls = [functools.partial(program, w, x) for w, x in zip(sets, xs)]
    for call in calls:
        jax.block_until_ready(call())
    times = []
    for _ in range(5):
        start = time.perf_counter()
        out = None
        for i in range(6):
            out = calls[i % len(calls)]()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / 6)
    kernels, per_name = trace_kernels(calls[0], 3)
    device_us = sum(per_name.values()) / layers
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1])
    ideal = active_expert_bytes(shape, real, dtype) / bw * 1e6
    return dict(bucket=bucket, real=real, impl=name, layers=layers,
                us_per_layer=statistics.median(times) / layers * 1e6, device_us_per_layer=device_us,
                kernels_per_layer=kernels / layers, ideal_us=ideal,
                top=[dict(name=n[:100], us_per_layer=us / layers) for n, us in ranked[:25]])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="moe_block.json")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--impls", default="engine,engine_topk,pairs3,grouped,ragged_dot",
                        help="engine: as the runner builds it (the per-pair path for decode steps on a GPU, fused); "
                             "engine:FxKxDxSTAGES[xrows]: the fused kernel at that SwigluTiling; "
                             "engine_topk: with the routing kernel; pairs3: the per-pair path with three gather_matmul launches; "
                             "grouped: the grouped matmul at every step; ragged_dot: XLA's")
    parser.add_argument("--cases", default="", help="bucket:real pairs, comma-separated (default: the engine's)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, any backend")
    args = parser.parse_args(argv)
    shape = SMOKE if args.smoke else QWEN3
    cases = SMOKE_CASES if args.smoke else CASES
    if args.cases:
        cases = [tuple(int(v) for v in c.split(":")) for c in args.cases.split(",")]
    dtype = jnp.bfloat16
    sets = [[layer_weights(jax.random.key(10 * s + i), shape, dtype) for i in range(args.layers)]
            for s in range(2)]  # two weight sets, so the L2 does not serve the next call's experts
    bw = copy_bandwidth()
    rows = []
    for bucket, real in cases:
        for impl in args.impls.split(","):
            try:
                row = run_case(bucket, real, impl, shape, args.layers, dtype, sets, bw)
            except Exception as e:  # one failing case leaves the others' numbers
                row = dict(bucket=bucket, real=real, impl=impl, error=f"{type(e).__name__}: {e}"[:400])
            rows.append(row)
            with open(args.out, "w") as f:
                json.dump(dict(device=str(jax.devices()[0]), copy_GBps=bw / 1e9, shape=shape, rows=rows), f, indent=1)
    for row in rows:
        if "error" in row:
            continue
        print(f"\n{row['impl']} T={row['bucket']} real={row['real']}: top kernels (us per layer)")
        for t in row["top"][:15]:
            print(f"  {t['us_per_layer']:8.1f}  {t['name']}")
    print(f"\ncopy {bw / 1e9:,.0f} GB/s")
    print(f"{'case':24} {'impl':18} {'us/layer':>9} {'device us':>10} {'kernels':>8} {'ideal us':>9}")
    for row in rows:
        name = f"T={row['bucket']} real={row['real']}"
        if "error" in row:
            print(f"{name:24} {row['impl']:18} error: {row['error'][:80]}")
            continue
        print(f"{name:24} {row['impl']:18} {row['us_per_layer']:9.1f} {row['device_us_per_layer']:10.1f} "
              f"{row['kernels_per_layer']:8.1f} {row['ideal_us']:9.1f}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
