"""Engine start, cold and then warm, each in its own process (as a user's second start would be): the second
start finds the executables the first compiled in the persistent compilation cache (`LLM(compilation_cache_dir=...)`),
so it should only trace and load them. Per start: `first_token_s` from the process launch to its first
generated token (imports included), `engine_s` for `LLM(...)`, `cache_files` (no new files on the warm start
means every executable hit). `jaxinfer bench --start-times` runs the same and reports `warm_start_s`.

    JAX_PLATFORMS=cuda PYTHONPATH=$PWD python3 scripts/bench_warmup.py --out $OUT/warmup.json

The engine settings default to those of `jaxinfer bench` (Llama-3-8B shape, bf16, 256 rows, 4096-token
budget, 8 decode iterations per call). The cache directory is a fresh temporary one unless --cache-dir says
otherwise, so the first start is cold whatever ran before on the machine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jaxinfer.bench.children import start_times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=4112)
    p.add_argument("--decode-steps-per-call", type=int, default=8)
    p.add_argument("--memory-fraction", type=float, default=0.5)
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--compile-threads", type=int, default=None, help="LLM(compile_threads=...); default: one per core")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--out", default="warmup.json")
    args = p.parse_args()
    engine = {"dtype": args.dtype, "max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len,
              "max_num_batched_tokens": args.max_num_batched_tokens, "memory_fraction": args.memory_fraction,
              "decode_steps_per_call": args.decode_steps_per_call, "num_pages": args.num_pages,
              "compile_threads": args.compile_threads}
    result = start_times(args.model, engine, args.cache_dir)
    for label in ("cold", "warm"):
        print(json.dumps({label: result.get(label)}))
    # The headline keys `jaxinfer bench --carry` picks up.
    head = {f"{label}_start_s": (result.get(label) or {}).get("first_token_s") for label in ("cold", "warm")}
    Path(args.out).write_text(json.dumps({**head, **result}, indent=1) + "\n")


if __name__ == "__main__":
    main()
