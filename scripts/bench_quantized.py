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
            each in one jit, M = 1, for bf16 / int8 (per channel; and in groups of 128 and 32) / int4 (groups of 32 with zero points, as
            quantization="int4" stores it; groups of 128; groups of 32 in plain order, pack 2): int8's % of
            copy bandwidth and int4's tokens/s
            over int8's; fp8 W8A8 against bf16 at M = 256, 1024, 4096 on
            4096 x 14336 (each against the same bf16 product and against the 8192^3 rate);
  tilings_m1, tilings_fp8   (not in the default set) the same kernels under alternative tilings, device time from a profiler
            trace: the weight-only kernel at M = 1 over K step x pipeline depth x split-K for int8 and int4,
            and fp8 W8A8 at M = 256 / 1024 / 4096 for the Pallas rows kernel's tilings and XLA's own fp8
            dot (cuBLASLt), each beside the bf16 product; the table the defaults were chosen from;
  occupancy_m1 (not in the default set) the weight-only kernel at M = 1 at small pipelines and more split-K: CTAs
            per SM against latency;
  zeros     (not in the default set) int4 with zero points at M = 1, one layer: the zero points added by the
            wrapper against inside the kernel (gpu.ZEROS_IN_KERNEL, on since this measured it);
  m_scale   (not in the default set) int8 / int4 weight-only from 16 rows to 8,192: the Pallas kernel against
            dequantize-then-dot and the bf16 dot (where quantized_matmul switches to dequantize + dot);
  xla_paths (not in the default set) one joined layer (qkv, o, gate/up, down) from 1 row to 2,048: the Pallas
            weight-only kernel against XLA's dot taking the quantized codes (widened in the dot's fusion) and
            W8A8 int8 / fp8 dots, beside the bf16 dot; device time and the kernels XLA chose;
  xla_m1    (not in the default set) the same layer at 1-16 rows: the kernel against XLA's dot with the rows padded
            to 8 or 16 and the product written as an elementwise multiply and a reduction over K (int8, int4 in
            groups of 128 and 32, fp8);
  decode    engine decode at batch 1 (ctx 512, 128 steps) for bf16, int8, int4 (groups of 32), int4 in chunk
            halves (int4_halves: the storage order plain order replaced on GPUs), int4 with its zero points
            added by the wrapper instead of inside the kernel (int4_zeros_outside), int8 with its activation
            rows unpadded (int8_unpadded, gpu.UNPADDED_ROWS), int8 through the Pallas kernel rather than XLA's dot
            (int8_kernel, gpu.XLA_PER_CHANNEL_8BIT off), int4:128 weights, and bf16 with the request
            streamed (bf16_streamed: single steps): step time end to end and the speedup over bf16, then the
            device's time for a single step and for one iteration of the multi-step loop, with the single
            step's costliest kernels;
  offline   1000/1000 (512 prompts) with int8 weights + fp8 KV, and 128/128 (2048 prompts) with fp8 weights
            (+ fp8 KV): output tok/s, and any kernel that fell back to the jnp reference (`fallbacks`); beside
            them the same workloads in bf16 and with bf16 KV. `--only` picks runs (decode formats, offline keys).
Every engine run (decode formats, offline runs) is a process of its own (`in_child`).
Acceptance (issue 15): decode_b1_int8_speedup >= 1.8, decode_b1_int4_speedup >= 2.8,
offline_1000_int8w_fp8kv_tok_s >= 16000, offline_128_fp8_tok_s >= 30000, int8_m1_pct_of_copy_bw >= 80,
int4_over_int8_m1_tok_s >= 1.6, fp8_over_bf16_matmul_rate >= 1.6.

`--smoke` runs every section on CPU with a tiny model and tiny shapes (the code path, not the numbers).
"""

from __future__ import annotations

import argparse
import functools
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

SECTIONS = ("ceilings", "kernels", "tilings_m1", "tilings_fp8", "occupancy_m1", "zeros", "m_scale", "xla_paths",
            "xla_m1", "decode", "offline")


def sizes(smoke: bool) -> dict[str, Any]:
    """Every size the sections use: the real ones, or tiny ones for --smoke on CPU."""
    if smoke:
        return dict(model="smollm2-135m", int4_wide="int4:64", layers=2, d=256, qkv=384, f=512, fp8_k=256, fp8_n=512, fp8_m=(256,), scale_m=(8, 64), xla_m=(1, 64), xla_m1=(1, 8),
                    bw_gib=0.05, matmul_n=256, ctx=32, steps=8, offline_1000=(32, 32, 4), offline_128=(16, 16, 4),
                    engine=dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=128, num_pages=64,
                                warmup=False))  # CPU: compile only the buckets used
    return dict(model="llama-3-8b", int4_wide="int4:128", layers=32, d=4096, qkv=6144, f=14336, fp8_k=4096, fp8_n=14336,
                fp8_m=(256, 1024, 4096), scale_m=(16, 64, 128, 256, 512, 2048, 8192),
                xla_m=(1, 8, 32, 64, 128, 256, 512, 2048), xla_m1=(2, 4, 8, 16), bw_gib=4.0, matmul_n=8192, ctx=512, steps=128,
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


# The weight-only formats the sweeps time: int8 per channel, int4 in groups of 32 with zero points in chunk-halves
# order (what quantization="int4" stored on a GPU before plain order, and stores on a CPU or TPU) and int4 in
# groups of 128. The kernels section adds int4 in plain order (pack 2, what a GPU stores now).
WEIGHT_ONLY_FORMATS = {"int8": dict(bits=8), "int4": dict(bits=4, group_size=32, zero_point=True),
                       "int4_g128": dict(bits=4, group_size=128, zero_point=True)}


def layer_shapes(s: dict[str, Any]) -> list[tuple[int, int]]:
    """One layer's matrices as [K, N]: qkv [D, QKV], o [D, D], gate and up [D, F], down [F, D]."""
    return [(s["d"], s["qkv"]), (s["d"], s["d"]), (s["d"], s["f"]), (s["d"], s["f"]), (s["f"], s["d"])]


