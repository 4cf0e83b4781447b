"""Where structured output's time goes at batch B, without admission churn: one wave of B prompts (all admitted
at once), under the `long_list` JSON schema, then other prompts of the same lengths without it (multi-step
decode), each run once plainly for its wall time and once under the JAX profiler for the device's busy time.
Prints one JSON object: per run the wall seconds, output tokens, tok/s, device-busy ms (kernel time summed from
the trace; memcpys left out), engine steps, pipelined steps and phase seconds.

    PYTHONPATH=$PWD python3 scripts/profile_structured.py --tokenizer serve_wheels/tokenizer --out $OUT/profile.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from jaxinfer import LLM, SamplingParams
    from jaxinfer.bench.measure import device_spans, fixed, prompts
    from jaxinfer.bench.serve_bench import LONG_LIST

    llm = LLM(args.model, random_weights=True, tokenizer=args.tokenizer, dtype="bfloat16", max_num_seqs=args.batch,
              max_num_batched_tokens=4096, max_model_len=2048, decode_steps_per_call=8, memory_fraction=0.9,
              use_tqdm=False)
    vocab = llm.model_config.vocab_size

    def batch(seed: int) -> list[Any]:
        return prompts(fixed(args.input_len, 1, args.batch), vocab, seed)

    def run(params: list[Any], seed: int, profile: bool) -> tuple[list[int], dict[str, Any]]:
        ids = batch(seed)
        before = llm.engine_stats()
        t = time.perf_counter()
        if profile:
            source, spans = device_spans(lambda: llm.generate(ids, params, use_tqdm=False) and 0)
            busy = sum(ms for name, ms in spans.items() if "memcpy" not in name.lower())
        else:
            outs = llm.generate(ids, params, use_tqdm=False)
        wall = time.perf_counter() - t
        after = llm.engine_stats()
        result: dict[str, Any] = {"wall_s": wall, "steps": after["num_steps"] - before["num_steps"],
                                  "pipelined_steps": after["num_pipelined_steps"] - before["num_pipelined_steps"],
                                  "phase_s": {k: v - before["step_time_s"][k] for k, v in after["step_time_s"].items()}}
        if profile:
            result.update(source=source, device_busy_ms=busy)
            return [], result
        lengths = [len(o.token_ids) for o in outs]
        result.update(output_tokens=sum(lengths), output_tok_s=sum(lengths) / wall)
        return lengths, result

    structured = [SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                                 structured={"json": LONG_LIST}) for _ in range(args.batch)]
    run(structured, 100, False)  # the grammar's first compile and the warm path, outside the timings
    lengths, s_plain = run(structured, 1, False)
    _, s_prof = run(structured, 2, True)
    plain = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    _, p_plain = run(plain, 3, False)
    _, p_prof = run(plain, 4, True)
    out = {"command": "python3 scripts/profile_structured.py", "batch": args.batch, "input_len": args.input_len,
           "structured": {**s_plain, "profiled": s_prof}, "plain_same_length": {**p_plain, "profiled": p_prof},
           "structured_cost": 1 - s_plain["output_tok_s"] / p_plain["output_tok_s"]}
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
