"""How a single step of one decoding row should run: per candidate token bucket and per set of XLA compiler
options for the step's two programs, the step's time, the host's time to launch it, and its kernels.

    JAX_PLATFORMS=cuda PYTHONPATH=$PWD python3 scripts/profile_single_step.py --buckets 2 16 \
        --variants plain graphs graphs_skip_temp --out $OUT/single_step.json

Each bucket is a (tokens, rows) shape of `Engine._step_args`; the row is the same sequence (ctx tokens of
context) in every one, its padding rows write to the trash page. Like a pipelined engine step, every call
places a fresh copy of the batch from the host (so its buffers sit at new addresses), runs the forward, then
the sampler (its branch-free build where the pipeline would take it), `--calls` times back to back without
reading anything back: the per-call time is the device's when the host keeps ahead, and `launch_ms` (the
host's time to make one call) says whether it does. Variants (`VARIANTS`) recompile both programs with other
compiler options than the runner's own (runner.NO_COMMAND_BUFFERS).
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import jax

from jaxinfer import LLM
from jaxinfer.bench.measure import _start_decoding, back_to_back, kernel_profile
from jaxinfer.bench.workloads import fixed, prompts
from jaxinfer.engine.batcher import BatchShape
from jaxinfer.engine.runner import NO_COMMAND_BUFFERS, SMALL_FORWARD_OPTIONS, forward_kind

VARIANTS = {
    "plain": NO_COMMAND_BUFFERS,  # what the runner compiles for steps of 9+ tokens: kernels launched one by one
    "graphs": {},  # XLA's default CUDA graphs, updated when an input moves
    "graphs_skip_temp": {"xla_gpu_command_buffer_update_mode": "SKIP_TEMP"},
    "graphs_skip_profiled": {"xla_gpu_command_buffer_update_mode": "SKIP_PROFILED"},
    # What the engine compiles for steps of <= 8 tokens (runner.SMALL_FORWARD_OPTIONS): XLA's dot merger past its
    # 32 MB default, so Llama-3-8B's gate and up (2 x 117 MB) are one GEMM.
    "dot_merge": SMALL_FORWARD_OPTIONS,
}

def programs(runner, options: dict) -> tuple:
    """The runner's forward and sampler entry points jitted with `options`."""
    forward = jax.jit(functools.partial(runner._forward_step_impl, attn_fn=runner.attn_fn), donate_argnums=(1,),
                      compiler_options=options)
    sampler = jax.jit(runner._sample_logits_impl, donate_argnums=(0,), static_argnames=("branch_free",),
                      compiler_options=options)
    return forward, sampler


def profile(llm: LLM, plan, slots: list[int], tokens: int, calls: int, options: dict) -> dict:
    engine, runner = llm.engine, llm.engine.runner
    shape = BatchShape(tokens=tokens, seqs=tokens, pages_per_seq=engine.pages_per_seq)
    host_batch, inputs = engine._step_args(shape, plan.seqs, slots)
    sampler_args = runner.place((inputs.sampling, inputs.slots, inputs.sample_mask))
    branch_free = runner.takes_branch_free(inputs.sampling)
    forward, sampler = programs(runner, options)

    def run():
        batch = runner.place(host_batch)  # new buffers, as in every engine step
        runner.kv_cache, step = forward(runner.weights, runner.kv_cache, batch)
        engine.penalties, out = sampler(engine.penalties, step.logits, *sampler_args, branch_free=branch_free)
        return out

    per_call, launch = back_to_back(run, calls)  # its warm call compiles (outside warmup, not counted there)
    try:
        kernels = kernel_profile(lambda: [run() for _ in range(5)], calls=5, top=16)
    except Exception as e:  # the profiler needs CUPTI on GPUs; the timings stand without it
        kernels = {"error": f"{type(e).__name__}: {e}"[:300]}
    return {"tokens": tokens, "branch_free_sampler": branch_free, "ms_per_call": per_call * 1e3,
            "launch_ms": launch * 1e3, "kernels": kernels}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--buckets", type=int, nargs="+", default=[2, 16])
    p.add_argument("--variants", nargs="+", default=["engine"], choices=["engine", *sorted(VARIANTS)],
                   help="engine: the options the engine compiles that bucket with")
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
    result = {"model": args.model, "ctx": args.ctx, "device": jax.devices()[0].device_kind, "runs": []}
    for variant in args.variants:
        for tokens in args.buckets:
            try:
                options = VARIANTS[variant] if variant != "engine" else (
                    SMALL_FORWARD_OPTIONS if forward_kind(tokens) == "small_forward" else NO_COMMAND_BUFFERS)
                row = {"variant": variant, **profile(llm, plan, slots, tokens, args.calls, options)}
            except Exception as e:  # noqa: BLE001 - an option this XLA refuses: say so, go on
                row = {"variant": variant, "tokens": tokens, "error": f"{type(e).__name__}: {e}"[:300]}
            result["runs"].append(row)
            k = row.get("kernels", {})
            print(json.dumps({key: (round(v, 3) if isinstance(v, float) else v) for key, v in row.items()
                              if key != "kernels"} | {"device_ms": round(k.get("total_ms_per_call", float("nan")), 3)}),
                  flush=True)
    for state in states:
        engine.abort(state.request_id)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