def weight_set(s: dict[str, Any], quantize: Callable[[jax.Array], Any]) -> list[Any]:
    """One decode token's matrices, [K, N] each: per layer qkv [D, QKV], o [D, D], gate/up [D, F], down [F, D]."""
    shapes = layer_shapes(s)
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
    """The weight set at M = 1 for bf16, int8 per channel (on XLA's dot, and on the Pallas kernel) / in groups of 128
    and 32, and int4 with zero points in groups of 32 / 128 (and in groups of 32 in plain order)."""
    from pallas_kernels.quantized_matmul import gpu, quantize_weights, quantized_matmul

    formats = {"bf16": None, **WEIGHT_ONLY_FORMATS, "int8_kernel": dict(bits=8), "int8_g128": dict(bits=8, group_size=128),
               "int8_g32": dict(bits=8, group_size=32),
               "int4_natural": dict(bits=4, group_size=32, zero_point=True, pack=2)}
    out = {}
    for name, fmt in formats.items():
        ws = weight_set(s, (lambda w: w) if fmt is None else (lambda w, f=fmt: quantize_weights(w, **f)))
        apply = (lambda x, w: x @ w) if fmt is None else (lambda x, w: quantized_matmul(x, w))
        # int8_kernel: per-channel int8 on the Pallas kernel, which XLA's dot replaced (gpu.XLA_PER_CHANNEL_8BIT);
        # the switch is read when the stream is traced, inside stream_time.
        gpu.XLA_PER_CHANNEL_8BIT = name != "int8_kernel"
        try:
            t = stream_time(ws, apply)
        finally:
            gpu.XLA_PER_CHANNEL_8BIT = True
        out[name] = {"weight_bytes": nbytes(ws), "time_ms": t * 1e3, "tok_s": 1 / t,
                     "pct_of_copy_bw": 100 * nbytes(ws) / t / copy_bw}
        del ws
        gc.collect()
    return out


def fp8_kernels(s: dict[str, Any], bf16_rate: float) -> dict[str, Any]:
    """fp8 W8A8 [M, K] x [K, N] against the bf16 product of the same shape and the bf16 ceiling rate, in device
    time (at M = 256 a product takes tens of microseconds, the order of a host dispatch)."""
    from pallas_kernels.quantized_matmul import quantize_weights, quantized_matmul

    k, n = s["fp8_k"], s["fp8_n"]
    ws = [jax.random.normal(jax.random.key(5 + i), (k, n), jnp.bfloat16) * 0.02 for i in range(3)]
    wqs = [quantize_weights(w, fp8=True, w8a8=True) for w in ws]
    fp8, bf16 = jax.jit(lambda x, w: quantized_matmul(x, w)), jax.jit(lambda x, w: x @ w)
    out = {}
    for m in s["fp8_m"]:
        xs = [jax.random.normal(jax.random.key(m + i), (m, k), jnp.bfloat16) for i in range(3)]
        flops = 2 * m * k * n
        t_fp8, t_bf16 = _device_seconds(fp8, list(zip(xs, wqs))), _device_seconds(bf16, list(zip(xs, ws)))
        out[str(m)] = {"fp8_tflops": flops / t_fp8 / 1e12, "bf16_tflops": flops / t_bf16 / 1e12,
                       "over_same_bf16": t_bf16 / t_fp8, "over_bf16_ceiling": flops / t_fp8 / bf16_rate}
    return out


def kernels(s: dict[str, Any], ceil: dict[str, Any]) -> dict[str, Any]:
    m1 = m1_kernels(s, ceil["copy_bw"])
    fp8 = fp8_kernels(s, ceil["bf16_matmul_rate"])
    return {"m1": m1, "fp8_w8a8": fp8,
            "int8_m1_pct_of_copy_bw": m1["int8"]["pct_of_copy_bw"],
            # int4 as a GPU stores it (plain order, groups of 32); the chunk-halves rows are what a CPU / TPU stores
            "int4_over_int8_m1_tok_s": m1["int4_natural"]["tok_s"] / m1["int8"]["tok_s"],
            "int4_halves_over_int8_m1_tok_s": m1["int4"]["tok_s"] / m1["int8"]["tok_s"],
            "int4g128_over_int8_m1_tok_s": m1["int4_g128"]["tok_s"] / m1["int8"]["tok_s"],
            "fp8_over_bf16_matmul_rate": min(r["over_bf16_ceiling"] for r in fp8.values())}


