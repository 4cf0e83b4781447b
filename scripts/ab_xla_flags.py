"""Decode speed under several XLA_FLAGS values, each in a process of its own (XLA reads the flags once), one
after another on the same machine: which runtime options pay, measured rather than guessed.

    PYTHONPATH=$PWD python3 scripts/ab_xla_flags.py --out $OUT/xla_flags.jsonl \
        --flags= --flags=--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL -- \
        --model llama-3-8b --decode-batches 1 64 --max-num-seqs 64 --max-num-batched-tokens 512

Everything after `--` goes to `jaxinfer bench` (the decode and decode_device sections always run, nothing else;
`--hf skip`). Each flag set appends one JSON line: the flags, and per decode batch the end-to-end ms per token
step and the device-only single-step and multi-step figures. A table of the same comes last. The flags apply
to every program the engine compiles, except where a program sets the option itself (runner.NO_COMMAND_BUFFERS).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def run_one(flags: str, bench_args: list[str], timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        cmd = [sys.executable, "-m", "jaxinfer.cli", "bench", "--hf", "skip", "--plot", "none",
               "--sections", "decode", "decode_device", *bench_args, "--out", str(out)]
        env = {**os.environ, "XLA_FLAGS": flags}
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"xla_flags": flags, "error": f"timed out after {timeout_s:.0f} s"}
        if proc.returncode or not out.exists():
            return {"xla_flags": flags, "error": f"rc={proc.returncode}", "stderr_tail": proc.stderr[-1500:]}
        result = json.loads(out.read_text())
    device = {d["batch"]: d for d in result.get("decode_device", [])}
    rows = []
    for d in result.get("decode", []):
        dd = device.get(d["batch"], {})
        rows.append({"batch": d["batch"], "step_ms": d["step_ms"], "mbu": d["mbu"],
                     "device_single_ms": dd.get("single_step_ms"),
                     "device_multi_ms": dd.get("multi_step_ms_per_iteration"),
                     "ideal_ms": dd.get("ideal_ms_at_copy_bw")})
    return {"xla_flags": flags, "device": result.get("device"), "warmup_s": result.get("warmup_s"),
            "copy_bw_gbs": result.get("ceilings", {}).get("copy_bw_gbs"), "decode": rows}


def table(results: list[dict]) -> str:
    lines = ["| XLA_FLAGS | batch | end to end ms | device single ms | device multi ms | ideal ms |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for r in results:
        if "error" in r:
            lines.append(f"| `{r['xla_flags'] or '(none)'}` | error: {r['error']} | | | | |")
            continue
        for d in r["decode"]:
            lines.append(f"| `{r['xla_flags'] or '(none)'}` | {d['batch']} | {fmt(d['step_ms'])} | "
                         f"{fmt(d['device_single_ms'])} | {fmt(d['device_multi_ms'])} | {fmt(d['ideal_ms'])} |")
    return "\n".join(lines)


def main() -> None:
    argv = sys.argv[1:]
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flags", action="append", default=None,
                   help="one XLA_FLAGS value per child, written --flags=VALUE (repeatable; default: only the empty one)")
    p.add_argument("--repeats", type=int, default=1, help="run the whole list this many times, alternating")
    p.add_argument("--timeout", type=float, default=400.0, help="seconds per child")
    p.add_argument("--out", type=Path, required=True, help="JSON lines, appended")
    args = p.parse_args(own)
    results = []
    for _ in range(args.repeats):
        for flags in args.flags or [""]:
            results.append(run_one(flags, bench_args, args.timeout))
            with args.out.open("a") as f:
                f.write(json.dumps(results[-1]) + "\n")
            print(json.dumps(results[-1]), flush=True)
    print(table(results))


if __name__ == "__main__":
    main()
