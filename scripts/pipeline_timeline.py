"""Where a pipelined single step's time goes, Llama-3-8B shape at batch 64 (jaxinfer/engine/pipeline.py).

Part 1, the host timeline: 64 prompts decode under a JSON schema while the engine's and the launcher's calls are
time-stamped from outside (the runner's forward and sampler, the launcher's job, the engine thread's wait for
the tokens). Prints medians over the steady state: the step period, the engine thread's wait for tokens and
its host work between two waits, how long each device call takes to return to the host (a call that syncs on a
branch predicate returns only when the device got there), how late the launcher starts a job, and the engine
thread's time per step in the functions that make up its host work. `--cprofile N` adds a cProfile'd run.

Part 2, device time with the host taken out: the same decode step's programs dispatched back to back, 20 calls
each (forward alone with the same and with new input buffers, sampler alone with the all-allowed mask and with
a grammar mask, forward + sampler, the multi-step loop per iteration), how much a Python thread gets done while
another waits in a device call (the GIL probe), and the number of `conditional` ops in each compiled program.

    PYTHONPATH=$PWD python3 scripts/pipeline_timeline.py --tokenizer serve_wheels/tokenizer
    # a quick try of the script on CPU:
    ... --model smollm2-135m --dtype float32 --batch 8 --input-len 32 --max-tokens 24
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import pstats
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import jax
import numpy as np

from jaxinfer.bench.measure import back_to_back
from jaxinfer.engine import pipeline, runner

LOG: list[tuple[float, str, str]] = []


def _stamped(owner: Any, name: str, tag: str) -> None:
    inner = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        LOG.append((time.perf_counter(), threading.current_thread().name, f"{tag}_call"))
        out = inner(*args, **kwargs)
        LOG.append((time.perf_counter(), threading.current_thread().name, f"{tag}_ret"))
        return out

    setattr(owner, name, wrapper)


HOST: dict[str, float] = {}  # engine-thread seconds per function, inclusive


def _timed(owner: Any, name: str, label: str) -> None:
    """Add the engine thread's time inside owner.name to HOST[label] (calls from other threads are not counted)."""
    inner = owner.__dict__[name]
    fn = inner.__func__ if isinstance(inner, classmethod) else inner

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return fn(*args, **kwargs)
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            HOST[label] = HOST.get(label, 0.0) + time.perf_counter() - t

    setattr(owner, name, classmethod(wrapper) if isinstance(inner, classmethod) else wrapper)


def _time_host_work() -> None:
    from jaxinfer.engine import decode_loop, engine, grammar, output_path, sampling_rows

    for owner, name in [(engine.Engine, "_sample_inputs"), (engine.Engine, "_grammar_bitmask"),
                        (engine.Engine, "_slot_rows"), (engine.Engine, "_pack"), (engine.Engine, "_forward_inputs"),
                        (engine.Engine, "_prompt_next_ids"), (sampling_rows.SamplingArrays, "from_params"),
                        (runner.ModelRunner, "place"), (pipeline.StepPipeline, "_plan_ahead"),
                        (decode_loop.DecodeLoop, "settle"), (output_path.OutputPath, "apply"),
                        (output_path.OutputPath, "emit"), (grammar.GrammarCache, "fill"),
                        (engine.Engine, "step"), (Future, "result")]:
        _timed(owner, name, f"{owner.__name__}.{name}")


def _spans(tag: str, thread: str | None = None) -> list[tuple[float, float]]:
    """(call, return) times of `tag`, in order."""
    events = [(t, x) for t, th, x in LOG if x.startswith(tag + "_") and (thread is None or th == thread)]
    return [(a, b) for (a, x), (b, y) in zip(events, events[1:]) if x.endswith("call") and y.endswith("ret")]


def _median_ms(values: list[float]) -> float:
    return float(np.median(values) * 1e3) if values else float("nan")


