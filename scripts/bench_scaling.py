"""Multi-device scaling in one command: each parallel layout beside one device, on the same machine.

Each configuration runs `jaxinfer bench` in its own process (so every run starts with empty devices) on the
same prompts (decode at batch 1 and one offline workload), then the ratios are computed and written with
the raw results.

    PYTHONPATH=$PWD python3 scripts/bench_scaling.py --out $OUT/tp2.json              # two GPUs: issue 18
    PYTHONPATH=$PWD python3 scripts/bench_scaling.py --mode moe --out $OUT/moe.json   # two GPUs: issue 19

--mode tp (default --model llama-3-8b, random weights, bf16): TP=1, TP=2 and DP=2, then --big-model (default
llama-3-70b) at TP=2, and the teacher-forced top-1 agreement of TP=2 with TP=1 on a real bundled model
(--agreement-model). Keys: device, decode_step_ratio_vs_tp1, offline_ratio_vs_tp1, dp2_offline_ratio_vs_tp1,
pair_mbu_batch1, llama70b_decode_mbu_batch1, llama70b_offline_fraction_of_limit, top1_agreement_tp2_vs_tp1.

--mode moe (default --model qwen3-30b-a3b): one device, EP=2, TP=2 and DP=2. Keys: device,
ep2_offline_ratio_vs_ep1, ep2_decode_step_ratio, tp2_offline_ratio_vs_ep1, dp2_offline_ratio_vs_ep1, and the
EP run's per-expert load (engine_stats' expert_token_counts, expert_load_max_over_mean).

Both write "targets" (each figure against its issue's bar), "runs" (every bench result) and the command. On
CPU with forced devices (XLA_FLAGS=--xla_force_host_platform_device_count=N) and small --model/--grid settings
the same command exercises every path; tests/test_bench_scaling.py does that.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

# Each issue's bars: (key, comparison, bar).
MOE_TARGETS = [
    ("ep2_offline_ratio_vs_ep1", ">=", 1.6),
    ("ep2_decode_step_ratio", "<=", 0.7),
]
TARGETS = [
    ("decode_step_ratio_vs_tp1", "<=", 0.65),
    ("offline_ratio_vs_tp1", ">=", 1.8),
    ("dp2_offline_ratio_vs_tp1", ">=", 1.8),
    ("llama70b_decode_mbu_batch1", ">=", 0.75),
    ("llama70b_offline_fraction_of_limit", ">=", 0.60),
    ("top1_agreement_tp2_vs_tp1", ">=", 0.99),
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["tp", "moe"], default="tp")
    p.add_argument("--model", default=None, help="default: llama-3-8b (tp), qwen3-30b-a3b (moe)")
    p.add_argument("--big-model", default="llama-3-70b", help="'none' skips it")
    p.add_argument("--agreement-model", default="gemma3-270m", help="a real bundled model; 'none' skips it")
    p.add_argument("--agreement-tokens", type=int, default=512)
    p.add_argument("--devices", type=int, default=2, help="the TP and DP degree compared with one device")
    p.add_argument("--grid", default="1000x1000:64", help="the offline workload of every run")
    p.add_argument("--bench-args", default="", help="extra `jaxinfer bench` arguments for every run")
    p.add_argument("--layouts", nargs="+", choices=["tp1", "tp", "dp", "ep"], default=None,
                   help="run only these layouts (default: every one of the mode; tp1 is the baseline of every ratio, "
                        "and the ratios of layouts left out are null)")
    p.add_argument("--out", default="bench_results/tp2.json")
    return p.parse_args(argv)


def run_bench(name: str, args: argparse.Namespace, model: str, extra: list[str], workdir: Path) -> dict[str, Any]:
    out = workdir / f"{name}.json"
    cmd = [sys.executable, "-m", "jaxinfer.cli", "bench", "--model", model, "--hf", "skip", "--plot", "none",
           "--decode-batches", "1", "--grid", args.grid, "--concurrency", "--sections", "decode", "grid",
           "--out", str(out), *extra, *args.bench_args.split()]
    print(f"[{name}]", " ".join(cmd), flush=True)
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, check=False)
    if proc.returncode != 0 or not out.exists():
        return {"error": f"exited with {proc.returncode}", "command": " ".join(cmd)}
    result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - t
    return result


def decode_b1(result: dict[str, Any]) -> dict[str, Any] | None:
    return next((d for d in result.get("decode", []) if d["batch"] == 1), None)


def offline(result: dict[str, Any]) -> dict[str, Any] | None:
    grid = result.get("grid") or []
    return grid[0] if grid else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _get(d: dict[str, Any] | None, key: str) -> float | None:
    return None if d is None else d.get(key)


def agreement(model: str, tokens: int, tp: int) -> dict[str, Any]:
    """Teacher-forced top-1 agreement of TP=tp with TP=1 (bf16) over one long real text, in a subprocess."""
    code = f"""
