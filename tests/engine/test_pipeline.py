"""Pipelined single steps (jaxinfer/engine/pipeline.py): the next forward launched before the host has read the
tokens it runs on must change nothing but the timing. Every test compares an engine with the pipeline (the
default, overlap on) against the same engine with overlap off, or against the float64 reference, and checks
that the pipeline really ran (`num_pipelined_steps`), left no page behind and compiled nothing after warmup."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer import LLM
from jaxinfer.config import CacheConfig, EngineConfig, SamplingParams
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.sequence import FinishReason
from jaxinfer.presets import load_preset

from test_engine import CFG, GREEDY, MAX_LEN, assert_all_pages_free, prompts_of, reference_greedy, shared_runner

PROMPTS = prompts_of([5, 9, 3, 12])


def _engine(pipeline: bool, max_num_seqs: int = 4, steps: int = 1) -> Engine:
    engine = Engine(shared_runner(16), None, EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=16,
                                                          max_model_len=MAX_LEN),
                    CacheConfig(page_size=16), use_tqdm=False, decode_steps_per_call=steps, overlap_decode=pipeline)
    engine.warmup()
    return engine


def _check_clean(engine: Engine, pipelined: bool) -> None:
    stats = engine.stats()
    assert (stats["num_pipelined_steps"] > 0) == pipelined
    assert stats["num_compiles_after_warmup"] == 0
    assert_all_pages_free(engine)


def test_greedy_equals_the_reference_with_and_without_the_pipeline() -> None:
    for pipeline in (True, False):
        engine = _engine(pipeline)
        outs = engine.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == [reference_greedy(tuple(p), GREEDY.max_tokens) for p in PROMPTS]
        _check_clean(engine, pipeline)


def test_sampled_tokens_penalties_and_logprobs_are_unchanged() -> None:
    """Seeds, penalties and logprobs are built from the host's state just before each sampler runs."""
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=7 + i, max_tokens=24, ignore_eos=True, logprobs=2,
                             repetition_penalty=1.3, frequency_penalty=0.5)
              for i in range(len(PROMPTS))]
    runs = {}
    for pipeline in (True, False):
        engine = _engine(pipeline)
        runs[pipeline] = engine.generate(PROMPTS, params)
        _check_clean(engine, pipeline)
    for a, b in zip(runs[True], runs[False]):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(a.outputs[0].logprobs, a.token_ids)],
                                   [lp[t].logprob for lp, t in zip(b.outputs[0].logprobs, b.token_ids)], atol=1e-5)


def test_stops_aborts_and_arrivals_mid_pipeline() -> None:
    """A row stopped on a token the forward launched ahead already runs on, a request aborted while a forward
    is in flight, and one that arrives then: the others' tokens equal the reference, every page comes back."""
    ref = {i: reference_greedy(tuple(p), 30) for i, p in enumerate(PROMPTS)}
    stop_at = 6
    engine = _engine(True)
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True) for _ in PROMPTS]
    params[1] = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[ref[1][stop_at]])
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS[:3], params[:3])]
    outs: dict[str, list[int]] = {}
    while engine.stats()["num_pipelined_steps"] < 3:
        outs.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert engine.pipeline.ahead is not None
    aborted = engine.abort(ids[2])
    assert aborted.outputs[0].finish_reason == FinishReason.ABORT.value
    late = engine.add_request(PROMPTS[3], params[3])
    while engine.has_unfinished():
        outs.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    engine.flush()
    assert outs[ids[0]] == ref[0]
    first_stop = ref[1].index(ref[1][stop_at])
    assert outs[ids[1]] == ref[1][: first_stop + 1]
    assert outs[late] == ref[3]
    assert aborted.outputs[0].token_ids == ref[2][: len(aborted.outputs[0].token_ids)]
    _check_clean(engine, True)


def test_rows_under_the_smallest_token_bucket_get_their_tokens_spliced_in() -> None:
    """max_num_seqs 2 keeps 2 sampler rows in a 16-token bucket: the next forward's ids are spliced in front."""
    engine = _engine(True, max_num_seqs=2)
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [reference_greedy(tuple(p), GREEDY.max_tokens) for p in PROMPTS]
    _check_clean(engine, True)


