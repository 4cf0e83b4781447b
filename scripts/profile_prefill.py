"""Where one long prefill chunk's device time goes: the forward of a `--tokens`-token prompt (one chunk, the
engine's own bucket and compiled program), timed back to back and broken down by kernel.

    for m in qwen3-30b-a3b llama-3-8b; do JAX_PLATFORMS=cuda PYTHONPATH=$PWD python3 scripts/profile_prefill.py \
        --model $m --tokens 4096 --variants engine graphs --out $OUT/prefill_profile.json; done

One JSON line per variant (the runner's own program, or the same forward compiled with other XLA options):
the forward's time back to back (the device's, when the host keeps ahead), one lone call's wall time (what a
first token waits for), the host's time to make a call, MFU against the active FLOPs (the bench's
`prefill_mfu` count), and the kernels' total; `sampler`, the step's sampler program over the forward's [S, V]
logits (S follows `--max-num-seqs`); the JSON adds the bench's kernel table (`kernel_profile`: classes
and the top kernels), and `generate_ms`, the bench's own end-to-end measurement (`measure.prefill_mfu`:
LLM.generate to the first token, median of three prompts). The chunk rewrites the same KV pages on every call,
which changes nothing the forward computes. `--trace-generate` traces that end-to-end measurement too (where its
time beyond the forward's goes); `--hlo` writes the forward's compiled HLO, to tell what each fusion in the
kernel table computes. The variants' compiler options are profile_single_step's (`VARIANTS`).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import jax

from jaxinfer import LLM
from jaxinfer.bench.limits import ModelCost
from jaxinfer.bench.measure import (back_to_back, greedy, kernel_profile, matmul_rate, prefill_mfu,
                                    profiler_events)
from jaxinfer.bench.workloads import fixed, prompts
from jaxinfer.engine.runner import forward_kind

sys.path.insert(0, str(Path(__file__).parent))  # the sibling scripts below
from profile_single_step import VARIANTS  # noqa: E402  (XLA option sets: plain, graphs, dot_merge, ...)


def traced_generate(llm: LLM, tokens: int) -> dict:
    """The bench's `prefill_mfu` measurement (a fresh `tokens`-long prompt to its first token through
    `LLM.generate`) under the profiler: its wall time, the device's busy time in it, and what the host did
    while the device sat idle (scripts/trace_engine.summarize)."""
    from trace_engine import summarize

    warm, prompt = prompts(fixed(tokens, 1, 2), llm.model_config.vocab_size, seed=tokens + 1)
    llm.generate([warm], greedy(1), use_tqdm=False)
    wall = []

    def timed():
        t = time.perf_counter()
        llm.generate([prompt], greedy(1), use_tqdm=False)
        wall.append(time.perf_counter() - t)

    summary = summarize(profiler_events(timed), min_gap_us=50.0)
    summary.pop("top_kernels_us", None)
    return {"wall_ms": wall[0] * 1e3, **summary}


def lone_call_ms(fn, repeats: int = 5) -> float:
    """Median wall time of one call from an idle device to its result on the host: what a prompt's first
    token waits for (back_to_back's per-call time hides the host's launch behind the previous call)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e3


def sampler_profile(engine, plan, tokens: int, calls: int) -> dict:
    """The step's other program: the sampler over the forward's logits, [S, V] for S = the bucket's rows (the
    engine's `max_num_seqs`, rounded up to a power of two, in a bucket this large), with the sampling arrays the
    engine builds for this prompt. Back to back, device time; and the host's time to build and place them."""
    runner = engine.runner
    shape = engine.batch_shape(tokens)
    t = time.perf_counter()
    inputs = engine._sample_inputs(shape, plan.seqs, [0])
    placed = runner.place((inputs.sampling, inputs.slots, inputs.sample_mask))
    jax.block_until_ready(placed)
    host_ms = (time.perf_counter() - t) * 1e3
    branch_free = runner.takes_branch_free(inputs.sampling)
    logits = runner.forward(runner.place(engine._pack(shape, plan.seqs))).logits

    def run():
        engine.penalties, out = runner.sample(engine.penalties, logits, *placed, branch_free=branch_free)
        return out.tokens

    per_call, _ = back_to_back(run, calls)
    return {"rows": shape.seqs, "vocab": int(logits.shape[-1]), "branch_free": branch_free,
            "ms_per_call": per_call * 1e3, "host_inputs_ms": host_ms,
            "kernels": kernel_profile(lambda: [run() for _ in range(calls)], calls, top=15)}


