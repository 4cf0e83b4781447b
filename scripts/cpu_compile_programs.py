"""How long each program of an engine's warmup takes to compile on a CPU, one at a time (docs/PERFORMANCE.md, "CPU").

Builds an engine on the bundled SmolLM2-135M's shape (random weights, `--layers` of them) without warming it up,
then compiles warmup's plan (jaxinfer.engine.warmup.plan) one program after another on one thread and prints each
program's seconds (tracing, lowering and XLA compiling) and the total. Run it with an empty compilation cache, or
the programs load instead of compiling:

    JAX_COMPILATION_CACHE_DIR=$(mktemp -d) PYTHONPATH=$PWD python scripts/cpu_compile_programs.py --layers 30
    JAX_COMPILATION_CACHE_DIR=$(mktemp -d) PYTHONPATH=$PWD python scripts/cpu_compile_programs.py --layers 2

The shapes are those of tests/test_parity.py's engine (8 sequences, a 64-token budget, 96 pages of 16, float32),
with the attention CPU users get by default unless `--attention-impl` says otherwise.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_llvm_disable_expensive_passes=true")  # as the test suite compiles
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=30, help="decoder layers (the real model has 30)")
    p.add_argument("--attention-impl", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=64)
    args = p.parse_args()

    import jax

    from jaxinfer import LLM
    from jaxinfer.engine import warmup
    from jaxinfer.presets import bundled_checkpoint, load_preset

    cfg = load_preset("smollm2-135m").replace(num_layers=args.layers)
    llm = LLM(cfg, tokenizer=bundled_checkpoint("smollm2-135m-instruct"), random_weights=True, dtype="float32",
              max_model_len=256, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, num_pages=96,
              attention_impl=args.attention_impl, use_tqdm=False, warmup=False)
    engine = llm.engine
    total = 0.0
    for call in warmup.plan(engine).now:
        kind, rest, static = call
        start = time.perf_counter()
        engine.runner.precompile([call], threads=1)
        seconds = time.perf_counter() - start
        total += seconds
        shapes = [tuple(a.shape) for a in jax.tree.leaves(rest)[:3]]
        print(f"{seconds:7.2f} s  {kind} {static or ''} {shapes}")
    print(f"{total:7.2f} s  in all ({args.layers} layers, attention {args.attention_impl})")


if __name__ == "__main__":
    main()
