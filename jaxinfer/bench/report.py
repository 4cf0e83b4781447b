"""Turn a bench result into the summary keys of docs/benchmarks/latest.json, a text table and a PNG plot."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

HEADLINE_WORKLOAD = "1000/1000"  # the offline-throughput figure: Llama-3-8B shape, 1000 in / 1000 out
# Headline keys measured by runs of their own (`--device cpu`, `--start-times`, `--defaults-check`), which a
# run of record may carry in with --carry. Nothing else is carried: a figure of the run itself never is.
CARRIABLE = ("cold_start_s", "warm_start_s", "defaults_fraction_of_tuned", "cpu_ratio_vs_hf_b1", "cpu_ratio_vs_hf_b32")


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The keys every latest.json carries at its top level (None where a section was not run)."""
    decode = {d["batch"]: d for d in result.get("decode", [])}
    streamed = {d["batch"]: d for d in result.get("decode_streamed", [])}
    grid = {g["workload"]: g for g in result.get("grid", [])}
    main = grid.get(HEADLINE_WORKLOAD)
    hf = result.get("hf_comparison")
    starts = result.get("start_times") or {}
    defaults = result.get("defaults_run") or {}
    return {
        "device": result.get("device"),
        "decode_mbu_batch1": decode[1]["mbu"] if 1 in decode else None,
        "decode_mbu_batch64": decode[64]["mbu"] if 64 in decode else None,
        # The same batch-1 decode with the request streamed (None where streaming does not change the path).
        "decode_mbu_batch1_streamed": streamed[1]["mbu"] if 1 in streamed else None,
        "prefill_mfu_4k": (result.get("prefill") or {}).get("mfu") if (result.get("prefill") or {}).get("tokens") == 4096 else None,
        "offline_output_tok_s": main["output_tok_s"] if main else None,
        "offline_fraction_of_limit": main["fraction_of_limit"] if main else None,
        "ratio_vs_hf": hf["ratio"] if hf and "ratio" in hf else None,
        "recompiles_after_warmup": result.get("recompiles_after_warmup"),
        "warmup_s": result.get("warmup_s"),
        "cold_start_s": (starts.get("cold") or {}).get("first_token_s"),
        "warm_start_s": (starts.get("warm") or {}).get("first_token_s"),
        "itl_p99_over_median_c1": _itl_tail(result, 1),
        "itl_p99_over_median_max_c1_8": max((_itl_tail(result, c) or 0.0 for c in (1, 2, 4, 8)), default=None) or None,
        "defaults_fraction_of_tuned": (defaults["output_tok_s"] / main["output_tok_s"]
                                       if main and defaults.get("output_tok_s") else None),
        "cpu_ratio_vs_hf_b1": None,  # `jaxinfer bench --device cpu`, brought in with --carry
        "cpu_ratio_vs_hf_b32": None,
        "command": result.get("command"),
    }


def _itl_tail(result: dict[str, Any], concurrency: int) -> float | None:
    """Inter-token latency p99 over its median in the sweep at `concurrency`: how bursty streaming is."""
    for s in result.get("sweep", []):
        if s.get("concurrency") == concurrency and s["itl"].get("median_ms"):
            return s["itl"]["p99_ms"] / s["itl"]["median_ms"]
    return None


