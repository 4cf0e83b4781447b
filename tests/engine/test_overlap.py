"""Overlapped decode: the engine launches the next multi-step call before reading the last one back.

Every test compares an engine with `overlap_decode=True` against the same engine (same runner, same weights)
with it off: the tokens, finish reasons and logprobs must be identical, whatever finishes rows on the device
(budgets, stop ids) or only on the host (stop ids past the device's MAX_STOP_IDS, aborts).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from jaxinfer.config import CacheConfig, EngineConfig, SamplingParams
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.runner import DECODE_KINDS
from jaxinfer.validation import MAX_STOP_IDS
import model_helpers
from model_helpers import run_to_completion

CFG = model_helpers.tiny_config()
STEPS = 4


@functools.cache
def runner(tp: int = 1):
    return model_helpers.build_runner(CFG, tp=tp, seed=3, num_pages=96, page_size=4)


def make_engine(overlap: bool, tp: int = 1, max_num_seqs: int = 8) -> Engine:
    engine = Engine(
        runner(tp), None, EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=96),
        CacheConfig(page_size=4), use_tqdm=False, decode_steps_per_call=STEPS, overlap_decode=overlap,
    )
    engine.warmup()
    return engine


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, CFG.vocab_size, rng.integers(3, 14))] for _ in range(n)]


def mixed_params(free: list[list[int]]) -> list[SamplingParams]:
    """Rows that stop at different iterations, for every reason the engine knows. `free`: each row's tokens
    without stops, from which the stop ids are picked so that they are hit."""
    def unused(row: int) -> tuple[int, ...]:  # ids the row never samples: filler for the device's slots
        return tuple(t for t in range(CFG.vocab_size) if t not in free[row])[:MAX_STOP_IDS]

    params = [
        SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=30, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.7, seed=5, max_tokens=17, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=8, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=2, max_tokens=9, ignore_eos=True, frequency_penalty=0.5),
        SamplingParams(temperature=0.8, seed=4, max_tokens=33, ignore_eos=True, min_tokens=6),
    ]
    if free:
        stops = {3: (free[3][13],),  # the device sees it and stops the row
                 4: unused(4) + (free[4][10],),  # past the device's MAX_STOP_IDS: only the host stops it
                 6: (free[6][2], free[6][9])}  # held back under min_tokens, then a device stop
        params = [dataclasses.replace(p, stop_token_ids=stops.get(i, ())) for i, p in enumerate(params)]
    return params


# place_ahead=False: a continuation's host arrays are sent after the call before it returns, as on a mesh that
# spans processes (DecodeLoop.place_ahead).
@pytest.mark.parametrize("tp, place_ahead", [(1, True), (2, True), (1, False)])
def test_overlapped_decode_gives_the_synchronous_results(tp: int, place_ahead: bool) -> None:
    ps = prompts(7)
    sync, overlapped = make_engine(False, tp), make_engine(True, tp)
    overlapped.loop.place_ahead = place_ahead
    free = [o.outputs[0].token_ids for o in sync.generate(ps, mixed_params([]))]
    want = sync.generate(ps, mixed_params(free))
    got = overlapped.generate(ps, mixed_params(free))
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in want]
    # Logprobs agree to float32 noise: the synchronous engine packs surviving rows into new row positions.
    for g, w in zip(got, want):
        assert g.outputs[0].cumulative_logprob == pytest.approx(w.outputs[0].cumulative_logprob, rel=1e-4, abs=1e-5)
        for g_top, w_top in zip(g.outputs[0].logprobs or [], w.outputs[0].logprobs or []):
            assert g_top.keys() == w_top.keys()
            assert list(g_top.values()) == pytest.approx(list(w_top.values()), rel=1e-4, abs=1e-5)
    # Host-only stops and device stops both happened, and calls did overlap.
    reasons = {str(o.outputs[0].finish_reason) for o in want}
    assert len(reasons) == 2, reasons
    stats = overlapped.stats()
    assert stats["num_overlapped_calls"] > 0 and sync.stats()["num_overlapped_calls"] == 0
    assert stats["num_compiles_after_warmup"] == 0
    assert stats["free_pages"] == stats["total_pages"] and not overlapped.requests


def test_n_greater_than_one_and_late_arrivals_match() -> None:
    # A request arriving while a chain runs must wait at most one call, and forks must never be continued.
    ps = prompts(5, seed=1)
    params = SamplingParams(temperature=0.8, seed=9, max_tokens=21, ignore_eos=True)
    results = []
    for overlap in (False, True):
        engine = make_engine(overlap, max_num_seqs=4)
        ids = [engine.add_request(p, params) for p in ps[:3]]
        for _ in range(3):
            engine.step()
        ids += [engine.add_request(ps[3], params), engine.add_request(ps[4], SamplingParams(
            n=2, temperature=0.8, seed=1, max_tokens=13, ignore_eos=True))]
        final = run_to_completion(engine)
        results.append([[s.token_ids for s in final[i].outputs] for i in ids])
        assert engine.stats()["free_pages"] == engine.stats()["total_pages"]
    assert results[0] == results[1]


def test_abort_while_a_call_is_in_flight() -> None:
    ps = prompts(4, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    sync = make_engine(False)
    want = {o.request_id: o.outputs[0].token_ids for o in sync.generate(ps, params)}

    engine = make_engine(True)
    for i, p in enumerate(ps):
        engine.add_request(p, params, request_id=f"r{i}")
    while engine.loop.inflight is None or engine.loop.inflight.plan.seqs[0].start_pos < len(ps[0]) + 2 * STEPS:
        engine.step()
    partial = engine.abort("r1")
    assert partial is not None and partial.finished
    assert partial.outputs[0].token_ids == want["req-1"][: len(partial.outputs[0].token_ids)]
    final = run_to_completion(engine)
    assert "r1" not in final
    for i in (0, 2, 3):
        assert final[f"r{i}"].outputs[0].token_ids == want[f"req-{i}"]
    stats = engine.stats()
    assert stats["free_pages"] == stats["total_pages"] and not engine.requests


def test_decode_row_buckets_add_one_and_a_half_steps_above_64() -> None:
    engine = Engine(runner(), None, EngineConfig(max_num_seqs=256, max_num_batched_tokens=64, max_model_len=96),
                    CacheConfig(page_size=4), use_tqdm=False, decode_steps_per_call=STEPS)
    assert engine.decode_row_buckets == [1, 16, 32, 64, 96, 128, 192, 256]
    rows = {n: engine.decode_shape(n).seqs for n in (1, 2, 16, 17, 64, 65, 96, 97, 129, 192, 193, 256)}
    assert rows == {1: 1, 2: 16, 16: 16, 17: 32, 64: 64, 65: 96, 96: 96, 97: 128, 129: 192, 192: 192, 193: 256,
                    256: 256}


def test_branch_free_multi_step_build_changes_no_token_and_has_no_conditional(monkeypatch) -> None:
    """The GPU's multi-step loop without `lax.cond` in its body (forced here on CPU) gives the branching build's
    tokens, finish reasons and logprobs for batches `branch_free_applies` to (greedy and seeded rows, penalties,
    min-p, min_tokens), compiles in the background after warmup (no compile while serving), and has no
    conditional in its program; a batch with a top-p row or top logprobs keeps the branching build."""
    ps = prompts(6, seed=4)
    free_params = [dataclasses.replace(p, top_p=1.0, logprobs=0) for p in mixed_params([])[:6]]
    free_params[3] = dataclasses.replace(free_params[3], min_p=0.05)
    calls: list[bool] = []
    run = runner(1)  # make_engine's (the cache keys on the argument as passed)
    decode_steps = run.decode_steps

    def recorded(*args, branch_free=False, **kwargs):
        calls.append(branch_free)
        return decode_steps(*args, branch_free=branch_free, **kwargs)

    monkeypatch.setattr(run, "decode_steps", recorded)
    results = {}
    for branch_free in (False, True):
        monkeypatch.setattr(run, "branch_free_sampler", branch_free)
        engine = make_engine(True)
        assert engine.wait_for_background_compile(timeout=300)  # the branch-free builds come after warmup
        out = engine.generate(ps, free_params)
        results[branch_free] = [(o.outputs[0].token_ids, str(o.outputs[0].finish_reason),
                                 o.outputs[0].cumulative_logprob) for o in out]
        assert calls and all(c == branch_free for c in calls)
        assert engine.stats()["num_compiles_after_warmup"] == 0
        calls.clear()
    for (ids_a, why_a, lp_a), (ids_b, why_b, lp_b) in zip(results[True], results[False]):
        assert ids_a == ids_b and why_a == why_b
        assert lp_a == pytest.approx(lp_b, rel=1e-5, abs=1e-5)

    engine.generate(ps[:2], [SamplingParams(temperature=0.9, top_p=0.8, seed=1, max_tokens=12, ignore_eos=True),
                             SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)])
    assert calls and not any(calls)  # top-p and top logprobs: the branching build
    decode = (run.weights, run.kv_cache, engine.penalties,
              *engine._decode_args(engine.decode_shape(4), [], [], 0))
    texts = {bf: run._decode_steps.lower(*decode, max_steps=STEPS, branch_free=bf).compile().as_text()
             for bf in (False, True)}
    assert " conditional(" in texts[False] and " conditional(" not in texts[True]


def test_decode_keeps_to_the_branching_build_until_the_background_one_is_ready(monkeypatch) -> None:
    """Warmup leaves the branch-free decode builds to a background thread: until it hands them over, decode calls
    run the branching build (never a compile of their own), afterwards the branch-free one, with the same tokens."""
    import threading

    run = model_helpers.build_runner(CFG, tp=1, seed=3, num_pages=96, page_size=4)  # nothing compiled yet
    monkeypatch.setattr(run, "branch_free_sampler", True)
    gate, precompile = threading.Event(), run.precompile

    def held(calls, threads=None, stop=None, background=False):
        if getattr(run._in_background, "on", False):
            assert gate.wait(300)
        return precompile(calls, threads, stop=stop, background=background)

    monkeypatch.setattr(run, "precompile", held)
    builds: list[bool] = []
    dispatch = run._dispatch

    def recorded(kind, args, static):
        if kind in DECODE_KINDS:
            builds.append(static.get("branch_free", False))
        return dispatch(kind, args, static)

    monkeypatch.setattr(run, "_dispatch", recorded)
    engine = Engine(run, None, EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=96),
                    CacheConfig(page_size=4), use_tqdm=False, decode_steps_per_call=STEPS, overlap_decode=True)
    engine.warmup()
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=14, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in engine.generate(prompts(3, seed=6), params)]
    assert builds and not any(builds) and engine.stats()["background_compile_pending"]
    builds.clear()
    gate.set()
    assert engine.wait_for_background_compile(timeout=300)
    after = [o.outputs[0].token_ids for o in engine.generate(prompts(3, seed=6), params)]
    assert builds and all(builds) and after == before
    stats = engine.stats()
    # The background build may come from the export cache's recipes untraced (an earlier test of the same shapes
    # left them), so it need not count a trace: what matters is that it was handed over and serving never compiled.
    assert stats["num_compiles_after_warmup"] == 0
    assert not stats["background_compile_pending"]
    # At exit the thread stops tracing (runner.precompile_in_background's atexit hook): a set `stop` compiles nothing.
    compiled, stop = dict(run._executables), threading.Event()
    stop.set()
    args = engine._decode_args(engine.decode_shape(2), [], [], 0)
    precompile([("decode", (engine.penalties, *args), {"max_steps": STEPS + 1})], stop=stop)
    assert run._executables == compiled