# ----------------------------------------------------------------------------- tilings


def _device_seconds(fn: Callable[..., Any], arg_sets: list[tuple]) -> float:
    """Device seconds per call (profiler trace; bench_kernels.time_fn), so short kernels are not host dispatch."""
    from bench_kernels import time_fn  # scripts/ is the script's own directory, first on sys.path

    return time_fn(fn, arg_sets)["device"]


def _m1_tilings(s: dict[str, Any], copy_bw: float) -> list[dict[str, Any]]:
    """The weight-only kernel at M = 1 over the shapes of one layer (qkv, o, gate, up, down; several sets so L2
    serves nothing) for each format x K step x stages x split-K factor; XLA's dequantize-then-dot beside them."""
    int8 = [dict(tile_k=tk, stages=st, split_factor=f) for tk in (256, 512, 1024) for st in (4, 8) for f in (0.5, 1, 2)]
    int4 = [dict(tile_k=tk, stages=st, split_factor=f)
            for tk, st in ((512, 4), (1024, 4), (1024, 8), (2048, 4)) for f in (0.5, 1)]
    return _layer_sweep(s, copy_bw, {name: int8 if name == "int8" else int4 for name in WEIGHT_ONLY_FORMATS})


def _m1_occupancy(s: dict[str, Any], copy_bw: float) -> list[dict[str, Any]]:
    """The weight-only kernel at M = 1 over one layer's shapes at small pipelines (2-3 stages, narrower K steps:
    less shared memory per CTA, so more CTAs and warps per SM) and doubled split-K (more, shorter CTAs): is it
    bound by the latency one 4-warp CTA cannot hide? (The table gpu's M <= 8 tiling was chosen from.)"""
    int8 = [dict(tile_k=tk, stages=st, split_factor=f) for tk in (128, 256) for st in (2, 3, 4) for f in (1, 2)]
    int4 = [dict(tile_k=tk, stages=st, split_factor=f) for tk in (256, 512) for st in (2, 3, 4) for f in (1, 2)]
    return _layer_sweep(s, copy_bw, {name: int8 if name == "int8" else int4 for name in WEIGHT_ONLY_FORMATS})


# Formats with grouped zero points, for the zeros section: plain-order int4 (what a GPU stores) in groups of 32 and
# 128, chunk-halves int4 in groups of 32 (what a CPU or TPU stores).
ZERO_POINT_FORMATS = {"int4_plain": dict(bits=4, group_size=32, zero_point=True, pack=2),
                      "int4_plain_g128": dict(bits=4, group_size=128, zero_point=True, pack=2),
                      "int4_halves": dict(bits=4, group_size=32, zero_point=True)}


def _zeros(s: dict[str, Any], copy_bw: float) -> list[dict[str, Any]]:
    """One layer's five products at M = 1, zero points added by the wrapper (xsum @ zeros) against inside the
    kernel (gpu.ZEROS_IN_KERNEL): the measurement behind that default."""
    grid = [dict(zeros_in_kernel=False), dict(zeros_in_kernel=True)]
    return _layer_sweep(s, copy_bw, dict.fromkeys(ZERO_POINT_FORMATS, grid), ZERO_POINT_FORMATS)