import json, numpy as np
from jaxinfer.bench.agreement import top1_agreement
print(json.dumps(top1_agreement({model!r}, {tokens}, {tp})))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _targets(out: dict[str, Any], bars: list[tuple[str, str, float]]) -> dict[str, Any]:
    return {k: {"value": out[k], "bar": f"{op} {bar}",
                "met": None if out[k] is None else (out[k] <= bar if op == "<=" else out[k] >= bar)}
            for k, op, bar in bars}


def summarize(runs: dict[str, dict[str, Any]], agree: dict[str, Any] | None) -> dict[str, Any]:
    tp1, tpn, dpn, big = (runs.get(k, {}) for k in ("tp1", "tp", "dp", "big"))
    out = {
        "device": tp1.get("device"),
        "decode_step_ratio_vs_tp1": _ratio(_get(decode_b1(tpn), "step_ms"), _get(decode_b1(tp1), "step_ms")),
        "offline_ratio_vs_tp1": _ratio(_get(offline(tpn), "output_tok_s"), _get(offline(tp1), "output_tok_s")),
        "dp2_offline_ratio_vs_tp1": _ratio(_get(offline(dpn), "output_tok_s"), _get(offline(tp1), "output_tok_s")),
        "pair_mbu_batch1": _get(decode_b1(tpn), "mbu"),
        "llama70b_decode_mbu_batch1": _get(decode_b1(big), "mbu"),
        "llama70b_offline_fraction_of_limit": _get(offline(big), "fraction_of_limit"),
        "top1_agreement_tp2_vs_tp1": None if not agree else agree.get("agreement"),
    }
    return {**out, "targets": _targets(out, TARGETS)}


def summarize_moe(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    one, ep, tp, dp = (runs.get(k, {}) for k in ("tp1", "ep", "tp", "dp"))
    ep_tok_s = _get(offline(ep), "output_tok_s")
    load = ep.get("engine_stats") or {}
    out = {
        "device": one.get("device"),
        "ep2_offline_ratio_vs_ep1": _ratio(ep_tok_s, _get(offline(one), "output_tok_s")),
        "ep2_decode_step_ratio": _ratio(_get(decode_b1(ep), "step_ms"), _get(decode_b1(one), "step_ms")),
        "tp2_offline_ratio_vs_ep1": _ratio(_get(offline(tp), "output_tok_s"), _get(offline(one), "output_tok_s")),
        "dp2_offline_ratio_vs_ep1": _ratio(_get(offline(dp), "output_tok_s"), _get(offline(one), "output_tok_s")),
        "one_device_decode_mbu_batch1": _get(decode_b1(one), "mbu"),
        "one_device_offline_fraction_of_limit": _get(offline(one), "fraction_of_limit"),
        "expert_load_max_over_mean": load.get("expert_load_max_over_mean"),
        "expert_token_counts": load.get("expert_token_counts"),
    }
    return {**out, "targets": _targets(out, MOE_TARGETS)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    n = str(args.devices)
    moe = args.mode == "moe"
    model = args.model or ("qwen3-30b-a3b" if moe else "llama-3-8b")
    layouts = {"tp1": [], "tp": ["--tensor-parallel-size", n], "dp": ["--data-parallel-size", n]}
    if moe:
        layouts["ep"] = ["--expert-parallel-size", n]
    if args.layouts is not None:
        unknown = set(args.layouts) - set(layouts)
        if unknown:
            raise SystemExit(f"--layouts {' '.join(sorted(unknown))}: not a layout of --mode {args.mode} "
                             f"({', '.join(layouts)})")
        layouts = {name: extra for name, extra in layouts.items() if name in args.layouts}
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name, extra in layouts.items():
            runs[name] = run_bench(name, args, model, extra, work)
        if not moe and args.big_model != "none":
            runs["big"] = run_bench("big", args, args.big_model, ["--tensor-parallel-size", n], work)
    agree = None
    if not moe and args.agreement_model != "none":
        agree = agreement(args.agreement_model, args.agreement_tokens, args.devices)
    summary = summarize_moe(runs) if moe else summarize(runs, agree)
    result = {**summary, "command": "scripts/bench_scaling.py " + " ".join(argv or sys.argv[1:]),
              "model": model, "agreement": agree, "runs": runs, "xla_flags": os.environ.get("XLA_FLAGS", "")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    for key, t in result["targets"].items():
        value = "n/a" if t["value"] is None else f"{t['value']:.3f}"
        print(f"{key:<38} {value:>8}  (target {t['bar']}: {'met' if t['met'] else 'NOT met' if t['met'] is False else '-'})")
    print("wrote", args.out)
    return 0 if all("error" not in r for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