def _fmt(x: Any, pct: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if pct:
        return f"{100 * x:.1f}%"
    return f"{x:,.1f}" if isinstance(x, float) else str(x)


def table(result: dict[str, Any]) -> str:
    """A short plain-text summary, printed last by the bench."""
    lines = [f"device: {result.get('device')}  copy {_fmt(result['ceilings']['copy_bw_gbs'])} GB/s  "
             f"matmul {_fmt(result['ceilings']['matmul_tflops'])} TFLOP/s  warmup {_fmt(result.get('warmup_s'))} s  "
             f"recompiles {result.get('recompiles_after_warmup')}"]
    for d in [*result.get("decode", []), *result.get("decode_streamed", [])]:
        lines.append(f"decode batch {d['batch']:>3} ctx {d['ctx']}{', streamed' if d.get('streamed') else ''}: "
                     f"{d['step_ms']:.2f} ms/step  {d['tok_s']:,.0f} tok/s  MBU {_fmt(d['mbu'], True)}")
    for d in result.get("decode_device", []):
        lines.append(f"  device only, batch {d['batch']:>3}: single step {d['single_step_ms']:.2f} ms"
                     f" (MBU {_fmt(d['device_mbu_single'], True)}), multi-step {d['multi_step_ms_per_iteration']:.2f} ms"
                     f"/iteration (MBU {_fmt(d['device_mbu_multi'], True)}), ideal {d['ideal_ms_at_copy_bw']:.2f} ms")
        k = d.get("kernels")
        if k and k["source"] == "device":
            lines.append("    kernels per step: " + ", ".join(f"{c} {ms:.2f} ms" for c, ms in k["ms_per_call_by_class"].items())
                         + f" (sum {k['total_ms_per_call']:.2f} ms)")
    if result.get("prefill"):
        p = result["prefill"]
        lines.append(f"prefill {p['tokens']} tokens: {p['prefill_s'] * 1e3:.1f} ms  MFU {_fmt(p['mfu'], True)}")
    for g in result.get("grid", []):
        lines.append(f"offline {g['workload']:>13} x{g['num_prompts']:<5}: {g['output_tok_s']:>9,.0f} out tok/s"
                     f" {g['total_tok_s']:>9,.0f} total tok/s  {_fmt(g['fraction_of_limit'], True)} of limit"
                     f" ({g['limit']['output_tok_s']:,.0f}, {g['limit']['bound']}-bound)")
    for s in result.get("sweep", []):
        lines.append(f"concurrency {s['concurrency']:>4}: {s['output_throughput']:>9,.0f} out tok/s  TTFT p50"
                     f" {s['ttft']['median_ms']:.0f} ms  TPOT p50 {s['tpot']['median_ms']:.1f} ms  ITL p99"
                     f" {s['itl']['p99_ms']:.1f} ms"
                     + (f" (worst gaps before tokens {', '.join(str(w['token']) for w in s['itl_worst'][:5])})"
                        if s.get("itl_worst") else "")
                     + (f"  (Poisson arrivals, {s['request_rate']:g} req/s)" if s.get("request_rate") else ""))
    hf = result.get("hf_comparison")
    if hf:
        lines.append(f"vs HF transformers ({hf.get('workload')}, {hf.get('num_prompts')} prompts): ours"
                     f" {_fmt(hf.get('ours_output_tok_s'))} / HF {hf.get('hf_best_mode')}"
                     f" {_fmt(hf.get('hf_output_tok_s'))} out tok/s = {_fmt(hf.get('ratio'))}x")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str | Path) -> Path:
    """Three panels: offline throughput vs each workload's limit (and HF), the concurrency sweep, and the
    decode MBU / prefill MFU ratios. Needs matplotlib (the `bench` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    grid = result.get("grid", [])
    names = [g["workload"] for g in grid]
    xs = range(len(grid))
    axes[0].bar([x - 0.2 for x in xs], [g["output_tok_s"] for g in grid], 0.4, label="jaxinfer")
    axes[0].bar([x + 0.2 for x in xs], [g["limit"]["output_tok_s"] for g in grid], 0.4, label="workload limit",
                color="lightgray")
    hf = result.get("hf_comparison") or {}
    if hf.get("hf_output_tok_s"):
        axes[0].axhline(hf["hf_output_tok_s"], color="tab:red", ls="--",
                        label=f"HF transformers {hf.get('workload')} ({hf.get('num_prompts')} prompts)")
    axes[0].set_xticks(list(xs), names)
    axes[0].set_ylabel("output tokens / s")
    axes[0].set_title("offline throughput")
    axes[0].legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)

    sweep = result.get("sweep", [])
    conc = [s["concurrency"] for s in sweep]
    axes[1].plot(conc, [s["output_throughput"] for s in sweep], "o-", label="output tok/s")
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("max concurrency")
    axes[1].set_ylabel("output tokens / s")
    twin = axes[1].twinx()
    twin.plot(conc, [s["tpot"]["median_ms"] for s in sweep], "s--", color="tab:orange", label="TPOT p50 (ms)")
    twin.set_ylabel("TPOT p50, ms")
    handles = axes[1].get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    axes[1].legend(handles, [h.get_label() for h in handles], fontsize=8)
    axes[1].set_title("concurrency sweep")

    bars = {f"decode MBU b{d['batch']}": d["mbu"] for d in result.get("decode", [])}
    if result.get("prefill"):
        bars[f"prefill MFU {result['prefill']['tokens']}"] = result["prefill"]["mfu"]
    for g in grid:
        bars[f"{g['workload']} of limit"] = g["fraction_of_limit"]
    axes[2].barh(list(bars), [100 * v for v in bars.values()])
    axes[2].axvline(100, color="gray", lw=0.8)
    axes[2].set_xlabel("% of the measured ceiling")
    axes[2].set_title("ratios")
    fig.suptitle(f"{result.get('model')} ({result.get('dtype')}), {result.get('device')}")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(result: dict[str, Any], path: str | Path) -> None:
    """latest.json: the headline keys first, then every section in full."""
    head = headline(result)
    for key, (value, _source) in (result.get("carried") or {}).items():
        if head.get(key) is None:  # what this run measured itself wins
            head[key] = value
    out = {**head, **{k: v for k, v in result.items() if k not in head}}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1) + "\n")