def _layer_sweep(s: dict[str, Any], copy_bw: float, grid: dict[str, list[dict[str, Any]]],
                 formats: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Device time of one layer's five shapes for each format (`formats`, default WEIGHT_ONLY_FORMATS) and each
    set of gpu.quantized_matmul overrides in `grid` (split_factor scales the default split-K count), then XLA's
    dequantize-then-dot."""
    from pallas_kernels.quantized_matmul import dequantize_weights, gpu, quantize_weights

    shapes = layer_shapes(s)
    rows = []
    for name, overrides in grid.items():
        fmt = (formats or WEIGHT_ONLY_FORMATS)[name]
        sets = [[quantize_weights(jax.random.normal(jax.random.key(17 * r + i), (k, n), jnp.bfloat16) * 0.02, **fmt)
                 for i, (k, n) in enumerate(shapes)] for r in range(3)]
        weight_bytes = nbytes(sets[0])
        x = {k: jnp.full((1, k), 0.01, jnp.bfloat16) for k, _ in shapes}

        def layer(ws, kw):
            kw = dict(kw)
            factor = kw.pop("split_factor", None)
            return [gpu.quantized_matmul(x[w.in_features], w, **kw, k_splits=None if factor is None else
                                         _splits(w, kw.get("tile_k"), kw.get("stages"), factor)) for w in ws]

        for kw in overrides:
            label = dict(format=name, **kw)
            fn = jax.jit(lambda ws, kw=tuple(sorted(kw.items())): layer(ws, kw))
            try:
                t = _device_seconds(fn, [(ws,) for ws in sets])
                rows.append({**label, "us": t * 1e6, "pct_of_copy_bw": 100 * weight_bytes / t / copy_bw})
            except Exception as e:  # noqa: BLE001 - a tiling that does not lower is a row, not the end
                rows.append({**label, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            print(json.dumps(rows[-1]), flush=True)
        xla = jax.jit(lambda ws: [(x[w.in_features] @ dequantize_weights(w).astype(jnp.bfloat16)) for w in ws])
        t = _device_seconds(xla, [(ws,) for ws in sets])
        rows.append(dict(format=name, tiling="XLA dequantize + dot", us=t * 1e6,
                         pct_of_copy_bw=100 * weight_bytes / t / copy_bw))
        print(json.dumps(rows[-1]), flush=True)
        del sets
        gc.collect()
    return rows


def _splits(w: Any, tile_k: int | None, stages: int | None, factor: float) -> int | None:
    """The default split-K count of `w` at this K step, times `factor`; None (the default) where that does not
    divide the K steps."""
    from pallas_kernels.quantized_matmul import gpu

    k_steps = w.padded_in_features // gpu.plan(w, 1, tile_k, stages).tile_k
    splits = int(gpu.default_k_splits(w.out_features // 64, k_steps, gpu._SM_COVERS_DECODE) * factor)
    return splits if splits >= 1 and k_steps % splits == 0 else None


def _fp8_tilings(s: dict[str, Any], bf16_rate: float) -> list[dict[str, Any]]:
    """fp8 W8A8 [M, K] x [K, N]: the Pallas rows kernel's tilings and XLA's fp8 dot (both with the per-row
    activation quantization), beside XLA's bf16 product; device time, TFLOP/s and the ratio to the bf16 rate."""
    from pallas_kernels.quantized_matmul import gpu_fp8, quantize_rows, quantize_weights

    k, n = s["fp8_k"], s["fp8_n"]
    ws = [jax.random.normal(jax.random.key(5 + i), (k, n), jnp.bfloat16) * 0.02 for i in range(3)]
    wqs = [quantize_weights(w, fp8=True, w8a8=True) for w in ws]
    tilings = {f"pallas rows n{tn} k{tk} s{st}": gpu_fp8.RowsTiling(tn, tk, st)
               for tn in (128, 256) for tk in (64, 128) for st in (3, 4, 5)
               if gpu_fp8.rows_smem_bytes(gpu_fp8.RowsTiling(tn, tk, st)) <= gpu_fp8._SMEM_BUDGET}

    def pallas(x, wq, tiling):
        xq, sx = quantize_rows(x)
        return gpu_fp8._run_rows(xq, wq.values, sx, wq.scales[0].astype(jnp.float32), x.dtype, False, tiling)

    def xla_fp8(x, wq):
        xq, sx = quantize_rows(x)
        y = jax.lax.dot_general(xq, wq.values, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return (y * sx[:, None] * wq.scales[0].astype(jnp.float32)[None, :]).astype(x.dtype)  # [M, N]

    rows = []
    for m in s["fp8_m"]:
        xs = [jax.random.normal(jax.random.key(m + i), (m, k), jnp.bfloat16) for i in range(3)]
        flops = 2 * m * k * n
        cands = {"XLA bf16 dot": (jax.jit(lambda x, w: x @ w), list(zip(xs, ws))),
                 "XLA fp8 dot (cuBLASLt)": (jax.jit(xla_fp8), list(zip(xs, wqs)))}
        cands.update({name: (jax.jit(functools.partial(pallas, tiling=t)), list(zip(xs, wqs)))
                      for name, t in tilings.items()})
        for name, (fn, args) in cands.items():
            try:
                t = _device_seconds(fn, args)
                rows.append(dict(m=m, kernel=name, us=t * 1e6, tflops=flops / t / 1e12,
                                 over_bf16_rate=flops / t / bf16_rate))
            except Exception as e:  # noqa: BLE001 - a tiling that does not lower is a row, not the end
                rows.append(dict(m=m, kernel=name, error=f"{type(e).__name__}: {str(e)[:200]}"))
            print(json.dumps(rows[-1]), flush=True)
    return rows




def _m_scale(s: dict[str, Any], bf16_rate: float) -> list[dict[str, Any]]:
    """Weight-only formats over M (decode rows to prefill chunks) on one layer's shapes: the Pallas kernel, the
    weights dequantized to bf16 by XLA then XLA's dot, and the bf16 weights' dot; device time. Where the
    kernel's time crosses the dequantize + dot line is the M from which quantized_matmul takes the latter."""
    from pallas_kernels.quantized_matmul import dequantize_weights, gpu, quantize_weights

    shapes = layer_shapes(s)
    formats = WEIGHT_ONLY_FORMATS
    floats = [[jax.random.normal(jax.random.key(31 * r + i), (k, n), jnp.bfloat16) * 0.02
               for i, (k, n) in enumerate(shapes)] for r in range(2)]
    quantized = {name: [[quantize_weights(w, **fmt) for w in ws] for ws in floats] for name, fmt in formats.items()}
    flops_per_row = 2 * sum(k * n for k, n in shapes)
    paths = {"bf16 dot": lambda xs, ws: [x @ w for x, w in zip(xs, ws)],
             "pallas": lambda xs, ws: [gpu.quantized_matmul(x, w) for x, w in zip(xs, ws)],
             "dequantize + dot": lambda xs, ws: [x @ dequantize_weights(w).astype(x.dtype) for x, w in zip(xs, ws)]}
    rows = []
    for m in s["scale_m"]:
        xs = [[jax.random.normal(jax.random.key(m + r), (m, k), jnp.bfloat16) for k, _ in shapes] for r in range(2)]
        runs = [("bf16", "bf16 dot", floats)] + [(f, p, quantized[f]) for f in formats for p in ("pallas", "dequantize + dot")]
        for fmt, path, weights in runs:
            try:
                t = _device_seconds(jax.jit(paths[path]), list(zip(xs, weights)))
                rows.append(dict(m=m, format=fmt, path=path, us=t * 1e6,
                                 over_bf16_rate=m * flops_per_row / t / bf16_rate))
            except Exception as e:  # noqa: BLE001 - one failing cell is a row, not the end
                rows.append(dict(m=m, format=fmt, path=path, error=f"{type(e).__name__}: {str(e)[:200]}"))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def joined_layer_shapes(s: dict[str, Any]) -> list[tuple[int, int]]:
    """One layer's products as the engine runs them since q/k/v and gate/up are joined: [K, N] each."""
    return [(s["d"], s["qkv"]), (s["d"], s["d"]), (s["d"], 2 * s["f"]), (s["f"], s["d"])]


def _xla_products() -> dict[str, tuple[dict[str, Any] | None, Callable[[jax.Array, Any], jax.Array]]]:
    """Each path of xla_paths / xla_m1: (quantize_weights' arguments, or None for the bf16 weights;
    x [M, K] @ w -> [M, N])."""
    from pallas_kernels.quantized_matmul import gpu, quantize_rows

    def codes(wq, dtype=jnp.bfloat16):  # [N, Kp]: int8 / e4m3 codes, or plain-order int4 (two a byte, low first)
        v = wq.values
        if wq.bits == 4:
            v = jax.lax.bitcast_convert_type(v, jnp.int4).reshape(wq.out_features, wq.padded_in_features)
        return v.astype(dtype)

    def nt_dot(x, w, **kw):  # x [M, K] . w [N, K] -> [M, N]
        return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), **kw)

    def convert_dot(x, wq):  # per channel: the codes widened inside the dot's fusion, the scale on the output
        return (nt_dot(x, codes(wq), preferred_element_type=jnp.float32) * wq.scales[0][None, :]).astype(x.dtype)

    def padded(product, rows):  # the same with the activation rows padded to `rows` (XLA tiles M = 1 differently)
        def run(x, wq):
            return product(jnp.pad(x, ((0, rows - x.shape[0]), (0, 0))), wq)[:x.shape[0]]
        return run

    def dequantized(wq):  # [N, G, g] codes x scale (+ zero point) per group, in bf16
        w = codes(wq).reshape(wq.out_features, wq.num_groups, wq.group_size)
        w = w * wq.scales.T.astype(jnp.bfloat16)[:, :, None]
        if wq.zeros is not None:
            w = w + wq.zeros.T.astype(jnp.bfloat16)[:, :, None]
        return w

    def grouped_dot(x, wq):  # groups: dequantized before the dot
        w = dequantized(wq).reshape(wq.out_features, wq.padded_in_features)  # [N, G, g] -> [N, Kp]
        return nt_dot(x, w).astype(x.dtype)

    def reduce_rows(x, wq):  # M rows as an elementwise product and a reduction over K (XLA's reduction emitter)
        w = dequantized(wq).astype(jnp.float32).reshape(wq.out_features, wq.padded_in_features)  # [N, Kp]
        y = (x.astype(jnp.float32)[:, None, :] * w[None]).sum(-1)  # [M, N, Kp] -> [M, N]
        return y.astype(x.dtype)

    def int8_w8a8(x, wq):  # x quantized per row to int8, int8 x int8 -> int32 (IMMA), both scales on the output
        sx = jnp.maximum(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1), 1e-12) / 127  # [M]
        xq = jnp.round(x.astype(jnp.float32) / sx[:, None]).astype(jnp.int8)
        y = nt_dot(xq, wq.values, preferred_element_type=jnp.int32).astype(jnp.float32)
        return (y * sx[:, None] * wq.scales[0][None, :]).astype(x.dtype)

    def fp8_w8a8(x, wq):
        xq, sx = quantize_rows(x)
        y = nt_dot(xq, wq.values, preferred_element_type=jnp.float32)
        return (y * sx[:, None] * wq.scales[0].astype(jnp.float32)[None, :]).astype(x.dtype)

    int8, fp8 = dict(bits=8), dict(fp8=True)
    g128, g32 = dict(bits=4, group_size=128, zero_point=True, pack=2), dict(bits=4, group_size=32, zero_point=True, pack=2)
    return {"bf16 dot": (None, lambda x, w: x @ w),
            "int8 pallas": (int8, gpu.quantized_matmul),
            "int8 convert+dot": (int8, convert_dot),
            "int8 convert+dot pad8": (int8, padded(convert_dot, 8)),
            "int8 convert+dot pad16": (int8, padded(convert_dot, 16)),
            "int8 reduce": (int8, reduce_rows),
            "int8 w8a8 dot": (int8, int8_w8a8),
            "int4 g128 pallas": (g128, gpu.quantized_matmul),
            "int4 g128 convert+dot": (g128, grouped_dot),
            "int4 g128 reduce": (g128, reduce_rows),
            "int4 g32 pallas": (g32, gpu.quantized_matmul),
            "int4 g32 reduce": (g32, reduce_rows),
            "fp8 convert+dot": (fp8, convert_dot),
            "fp8 convert+dot pad8": (fp8, padded(convert_dot, 8)),
            "fp8 reduce": (fp8, reduce_rows),
            "fp8 w8a8 dot": (dict(fp8=True, w8a8=True), fp8_w8a8)}