def test_multi_step_engines_pipeline_only_structured_rows(smollm2_path) -> None:
    """With decode_steps_per_call > 1 plain rows keep the multi-step loop; rows under a grammar are pipelined,
    and give the same text as without the pipeline (same seeds)."""
    cfg = load_preset("smollm2-135m").replace(hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                                              num_kv_heads=2, head_dim=16)
    choices = ["alpha beta gamma", "delta epsilon", "zeta eta theta iota"]
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=40, structured={"choice": choices}) for s in range(3)]
    texts = {}
    for pipeline in (True, False):
        llm = LLM(cfg, tokenizer=smollm2_path, random_weights=True, dtype="float32", max_num_seqs=16,
                  max_num_batched_tokens=32, max_model_len=128, attention_impl="reference", decode_steps_per_call=4,
                  overlap_decode=pipeline, use_tqdm=False)
        plain = llm.generate(["Say something."], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        assert llm.engine_stats()["num_pipelined_steps"] == 0 and len(plain[0].token_ids) == 12
        texts[pipeline] = [o.text for o in llm.generate(["Pick one."] * 3, params)]
        stats = llm.engine_stats()
        assert (stats["num_pipelined_steps"] > 0) == pipeline
        assert stats["num_compiles_after_warmup"] == 0 and stats["free_pages"] == stats["total_pages"]
    assert texts[True] == texts[False]
    assert all(t in choices for t in texts[True])


def test_branch_free_sampler_in_the_engine_changes_no_token(monkeypatch) -> None:
    """The GPU build of the single-step sampler without branches (forced here on CPU), in the steps it serves,
    gives the tokens and logprobs of the branching one: sampled rows with seeds, penalties and min-p, and greedy
    rows; a row asking for top logprobs keeps its step on the branching build."""
    runner = shared_runner(16)
    params = [SamplingParams(temperature=0.9, seed=3 + i, max_tokens=20, ignore_eos=True, min_p=0.02 * i,
                             repetition_penalty=1.2, presence_penalty=0.3 * i, logprobs=0) for i in range(3)]
    params.append(SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=0))
    builds: list[bool] = []
    sample = runner.sample

    def counted(*args, branch_free=False):
        builds.append(branch_free)
        return sample(*args, branch_free=branch_free)

    monkeypatch.setattr(runner, "sample", counted)
    runs = {}
    for branch_free in (True, False):
        monkeypatch.setattr(runner, "branch_free_sampler", branch_free)
        engine = _engine(True)
        outs = engine.generate(PROMPTS, params)
        runs[branch_free] = [(o.token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.token_ids)])
                             for o in outs]
        _check_clean(engine, True)
        assert any(builds) == branch_free
        builds.clear()
    for (ids_a, lps_a), (ids_b, lps_b) in zip(runs[True], runs[False]):
        assert ids_a == ids_b
        np.testing.assert_allclose(lps_a, lps_b, atol=1e-6)
    monkeypatch.setattr(runner, "branch_free_sampler", True)
    engine = _engine(True)
    engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=6, logprobs=2))
    assert builds and not any(builds)  # top logprobs: the branching build
    _check_clean(engine, True)


def test_admission_waves_change_no_token_and_admit_in_fewer_steps(monkeypatch) -> None:
    """While single steps are pipelined, a request that could be admitted is held back (at most
    ADMISSION_WAVE_STEPS steps, or until an eighth of the slots is free) so that others join it: the tokens are
    the reference's either way, and requests come in over fewer steps than with no hold (each row here finishes
    on a step of its own, so without a hold every finish admits one prompt)."""
    from jaxinfer.engine import pipeline
    from jaxinfer.engine.scheduler import Scheduler

    prompts = prompts_of([4 + i % 5 for i in range(24)], seed=3)
    params = [SamplingParams(temperature=0.0, max_tokens=6 + i, ignore_eos=True) for i in range(24)]
    want = [reference_greedy(tuple(p), sp.max_tokens) for p, sp in zip(prompts, params)]
    admit = Scheduler._try_admit
    admitting_steps: dict[int, set[int]] = {}
    waves = pipeline.ADMISSION_WAVE_STEPS
    for wave_steps in (waves, 0):
        monkeypatch.setattr(pipeline, "ADMISSION_WAVE_STEPS", wave_steps)
        engine = Engine(shared_runner(16), None, EngineConfig(max_num_seqs=16, max_num_batched_tokens=64,
                                                              max_model_len=MAX_LEN),
                        CacheConfig(page_size=16), use_tqdm=False, decode_steps_per_call=1)
        engine.warmup()
        steps = admitting_steps[wave_steps] = set()

        def counted(scheduler, seq, builder, engine=engine, steps=steps):
            admitted = admit(scheduler, seq, builder)
            if admitted:
                steps.add(engine.num_steps)
            return admitted

        monkeypatch.setattr(Scheduler, "_try_admit", counted)
        assert [o.token_ids for o in engine.generate(prompts, params)] == want
        _check_clean(engine, True)
    assert len(admitting_steps[waves]) < len(admitting_steps[0])


