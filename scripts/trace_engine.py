"""Where an engine step's wall time goes on the device: a JAX profiler trace of a few decode calls, reduced
to the device's busy fraction, its idle gaps, and what the host threads were doing during the gaps.

    JAX_PLATFORMS=cuda PYTHONPATH=$PWD python3 scripts/trace_engine.py --batch 64 --out $OUT/trace.json

Runs the same decode twice, with overlapped decode off and on (`--overlap-only`: on only), after one shared
warmup; with `--single-step-max-rows 8 0`, once per value of that knob (pipelined single steps against the
multi-step loop). Each run also lists the device's kernels (count, total time) and the host's events. The raw
Perfetto traces are kept beside --out for a look in ui.perfetto.dev.

`--workload 128x128:256` (the bench's grid spelling) traces a whole offline run of `llm.generate` instead, after one
untraced run of the same workload: where the device idles between the prefill steps and the decode calls of a grid
row, and what the host threads were doing then.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import shutil
import tempfile
import time
from pathlib import Path

import jax

from jaxinfer import LLM
from jaxinfer.bench.measure import _start_decoding, offline_throughput
from jaxinfer.bench.workloads import Workload, fixed, parse, prompts


def _merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def summarize(events: list[dict], min_gap_us: float) -> dict:
    """Device busy time and idle gaps (us) over the traced window, and the host events inside the gaps."""
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {pid for pid, n in names.items() if "GPU" in n or "TPU" in n}
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    busy = _merge([(e["ts"], e["ts"] + e["dur"]) for e in spans if e["pid"] in device])
    if not busy:
        return {"error": "no device events in the trace"}
    window = busy[-1][1] - busy[0][0]
    gaps = [(a[1], b[0]) for a, b in zip(busy, busy[1:]) if b[0] - a[1] >= min_gap_us]
    largest = sorted(gaps, key=lambda g: g[0] - g[1])[:8]
    in_largest: list[dict[str, float]] = [{} for _ in largest]
    during: dict[str, float] = {}
    host: dict[str, float] = {}
    kernels: dict[str, list[float]] = {}  # name -> [count, total us]
    for e in spans:
        if e["pid"] in device:
            k = kernels.setdefault(e["name"], [0, 0.0])
            k[0] += 1
            k[1] += e["dur"]
            continue
        host[e["name"]] = host.get(e["name"], 0.0) + e["dur"]
        s, t = e["ts"], e["ts"] + e["dur"]
        for g0, g1 in gaps:
            overlap = min(t, g1) - max(s, g0)
            if overlap > 0:
                during[e["name"]] = during.get(e["name"], 0.0) + overlap
        for (g0, g1), names in zip(largest, in_largest):
            overlap = min(t, g1) - max(s, g0)
            if overlap > 0:
                names[e["name"]] = names.get(e["name"], 0.0) + overlap
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:25]
    return {
        "window_us": window,
        "device_events": sum(k[0] for k in kernels.values()),
        "top_kernels_us": {name: {"count": n, "total_us": round(us, 1)} for name, (n, us) in top},
        "device_busy_us": sum(e - s for s, e in busy),
        "busy_fraction": sum(e - s for s, e in busy) / window,
        "gaps": len(gaps),
        "gap_us_total": sum(g1 - g0 for g0, g1 in gaps),
        "largest_gaps_us": sorted((g1 - g0 for g0, g1 in gaps), reverse=True)[:10],
        # The largest gaps: where they start (ms into the window) and the host events inside each (the innermost
        # ones are the shortest of those that cover the whole gap).
        "largest_gaps": [{"at_ms": round((g0 - busy[0][0]) / 1e3, 2), "us": round(g1 - g0, 1),
                          "host": {k: round(v, 1) for k, v in sorted(names.items(), key=lambda kv: -kv[1])[:12]}}
                         for (g0, g1), names in zip(largest, in_largest)],
        "host_events_in_gaps_us": dict(sorted(during.items(), key=lambda kv: -kv[1])[:25]),
        # Inclusive times (a caller's span holds its callees'), summed over the host threads.
        "host_events_us": {k: round(v, 1) for k, v in sorted(host.items(), key=lambda kv: -kv[1])[:40]},
    }


def _profiled(fn, out_dir: Path, label: str) -> tuple[object, float, list[dict]]:
    """fn() under the JAX profiler: (its result, wall seconds, the trace's events); the raw trace is kept in
    out_dir as trace_<label>.json.gz."""
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            result = fn()
        wall = time.perf_counter() - t
        (path,) = glob.glob(f"{tmp}/**/perfetto_trace.json.gz", recursive=True)
        shutil.copy(path, out_dir / f"trace_{label}.json.gz")
        with gzip.open(path) as f:
            trace = json.load(f)
    return result, wall, trace["traceEvents"] if isinstance(trace, dict) else trace


def traced_decode(llm: LLM, batch: int, ctx: int, tokens: int, out_dir: Path, label: str, min_gap_us: float,
                  calls: int) -> dict:
    engine = llm.engine
    # Streamed, so that single_step_max_rows decides the path (rows nobody streams always run multi-step calls).
    states = _start_decoding(engine, prompts(fixed(ctx, tokens, batch), llm.model_config.vocab_size, seed=batch),
                             streamed=True)
    for _ in range(2):  # into the steady state (a continuation in flight when overlapped)
        engine.step()

    def run() -> None:
        for _ in range(calls):
            engine.step()
        engine.flush()

    _, wall, events = _profiled(run, out_dir, label)
    for s in states:
        engine.abort(s.request_id)
    return {"wall_s": wall, "engine_calls": calls, **summarize(events, min_gap_us)}


def traced_workload(llm: LLM, workload: Workload, out_dir: Path, label: str, min_gap_us: float) -> dict:
    """One untraced offline run (the steady state), then the same workload traced, on other prompts: the same
    prompts again would hit the prefix cache and skip most of the prefill."""
    untraced = offline_throughput(llm, workload, seed=0)
    traced, _, events = _profiled(lambda: offline_throughput(llm, workload, seed=1), out_dir, label)
    return {"untraced": untraced, "traced": traced, **summarize(events, min_gap_us)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--min-gap-us", type=float, default=50.0)
    p.add_argument("--decode-steps-per-call", type=int, default=8)
    p.add_argument("--memory-fraction", type=float, default=0.5)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--single-step-max-rows", type=int, nargs="*", default=[],
                   help="the engine's knob, one traced run per value (default: the platform's); 0 makes every decode "
                        "batch multi-step")
    p.add_argument("--calls", type=int, default=4, help="engine steps traced per run")
    p.add_argument("--overlap-only", action="store_true", help="skip the runs with overlapped decode off")
    p.add_argument("--out", default="trace_engine.json")
    p.add_argument("--quantization", default=None, help="LLM(quantization=...): int8, int4, fp8, ...")
    p.add_argument("--workload", default=None, metavar="INxOUT:N",
                   help="trace a whole offline run of this grid workload (e.g. 128x128:256) instead of decode calls")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: the batch (at least 16), or N of --workload")
    p.add_argument("--int4-pack", type=int, default=None, help="store int4 weights with this packing chunk (2: plain)")
    args = p.parse_args()
    if args.int4_pack:
        from profile_decode_buckets import force_int4_pack

        force_int4_pack(args.int4_pack)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    workload = None
    max_len = args.ctx + 512
    if args.workload:
        name, _, n = args.workload.partition(":")
        workload = parse(name, int(n) if n else 256)
        max_len = max(i + o for i, o in zip(workload.input_lens, workload.output_lens)) + 16
    max_seqs = args.max_num_seqs or (workload.num_prompts if workload else max(16, args.batch))
    llm = LLM(args.model, random_weights=True, dtype="bfloat16", max_num_seqs=max_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_len,
              memory_fraction=args.memory_fraction,
              decode_steps_per_call=args.decode_steps_per_call, quantization=args.quantization,
              # The largest value asked for, so the small single-step buckets it needs exist (the engine builds them
              # from the value it starts with; MoE and quantized models on a GPU start at 0).
              single_step_max_rows=max(args.single_step_max_rows) if args.single_step_max_rows else None,
              use_tqdm=False)
    llm.wait_for_background_compile()  # steady-state speed
    if workload is not None:
        label = "workload_" + args.workload.replace(":", "_")
        result = {"workload": args.workload, label: traced_workload(llm, workload, out.parent, label, args.min_gap_us)}
        print(json.dumps(result), flush=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        return
    result = {"batch": args.batch, "ctx": args.ctx}
    # Every decode row bucket has its multi-step program whatever the knob, so one warmed engine serves each value.
    for single in args.single_step_max_rows or [llm.engine.single_step_max_rows]:
        llm.engine.single_step_max_rows = single
        for label, overlap in (("sync", False), ("overlap", True)):
            if args.overlap_only and not overlap:
                continue
            if args.single_step_max_rows:
                label = f"single{single}_{label}"
            llm.engine.loop.overlap = overlap
            result[label] = traced_decode(llm, args.batch, args.ctx, 400, out.parent, label, args.min_gap_us,
                                          args.calls)
            print(json.dumps({label: result[label]}), flush=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
