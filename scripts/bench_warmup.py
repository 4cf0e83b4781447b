"""Engine warmup, cold and then warm, each in its own process (as a user's second start would be): the second
start looks for the executables the first one compiled in the persistent compilation cache
(`LLM(compilation_cache_dir=...)`), so it should only trace and load them. `cache_files` says whether it did
(no new files). `first_token_s` is the time from `LLM(...)` to the first generated token; `process_s`, timed
by the parent, adds the interpreter and JAX imports and the exit.

    JAX_PLATFORMS=cuda PYTHONPATH=$PWD python3 scripts/bench_warmup.py --out $OUT/warmup.json

The engine settings default to those of `jaxinfer bench` (Llama-3-8B shape, bf16, 256 rows, 4096-token
budget, 8 decode iterations per call). The cache directory is a fresh temporary one unless --cache-dir says
otherwise, so the first start is cold whatever ran before on the machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def start(args: argparse.Namespace, cache_dir: str, num_pages: int | None) -> dict:
    t = time.perf_counter()
    from jaxinfer import LLM, SamplingParams

    llm = LLM(args.model, random_weights=True, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
              memory_fraction=args.memory_fraction, num_pages=num_pages,
              decode_steps_per_call=args.decode_steps_per_call, compilation_cache_dir=cache_dir, use_tqdm=False)
    warm = time.perf_counter() - t
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1), use_tqdm=False)
    record = {"warmup_s": warm, "first_token_s": time.perf_counter() - t, **llm.engine.runner.precompile_times,
              "num_pages": llm.engine.runner.kv_cache.k[0].shape[0],  # pages allocated, the trash page included
              "cache_files": sum(1 for p in Path(cache_dir).rglob("*") if p.is_file()),
              "compiles_after_warmup": llm.engine_stats()["num_compiles_after_warmup"]}
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=4112)
    p.add_argument("--decode-steps-per-call", type=int, default=8)
    p.add_argument("--memory-fraction", type=float, default=0.5)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--one-start", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="warmup.json")
    args = p.parse_args()
    if args.one_start:  # a child process: one start, its record as the last line
        print(json.dumps(start(args, args.cache_dir, args.num_pages)), flush=True)
        return
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="jaxinfer-xla-")
    result = {"cache_dir": cache_dir}
    num_pages = None  # the cold start sizes the cache; the warm one reuses it, so its shapes match exactly
    for label in ("cold", "warm"):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--one-start", "--cache-dir", cache_dir]
        cmd += ["--num-pages", str(num_pages)] if num_pages else []
        t = time.perf_counter()
        proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
        result[label] = {**json.loads(proc.stdout.strip().splitlines()[-1]), "process_s": time.perf_counter() - t}
        num_pages = result[label]["num_pages"]
        print(json.dumps({label: result[label]}), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