@pytest.mark.parametrize("tp", [2])
def test_tensor_parallel_pipeline_equals_one_device(tp: int) -> None:
    """Under TP the sampler's tokens go straight into the next forward: their sharding must be the one that
    forward was compiled for (replicated), or the call would fail."""
    import model_helpers

    runner = model_helpers.build_runner(CFG, tp=tp, seed=0, num_pages=48, page_size=16)
    engine = Engine(runner, None, EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=MAX_LEN),
                    CacheConfig(page_size=16), use_tqdm=False, decode_steps_per_call=1)
    engine.warmup()
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [reference_greedy(tuple(p), GREEDY.max_tokens) for p in PROMPTS]
    _check_clean(engine, True)


@pytest.mark.gpu
def test_pipeline_on_gpu_with_the_platform_kernels() -> None:
    """On a GPU the forward holds the Pallas attention kernel and the sampler is the branch-free build; launched
    from the launcher thread ahead of the host, they must still give the tokens of the unpipelined engine with the
    branching sampler (bf16, so the comparison is engine against engine rather than against the float64
    reference). Decode steps run in the small token buckets (Engine.small_step_buckets) once compiled."""
    import jax

    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU (jax.default_backend() != 'gpu')")
    # head_dim 64: the smallest the GPU kernel takes (at 32 the forward fell back to the jnp reference).
    cfg = load_preset("llama-3-8b").replace(hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                                            num_kv_heads=2, head_dim=64, vocab_size=4096)
    prompts = [list(range(3 + i, 40 + 7 * i)) for i in range(6)]
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=48, ignore_eos=True) for i in range(6)]
    runs = {}
    for pipeline in (True, False):
        llm = LLM(cfg, random_weights=True, dtype="bfloat16", max_num_seqs=16, max_model_len=256,
                  decode_steps_per_call=1, overlap_decode=pipeline, use_tqdm=False)
        assert llm.engine.runner.branch_free_sampler
        assert llm.engine.small_step_buckets == (2, 4, 8)
        llm.wait_for_background_compile()  # the 6 decoding rows step in the 8-token bucket, fewer rows in smaller
        # The unpipelined engine samples with the branching build: the branch-free one must agree with it.
        llm.engine.runner.branch_free_sampler = pipeline
        runs[pipeline] = [o.token_ids for o in llm.generate(prompts, params)]
        stats = llm.engine_stats()
        assert (stats["num_pipelined_steps"] > 0) == pipeline and stats["num_compiles_after_warmup"] == 0
        del llm
    assert runs[True] == runs[False]


def streamed(engine: Engine, prompts, params) -> list:
    """`engine.stream`'s final outputs in the order of `prompts`: the requests stream (CUMULATIVE), where
    `generate` asks for final outputs only."""
    finals = {o.request_id: o for o in engine.stream(prompts, params) if o.finished}
    return [finals[rid] for rid in sorted(finals, key=lambda rid: int(rid.rsplit("-", 1)[1]))]


def test_small_streamed_decode_batches_run_pipelined_single_steps_and_others_multi_step_calls() -> None:
    """`single_step_max_rows`: a decode batch of at most that many rows, one of them streamed, runs one
    iteration per call, pipelined; a larger one, or one whose requests all return only when finished
    (`generate`), runs multi-step calls. Greedy tokens equal the reference either way."""
    def engine_with(max_rows: int) -> Engine:
        engine = Engine(shared_runner(16), None, EngineConfig(max_num_seqs=4, max_num_batched_tokens=16,
                                                              max_model_len=MAX_LEN),
                        CacheConfig(page_size=16), use_tqdm=False, decode_steps_per_call=4,
                        single_step_max_rows=max_rows)
        engine.warmup()
        return engine

    want = [reference_greedy(tuple(p), GREEDY.max_tokens) for p in PROMPTS]
    for max_rows, stream, pipelined in ((4, True, True), (3, True, False), (4, False, False)):  # 4 rows
        engine = engine_with(max_rows)
        before_calls = engine.stats()["num_overlapped_calls"]
        outs = streamed(engine, PROMPTS, GREEDY) if stream else engine.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == want
        stats = engine.stats()
        assert (stats["num_pipelined_steps"] > 0) == pipelined, (max_rows, stream, stats["num_pipelined_steps"])
        # Multi-step calls launched ahead happen only when the batch is over the limit or nobody streams.
        assert (stats["num_overlapped_calls"] > before_calls) == (not pipelined), stats["num_overlapped_calls"]
        _check_clean(engine, pipelined)
    # One row left (the others finished): a streamed batch that small steps singly even under a low limit.
    engine = engine_with(1)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (4, 4, 4, 20)]
    outs = streamed(engine, PROMPTS, params)
    assert [o.token_ids for o in outs] == [w[:n] for w, n in zip(
        [reference_greedy(tuple(p), 20) for p in PROMPTS], (4, 4, 4, 20))]
    assert engine.stats()["num_pipelined_steps"] > 0


