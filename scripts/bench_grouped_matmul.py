"""Benchmark of the grouped matmul (MoE experts) on the GPU machine, against jax.lax.ragged_dot.

    JAX_PLATFORMS=cuda PYTHONPATH=$PWD python3 scripts/bench_grouped_matmul.py --out $OUT/gmm.json
    PYTHONPATH=$PWD python3 scripts/bench_grouped_matmul.py --smoke   # CPU: tiny shapes, interpret mode

Qwen3-30B-A3B expert shapes (128 experts, top-8, hidden 2048, moe_intermediate_size 768): gate/up
`[E, 2048, 768]` and down `[E, 768, 2048]`, at decode (1, 8, 64, 256 tokens x top-8 rows) and
prefill (4096 tokens x 8), random balanced routing (each token picks 8 distinct experts uniformly),
bf16 weights and int8 / fp8 QuantizedExperts (bf16 activations throughout).

Each case times our Pallas GPU kernel (the tuned tiling, then a few alternative tilings so the
table in pallas_kernels/grouped_matmul/tuning.py can be corrected from the numbers), XLA's
`jax.lax.ragged_dot` on the bf16 weights, and for quantized weights XLA's dequantize + ragged_dot
in one jit. `--ragged-dot-flags` also times bf16 ragged_dot in subprocesses with XLA's cuDNN
ragged-dot fusion flag explicitly off (a dense dot over all experts) and on (cuDNN's grouped GEMM;
the default in recent XLA where cuDNN >= 9.22), so the table says which one "ragged_dot" was.

Timing is scripts/bench_kernels.py's: device time per call summed from a profiler trace over a
batch of calls rotating 3 input sets (different weights and routing, so the L2 cannot serve the
next call's weights), the wall time beside it. Bytes are what a perfect kernel must move: the
weights (and scales) of the experts that received rows, the lhs and the output; flops are
2 M K N over the real rows. `roof%` is max(bytes / copy bandwidth, flops / matmul rate), both
measured in the same run, over the time. Prints a table last and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench_kernels import Results, measure_ceilings, time_fn
from pallas_kernels.grouped_matmul import GpuTiling, dequantize, quantize_experts
from pallas_kernels.grouped_matmul import gpu as gmm_gpu
from pallas_kernels.grouped_matmul import tuning

QWEN3_MOE = dict(experts=128, top_k=8, shapes={"gate_up": (2048, 768), "down": (768, 2048)})
SMOKE = dict(experts=8, top_k=2, shapes={"gate_up": (256, 128), "down": (128, 256)})
DECODE_TOKENS, PREFILL_TOKENS = (1, 8, 64, 256), (4096,)
NUM_SETS = 3

# Alternatives timed beside the tuned tiling; each is skipped if it does not fit the shape.
DECODE_VARIANTS = {
    "cols tn=128": dict(tile_n=128),
    "cols k_splits=1": dict(k_splits=1),
    "cols stages=3": dict(stages=3),
}
PREFILL_VARIANTS = {
    "rows_ws 128x256 s3": dict(path="rows_ws", tile_m=128, tile_n=256, tile_k=64, stages=3),
    "rows_ws 128x128 s4": dict(path="rows_ws", tile_m=128, tile_n=128, tile_k=64, stages=4),
    "rows 64x256": dict(tile_m=64, tile_n=256, stages=3),
    "rows 128x128 tk=128 s2": dict(tile_m=128, tile_n=128, tile_k=128, stages=2),
    "rows 64x128": dict(tile_m=64, tile_n=128),
}


@dataclasses.dataclass(frozen=True)
class Case:
    shape: str  # "gate_up" | "down"
    tokens: int
    weights: str  # "bf16" | "int8" | "fp8"
    k: int
    n: int
    experts: int
    top_k: int

    @property
    def rows(self) -> int:
        return self.tokens * self.top_k

    @property
    def section(self) -> str:
        phase = "prefill" if self.rows > 48 * self.experts else "decode"  # tuning.GPU_TABLE's split
        return f"{self.shape} {phase} T={self.tokens} {self.weights}"


def routed_sizes(rng, case: Case) -> np.ndarray:
    """group_sizes [E] of random balanced top-k routing of case.tokens tokens."""
    picks = np.argsort(rng.random((case.tokens, case.experts)), axis=1)[:, :case.top_k]
    return np.bincount(picks.ravel(), minlength=case.experts).astype(np.int32)


def make_sets(case: Case, seed: int = 0):
    """NUM_SETS of (lhs, rhs in the case's format, bf16 rhs [E, K, N], group_sizes)."""
    rng = np.random.default_rng(seed)
    sets = []
    for i in range(NUM_SETS):
        kx, kw = jax.random.split(jax.random.key(seed * 100 + i))
        x = jax.random.normal(kx, (case.rows, case.k), jnp.bfloat16)
        w = jax.random.normal(kw, (case.experts, case.k, case.n), jnp.float32) * case.k ** -0.5
        if case.weights == "bf16":
            rhs = w.astype(jnp.bfloat16)
            dense = rhs
        else:
            rhs = quantize_experts(w, fp8=case.weights == "fp8")
            dense = dequantize(rhs).astype(jnp.bfloat16)
        del w
        sets.append((x, rhs, dense, jnp.asarray(routed_sizes(rng, case))))
    return sets


def case_cost(case: Case, sets) -> tuple[float, float]:
    """Mean bytes a perfect kernel moves (active experts' weights + scales, lhs, out) and flops."""
    per_weight = 2 if case.weights == "bf16" else 1
    active = np.mean([int(jnp.sum(gs > 0)) for *_, gs in sets])
    weight_bytes = active * case.n * (case.k * per_weight + (0 if case.weights == "bf16" else 4))
    return weight_bytes + case.rows * (case.k + case.n) * 2, 2.0 * case.rows * case.k * case.n


def _variant_tilings(case: Case, default: GpuTiling) -> dict[str, GpuTiling]:
    """The tuned tiling plus the variants that are legal and fit shared memory."""
    table = DECODE_VARIANTS if default.path == "cols" else PREFILL_VARIANTS
    wdtype = jnp.bfloat16 if case.weights == "bf16" else jnp.int8
    out = {f"ours {default.path} (tuned)": default}
    for name, change in table.items():
        t = dataclasses.replace(default, **change)
        if t.path == "rows" and t.tile_m % 64:
            continue
        if case.weights != "bf16" and t.path == "cols" and t.tile_n * t.tile_k > 16384:
            t = dataclasses.replace(t, tile_k=16384 // t.tile_n)  # the register weight tile
        try:
            gmm_gpu.check_tiling(t, case.k, case.n, quantized=case.weights != "bf16")
        except ValueError:
            continue
        if gmm_gpu.smem_bytes(t, jnp.bfloat16, wdtype, jnp.bfloat16) <= tuning.SMEM_BUDGET and t != default:
            out[f"ours {name}"] = t
    return out


def bench_case(res: Results, case: Case, *, variants: bool, interpret: bool, timing: dict,
               baseline_only: bool = False):
    sets = make_sets(case)
    bytes_moved, flops = case_cost(case, sets)
    measure = dict(bytes_moved=bytes_moved, flops=flops)
    sec = case.section
    default = gmm_gpu.choose_tiling(case.rows, case.k, case.n, case.experts, jnp.bfloat16,
                                    jnp.bfloat16 if case.weights == "bf16" else jnp.int8, jnp.bfloat16)
    tilings = _variant_tilings(case, default) if variants else {f"ours {default.path} (tuned)": default}
    if baseline_only:
        tilings = {}
    ragged = jax.jit(lambda x, w, gs: jax.lax.ragged_dot(x, w, gs))
    # XLA's dense fallback at prefill runs ~10-100 ms a call: fewer batches keep the run in budget.
    slow = timing or (dict(repeats=3, batch=3) if case.rows > 48 * case.experts else {})
    for name, tiling in tilings.items():
        fn = jax.jit(lambda x, w, gs, t=tiling: gmm_gpu.grouped_matmul(x, w, gs, tiling=t,
                                                                        interpret=interpret))
        res.run(sec, name, lambda fn=fn, name=name, tiling=tiling: _time_ours(
            res, sec, name, tiling, fn, ragged, sets, measure, timing))
    res.run(sec, "ragged_dot", lambda: res.add(
        sec, "XLA ragged_dot (bf16 weights)", time_fn(ragged, [(x, d, gs) for x, _, d, gs in sets], **slow),
        **measure))
    if case.weights != "bf16":
        deq = jax.jit(lambda x, wq, gs: jax.lax.ragged_dot(x, dequantize(wq).astype(x.dtype), gs))
        res.run(sec, "dequant+ragged_dot", lambda: res.add(
            sec, "XLA dequantize + ragged_dot", time_fn(deq, [(x, r, gs) for x, r, _, gs in sets], **slow),
            **measure))


def _time_ours(res, sec, name, tiling, fn, ragged, sets, measure, timing):
    x, rhs, dense, gs = sets[0]
    got, want = fn(x, rhs, gs).astype(jnp.float32), ragged(x, dense, gs).astype(jnp.float32)
    rel = float(jnp.linalg.norm(got - want) / jnp.maximum(jnp.linalg.norm(want), 1e-30))
    timed, spans = time_with_breakdown(fn, [(x, r, g) for x, r, _, g in sets], **timing)
    res.add(sec, name, timed, **measure)
    res.rows[-1].update(tiling=dataclasses.asdict(tiling), rel_err_vs_xla=rel, spans_us=spans)
    if rel > 2e-2:
        res.errors[f"{sec}/{name}"] = f"relative error {rel:.3g} against XLA ragged_dot"


def time_with_breakdown(fn, arg_sets, *, warmup=2, repeats=7, batch=10):
    """bench_kernels.time_fn's measurement (median wall time of `repeats` batches, device time of
    one traced batch) from a single trace, which also gives the device time per call of each
    kernel: our Mosaic kernel vs the wrapper's XLA ops (work-item table, padding, cols gather),
    the 8 largest."""
    from jaxinfer.bench.measure import device_spans

    def run_batch():
        out = None
        for i in range(batch):
            out = fn(*arg_sets[i % len(arg_sets)])
        return out

    for i in range(warmup):
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run_batch())
        walls.append((time.perf_counter() - start) / batch)
    wall = statistics.median(walls)
    source, spans = device_spans(run_batch)
    if source != "device":
        return dict(wall=wall, device=wall), {}
    top = sorted(spans.items(), key=lambda kv: -kv[1])[:8]
    device = sum(spans.values()) / 1e3 / batch
    return dict(wall=wall, device=device), {name[:100]: ms * 1e3 / batch for name, ms in top}


def ragged_dot_flag_rows(args, fusion: bool) -> list[dict]:
    """bf16 ragged_dot with XLA's cuDNN ragged-dot fusion flag set explicitly, timed in a fresh
    process (XLA reads its flags once, at backend start). Recent XLA turns the flag on by default
    where cuDNN >= 9.22; before that ragged_dot was rewritten to a dense dot over all experts."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "baseline.json")
        env = dict(os.environ)
        flag = f"--xla_gpu_experimental_use_ragged_dot_fusion={str(fusion).lower()}"
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
        cmd = [sys.executable, __file__, "--baseline-only", "--out", out, "--shapes", args.shapes,
               "--tokens", args.tokens, "--weights", "bf16", *(["--smoke"] if args.smoke else [])]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{flag} baseline failed ({done.returncode}): {done.stderr[-1500:]}")
        with open(out) as f:
            rows = json.load(f)["rows"]
    for r in rows:
        r["name"] = f"XLA ragged_dot, {flag.lstrip('-')}"
    return rows


def cases(args) -> list[Case]:
    model = SMOKE if args.smoke else QWEN3_MOE
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else (
        [1, 256] if args.smoke else [*DECODE_TOKENS, *PREFILL_TOKENS])
    out = []
    for shape in args.shapes.split(","):
        k, n = model["shapes"][shape]
        for t in tokens:
            for weights in args.weights.split(","):
                out.append(Case(shape, t, weights, k, n, model["experts"], model["top_k"]))
    return out


def summary(res: Results) -> list[dict]:
    """Per case: the tuned kernel, the best variant, ragged_dot and the speedups."""
    by_case: dict[str, dict[str, dict]] = {}
    for r in res.rows:
        if r["section"] != "ceiling":
            by_case.setdefault(r["section"], {})[r["name"]] = r
    ceil = res.ceilings
    out = []
    for sec, rows in by_case.items():
        ours = {n: r for n, r in rows.items() if n.startswith("ours")}
        tuned = next((r for n, r in ours.items() if n.endswith("(tuned)")), None)
        best = min(ours.values(), key=lambda r: r["us"]) if ours else None
        base = rows.get("XLA ragged_dot (bf16 weights)")
        # With --ragged-dot-flags the section also holds ragged_dot under each flag setting.
        fastest = min((r for n, r in rows.items() if n.startswith("XLA ragged_dot")),
                      key=lambda r: r["us"], default=None)
        line = dict(case=sec, tuned_us=tuned and tuned["us"], best=best and best["name"],
                    best_us=best and best["us"], ragged_dot_us=base and base["us"],
                    fastest_ragged_dot=fastest and fastest["name"])
        if tuned and base:
            line["speedup_tuned"] = base["us"] / tuned["us"]
        if tuned and fastest:
            line["speedup_vs_fastest_ragged_dot"] = fastest["us"] / tuned["us"]
        if tuned and "copy_GBps" in ceil and "matmul_TFLOPs" in ceil:
            t_min = max(tuned.get("GB/s", 0) * tuned["us"] / ceil["copy_GBps"],
                        tuned.get("TFLOP/s", 0) * tuned["us"] / ceil["matmul_TFLOPs"])
            line["roof%"] = 100 * t_min / tuned["us"]
        out.append(line)
    return out


def print_summary(lines: list[dict]):
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    print(f"\n{'case':<34} {'tuned us':>9} {'ragged_dot us':>13} {'speedup':>8} {'vs fastest':>10} "
          f"{'roof%':>6}  best variant")
    for ln in lines:
        print(f"{ln['case']:<34} {fmt(ln['tuned_us'], '9.1f')} {fmt(ln['ragged_dot_us'], '13.1f')} "
              f"{fmt(ln.get('speedup_tuned'), '7.2f')}x "
              f"{fmt(ln.get('speedup_vs_fastest_ragged_dot'), '9.2f')}x "
              f"{fmt(ln.get('roof%'), '6.1f')}  {ln['best']} ({fmt(ln['best_us'], '.1f')} us)")
    met = [ln for ln in lines if ln.get("speedup_tuned") is not None]
    if met:
        low = min(met, key=lambda ln: ln["speedup_tuned"])
        verdict = "met" if low["speedup_tuned"] >= 1.3 else "NOT met"
        print(f"target >= 1.3x ragged_dot on every case: {verdict} "
              f"(lowest {low['speedup_tuned']:.2f}x, {low['case']})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_grouped_matmul.json")
    parser.add_argument("--shapes", default="gate_up,down")
    parser.add_argument("--tokens", default="", help="comma-separated token counts (rows = tokens x top-k)")
    parser.add_argument("--weights", default="bf16,int8,fp8")
    parser.add_argument("--no-variants", action="store_true", help="time only the tuned tiling")
    parser.add_argument("--no-ceilings", action="store_true")
    parser.add_argument("--ragged-dot-flags", action="store_true",
                        help="also time bf16 ragged_dot with XLA's cuDNN fusion flag off and on "
                             "(subprocesses)")
    parser.add_argument("--baseline-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true",
                        help="CPU check of this script: tiny shapes, interpret mode, no variants")
    args = parser.parse_args()
    res = Results()
    device = jax.devices()[0].device_kind
    print("device:", device, flush=True)
    if not (args.no_ceilings or args.smoke or args.baseline_only):
        measure_ceilings(res)
    timing = dict(warmup=1, repeats=1, batch=1) if args.smoke else {}
    def write():  # after every case, so a run cut short by a time limit keeps what it measured
        with open(args.out, "w") as f:
            json.dump(dict(device=device, argv=sys.argv, ceilings=res.ceilings, rows=res.rows,
                           summary=summary(res), errors=res.errors), f, indent=1)

    if args.ragged_dot_flags:
        for fusion in (False, True):
            res.run("baseline", f"fusion={fusion}",
                    lambda fusion=fusion: res.rows.extend(ragged_dot_flag_rows(args, fusion)))
    for case in cases(args):
        bench_case(res, case, variants=not (args.no_variants or args.smoke), interpret=args.smoke,
                   timing=timing, baseline_only=args.baseline_only)
        write()
    write()
    lines = summary(res)
    if args.baseline_only:
        return
    print_table(res)
    print_summary(lines)


def print_table(res: Results):
    """bench_kernels' table, with the relative error of our rows against XLA."""
    from bench_kernels import print_table as kernels_table

    kernels_table(res)
    for r in res.rows:
        if "rel_err_vs_xla" in r:
            spans = r.get("spans_us") or {}
            top = ", ".join(f"{k[:40]} {v:.1f}" for k, v in list(spans.items())[:3])
            print(f"  {r['section']:<30} {r['name']:<28} rel err vs XLA {r['rel_err_vs_xla']:.2e}  "
                  f"device us/call: {top}")


if __name__ == "__main__":
    main()