# Which paths each sweep times: xla_paths over M (decode batches to prefill chunks), xla_m1 the decode rows.
XLA_PATHS_MANY_M = ("bf16 dot", "int8 pallas", "int8 convert+dot", "int8 w8a8 dot", "int4 g128 pallas",
                    "int4 g128 convert+dot", "fp8 convert+dot", "fp8 w8a8 dot")
XLA_PATHS_FEW_M = ("bf16 dot", "int8 pallas", "int8 convert+dot", "int8 convert+dot pad8", "int8 convert+dot pad16",
                   "int8 reduce", "int8 w8a8 dot", "int4 g128 pallas", "int4 g128 reduce", "int4 g32 pallas",
                   "int4 g32 reduce", "fp8 convert+dot", "fp8 convert+dot pad8", "fp8 reduce")


def _xla_paths(s: dict[str, Any], copy_bw: float, bf16_rate: float, names: tuple[str, ...],
               ms: tuple[int, ...]) -> list[dict[str, Any]]:
    """One joined layer's four products (qkv, o, gate/up, down) from one row to prefill chunks, device time, for the
    Pallas weight-only kernel against letting XLA's own dot take the quantized weights: the codes widened inside the
    dot's fusion (per-channel scale on the output; grouped scales and zero points before the dot), int8 and fp8
    activations quantized per row (IMMA / fp8 tensor cores). Which path XLA compiled shows in each row's kernels."""
    from jaxinfer.bench.measure import device_spans
    from pallas_kernels.quantized_matmul import quantize_weights

    shapes = joined_layer_shapes(s)
    floats = [[jax.random.normal(jax.random.key(41 * r + i), (k, n), jnp.bfloat16) * 0.02
               for i, (k, n) in enumerate(shapes)] for r in range(2)]
    paths = {name: path for name, path in _xla_products().items() if name in names}
    weights = {}
    for name, (fmt, _) in paths.items():
        weights[name] = floats if fmt is None else [[quantize_weights(w, **fmt) for w in ws] for ws in floats]
    flops_per_row = 2 * sum(k * n for k, n in shapes)
    rows = []
    for m in ms:
        xs = [[jax.random.normal(jax.random.key(m + r), (m, k), jnp.bfloat16) for k, _ in shapes] for r in range(2)]
        for name, (_, product) in paths.items():
            fn = jax.jit(lambda xs_, ws_, product=product: [product(x, w) for x, w in zip(xs_, ws_)])
            args = list(zip(xs, weights[name]))
            try:
                t = _device_seconds(fn, args)
                _, spans = device_spans(lambda: fn(*args[0]))
                top = sorted(spans.items(), key=lambda kv: -kv[1])[:4]
                wbytes = nbytes(weights[name][0])
                rows.append(dict(m=m, path=name, us=t * 1e6, weight_gbps=wbytes / t / 1e9,
                                 pct_copy_bw=100 * wbytes / t / copy_bw, over_bf16_rate=m * flops_per_row / t / bf16_rate,
                                 kernels=[[k, round(v * 1e3, 1)] for k, v in top]))
            except Exception as e:  # noqa: BLE001 - one failing cell is a row, not the end
                rows.append(dict(m=m, path=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
            print(json.dumps(rows[-1]), flush=True)
    return rows


# ----------------------------------------------------------------------------- engine


def build(s: dict[str, Any], smoke: bool, **kwargs: Any) -> Any:
    from jaxinfer import LLM

    dtype = "float32" if smoke else "bfloat16"
    llm = LLM(s["model"], random_weights=True, dtype=dtype, use_tqdm=False, **{**s["engine"], **kwargs})
    llm.wait_for_background_compile()  # steady-state speed: every build warmup compiles, in place
    return llm


def in_child(section: str, name: str, smoke: bool) -> dict[str, Any]:
    """`--child SECTION:NAME` in a process of its own; its last stdout line is the JSON row. Why a process each:
    an 8B engine and its cache leave the next engine no memory, and dropping them inside one process did not
    give it back (the 11-24 decode section failed that way)."""
    import subprocess
    import sys

    cmd = [sys.executable, __file__, "--child", f"{section}:{name}"] + (["--smoke"] if smoke else [])
    done = subprocess.run(cmd, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    row = json.loads(lines[-1]) if done.returncode == 0 and lines else {
        "error": f"exit {done.returncode}: {done.stderr[-1500:]}"}
    print(section, name, json.dumps(row), flush=True)
    return row


def _fallbacks(caught: list[warnings.WarningMessage]) -> list[str]:
    """The kernels that ran on the jnp reference instead (each says so in a warning)."""
    return sorted({str(w.message) for w in caught if "reference" in str(w.message)})


# Decode formats beside the plain methods: int4 in groups of 32 stored in chunk halves (pack 64), what a GPU stored
# before plain order; int4 with its zero points added by the wrapper (gpu.ZEROS_IN_KERNEL off); bf16 with its
# request streamed, which a GPU decodes in single steps at batch 1 (the other rows time requests that return when
# finished, as generate's do, and run multi-step calls).
HALVES_INT4 = "int4_halves"
ZEROS_OUTSIDE_INT4 = "int4_zeros_outside"
UNPADDED_INT8 = "int8_unpadded"  # int8 with the activation rows handed to the kernel unpadded (gpu.UNPADDED_ROWS on)
KERNEL_INT8 = "int8_kernel"  # int8 through the Pallas kernel instead of XLA's dot (gpu.XLA_PER_CHANNEL_8BIT off)
BF16_STREAMED = "bf16_streamed"
GPU_KERNEL_SWITCHES = {ZEROS_OUTSIDE_INT4: ("ZEROS_IN_KERNEL", False), UNPADDED_INT8: ("UNPADDED_ROWS", True),
                       KERNEL_INT8: ("XLA_PER_CHANNEL_8BIT", False)}


def decode_one(s: dict[str, Any], smoke: bool, name: str) -> dict[str, Any]:
    """Engine decode at batch 1 for one weight format: end to end, then the device's time for the engine's
    single step and for one iteration of its multi-step call (the host taken out), with the single step's
    costliest kernels."""
    from jaxinfer.bench.limits import ModelCost
    from jaxinfer.bench.measure import decode_device_profile, decode_mbu

    quantization = {"bf16": None, BF16_STREAMED: None, HALVES_INT4: "int4", ZEROS_OUTSIDE_INT4: "int4",
                    UNPADDED_INT8: "int8", KERNEL_INT8: "int8"}.get(name, name)
    if name == HALVES_INT4:
        from profile_decode_buckets import force_int4_pack

        force_int4_pack(2 * 32)
    if name in GPU_KERNEL_SWITCHES:
        from pallas_kernels.quantized_matmul import gpu

        setattr(gpu, *GPU_KERNEL_SWITCHES[name])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # warmup=False compiles only the programs batch-1 decode meets, lazily: a first pass compiles them (its
        # time is not the step's), the second is timed.
        llm = build(s, smoke, quantization=quantization, warmup=False)
        cost = ModelCost.of(llm.model_config)
        for _ in range(2):
            r = decode_mbu(llm, cost, batch=1, ctx=s["ctx"], steps=s["steps"], copy_bw=1.0,
                           streamed=name == BF16_STREAMED)
        device = decode_device_profile(llm, cost, batch=1, ctx=s["ctx"], copy_bw=1.0)
    return {"step_ms": r["step_ms"], "tok_s": r["tok_s"], "weight_bytes": llm.engine_stats()["weight_bytes"],
            "device_single_step_ms": device["single_step_ms"],
            "device_multi_step_ms_per_iteration": device["multi_step_ms_per_iteration"],
            "single_step_kernels": device["kernels"], "fallbacks": _fallbacks(caught)}


def decode_b1(s: dict[str, Any], smoke: bool, only: set[str] | None) -> dict[str, Any]:
    names = [n for n in ("bf16", BF16_STREAMED, "int8", KERNEL_INT8, UNPADDED_INT8, "int4", HALVES_INT4, ZEROS_OUTSIDE_INT4,
                         s["int4_wide"]) if not only or n in only]
    rows = {name: in_child("decode", name, smoke) for name in names}
    ok = {k: v for k, v in rows.items() if "step_ms" in v}
    speedup = lambda k: ok["bf16"]["step_ms"] / ok[k]["step_ms"] if "bf16" in ok and k in ok else None
    for name in ok.keys() - {"bf16"}:  # each row keeps its own baseline, so rows merged from other runs read right
        rows[name]["bf16_step_ms_same_run"] = ok.get("bf16", {}).get("step_ms")
        rows[name]["speedup_over_bf16"] = speedup(name)
    return {"by_format": rows, "decode_b1_int8_speedup": speedup("int8"), "decode_b1_int4_speedup": speedup("int4"),
            "decode_b1_int4g128_speedup": speedup(s["int4_wide"]), "decode_b1_int4_halves_speedup": speedup(HALVES_INT4),
            "decode_b1_int4_zeros_outside_speedup": speedup(ZEROS_OUTSIDE_INT4),
            "decode_b1_int8_unpadded_speedup": speedup(UNPADDED_INT8),
            "decode_b1_int8_kernel_speedup": speedup(KERNEL_INT8),
            "decode_b1_bf16_streamed_speedup": speedup(BF16_STREAMED)}


def offline_runs(s: dict[str, Any]) -> dict[str, tuple[tuple[int, int, int], dict[str, str]]]:
    """The acceptance's two runs (`offline_1000_int8w_fp8kv`, `offline_128_fp8`) and, to read them by, the same
    workloads in bf16 and with the weights quantized but the KV cache in bf16."""
    big, small = s["offline_1000"], s["offline_128"]
    return {"offline_1000_bf16": (big, {}), "offline_1000_int8w": (big, dict(quantization="int8")),
            "offline_1000_int8w_fp8kv": (big, dict(quantization="int8", kv_cache_dtype="fp8")),
            "offline_128_bf16": (small, {}), "offline_128_fp8w": (small, dict(quantization="fp8")),
            "offline_128_fp8": (small, dict(quantization="fp8", kv_cache_dtype="fp8"))}


def offline_one(s: dict[str, Any], smoke: bool, key: str) -> dict[str, Any]:
    (inp, outp, n), kwargs = offline_runs(s)[key]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = build(s, smoke, **kwargs)
        offline_throughput(llm, fixed(inp, outp, min(n, 8)), seed=1)  # compile every bucket the run meets
        r = offline_throughput(llm, fixed(inp, outp, n))
    return {**kwargs, "num_prompts": n, "output_tok_s": r["output_tok_s"], "total_tok_s": r["total_tok_s"],
            "elapsed_s": r["elapsed_s"], "kv_cache_bytes": llm.engine_stats()["kv_cache_bytes"],
            "fallbacks": _fallbacks(caught)}


def offline(s: dict[str, Any], smoke: bool, only: set[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in [k for k in offline_runs(s) if not only or k in only]:
        out[key] = in_child("offline", key, smoke)
        out[f"{key}_tok_s"] = out[key].get("output_tok_s")
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
             "tilings_m1": lambda: {"rows": _m1_tilings(s, result["ceilings"]["copy_bw"])},
             "occupancy_m1": lambda: {"rows": _m1_occupancy(s, result["ceilings"]["copy_bw"])},
             "zeros": lambda: {"rows": _zeros(s, result["ceilings"]["copy_bw"])},
             "m_scale": lambda: {"rows": _m_scale(s, result["ceilings"]["bf16_matmul_rate"])},
             "xla_paths": lambda: {"rows": _xla_paths(s, result["ceilings"]["copy_bw"], result["ceilings"]["bf16_matmul_rate"],
                                                      XLA_PATHS_MANY_M, s["xla_m"])},
             "xla_m1": lambda: {"rows": _xla_paths(s, result["ceilings"]["copy_bw"], result["ceilings"]["bf16_matmul_rate"],
                                                   XLA_PATHS_FEW_M, s["xla_m1"])},
             "tilings_fp8": lambda: {"rows": _fp8_tilings(s, result["ceilings"]["bf16_matmul_rate"])},
             "decode": lambda: decode_b1(s, args.smoke, args.only), "offline": lambda: offline(s, args.smoke, args.only)}
    for name in args.sections:
        if name in ("kernels", "tilings_m1", "tilings_fp8", "occupancy_m1", "zeros", "m_scale", "xla_paths", "xla_m1") and "ceilings" not in result:
            result["ceilings"] = ceilings(s)
        start = time.perf_counter()
        try:
            section = steps[name]()
        except Exception as e:  # noqa: BLE001 - one failing section is recorded; the others still run
            traceback.print_exc()
            section = {"error": f"{type(e).__name__}: {e}"}
        section["section_s"] = time.perf_counter() - start
        # --only runs add to what the file holds: a format or run measured before keeps its row and figures.
        result[name] = merge_section(result.get(name), section) if args.only else section
        result.update({k: v for k, v in section.items() if k in HEADLINE and (v is not None or not args.only)})
        print(name, json.dumps(_brief(section)), flush=True)
        save()
    return result


def merge_section(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """`new` over `old`, one level into dicts (decode's by_format), where None never replaces a value."""
    out = dict(old or {})
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = {**out[k], **v}
        elif v is not None or k not in out:
            out[k] = v
    return out


def _brief(section: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in section.items() if not isinstance(v, dict)}


def main(argv: list[str] | None = None) -> int:
    import sys

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/quantized.json"))
    parser.add_argument("--sections", default=",".join(x for x in SECTIONS
                                                      if not x.startswith(("tilings", "occupancy"))
                                                      and x not in ("m_scale", "zeros", "xla_paths", "xla_m1")),
                        help="comma-separated: " + ", ".join(SECTIONS))
    parser.add_argument("--only", type=lambda v: set(v.split(",")), default=None,
                        help="decode / offline: only these runs (formats such as int8, or offline keys)")
    parser.add_argument("--child", metavar="SECTION:NAME", help=argparse.SUPPRESS)  # in_child's process
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for CPU: the code path only")
    parser.add_argument("--fresh", action="store_true", help="start a new JSON instead of adding to --out")
    args = parser.parse_args(argv)
    if args.child:  # one engine run of the decode or offline section: one JSON line
        section, name = args.child.split(":", 1)
        one = {"decode": decode_one, "offline": offline_one}[section]
        print(json.dumps(one(sizes(args.smoke), args.smoke, name)), flush=True)
        return 0
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
