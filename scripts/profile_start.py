"""Where a warm start's tracing and lowering go: builds the bench's engine (Llama-3-8B shape, random weights)
without warmup, then runs the warmup under cProfile and prints the heaviest functions and the programs it
compiled. Run it twice on one machine so the second finds every executable in the compilation cache.

    JAX_PLATFORMS=cuda PYTHONPATH=$PWD python3 scripts/profile_start.py --cache-dir /tmp/xla --top 40
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--memory-fraction", type=float, default=0.85)
    args = p.parse_args()
    from jaxinfer import LLM

    t = time.perf_counter()
    llm = LLM(args.model, random_weights=True, use_tqdm=False, compilation_cache_dir=args.cache_dir, warmup=False,
              dtype="bfloat16", max_num_seqs=256, max_num_batched_tokens=4096, max_model_len=4112,
              decode_steps_per_call=8, memory_fraction=args.memory_fraction)
    built = time.perf_counter() - t
    profile = cProfile.Profile()
    profile.enable()
    llm.engine.warmup()
    profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text).sort_stats("cumulative")
    stats.print_stats(args.top)
    print(text.getvalue())
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue())
    keys = sorted(str(k[0]) + " " + str([s for s, _ in k[1]][:3]) for k in llm.engine.runner._executables)
    print(json.dumps({"engine_without_warmup_s": built, **llm.engine.runner.precompile_times, "programs": keys}))


if __name__ == "__main__":
    main()
