"""Which bucket a single step of one decoding row should run in: the step's device time, its host time to
launch and its kernels, per candidate token bucket, for one real decoding row.

    JAX_PLATFORMS=cuda PYTHONPATH=$PWD python3 scripts/profile_single_step.py --buckets 1 2 4 8 16 --out $OUT/x.json

Each bucket is a (tokens, rows) shape of `Engine._step_args`; the row is the same sequence (ctx tokens of
context) in every one, its padding rows write to the trash page. The forward and the sampler (its branch-free build where the
pipeline would take it) run back to back `--calls` times without reading anything back, so the per-call time
is the device's when the host keeps ahead, and `launch_ms` (the host's time to make the two calls) says whether
it does.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np

from jaxinfer import LLM
from jaxinfer.bench.measure import _start_decoding, kernel_profile
from jaxinfer.bench.workloads import fixed, prompts
from jaxinfer.engine.batcher import BatchShape
from jaxinfer.engine.runner import ForwardInputs


def profile_bucket(llm: LLM, plan, slots: list[int], tokens: int, calls: int) -> dict:
    engine, runner = llm.engine, llm.engine.runner
    shape = BatchShape(tokens=tokens, seqs=tokens, pages_per_seq=engine.pages_per_seq)
    batch, inputs = engine._step_args(shape, plan.seqs, [], slots)
    # Placed once, and the sampler's build as the pipeline picks it (branch-free on a GPU: no host sync).
    batch, fwd = runner.place((batch, ForwardInputs.of(inputs)))
    sampler_args = runner.place((inputs.sampling, inputs.slots, inputs.sample_mask))
    branch_free = runner.takes_branch_free(inputs.sampling)

    def run():
        logits = runner.forward(batch, fwd).logits
        engine.penalties, out = runner.sample(engine.penalties, logits, *sampler_args, branch_free=branch_free)
        return out

    jax.block_until_ready(run())  # compiles this bucket (outside the engine's warmup, so not counted there)
    launch, per_call = [], []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(calls - 1):
            s = time.perf_counter()
            run()
            launch.append(time.perf_counter() - s)
        jax.block_until_ready(run())
        per_call.append((time.perf_counter() - t) / calls)
    try:
        kernels = kernel_profile(lambda: [run() for _ in range(5)], calls=5, top=16)
    except Exception as e:  # the profiler needs CUPTI on GPUs; the timings stand without it
        kernels = {"error": f"{type(e).__name__}: {e}"[:300]}
    return {"tokens": tokens, "branch_free_sampler": branch_free, "ms_per_call": float(np.median(per_call)) * 1e3,
            "launch_ms": float(np.median(launch)) * 1e3, "kernels": kernels}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--buckets", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--memory-fraction", type=float, default=0.85)
    p.add_argument("--out", default="profile_single_step.json")
    args = p.parse_args()
    llm = LLM(args.model, random_weights=True, dtype="bfloat16", max_num_seqs=16, max_num_batched_tokens=512,
              max_model_len=args.ctx + 512, memory_fraction=args.memory_fraction, use_tqdm=False)
    llm.wait_for_background_compile()
    engine = llm.engine
    states = _start_decoding(engine, prompts(fixed(args.ctx, 1, 1), llm.model_config.vocab_size, 7))
    plan = engine.scheduler.schedule()  # the one row decodes one token
    slots = engine._slot_rows(plan)
    result = {"model": args.model, "ctx": args.ctx, "device": jax.devices()[0].device_kind, "buckets": []}
    for tokens in args.buckets:
        row = profile_bucket(llm, plan, slots, tokens, args.calls)
        result["buckets"].append(row)
        k = row["kernels"]
        print(json.dumps({"tokens": tokens, "ms_per_call": round(row["ms_per_call"], 3),
                          "launch_ms": round(row["launch_ms"], 3),
                          "device_ms": round(k.get("total_ms_per_call", float("nan")), 3),
                          "by_class": {c: round(v, 3) for c, v in k.get("ms_per_call_by_class", {}).items()}}),
              flush=True)
    for state in states:
        engine.abort(state.request_id)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