def timeline(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    from jaxinfer import SamplingParams
    from jaxinfer.bench.measure import fixed, prompts
    from jaxinfer.bench.serve_bench import LONG_LIST

    _stamped(runner.ModelRunner, "forward", "fwd")
    _stamped(runner.ModelRunner, "sample", "smp")
    _stamped(pipeline.StepPipeline, "_sample", "step")
    _stamped(pipeline.StepPipeline, "_sample_then_forward", "job")
    _stamped(pipeline.jax, "device_get", "get")
    _time_host_work()
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                             structured={"json": LONG_LIST}) for _ in range(args.batch)]
    vocab = llm.model_config.vocab_size
    llm.generate(prompts(fixed(args.input_len, 1, args.batch), vocab, 1), params, use_tqdm=False)  # warm
    LOG.clear()
    HOST.clear()
    steps_before = llm.engine_stats()["num_steps"]
    t = time.perf_counter()
    llm.generate(prompts(fixed(args.input_len, 1, args.batch), vocab, 2), params, use_tqdm=False)
    wall = time.perf_counter() - t
    num_steps = llm.engine_stats()["num_steps"] - steps_before
    main = threading.main_thread().name
    steps = [a for a, _ in _spans("step")]
    steps = steps[len(steps) // 6: -len(steps) // 6]  # decode-only, pipelined steady state
    lo, hi = steps[0], steps[-1]
    gets = [(a, b) for a, b in _spans("get", main) if lo <= a <= hi]
    work = [nxt[0] - prev[1] for prev, nxt in zip(gets, gets[1:])]  # host work between two token reads
    jobs = [a for a, _ in _spans("job") if lo <= a <= hi]
    late = [j - s for s, j in zip(steps, jobs)]  # step entry (the job is submitted in it) -> job start
    result = {
        "wall_s": wall,
        "step_period_ms": float(np.median(np.diff(steps)) * 1e3),
        "wait_for_tokens_ms": _median_ms([b - a for a, b in gets]),
        "host_work_between_reads_ms": _median_ms(work),
        "forward_call_returns_ms": _median_ms([b - a for a, b in _spans("fwd") if lo <= a <= hi]),
        "sampler_call_returns_ms": _median_ms([b - a for a, b in _spans("smp") if lo <= a <= hi]),
        "launcher_job_ms": _median_ms([b - a for a, b in _spans("job") if lo <= a <= hi]),
        "step_entry_to_job_start_ms": _median_ms(late),
        "engine_steps": num_steps,
        # Mean over every step of the run (prefills too): where the engine thread's host time goes.
        "host_ms_per_step": {k: round(v / num_steps * 1e3, 3) for k, v in sorted(HOST.items(), key=lambda kv: -kv[1])},
    }
    if args.cprofile:  # the engine thread's host work by function, in a run of its own (cProfile slows it)
        profile = cProfile.Profile()
        profile.runcall(llm.generate, prompts(fixed(args.input_len, 1, args.batch), vocab, 3), params, use_tqdm=False)
        stats = pstats.Stats(profile, stream=sys.stderr)
        stats.sort_stats("tottime").print_stats(args.cprofile)
        stats.sort_stats("cumtime").print_stats(args.cprofile)
    return result


def per_call_ms(fn: Callable[[], Any], calls: int = 20) -> tuple[float, float]:
    """(device ms per call with `calls` calls queued back to back, median ms for one call to return)."""
    period, returns = back_to_back(fn, calls)
    return period * 1e3, returns * 1e3


def gil_probe(call: Callable[[], Any], before: Callable[[], Any], wait_first: bool = False) -> float:
    """How much pure-Python work this thread gets done while another thread makes `call` (after `before` queued
    work ahead of it on the device), as a fraction of its rate beside an idle thread: near 1 when the call
    releases the GIL while it waits for the device, near 0 when it holds it."""

    def spin(until: threading.Event) -> float:
        n, t = 0, time.perf_counter()
        while not until.is_set():
            n += 1
        return n / (time.perf_counter() - t)

    idle = threading.Event()
    threading.Timer(0.02, idle.set).start()
    base = spin(idle)
    rates = []
    for _ in range(5):
        queued = before()
        done = threading.Event()

        def go() -> None:
            if wait_first and queued is not None:
                jax.block_until_ready(queued)
            jax.block_until_ready(call())
            done.set()

        threading.Thread(target=go).start()
        rates.append(spin(done))
    return float(np.median(rates) / base)


def device_times(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    from jaxinfer.bench.measure import _start_decoding, fixed, prompts

    engine, run = llm.engine, llm.engine.runner
    states = _start_decoding(engine, prompts(fixed(args.input_len, 1, args.batch), llm.model_config.vocab_size, 7))
    plan = engine.scheduler.schedule()  # every row decodes one token
    slots = engine._slot_rows(plan)
    shape = engine.batch_shape(len(plan.seqs))
    batch, inputs = run.place(engine._step_args(shape, plan.seqs, slots))
    n = engine.decode_steps_per_call
    decode_args = run.place(engine._decode_args(engine.decode_shape(len(plan.seqs)), plan.seqs, slots, n))
    rng = np.random.default_rng(0)
    grammar = run.place(rng.integers(-2**31, 2**31, inputs.sampling.token_bitmask.shape, dtype=np.int64)
                        .astype(np.int32) | 1)  # some tokens allowed in every row (bit 0 of word 0 at least)
    constrained = dataclasses.replace(inputs.sampling, token_bitmask=grammar)
    logits = run.forward(batch).logits
    box: dict[str, Any] = {"penalties": engine.penalties}

    def sample(sampling: Any) -> Callable[[], Any]:
        def go() -> Any:
            box["penalties"], out = run.sample(box["penalties"], logits, sampling, inputs.slots, inputs.sample_mask)
            return out
        return go

    def single(sampling: Any) -> Callable[[], Any]:
        def go() -> Any:
            step = run.forward(batch)
            box["penalties"], out = run.sample(box["penalties"], step.logits, sampling, inputs.slots,
                                               inputs.sample_mask)
            return out
        return go

    def multi() -> Any:
        box["penalties"], out = run.decode_steps(box["penalties"], *decode_args, max_steps=n)
        return out

    host_batch = engine._pack(shape, plan.seqs)
    result = {}
    for name, fn in [("forward", lambda: run.forward(batch).logits),
                     # fresh input buffers every call, as the engine's steps have them
                     ("forward_fresh_inputs", lambda: run.forward(run.place(host_batch)).logits),
                     ("sampler_open", sample(inputs.sampling)),
                     ("sampler_grammar", sample(constrained)), ("single_open", single(inputs.sampling)),
                     ("single_grammar", single(constrained))]:
        ms, ret = per_call_ms(fn)
        result[name] = {"device_ms_per_call": ms, "call_returns_ms": ret}
    ms, ret = per_call_ms(multi)
    result["multi_step"] = {"device_ms_per_iteration": ms / n, "call_returns_ms": ret, "iterations": n}
    result["python_progress_beside"] = {
        "sampler_queued_behind_forward": gil_probe(lambda: sample(inputs.sampling)(), lambda: run.forward(batch)),
        "sampler_after_forward_ready": gil_probe(
            lambda: sample(inputs.sampling)(), lambda: run.forward(batch), wait_first=True),
        "forward_alone": gil_probe(lambda: run.forward(batch), lambda: None),
    }
    engine.penalties = box["penalties"]
    hlo = {
        "forward": run._forward_step.lower(run.weights, run.kv_cache, batch).compile().as_text(),
        "sampler": run._sample_logits.lower(engine.penalties, logits, inputs.sampling, inputs.slots,
                                            inputs.sample_mask).compile().as_text(),
    }
    result["conditionals"] = {k: text.count(" conditional(") for k, text in hlo.items()}
    for state in states:
        engine.abort(state.request_id)
    return result


def main() -> None:
    from jaxinfer import LLM

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--timeline-only", action="store_true", help="leave out part 2")
    p.add_argument("--cprofile", type=int, default=0, help="print this many functions of a cProfile'd run to stderr")
    args = p.parse_args()
    llm = LLM(args.model, random_weights=True, tokenizer=args.tokenizer, dtype=args.dtype, max_num_seqs=args.batch,
              max_num_batched_tokens=4096, max_model_len=2048, decode_steps_per_call=8, memory_fraction=0.9,
              use_tqdm=False)
    out = {"backend": jax.default_backend(), "args": vars(args), "timeline": timeline(llm, args)}
    if not args.timeline_only:
        out["device"] = device_times(llm, args)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