def test_one_streamed_row_keeps_a_small_batch_in_single_steps() -> None:
    """A batch that mixes a streamed request with ones that return only when finished steps singly (the streamed
    row's tokens arrive one by one); once the streamed request is done, the rest go back to multi-step calls."""
    from jaxinfer.validation import RequestOutputKind

    engine = Engine(shared_runner(16), None, EngineConfig(max_num_seqs=4, max_num_batched_tokens=16,
                                                          max_model_len=MAX_LEN),
                    CacheConfig(page_size=16), use_tqdm=False, decode_steps_per_call=4, single_step_max_rows=4)
    engine.warmup()
    lengths = (6, 20, 20)  # the streamed request is the short one
    kinds = (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY, RequestOutputKind.FINAL_ONLY)
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, output_kind=k))
           for p, n, k in zip(PROMPTS, lengths, kinds)]
    finals, partials, at_stream_end = {}, 0, None
    while engine.has_unfinished():
        for out in engine.step():
            partials += out.request_id == ids[0] and not out.finished
            if out.finished:
                finals[out.request_id] = out
                at_stream_end = at_stream_end or (engine.stats() if out.request_id == ids[0] else None)
    engine.flush()
    assert [finals[i].token_ids for i in ids] == [reference_greedy(tuple(p), n) for p, n in zip(PROMPTS, lengths)]
    assert partials >= 3  # the streamed request reported its tokens as they came
    stats = engine.stats()
    # Single steps while the streamed row ran (at most one more, launched ahead as it finished), then multi-step.
    assert at_stream_end["num_pipelined_steps"] > 0 and at_stream_end["num_overlapped_calls"] == 0
    assert stats["num_pipelined_steps"] <= at_stream_end["num_pipelined_steps"] + 1
    assert stats["num_overlapped_calls"] > 0 and stats["num_compiles_after_warmup"] == 0
    assert_all_pages_free(engine)


def test_decode_steps_of_few_rows_run_in_small_buckets(monkeypatch) -> None:
    """Where decode batches of a few rows step singly (`single_step_max_rows` >= 1: GPUs and TPUs), a decode-only
    step runs in the smallest of `small_step_buckets` that holds its rows (2 for one row), once warmup's
    background compiles are done: sampled tokens, penalties and logprobs equal those of the engine without small
    buckets, and nothing compiles after warmup."""
    from jaxinfer.engine.runner import ModelRunner

    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=20, ignore_eos=True, logprobs=2,
                             repetition_penalty=1.3)]
    runs = {}
    for small in (True, False):
        engine = Engine(shared_runner(16), None, EngineConfig(max_num_seqs=4, max_num_batched_tokens=16,
                                                              max_model_len=MAX_LEN),
                        CacheConfig(page_size=16), use_tqdm=False, decode_steps_per_call=4, single_step_max_rows=1)
        assert engine.small_step_buckets == (2,)
        if not small:
            engine.small_step_buckets = ()
        engine.warmup()
        assert engine.wait_for_background_compile()
        buckets = []
        forward = ModelRunner.forward

        def spy(self, batch, *args, _forward=forward, _buckets=buckets):
            _buckets.append(batch.token_ids.shape[0])
            return _forward(self, batch, *args)

        monkeypatch.setattr(ModelRunner, "forward", spy)
        runs[small] = streamed(engine, PROMPTS[:1], params)
        monkeypatch.undo()
        _check_clean(engine, True)
        assert buckets[0] == 16 and set(buckets[1:]) == ({2} if small else {16}), buckets
    (a,), (b,) = runs[True], runs[False]
    assert a.token_ids == b.token_ids
    np.testing.assert_allclose([lp[t].logprob for lp, t in zip(a.outputs[0].logprobs, a.token_ids)],
                               [lp[t].logprob for lp, t in zip(b.outputs[0].logprobs, b.token_ids)], atol=1e-5)
    # Greedy rows in the 2- and 4-token buckets give the reference's tokens; rows that finish early leave the
    # others to a smaller bucket.
    engine = Engine(shared_runner(16), None, EngineConfig(max_num_seqs=4, max_num_batched_tokens=16,
                                                          max_model_len=MAX_LEN),
                    CacheConfig(page_size=16), use_tqdm=False, decode_steps_per_call=4, single_step_max_rows=4)
    assert engine.small_step_buckets == (2, 4)
    engine.warmup()
    assert engine.wait_for_background_compile()
    lengths = (3, 6, 9, 20)
    outs = streamed(engine, PROMPTS, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths])
    assert [o.token_ids for o in outs] == [reference_greedy(tuple(p), n) for p, n in zip(PROMPTS, lengths)]
    _check_clean(engine, True)
