"""Host cost of the engine loop per generated token, on any machine (CPU is fine).

The device step of a tiny random model is irrelevant here: only the engine's host phases (schedule,
prepare, apply; `Engine.times`) are reported, per generated token, for a batch of decoding requests. On
the GPU these phases are synchronous with the device, so they add directly to every step.

    PYTHONPATH=$PWD python scripts/bench_host.py --batch 192 --tokens 128
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import ModelConfig


def tiny() -> ModelConfig:
    from jaxinfer.presets import load_preset

    return load_preset("smollm2-135m").replace(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2,
                                               num_heads=4, num_kv_heads=2, head_dim=16)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=192)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--decode-steps-per-call", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(tiny(), random_weights=True, max_num_seqs=256, max_num_batched_tokens=4096, page_size=16,
              num_pages=4000, max_model_len=args.tokens + 64, decode_steps_per_call=args.decode_steps_per_call,
              use_tqdm=False)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0.0)
    llm.generate([rng.integers(0, 256, 32).tolist() for _ in range(8)], params)  # warm every path
    runs = []
    for _ in range(args.repeats):
        llm.engine.times.seconds = dict.fromkeys(llm.engine.times.PHASES, 0.0)
        outs = llm.generate([rng.integers(0, 256, 32).tolist() for _ in range(args.batch)], params)
        n = sum(len(o.token_ids) for o in outs)
        runs.append({k: v / n * 1e6 for k, v in llm.engine.times.seconds.items()})
    us = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
    print(json.dumps({"batch": args.batch, "tokens": args.tokens, "us_per_token": us,
                      "host_us_per_token": us["schedule"] + us["prepare"] + us["apply"]}))


if __name__ == "__main__":
    main()
