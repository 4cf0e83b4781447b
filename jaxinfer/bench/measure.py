"""The measurements of `jaxinfer bench`: ceilings, offline throughput, a concurrency sweep, decode MBU and
prefill MFU. Each takes a built `LLM` (random weights of a full-size preset on the GPU; a tiny config on
CPU in the tests) and returns plain numbers; `jaxinfer.bench.main` puts them together."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.bench.limits import ModelCost
from jaxinfer.bench.workloads import Workload, fixed, prompts
from jaxinfer.config import RequestOutputKind, SamplingParams


def median_time(fn: Callable[[], Any], repeats: int = 10) -> float:
    jax.block_until_ready(fn())  # compile and warm
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def copy_bandwidth(gib: float) -> dict[str, float]:
    """Bytes read + written per second by plain XLA passes over a large bf16 array, per method."""
    n = int(gib * (1 << 30) // 2)
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    passes = {
        "jax_scale": jax.jit(lambda a: a * jnp.bfloat16(1.0001)),
        "jax_add": jax.jit(lambda a: a + jnp.bfloat16(1)),
    }
    return {name: 2 * x.nbytes / median_time(lambda f=f: f(x)) for name, f in passes.items()}


def matmul_rate(n: int) -> float:
    """bf16 FLOP/s of an n^3 product."""
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: x @ y)
    return 2 * n**3 / median_time(lambda: f(a, b))


def greedy(max_tokens: int, output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> SamplingParams:
    """Exactly max_tokens tokens, greedy: the lengths a benchmark asked for, whatever the weights say."""
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, output_kind=output_kind)


def _stats_delta(llm: Any, before: dict[str, Any]) -> dict[str, Any]:
    after = llm.engine_stats()
    phases = {k: after["step_time_s"][k] - before["step_time_s"][k] for k in after["step_time_s"]}
    return {
        "engine_steps": after["num_steps"] - before["num_steps"],
        "preemptions": after["num_preemptions"] - before["num_preemptions"],
        # Prompt tokens served from the prefix cache: 0 unless prompts share prefixes or a preempted request
        # comes back to its own cached pages.
        "prefix_cache_hit_tokens": after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"],
        # Which decode path ran: pipelined single steps, or multi-step calls launched ahead of the host.
        "pipelined_steps": after["num_pipelined_steps"] - before["num_pipelined_steps"],
        "overlapped_calls": after["num_overlapped_calls"] - before["num_overlapped_calls"],
        "step_time_s": phases,
    }


def offline_throughput(llm: Any, workload: Workload, seed: int = 0) -> dict[str, Any]:
    """Every request queued at once, run to completion: output and total tokens per second."""
    batch = prompts(workload, llm.model_config.vocab_size, seed)
    params = [greedy(n) for n in workload.output_lens]
    before = llm.engine_stats()
    t = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    produced = sum(len(o.token_ids) for o in outs)
    if produced != workload.output_tokens:
        raise RuntimeError(f"{workload.name}: generated {produced} tokens, the workload asks for {workload.output_tokens}")
    return {
        "num_prompts": workload.num_prompts,
        "input_tokens": workload.input_tokens,
        "output_tokens": produced,
        "elapsed_s": elapsed,
        "output_tok_s": produced / elapsed,
        "total_tok_s": (produced + workload.input_tokens) / elapsed,
        "request_s": workload.num_prompts / elapsed,
        **_stats_delta(llm, before),
    }


def _summary(values_s: Sequence[float]) -> dict[str, float]:
    """mean / median / p99 in milliseconds (the metric set of `vllm bench serve`)."""
    a = np.asarray(values_s, float) * 1e3
    if a.size == 0:
        return {"mean_ms": float("nan"), "median_ms": float("nan"), "p99_ms": float("nan")}
    return {"mean_ms": float(a.mean()), "median_ms": float(np.median(a)), "p99_ms": float(np.percentile(a, 99))}


ITL_WORST = 12  # the sweep keeps its largest inter-token gaps with where they fell: a p99 is about the 5th of 500


def serve_at_concurrency(llm: Any, workload: Workload, concurrency: int, seed: int = 0,
                         request_rate: float | None = None) -> dict[str, Any]:
    """Serving at most `concurrency` requests at a time. With no `request_rate` the loop is closed: a new request
    is sent as soon as one finishes (`vllm bench serve --max-concurrency C` with an infinite request rate), so
    clients of equal lengths finish, and send again, together. With a rate the requests arrive as a Poisson
    process of that many a second (seeded), each sent at its arrival or, while `concurrency` are in flight, when
    one finishes (`--request-rate R --max-concurrency C`). Times are from a request's add_request to its tokens
    reaching the host."""
    batch = prompts(workload, llm.model_config.vocab_size, seed)
    arrivals = poisson_arrivals(workload.num_prompts, request_rate, seed)
    pending = list(range(workload.num_prompts))[::-1]
    in_flight: dict[str, int] = {}
    ttfts, tpots, itls, e2es = [], [], [], []
    gaps: list[tuple[float, int, int]] = []  # (seconds, request, token position of the gap's later token)
    before = llm.engine_stats()
    start = time.perf_counter()
    while pending or in_flight:
        now = time.perf_counter() - start
        while pending and len(in_flight) < concurrency and arrivals[pending[-1]] <= now:
            i = pending.pop()
            in_flight[llm.add_request(batch[i], greedy(workload.output_lens[i]))] = i
        if not in_flight:  # nothing to run until the next request arrives
            time.sleep(max(0.0, arrivals[pending[-1]] - now))
            continue
        for out in llm.step():
            if not out.finished or out.request_id not in in_flight:
                continue
            index = in_flight.pop(out.request_id)
            m = out.metrics
            e2e = m["finished_time"] - m["arrival_time"]  # wall-clock seconds, as vLLM's RequestMetrics
            e2es.append(e2e)
            ttfts.append(m["ttft_s"])
            itls.extend(out.inter_token_latencies)
            # Gap j is between tokens j and j + 1 (token 0 is the prefill's): where in a request the tail sits.
            gaps.extend((g, index, j + 1) for j, g in enumerate(out.inter_token_latencies))
            if len(out.token_ids) > 1:
                tpots.append((e2e - m["ttft_s"]) / (len(out.token_ids) - 1))
    duration = time.perf_counter() - start
    return {
        "concurrency": concurrency,
        "request_rate": request_rate,  # None: closed loop
        "num_prompts": workload.num_prompts,
        "duration_s": duration,
        "request_throughput": workload.num_prompts / duration,
        "output_throughput": workload.output_tokens / duration,
        "total_token_throughput": (workload.input_tokens + workload.output_tokens) / duration,
        "ttft": _summary(ttfts),
        "tpot": _summary(tpots),
        "itl": _summary(itls),
        "itl_worst": [{"ms": g * 1e3, "request": i, "token": j} for g, i, j in sorted(gaps, reverse=True)[:ITL_WORST]],
        "e2e": _summary(e2es),
        **_stats_delta(llm, before),
    }


def poisson_arrivals(n: int, rate: float | None, seed: int = 0) -> list[float]:
    """Arrival times in seconds from the start of n requests at `rate` a second (exponential gaps, the first at
    its gap too); all 0.0 when rate is None (every request there from the start)."""
    if rate is None:
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"request_rate must be above 0 requests a second, got {rate}.")
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, n)).tolist()


def decode_mbu(llm: Any, cost: ModelCost, batch: int, ctx: int, steps: int, copy_bw: float,
               streamed: bool = False) -> dict[str, Any]:
    """Prefill `batch` prompts of `ctx` tokens, decode two untimed engine calls, then time the engine decoding
    `steps` more tokens for each.

    MBU = (weight bytes + KV bytes attended) per step / step time / copy bandwidth; a step is one token for
    every sequence, whatever the number of engine calls (multi-step decode makes several per call). The
    requests return only when finished, as `LLM.generate`'s do, or with `streamed` report every token as it
    comes (CUMULATIVE, as a streaming client's do): on a GPU small streamed batches decode in single steps
    (`Engine.decodes_singly`), so the two differ there.
    """
    engine = llm.engine
    states = _start_decoding(engine, prompts(fixed(ctx, steps, batch), llm.model_config.vocab_size, seed=batch),
                             streamed)

    def generated() -> int:
        return sum(len(s.seqs[0].token_ids) for s in states)

    # Two untimed calls' worth of tokens first (as many as the requests' room allows): the first executions of a
    # program at a new shape pay one-time costs (the GPU's CUDA graphs are built then), which a steady-state
    # step does not.
    warm = max(0, min(2 * engine.decode_steps_per_call, engine.max_model_len - ctx - steps - 2))
    warm_end = generated() + warm * batch
    while generated() < warm_end:
        engine.step()
    engine.flush()
    start = [len(s.seqs[0].token_ids) for s in states]  # rows prefilled early are already ahead
    start_tokens, before = sum(start), llm.engine_stats()
    t = time.perf_counter()
    while generated() - start_tokens < steps * batch:
        engine.step()
    engine.flush()  # the call launched last runs on (overlapped decode): its tokens count, so its time does too
    elapsed = time.perf_counter() - t
    end = [len(s.seqs[0].token_ids) for s in states]
    made = sum(end) - start_tokens
    delta = _stats_delta(llm, before)
    for s in states:
        engine.abort(s.request_id)
    step_s = elapsed / (made / batch)
    # Each row's mean context over the timed tokens: its prompt, what it had, half of what it made.
    context = sum(ctx + a + (b - a) / 2 for a, b in zip(start, end))
    kv_bytes = context * cost.kv_bytes_per_token
    return {
        "batch": batch,
        "ctx": ctx,
        "streamed": streamed,
        "step_ms": step_s * 1e3,
        "tok_s": batch / step_s,
        "bytes_per_step": cost.weight_bytes(batch) + kv_bytes,
        "mbu": (cost.weight_bytes(batch) + kv_bytes) / step_s / copy_bw,
        **delta,
    }


def _start_decoding(engine: Any, batch: list[list[int]], streamed: bool = False) -> list[Any]:
    """Queue `batch` and step until every request holds its first token; returns their states, which stay
    valid after the engine drops a request. max_tokens is far beyond what any measurement waits for (rows
    prefilled early decode while later ones prefill), so no request finishes while it is measured; the
    caller aborts them. The requests stream (CUMULATIVE outputs) or, as `generate`'s, return only when done."""
    kind = RequestOutputKind.CUMULATIVE if streamed else RequestOutputKind.FINAL_ONLY
    ids = [engine.add_request(p, greedy(engine.max_model_len - len(p), kind)) for p in batch]
    states = [engine.requests[rid] for rid in ids]
    while any(not s.seqs[0].token_ids for s in states):
        engine.step()
    engine.flush()  # callers may schedule by hand: no decode call may still be in flight
    return states


def prefill_mfu(llm: Any, cost: ModelCost, tokens: int, rate: float, repeats: int = 3) -> dict[str, Any]:
    """A `tokens`-long prompt timed to its first token (chunked by the engine's token budget): the median of
    `repeats` distinct prompts after one that warms the path (each is one engine step of ~100 ms at 4k tokens
    on an H200, so a single sample carries the host's jitter; all of them are kept in `prefill_times_s`)."""
    warm, *timed = prompts(fixed(tokens, 1, repeats + 1), llm.model_config.vocab_size, seed=tokens)  # no prefix hit
    llm.generate([warm], greedy(1), use_tqdm=False)
    times = []
    for prompt in timed:
        t = time.perf_counter()
        llm.generate([prompt], greedy(1), use_tqdm=False)
        times.append(time.perf_counter() - t)
    elapsed = float(np.median(times))
    flops = 2 * cost.body_params * tokens + 2 * cost.head_params + cost.attn_flops_per_pair * tokens * (tokens + 1) // 2
    return {"tokens": tokens, "prefill_s": elapsed, "prefill_times_s": times, "tflops": flops / elapsed / 1e12,
            "mfu": flops / elapsed / rate}


def back_to_back(fn: Callable[[], Any], calls: int = 20) -> tuple[float, float]:
    """`fn` (a device call that reads nothing back) made `calls` times in a row, three times over, after a warm
    call: (median seconds per call, median seconds for one call to return to the host). The first is the
    device's time per call when the host keeps ahead; the second says whether it does."""
    jax.block_until_ready(fn())
    periods, returns = [], []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(calls - 1):
            c = time.perf_counter()
            fn()
            returns.append(time.perf_counter() - c)
        jax.block_until_ready(fn())
        periods.append((time.perf_counter() - t) / calls)
    return float(np.median(periods)), float(np.median(returns))


def decode_device_profile(llm: Any, cost: ModelCost, batch: int, ctx: int, copy_bw: float, calls: int = 20) -> dict[str, Any]:
    """Device time of one decode step with the host taken out: the same step's arguments dispatched
    `calls` times back to back (asynchronously, so the device never waits for the host), for the single
    step and for the multi-step call. Set beside the engine's own step time, the difference is host time.
    """
    engine, runner = llm.engine, llm.engine.runner
    states = _start_decoding(engine, prompts(fixed(ctx, 1, batch), llm.model_config.vocab_size, 7))
    plan = engine.scheduler.schedule()  # every row decodes one token
    slots = engine._slot_rows(plan)
    rows = len(plan.seqs)
    step_args = engine._step_args(engine.step_shape(rows, rows), plan.seqs, slots)  # the engine's bucket
    n = engine.decode_steps_per_call
    decode_args = engine._decode_args(engine.decode_shape(rows), plan.seqs, slots, n)

    def run_single() -> Any:
        engine.penalties, out = runner.step(engine.penalties, *step_args)
        return out

    def run_multi() -> Any:
        engine.penalties, out = runner.decode_steps(engine.penalties, *decode_args, max_steps=n,
                                                    branch_free=runner.takes_branch_free(decode_args[1].sampling))
        return out

    single, multi = back_to_back(run_single, calls)[0], back_to_back(run_multi, calls)[0] / n
    try:
        kernels = kernel_profile(lambda: [run_single() for _ in range(5)], calls=5)
    except Exception as e:  # the profiler needs CUPTI on GPUs; the timings above stand without it
        kernels = {"error": f"{type(e).__name__}: {e}"[:500]}
    for state in states:
        engine.abort(state.request_id)
    bytes_per_step = cost.weight_bytes(batch) + batch * ctx * cost.kv_bytes_per_token
    return {
        "batch": batch,
        "ctx": ctx,
        "single_step_ms": single * 1e3,
        "multi_step_ms_per_iteration": multi * 1e3,
        "decode_steps_per_call": n,
        "bytes_per_step": bytes_per_step,
        "ideal_ms_at_copy_bw": bytes_per_step / copy_bw * 1e3,
        "device_mbu_single": bytes_per_step / single / copy_bw,
        "device_mbu_multi": bytes_per_step / multi / copy_bw,
        "kernels": kernels,
    }


KERNEL_CLASSES = (  # substrings of device event names, checked in order (the Pallas GPU kernels are named by
    # kernel_name: ragged_paged_attention_*, quantized_matmul, fp8_matmul_*, grouped_matmul_*, gather_matmul_swiglu)
    ("attention", ("ragged", "attention", "paged")),
    ("matmul", ("gemm", "cublas", "nvjet", "cutlass", "matmul", "dot")),
)


def kernel_class(name: str) -> str:
    """The KERNEL_CLASSES class of a device event name, or "other"."""
    lowered = name.lower()
    return next((c for c, keys in KERNEL_CLASSES if any(k in lowered for k in keys)), "other")


def device_spans(fn: Callable[[], Any]) -> tuple[str, dict[str, float]]:
    """Run `fn` once under the JAX profiler; (source, total ms per event name) from its Perfetto trace
    (`device_events`)."""
    source, events = device_events(fn)
    per_name: dict[str, float] = {}
    for name, ms in events:
        per_name[name] = per_name.get(name, 0.0) + ms
    return source, per_name


def profiler_events(fn: Callable[[], Any]) -> list[dict[str, Any]]:
    """Run `fn` once under the JAX profiler and wait for its result; the events of its Perfetto trace (raw
    dicts: ph, name, pid, ts, dur, args)."""
    import glob
    import gzip
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            jax.block_until_ready(fn())
        (path,) = glob.glob(f"{tmp}/**/perfetto_trace.json.gz", recursive=True)
        with gzip.open(path) as f:
            trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def device_events(fn: Callable[[], Any]) -> tuple[str, list[tuple[str, float]]]:
    """Run `fn` once under the JAX profiler; (source, [(event name, ms)] for every span) from its Perfetto trace.

    On a GPU only the device's own events count (the host threads are left out): source "device". On CPU
    there are no device events and the host's are taken instead: source "host".
    """
    events = profiler_events(fn)
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {pid for pid, name in names.items() if "GPU" in name or "TPU" in name}
    spans = [(e["name"], float(e.get("dur", 0.0)) / 1e3) for e in events  # us -> ms
             if e.get("ph") == "X" and (e["pid"] in device or not device)]
    return ("device" if device else "host"), spans


def kernel_profile(fn: Callable[[], Any], calls: int, top: int = 12) -> dict[str, Any]:
    """Device time per kernel name, per call of the step, for `fn` running `calls` steps (after a warm run)."""
    jax.block_until_ready(fn())
    source, spans = device_spans(fn)
    per_name = {name: ms / calls for name, ms in spans.items()}
    total = sum(per_name.values())
    classes = dict.fromkeys([c for c, _ in KERNEL_CLASSES] + ["other"], 0.0)
    for name, ms in per_name.items():
        classes[kernel_class(name)] += ms
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1])[:top]
    return {
        "source": source,
        "total_ms_per_call": total,
        "ms_per_call_by_class": classes,
        "top": [{"name": name[:120], "ms_per_call": ms, "share": ms / total if total else 0.0} for name, ms in ranked],
    }