def profile(model: str, tokens: int, calls: int, memory_fraction: float, rate: float | None,
            trace: bool = False, hlo_path: str | None = None, variants: tuple[str, ...] = ("engine",),
            max_num_seqs: int = 16) -> dict:
    llm = LLM(model, random_weights=True, dtype="bfloat16", max_num_seqs=max_num_seqs, max_num_batched_tokens=tokens,
              max_model_len=tokens + 64, memory_fraction=memory_fraction, use_tqdm=False)
    # Warmup leaves some builds to a background thread; its autotuning kernels would land in the timings below.
    llm.wait_for_background_compile()
    engine, runner = llm.engine, llm.engine.runner
    (prompt,) = prompts(fixed(tokens, 1, 1), llm.model_config.vocab_size, seed=tokens)
    rid = engine.add_request(prompt, greedy(1))
    plan = engine.scheduler.schedule()  # the whole prompt in one chunk (the budget is `tokens`)
    assert plan.seqs and len(plan.seqs[0].token_ids) == tokens, "the prompt did not fit one chunk"
    host_batch = engine._pack(engine.batch_shape(tokens), plan.seqs)
    cost = ModelCost.of(llm.model_config)
    flops = 2 * cost.body_params * tokens + cost.attn_flops_per_pair * tokens * (tokens + 1) // 2
    result = {"model": model, "tokens": tokens, "max_num_seqs": max_num_seqs, "device": jax.devices()[0].device_kind,
              "active_tflop": flops / 1e12, "variants": {}}
    if hlo_path:  # the compiled program itself, to tell what each fusion of the kernel table computes
        lowered = runner._jitted(forward_kind(tokens)).lower(runner.weights, runner.kv_cache, runner.place(host_batch))
        Path(hlo_path).write_text(lowered.compile().as_text())
    for variant in variants:
        if variant == "engine":
            forward = runner._forward_step
        else:  # the same program compiled with other XLA options
            forward = jax.jit(functools.partial(runner._forward_step_impl, attn_fn=runner.attn_fn),
                              donate_argnums=(1,), compiler_options=VARIANTS[variant])

        def run(forward=forward):
            runner.kv_cache, step = forward(runner.weights, runner.kv_cache, runner.place(host_batch))
            return step.logits

        per_call, launch = back_to_back(run, calls)
        lone = lone_call_ms(run)
        result["variants"][variant] = {
            "ms_per_forward": per_call * 1e3,  # back to back: the device's time when the host keeps ahead
            "launch_ms": launch * 1e3,  # the host's time to make one call
            "lone_call_ms": lone,
            "tflops": flops / per_call / 1e12, "mfu": flops / per_call / rate if rate else None,
            "lone_call_mfu": flops / (lone / 1e3) / rate if rate else None,
            # Every Pallas Mosaic GPU kernel (attention and the expert matmuls alike) is named
            # anonymous_mosaic_gpu_kernel; `--hlo` names the fusions.
            "kernels": kernel_profile(lambda run=run: [run() for _ in range(calls)], calls, top=40),
        }
    result["sampler"] = sampler_profile(engine, plan, tokens, calls)
    engine.abort(rid)
    result["generate"] = prefill_mfu(llm, cost, tokens, rate or float("nan"))  # the bench's own measurement
    result["generate_ms"] = result["generate"]["prefill_s"] * 1e3
    result["generate_traced"] = traced_generate(llm, tokens) if trace else None
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-30b-a3b", help="one model per process (the next would not fit beside it)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--memory-fraction", type=float, default=0.85)
    p.add_argument("--matmul-rate", type=float, default=None, help="TFLOP/s to take MFU against (default: measure)")
    p.add_argument("--trace-generate", action="store_true",
                   help="also trace the bench's end-to-end measurement (LLM.generate to the first token)")
    p.add_argument("--variants", nargs="+", default=["engine"], choices=["engine", *sorted(VARIANTS)],
                   help="engine: the runner's own program; others: the same forward compiled with those options")
    p.add_argument("--max-num-seqs", type=int, default=16, help="the bench's engine has 256")
    p.add_argument("--hlo", default=None, help="write the forward's compiled HLO text here")
    p.add_argument("--out", default="profile_prefill.json")
    args = p.parse_args()
    rate = args.matmul_rate * 1e12 if args.matmul_rate else None
    if rate is None:
        rate = matmul_rate(8192)  # the bench's ceiling, measured the same way
    out = Path(args.out)
    runs = json.loads(out.read_text())["runs"] if out.exists() else []  # one model per process appends here
    row = profile(args.model, args.tokens, args.calls, args.memory_fraction, rate, args.trace_generate,
                  args.hlo, tuple(args.variants), args.max_num_seqs)
    runs.append(row)
    for name, v in row["variants"].items():
        head = {"model": row["model"], "max_num_seqs": row["max_num_seqs"], "variant": name,
                "generate_ms": round(row["generate_ms"], 2)}
        figures = {k: (round(x, 3) if isinstance(x, float) else x) for k, x in v.items() if k != "kernels"}
        figures["kernel_ms"] = round(v["kernels"]["total_ms_per_call"], 3)
        print(json.dumps(head | figures), flush=True)
    sampler = {k: (round(x, 3) if isinstance(x, float) else x) for k, x in row["sampler"].items() if k != "kernels"}
    print(json.dumps({"model": row["model"], "max_num_seqs": row["max_num_seqs"], "sampler": sampler}), flush=True)
    out.write_text(json.dumps({"matmul_rate_tflops": rate / 1e12, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
