"""The engine end to end on a tiny random Llama: paging, budgets, preemption, prefix caching, aborts, every
sampling knob, multi-step decode, validation, streaming and metrics.

Greedy outputs are compared with an independent float64 NumPy model run one sequence at a time over the
whole history (no paging, no batching, no chunking). Compiling dominates the cost here, so the engines share
one `ModelRunner` per page size and use one token bucket (budget 16) and one sequence bucket (4 rows);
every engine after the first on a runner compiles nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import numpy as np
import pytest

from jaxinfer.config import CacheConfig, ConfigError, EngineConfig, SamplingParams
from jaxinfer.engine.batcher import BatchShape, SeqChunk, pack
from jaxinfer.engine.engine import Engine
from jaxinfer.validation import MAX_N
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.engine.step_plan import StepPlan
from jaxinfer.outputs import FinishReason, RequestOutput
import model_helpers
from model_helpers import run_to_completion


# Untied: with the tied tiny embedding the model echoes its input token with near-certainty, so greedy output
# would barely depend on the KV cache and seeds would not matter. The untied head gives logits of std ~1.
CFG = model_helpers.tiny_config(tie_word_embeddings=False)
EOS = CFG.eos_token_id
MAX_LEN = 128
MAX_SEQS = 4
BUDGET = 16
STEPS = 4  # decode_steps_per_call of the multi-step engines
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@functools.cache
def shared_runner(page_size: int) -> ModelRunner:
    """One runner (weights seed 0, so the same weights for every page size) per page size."""
    return model_helpers.build_runner(CFG, seed=0, num_pages=640 // page_size + 8, page_size=page_size)


def make_engine(
    page_size: int = 16, num_pages: int | None = None, *, steps: int = 1, prefix: bool = True,
    budget: int = BUDGET, tokenizer=None, runner: ModelRunner | None = None,
) -> Engine:
    engine = Engine(
        runner or shared_runner(page_size), tokenizer,
        EngineConfig(max_num_seqs=MAX_SEQS, max_num_batched_tokens=budget, max_model_len=MAX_LEN),
        CacheConfig(page_size=page_size, num_pages=num_pages),
        enable_prefix_caching=prefix, use_tqdm=False, decode_steps_per_call=steps,
    )
    engine.warmup()
    return engine


def prompts_of(lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, CFG.vocab_size, n)] for n in lengths]


PROMPTS = prompts_of([3, 17, 40, 9, 25, 1, 55])  # the last crosses a 64-token page


@functools.cache
def reference_greedy(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    """Greedy tokens of the float64 dense model, recomputing the whole history for every token."""
    ids, out = list(prompt), []
    for _ in range(max_tokens):
        token = int(np.argmax(model_helpers.dense_reference_logits(shared_runner(16).weights, CFG, ids)[-1]))
        out.append(token)
        ids.append(token)
    return out


def assert_all_pages_free(engine: Engine) -> None:
    stats = engine.stats()
    assert stats["free_pages"] == stats["total_pages"]
    assert stats["num_running"] == stats["num_waiting"] == 0 and not engine.requests


def record_plans(engine: Engine) -> list[StepPlan]:
    """Keep every plan the scheduler makes (to see preemptions and shared pages)."""
    plans: list[StepPlan] = []
    schedule = engine.scheduler.schedule

    def recording() -> StepPlan:
        plans.append(schedule())
        return plans[-1]

    engine.scheduler.schedule = recording
    return plans


# ------------------------------------------------------------------------------------------ greedy parity


@pytest.mark.parametrize(
    "page_size, num_pages, prefix, steps",
    [
        (1, None, True, 1),
        (1, 80, False, 1),  # about one sequence's worth of pages: preemption over and over
        (16, None, False, 1),
        (16, 6, True, 1),
        (16, None, True, STEPS),
        (16, 6, False, STEPS),
        (64, None, True, 1),
        (64, 3, True, 1),  # two pages: at most two sequences, and the longest needs both
    ],
)
def test_greedy_equals_unpaged_reference(page_size: int, num_pages: int | None, prefix: bool, steps: int) -> None:
    engine = make_engine(page_size, num_pages, steps=steps, prefix=prefix)
    outs = engine.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == reference_greedy(tuple(prompt), GREEDY.max_tokens)
        assert out.finish_reason is FinishReason.LENGTH
    stats = engine.stats()
    assert (stats["num_preemptions"] > 0) == (num_pages is not None and page_size < 64)
    assert stats["num_compiles_after_warmup"] == 0
    assert_all_pages_free(engine)


@pytest.mark.parametrize("steps", [1, STEPS])
def test_prompts_submitted_twice_hit_the_prefix_cache(steps: int) -> None:
    engine = make_engine(16, steps=steps)
    first = engine.generate(PROMPTS, GREEDY)
    second = engine.generate(PROMPTS + PROMPTS[:2], GREEDY)
    assert [o.token_ids for o in second] == [o.token_ids for o in first + first[:2]]
    assert engine.stats()["prefix_cache_hit_rate"] > 0
    assert engine.stats()["num_compiles_after_warmup"] == 0
    assert_all_pages_free(engine)


def test_reset_prefix_cache_mid_run_keeps_running_requests_whole() -> None:
    """A reset while requests decode uncaches their pages without freeing them; later prompts miss the cache."""
    engine = make_engine(16, steps=STEPS)
    first = engine.generate(PROMPTS, GREEDY)
    hits = engine.stats()["prefix_cache_hit_tokens"]
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    outs = {o.request_id: o for o in engine.step() if o.finished}  # these prompts hit the cache, then decode
    assert engine.stats()["prefix_cache_hit_tokens"] > hits and engine.reset_prefix_cache() is True
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert [outs[i].token_ids for i in ids] == [o.token_ids for o in first]
    hits = engine.stats()["prefix_cache_hit_tokens"]
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == [o.token_ids for o in first]
    assert engine.stats()["prefix_cache_hit_tokens"] > hits  # the finished requests' pages were cached anew
    assert engine.reset_prefix_cache() is True
    hits = engine.stats()["prefix_cache_hit_tokens"]
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == [o.token_ids for o in first]
    assert engine.stats()["prefix_cache_hit_tokens"] == hits
    assert_all_pages_free(engine)
    assert make_engine(16, prefix=False).reset_prefix_cache() is False


def test_multi_step_decode_runs_fewer_device_calls() -> None:
    single, multi = make_engine(16), make_engine(16, steps=STEPS)
    assert [o.token_ids for o in single.generate(PROMPTS, GREEDY)] == [
        o.token_ids for o in multi.generate(PROMPTS, GREEDY)
    ]
    assert multi.num_steps < 0.6 * single.num_steps


def test_abort_mid_run_leaves_others_unchanged() -> None:
    engine = make_engine(16, num_pages=10)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    finals: dict[str, RequestOutput] = {}
    for _ in range(4):
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    running = [rid for rid in ids[:3] if rid not in finals]
    aborted = {running[0], ids[-1]}  # one mid-decode or mid-prefill, one still queued
    for rid in aborted:
        out = engine.abort(rid)
        assert out.finished and out.finish_reason is FinishReason.ABORT
    assert engine.abort("no-such-request") is None
    finals.update(run_to_completion(engine))
    for rid, prompt in zip(ids, PROMPTS):
        if rid not in aborted:
            assert finals[rid].token_ids == reference_greedy(tuple(prompt), GREEDY.max_tokens)
    assert_all_pages_free(engine)


def test_length_limits_and_stop_token_ids() -> None:
    engine = make_engine(16, steps=STEPS)
    prompt = PROMPTS[1]
    ref = reference_greedy(tuple(prompt), 20)
    stop = ref[5]
    first_stop = ref.index(stop)
    params = [
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=(stop,), ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=(stop,), min_tokens=first_stop + 2,
                       ignore_eos=True),
        # the stop id is the 9th: the device does not know it (8 slots), only the host stops the row
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=tuple(range(200, 208)) + (stop,),
                       ignore_eos=True),
    ]
    outs = engine.generate([prompt] * len(params), params)
    assert outs[0].token_ids == ref[:7] and outs[0].finish_reason is FinishReason.LENGTH
    assert outs[1].token_ids == ref[: first_stop + 1] and outs[1].finish_reason is FinishReason.STOP
    assert outs[3].token_ids == outs[1].token_ids and outs[3].finish_reason is FinishReason.STOP
    # min_tokens bans the stop id until it may end the sequence, which changes the greedy path
    assert len(outs[2].token_ids) >= first_stop + 2 and stop not in outs[2].token_ids[: first_stop + 1]
    assert_all_pages_free(engine)


def test_eos_stops_unless_ignored_and_max_model_len_caps() -> None:
    engine = make_engine(16)
    prompt = PROMPTS[3]
    bias = {EOS: 100.0}  # make EOS the greedy choice at once
    stopped, ignored = engine.generate(
        [prompt, prompt],
        [SamplingParams(temperature=0.0, logit_bias=bias), SamplingParams(temperature=0.0, logit_bias=bias,
                                                                            ignore_eos=True, max_tokens=3)],
    )
    assert stopped.token_ids == [EOS] and stopped.finish_reason is FinishReason.STOP
    assert ignored.token_ids == [EOS] * 3 and ignored.finish_reason is FinishReason.LENGTH
    long_prompt = prompts_of([MAX_LEN - 3], seed=5)[0]
    (capped,) = engine.generate([long_prompt], GREEDY)
    assert len(capped.token_ids) == 3 and capped.finish_reason is FinishReason.LENGTH
    assert_all_pages_free(engine)


# ------------------------------------------------------------------------------------------ sampling


def sampled_params(seed: int | None = 7, **kw) -> SamplingParams:
    base = dict(temperature=0.9, top_k=40, top_p=0.95, max_tokens=12, ignore_eos=True, seed=seed)
    return SamplingParams(**{**base, **kw})


def test_seed_gives_the_same_tokens_alone_in_a_batch_and_after_preemption() -> None:
    prompt = PROMPTS[2]
    alone = make_engine(16).generate([prompt], sampled_params())[0].token_ids
    others = [sampled_params(seed=None), GREEDY, sampled_params(seed=99, temperature=1.3)]
    batched = make_engine(16, steps=STEPS).generate(PROMPTS[:3] + [prompt], others + [sampled_params()])
    assert batched[-1].token_ids == alone
    engine = make_engine(16, num_pages=7)
    plans = record_plans(engine)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS[4:7]]
    seeded = engine.add_request(prompt, sampled_params(), priority=1)  # least urgent: the preemption victim
    finals = run_to_completion(engine)
    assert any(key[0] == seeded for plan in plans for key in plan.preempted)
    assert finals[seeded].token_ids == alone
    assert all(finals[rid].token_ids == reference_greedy(tuple(p), 20) for rid, p in zip(ids, PROMPTS[4:7]))
    assert_all_pages_free(engine)


def test_unseeded_requests_differ() -> None:
    outs = make_engine(16).generate([PROMPTS[2]] * 2, sampled_params(seed=None, temperature=2.0, top_k=-1,
                                                                     top_p=1.0))
    assert outs[0].token_ids != outs[1].token_ids


# Single steps and the multi-step loop both run the page copies first (their own program, compiled at warmup).
@pytest.mark.parametrize("steps", [1, STEPS])
def test_n_shares_prompt_pages_and_returns_n_outputs(steps: int) -> None:
    engine = make_engine(16, steps=steps)
    plans = record_plans(engine)
    prompt = PROMPTS[2]  # 40 tokens: two full pages and a partial one, shared until copy-on-write
    (out,) = engine.generate([prompt], sampled_params(n=3, max_tokens=10))
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3  # seeds seed+0, seed+1, seed+2
    first_decode = next(p for p in plans if len(p.seqs) == 3)
    tables = [e.page_ids for e in first_decode.seqs]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]  # the full prompt pages are shared
    assert len(first_decode.page_copies) == 2  # the partial last page is copied for two of the three
    # Child i samples like a lone request seeded seed + i.
    for i, completion in enumerate(out.outputs):
        lone = engine.generate([prompt], sampled_params(seed=7 + i, max_tokens=10))[0]
        assert completion.token_ids == lone.token_ids
    assert_all_pages_free(engine)
    assert engine.stats()["num_compiles_after_warmup"] == 0


def test_logprobs_and_prompt_logprobs_match_log_softmax_of_the_logits() -> None:
    engine = make_engine(16)
    prompt = PROMPTS[3]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=4, prompt_logprobs=3)
    (out,) = engine.generate([prompt], params)
    ids = prompt + out.token_ids
    want = log_softmax_per_position(engine.runner, ids[:-1])  # [L - 1, V] row j predicts ids[j + 1]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for j in range(1, len(prompt)):
        check_top(out.prompt_logprobs[j], want[j - 1], ids[j], 3)
    for i, token in enumerate(out.token_ids):
        check_top(out.outputs[0].logprobs[i], want[len(prompt) - 1 + i], token, 4)
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(want[len(prompt) - 1 + i][t] for i, t in enumerate(out.token_ids)), abs=1e-4
    )


def test_prompt_logprobs_are_complete_when_the_prompt_is_cached() -> None:
    """A cached prompt would skip the positions whose logprobs are asked for, so such requests skip lookups."""
    engine = make_engine(16)
    prompt = PROMPTS[2]
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))  # caches the prompt's pages
    first = engine.generate([prompt], params)[0]
    second = engine.generate([prompt], params)[0]
    assert engine.stats()["prefix_cache_hit_rate"] == 0  # only lookups were skipped: nothing was served
    assert first.prompt_logprobs[0] is None and None not in first.prompt_logprobs[1:]
    for got, want in zip(second.prompt_logprobs[1:], first.prompt_logprobs[1:]):
        assert got is not None and got.keys() == want.keys()
        assert list(got.values()) == pytest.approx(list(want.values()), abs=1e-5)


def log_softmax_per_position(runner: ModelRunner, ids: list[int]) -> np.ndarray:
    """float64 log_softmax [L, V] of runner.logits after each token of `ids`, fed one token at a time.

    Writes KV into the last pages of the shared cache: the calling test's engine is done, and every later
    engine starts with an empty prefix cache, so nothing reads these pages as cached content.
    """
    shape = BatchShape(tokens=BUDGET, seqs=MAX_SEQS, pages_per_seq=MAX_LEN // 16)
    pages = list(range(runner.kv_cache.num_pages - shape.pages_per_seq, runner.kv_cache.num_pages))
    rows = [np.asarray(runner.logits(pack([SeqChunk([t], j, pages)], shape, 16)))[0] for j, t in enumerate(ids)]
    logits = np.asarray(rows, np.float64)  # [L, V]
    top = logits.max(-1, keepdims=True)  # [L, 1]
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def check_top(got: dict[int, float], want: np.ndarray, actual: int, k: int) -> None:
    top = np.argsort(-want)[:k]
    assert set(got) == set(top.tolist()) | {actual}
    for token, lp in got.items():
        assert lp == pytest.approx(want[token], abs=1e-4)


def test_penalties_and_logit_bias_steer_generation() -> None:
    engine = make_engine(16, steps=STEPS)
    prompt = PROMPTS[1]
    ref = reference_greedy(tuple(prompt), 12)
    banned = {t: -100.0 for t in set(ref[:4])}
    outs = engine.generate(
        [prompt] * 3,
        [
            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logit_bias=banned),
            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, presence_penalty=2.0,
                           frequency_penalty=2.0, repetition_penalty=1.3),
            GREEDY,
        ],
    )
    assert not set(outs[0].token_ids) & set(banned)
    assert outs[1].token_ids != ref[:12]
    assert outs[2].token_ids == reference_greedy(tuple(prompt), 20)


def test_zero_compiles_after_warmup_over_a_random_workload() -> None:
    rng = np.random.default_rng(3)
    engine = make_engine(16, num_pages=12, steps=STEPS)
    knobs = [
        dict(temperature=0.0), dict(temperature=0.7), dict(top_k=5), dict(top_p=0.5), dict(min_p=0.2),
        dict(repetition_penalty=1.2), dict(presence_penalty=0.5), dict(frequency_penalty=-0.5),
        dict(logit_bias={3: 5.0, 9: -5.0}), dict(seed=11), dict(logprobs=20), dict(prompt_logprobs=5),
        dict(n=2), dict(n=3, seed=4), dict(min_tokens=1, stop_token_ids=(5, 6)), dict(ignore_eos=False),
    ]
    prompts, params = [], []
    for i in range(24):
        prompts.append(prompts_of([int(rng.integers(1, 70))], seed=100 + i)[0])
        chosen = [knobs[j] for j in rng.choice(len(knobs), 3, replace=False)]
        params.append(SamplingParams(max_tokens=int(rng.integers(1, 30)), **functools.reduce(lambda a, b: {**a, **b},
                                                                                               chosen, {})))
    outs = engine.generate(prompts, params)
    assert all(o.finished for o in outs)
    stats = engine.stats()
    assert stats["num_compiles_after_warmup"] == 0 and stats["num_preemptions"] > 0
    assert_all_pages_free(engine)


# ------------------------------------------------------------------------------------------ validation


BAD_PARAMS = [
    ("temperature", -0.5), ("temperature", math.nan), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("n", 0), ("n", MAX_N + 1), ("n", MAX_SEQS + 1), ("max_tokens", 0), ("min_p", 2.0),
    ("logit_bias", {CFG.vocab_size: 1.0}), ("stop_token_ids", (-1,)), ("logprobs", 21),
]


def bypassing_post_init(**fields) -> SamplingParams:
    """SamplingParams holding values its constructor would refuse: the engine must refuse them itself."""
    params = SamplingParams()
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


@pytest.mark.parametrize("field, value", BAD_PARAMS, ids=[f"{f}={v}" for f, v in BAD_PARAMS])
def test_engine_refuses_bad_sampling_params(field: str, value) -> None:
    engine = make_engine(16)
    with pytest.raises(ValueError, match=field):
        engine.add_request(PROMPTS[0], bypassing_post_init(**{field: value}))
    assert not engine.has_unfinished() and not engine.requests


@pytest.mark.parametrize("field, value", BAD_PARAMS[:6] + BAD_PARAMS[8:9])
def test_sampling_params_refuse_bad_values_on_construction(field: str, value) -> None:
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**{field: value})


def test_bad_requests_are_refused_while_others_keep_running() -> None:
    engine = make_engine(16, steps=STEPS)
    good = [engine.add_request(p, GREEDY) for p in PROMPTS[:3]]
    finals = {o.request_id: o for o in engine.step() if o.finished}
    bad_prompts = [([], "empty"), ([CFG.vocab_size], "outside the vocabulary"), ([-1], "outside the vocabulary"),
                   (prompts_of([MAX_LEN])[0], "max_model_len"), ("text", "no tokenizer")]
    for prompt, message in bad_prompts:
        with pytest.raises(ValueError, match=message):
            engine.add_request(prompt, GREEDY)
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    for field, value in [("temperature", -1.0), ("top_p", 2.0), ("n", MAX_SEQS + 1), ("max_tokens", 0)]:
        with pytest.raises(ValueError, match=field):
            engine.add_request(PROMPTS[0], bypassing_post_init(**{field: value}))
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    with pytest.raises(ValueError, match="stop strings"):
        engine.add_request(PROMPTS[0], SamplingParams(stop=("x",)))
    finals.update(run_to_completion(engine))
    assert [finals[rid].token_ids for rid in good] == [reference_greedy(tuple(p), 20) for p in PROMPTS[:3]]
    assert_all_pages_free(engine)


def test_generate_refuses_the_whole_batch_and_queues_nothing() -> None:
    engine = make_engine(16, num_pages=5)
    with pytest.raises(ValueError, match="prompt 1"):
        engine.generate([PROMPTS[0], PROMPTS[0]], [GREEDY, SamplingParams(max_tokens=100)])  # 5 pages too few
    with pytest.raises(ValueError, match="prompt 2"):
        engine.generate([PROMPTS[0], PROMPTS[1], []], GREEDY)
    assert not engine.has_unfinished() and not engine.requests
    assert_all_pages_free(engine)


# ------------------------------------------------------------------------------------------ streaming, metrics


def test_stream_deltas_concatenate_to_the_final_output_and_metrics_are_sane() -> None:
    engine = make_engine(16, steps=STEPS)
    pieces: dict[str, list[int]] = {}
    final: dict[str, RequestOutput] = {}
    for out in engine.stream(PROMPTS[:4], GREEDY):
        pieces.setdefault(out.request_id, []).extend(out.outputs[0].delta_token_ids)
        if out.finished:
            final[out.request_id] = out
    assert len(final) == 4
    for rid, out in final.items():
        assert pieces[rid] == out.token_ids
        check_metrics(out.metrics)
    assert_all_pages_free(engine)


def test_stream_stopped_early_frees_everything() -> None:
    engine = make_engine(16)
    for _ in zip(range(3), engine.stream(PROMPTS[:4], GREEDY)):
        pass
    assert_all_pages_free(engine)


def check_metrics(m: dict[str, float]) -> None:
    assert 0 <= m["queue_time_s"] <= m["ttft_s"] < 60
    assert 0 <= m["mean_itl_s"] <= m["max_itl_s"] < 60


# ------------------------------------------------------------------------------------------ real tokenizer


@pytest.fixture(scope="module")
def text_engine() -> Engine:
    """The SmolLM2 tokenizer over a tiny random model with its vocabulary: real text, tiny compile."""
    from jaxinfer.presets import bundled_checkpoint
    from jaxinfer.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(bundled_checkpoint("smollm2-135m-instruct"))
    cfg = model_helpers.tiny_config(vocab_size=tokenizer.vocab_size, tie_word_embeddings=False)
    runner = model_helpers.build_runner(cfg, seed=0, num_pages=48, page_size=16)
    return make_engine(16, tokenizer=tokenizer, runner=runner)


@pytest.mark.slow
def test_stop_strings_across_token_boundaries_are_cut_from_the_text(text_engine: Engine) -> None:
    prompt = "The capital of France is"
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    (free,) = text_engine.generate([prompt], params)
    stop, cut = stop_string_across_a_boundary(text_engine.tokenizer, free.token_ids, free.text)
    stopped = text_engine.generate([prompt], dataclasses.replace(params, stop=(stop, "never-in-the-text")))[0]
    assert stopped.text == free.text[:cut] and stop not in stopped.text
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)] and len(stopped.token_ids) < 24
    streamed = "".join(
        o.outputs[0].delta_text for o in text_engine.stream([prompt], dataclasses.replace(params, stop=(stop,)))
    )
    assert streamed == stopped.text
    assert text_engine.stats()["num_compiles_after_warmup"] == 0
    assert_all_pages_free(text_engine)


def stop_string_across_a_boundary(tokenizer, token_ids: list[int], text: str) -> tuple[str, int]:
    """A 4-character stop string whose first occurrence straddles two tokens; and where it starts."""
    for i in range(1, len(token_ids)):
        cut = len(tokenizer.decode(token_ids[:i]))
        stop = text[cut - 2 : cut + 2]
        if cut >= 2 and len(stop) == 4 and stop.strip() == stop and text.find(stop) == cut - 2:
            return stop, cut - 2
    raise AssertionError(f"no usable token boundary in {text!r}")


@pytest.mark.slow
def test_text_prompts_stream_and_finish_on_eos(text_engine: Engine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, logit_bias={t: 100.0 for t in text_engine.eos_ids})
    (out,) = text_engine.generate(["Hello"], params)
    assert out.finish_reason is FinishReason.STOP and len(out.token_ids) == 1 and out.text == ""
