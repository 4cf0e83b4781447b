"""Failures stay with their request: one request's output handling raising, a device call raising, and
generate() interrupted, on the shared `text_llm`. In every case the other requests' outputs are exactly those
of a run without the failure, and the engine is left clean and serving."""

from __future__ import annotations

import pytest

from jaxinfer import LLM, SamplingParams
from model_helpers import assert_clean, run_to_completion

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = ["A first prompt", "The second one", "And a third, longer than the others are"]
PARAMS = [GREEDY, GREEDY.replace(stop=["never appears"]), GREEDY.replace(n=2, seed=3, temperature=1.0)]
MODES = [(1, False), (4, False), (4, True)]  # decode_steps_per_call, overlap_decode


@pytest.fixture(params=MODES, ids=[f"steps{s}-overlap{o}" for s, o in MODES])
def llm(request, text_llm: LLM, monkeypatch) -> LLM:
    steps, overlap = request.param
    monkeypatch.setattr(text_llm.engine.loop, "steps_per_call", steps)
    monkeypatch.setattr(text_llm.engine.loop, "overlap", overlap)
    yield text_llm
    assert_clean(text_llm)


def outputs_without(llm: LLM, skip: set[int]) -> dict[int, list[list[int]]]:
    """Token ids of every completion of the requests not in `skip`, run together without any failure."""
    keep = [i for i in range(len(PROMPTS)) if i not in skip]
    outs = llm.generate([PROMPTS[i] for i in keep], [PARAMS[i] for i in keep])
    return {i: [c.token_ids for c in o.outputs] for i, o in zip(keep, outs)}


def test_stop_handling_raising_fails_that_request_alone(llm: LLM, monkeypatch) -> None:
    want = outputs_without(llm, {1})
    engine = llm.engine
    ids = [engine.add_request(p, q) for p, q in zip(PROMPTS, PARAMS)]
    calls = []

    def broken_stop_matcher(text: str) -> None:
        calls.append(text)
        if len(calls) == 3:
            raise RuntimeError("stop matcher broke")

    monkeypatch.setattr(engine.requests[ids[1]], "_find_stop", broken_stop_matcher)
    finals = run_to_completion(engine)
    failed = finals[ids[1]]
    assert failed.finished and failed.finish_reason == "error" and len(failed.token_ids) == 3
    assert failed.error == "RuntimeError: stop matcher broke"
    assert {i: [c.token_ids for c in finals[ids[i]].outputs] for i in (0, 2)} == want
    assert llm.generate(PROMPTS[1], PARAMS[1])[0].finish_reason == "length"  # the same request runs fine again


def test_building_an_output_raising_fails_that_request_alone(llm: LLM, monkeypatch) -> None:
    want = outputs_without(llm, {0})
    engine = llm.engine
    ids = [engine.add_request(p, q) for p, q in zip(PROMPTS, PARAMS)]
    state = engine.requests[ids[0]]
    monkeypatch.setattr(state, "to_output", lambda: 1 / 0)
    finals = run_to_completion(engine)
    assert finals[ids[0]].finish_reason == "error" and "ZeroDivisionError" in finals[ids[0]].error
    assert {i: [c.token_ids for c in finals[ids[i]].outputs] for i in (1, 2)} == want


def test_a_failed_device_call_fails_its_requests_and_the_engine_resets(llm: LLM, monkeypatch) -> None:
    queued = ["Waiting its turn", "Also waiting"]  # max_num_seqs=4: these two wait while the others run
    want = [o.token_ids for o in llm.generate(queued, GREEDY)]
    engine, runner = llm.engine, llm.engine.runner
    dispatch, calls = runner._dispatch, []

    def failing_dispatch(kind, args, static):
        calls.append(kind)
        if len(calls) == 3:
            raise RuntimeError("RESOURCE_EXHAUSTED: simulated")
        return dispatch(kind, args, static)

    monkeypatch.setattr(runner, "_dispatch", failing_dispatch)
    failed_before = engine.num_failed_steps
    ids = [engine.add_request(p, q) for p, q in zip(PROMPTS, PARAMS)]
    later = [engine.add_request(p, GREEDY) for p in queued]
    finals = run_to_completion(engine)
    for rid in ids:
        assert finals[rid].finish_reason == "error" and "RESOURCE_EXHAUSTED: simulated" in finals[rid].error
        assert "the engine was reset" in finals[rid].error
    assert [finals[rid].token_ids for rid in later] == want
    assert engine.num_failed_steps == failed_before + 1 and engine.stats()["num_compiles_after_warmup"] == 0
    assert outputs_without(llm, set()) == outputs_without(llm, set())  # serving as before, twice over
    assert llm.generate(queued, GREEDY)[0].token_ids == want[0]


def test_generate_interrupted_aborts_its_own_requests(llm: LLM, monkeypatch) -> None:
    engine, step, calls = llm.engine, llm.engine.step, []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, PARAMS)
    monkeypatch.setattr(engine, "step", step)
    engine.flush()  # a decode call may still be in flight; reading it back drops the aborted rows
    assert_clean(llm)
    assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids == outputs_without(llm, {1, 2})[0][0]
