"""Run `jaxinfer bench` on two source trees alternately in one lease (A B A B ...), one JSON line per run, so a
change is judged against a baseline measured on the same machine minutes apart (the machines are noisy).

    python3 scripts/ab_bench.py --trees .ab_old . --repeats 2 --out $OUT/ab.jsonl -- \
        --hf skip --memory-fraction 0.85 --sections decode decode_device --decode-batches 1

Each run is its own process, started inside its tree with PYTHONPATH set to it. A line keeps the tree, its order, the warmup and
the bench's measured sections (the keys of --keys); a failed run keeps the tail of its log instead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_KEYS = ("warmup_s", "warmup_breakdown", "decode", "decode_device", "prefill", "grid", "ceilings")


def run_once(tree: str, bench_args: list[str], keys: tuple[str, ...], order: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
        # Run from inside the tree: `python -m` puts the working directory first on sys.path, ahead of
        # PYTHONPATH, so run from elsewhere every "tree" would import the working directory's jaxinfer.
        proc = subprocess.run([sys.executable, "-m", "jaxinfer.cli", "bench", *bench_args, "--plot", "none",
                               "--out", str(out)], env=env, cwd=tree, capture_output=True, text=True)
        record = {"tree": tree, "order": order}
        if proc.returncode != 0 or not out.exists():
            return {**record, "error": f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}"}
        result = json.loads(out.read_text())
        engine = result.get("engine") or {}
        return {**record, **{k: result.get(k, engine.get(k)) for k in keys if k in result or k in engine}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", nargs="+", required=True, help="source trees, run in this order each repeat")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--keys", nargs="+", default=list(DEFAULT_KEYS))
    p.add_argument("--out", required=True, help="JSON lines, appended")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: the bench's arguments")
    args = p.parse_args()
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    order = 0
    for _ in range(args.repeats):
        for tree in args.trees:
            order += 1
            line = json.dumps({**run_once(tree, bench_args, tuple(args.keys), order), "bench_args": bench_args})
            print(line, flush=True)
            with open(args.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
