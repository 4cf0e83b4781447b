"""Two checkouts of jaxinfer timed against each other in one lease, through the public `LLM` API only (the
bench's `prefill` section times one prompt once, and its ShareGPT-like run once, which cannot tell a 3%
regression from noise). `--workload prefill`: one long prompt, repeated. `--workload sharegpt`: the bench's
ShareGPT-like lengths (log-normal, medians 150 in / 130 out, sigma 0.9, seed 0; the same formula as
jaxinfer.bench.workloads, written out here so both checkouts run identical prompts) on the bench's tuned
engine, repeated. `--workload grid`: the run of record's fixed grids (`--grid 1000x1000:192 128x128:256
2048x2048:32`, INxOUT:PROMPTS, every request exactly OUT tokens) and decode at batch 1 (one prompt of 128
tokens, 512 out), each repeated, on the same tuned engine: one JSON line per grid.

    # on the GPU machine, the old tree carried as .ab_old (git worktree add .ab_old <commit>):
    for t in .ab_old . .ab_old .; do PYTHONPATH=$t python3 scripts/ab_prefill.py --label $t >> $OUT/ab.jsonl; done

Prints one JSON line: the label, the jaxinfer path it imported, each repeat's seconds, min and median.
Every prompt is distinct (random ids), so no prefix-cache hit shortens a repeat.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", required=True)
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--workload", choices=["prefill", "sharegpt", "grid"], default="prefill")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--grid", nargs="+", default=["1000x1000:192", "128x128:256", "2048x2048:32", "128x512:1"])
    args = p.parse_args()
    if args.workload == "sharegpt":
        return sharegpt(args)
    if args.workload == "grid":
        return grid(args)

    import jaxinfer
    from jaxinfer import LLM, SamplingParams

    llm = LLM(args.model, random_weights=True, dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=args.tokens,
              max_model_len=args.tokens + 64, memory_fraction=0.85, use_tqdm=False)
    rng = np.random.default_rng(0)
    vocab = llm.model_config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0)
    times = []
    for i in range(args.repeats + 1):
        prompt = rng.integers(10, vocab - 10, size=args.tokens).tolist()
        t = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        if i:  # the first one warms the path
            times.append(time.perf_counter() - t)
    print(json.dumps({"label": args.label, "jaxinfer": jaxinfer.__file__, "tokens": args.tokens, "seconds": times,
                      "min_s": min(times), "median_s": statistics.median(times)}), flush=True)


def tuned_llm(model: str):
    """The bench's tuned engine (jaxinfer bench's defaults for the run of record)."""
    from jaxinfer import LLM

    llm = LLM(model, random_weights=True, dtype="bfloat16", max_num_seqs=256, max_num_batched_tokens=4096,
              max_model_len=4112, decode_steps_per_call=8, memory_fraction=0.85, use_tqdm=False)
    llm.wait_for_background_compile()  # steady-state speed
    return llm


def sharegpt(args: argparse.Namespace) -> None:
    import jaxinfer
    from jaxinfer import SamplingParams

    llm = tuned_llm(args.model)
    rng = np.random.default_rng(0)
    inputs = np.clip(rng.lognormal(np.log(150), 0.9, args.num_prompts), 4, 2048).astype(int)
    outputs = np.clip(rng.lognormal(np.log(130), 0.9, args.num_prompts), 4, 1024).astype(int)
    params = [SamplingParams(max_tokens=int(o), temperature=0.0, ignore_eos=True) for o in outputs]
    vocab = llm.model_config.vocab_size
    tok_s = []
    for i in range(args.repeats + 1):
        prompts = [rng.integers(10, vocab - 10, size=int(n)).tolist() for n in inputs]  # fresh ids: no cache hits
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        if i:
            tok_s.append(int(outputs.sum()) / (time.perf_counter() - t))
    print(json.dumps({"label": args.label, "jaxinfer": jaxinfer.__file__, "workload": "sharegpt",
                      "num_prompts": args.num_prompts, "output_tok_s": tok_s, "median_tok_s": statistics.median(tok_s)}),
          flush=True)


def grid(args: argparse.Namespace) -> None:
    import jaxinfer
    from jaxinfer import SamplingParams

    llm = tuned_llm(args.model)
    vocab = llm.model_config.vocab_size
    rng = np.random.default_rng(0)
    for spec in args.grid:
        shape, count = spec.split(":")
        n_in, n_out = (int(x) for x in shape.split("x"))
        params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
        warm = [rng.integers(10, vocab - 10, size=n_in).tolist() for _ in range(min(int(count), 4))]
        llm.generate(warm, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
        tok_s = []
        for _ in range(args.repeats):
            prompts = [rng.integers(10, vocab - 10, size=n_in).tolist() for _ in range(int(count))]  # no cache hits
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            tok_s.append(int(count) * n_out / (time.perf_counter() - t))
        print(json.dumps({"label": args.label, "jaxinfer": jaxinfer.__file__, "workload": spec, "output_tok_s": tok_s,
                          "median_tok_s": statistics.median(tok_s)}), flush=True)


if __name__ == "__main__":
    main()
