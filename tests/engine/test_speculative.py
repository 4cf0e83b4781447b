"""Speculative decoding on tiny random Llamas: n-gram and draft-model proposals, greedy parity with plain
decoding, lossless sampling (chi-square), rollback under preemption and aborts, the cost model and the pieces.

The engines share one target runner per module (every engine after the first on it compiles only what is
new: the verification step, and a draft's proposal call on its own runner).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter

import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chi2_contingency

import model_helpers
from jaxinfer.config import CacheConfig, EngineConfig, SamplingParams
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.ngram import propose_ngram
from jaxinfer.engine.page_table import pages_for_tokens
from jaxinfer.engine.runner import DECODE_KINDS, ModelRunner
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.step_plan import StepPlan
from jaxinfer.engine.sequence import SequenceGroup
from jaxinfer.engine.speculative import EXPLORE_EVERY, SpecCostModel, expected_tokens
from jaxinfer.kv_cache import allocate_kv_cache
from jaxinfer.models import LLAMA
from jaxinfer.spec_config import parse_speculative

CFG = model_helpers.tiny_config(tie_word_embeddings=False)
PAGE = 4  # small pages: proposals and rollbacks cross page boundaries all the time
PAGES = 160
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
DRAFT = {"method": "draft", "model": "tiny", "num_speculative_tokens": 3}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@functools.cache
def target_runner(num_pages: int = PAGES):
    return model_helpers.build_runner(CFG, seed=0, num_pages=num_pages, page_size=PAGE)


@functools.cache
def draft_runner(kind: str, num_pages: int = PAGES):
    """'self': the target's own weights (every greedy proposal is accepted); 'small': the target's first layer
    alone (a smaller, differently configured model that agrees with the target part of the time)."""
    if kind == "self":
        return model_helpers.build_runner(CFG, seed=0, num_pages=num_pages, page_size=PAGE)
    target = target_runner(num_pages)
    weights = dataclasses.replace(target.weights, layers=target.weights.layers[:1])
    one = CFG.replace(num_layers=1)
    cache = allocate_kv_cache(one, num_pages, PAGE, jnp.float32, target.mesh, target.rules)
    return ModelRunner(LLAMA, one, weights, cache, target.mesh, target.rules, attention_impl="reference")


def make_engine(spec: dict | None = None, draft: str | None = None, *, num_pages: int = PAGES, seqs: int = 4,
                budget: int = 32, always: bool = True, cfg_runner=None) -> Engine:
    engine = Engine(
        cfg_runner or target_runner(num_pages), None,
        EngineConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=128),
        CacheConfig(page_size=PAGE), use_tqdm=False,
        speculative=parse_speculative(spec), draft_runner=draft_runner(draft, num_pages) if draft else None,
    )
    engine.warmup()
    if always and engine.spec is not None:  # the measured cost model is tested on its own below
        engine.spec.cost.worth = lambda *args: True
    return engine


@functools.cache
def plain_engine() -> Engine:
    return make_engine()


@functools.cache
def spec_engine(name: str) -> Engine:
    return {"ngram": lambda: make_engine(NGRAM), "self": lambda: make_engine(DRAFT, "self"),
            "small": lambda: make_engine(DRAFT, "small")}[name]()


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    base = [int(t) for t in rng.integers(0, CFG.vocab_size, 9)]
    return [base * 3, [int(t) for t in rng.integers(0, CFG.vocab_size, 21)], base[:4] * 5, [5], base * 2 + [7]]


def assert_clean(engine: Engine) -> None:
    stats = engine.stats()
    assert stats["free_pages"] == stats["total_pages"], "pages leaked"
    assert stats["num_running"] == stats["num_waiting"] == 0 and not engine.requests
    assert stats["num_compiles_after_warmup"] == 0


# ------------------------------------------------------------------------------------------ greedy parity


@pytest.mark.parametrize("name", ["ngram", "self", "small"])
def test_greedy_tokens_and_logprobs_equal_plain_decoding(name: str) -> None:
    params = dataclasses.replace(GREEDY, logprobs=2)
    want = plain_engine().generate(prompts(), params)
    engine = spec_engine(name)
    before = engine.stats()["spec_draft_tokens"]
    got = engine.generate(prompts(), params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    stats = engine.stats()
    assert stats["spec_draft_tokens"] > before and stats["spec_accepted_tokens"] > 0
    if name == "self":  # the model as its own draft: every greedy proposal is the target's argmax
        assert stats["spec_acceptance_rate"] == 1.0
    assert_clean(engine)


def test_stops_inside_accepted_proposals_cut_the_output_there() -> None:
    engine = spec_engine("self")
    plain = plain_engine().generate(prompts(), GREEDY)
    stops = [o.token_ids[7] for o in plain]
    params = [dataclasses.replace(GREEDY, stop_token_ids=(s,), ignore_eos=False) for s in stops]
    got = engine.generate(prompts(), params)
    want = plain_engine().generate(prompts(), params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(o.outputs[0].finish_reason == "stop" for o in got)
    max_tokens = [dataclasses.replace(GREEDY, max_tokens=n) for n in (1, 2, 5, 6, 13)]
    assert [o.token_ids for o in engine.generate(prompts(), max_tokens)] == [
        o.token_ids for o in plain_engine().generate(prompts(), max_tokens)]
    assert_clean(engine)


def test_requests_that_opt_out_never_speculate() -> None:
    engine = spec_engine("ngram")
    before = engine.stats()["spec_draft_tokens"]
    out = engine.generate(prompts(), dataclasses.replace(GREEDY, speculative=False))
    assert engine.stats()["spec_draft_tokens"] == before
    assert [o.token_ids for o in out] == [o.token_ids for o in plain_engine().generate(prompts(), GREEDY)]


def test_seeded_sampling_with_speculation_is_the_same_alone_and_in_a_batch() -> None:
    engine = spec_engine("ngram")
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=16, ignore_eos=True)
    alone = engine.generate([prompts()[0]], params)[0].token_ids
    batch = engine.generate(prompts()[1:3] + [prompts()[0]], params)
    assert batch[-1].token_ids == alone


# ------------------------------------------------------------------------------------------ rollback


@pytest.mark.parametrize("spec, draft", [(NGRAM, None), (DRAFT, "small")], ids=["ngram", "draft"])
def test_stress_rollback_leaks_no_pages(spec: dict, draft: str | None) -> None:
    """Few pages (preemption by recompute), every knob, n > 1, aborts mid-run: every page comes back, nothing
    compiles after warmup, and every greedy request equals plain decoding."""
    engine = make_engine(spec, draft, num_pages=24)
    rng = np.random.default_rng(5)
    knobs = [dict(temperature=0.0), dict(temperature=0.7, seed=1), dict(top_k=5), dict(top_p=0.5),
             dict(min_p=0.2), dict(repetition_penalty=1.2), dict(frequency_penalty=-0.5), dict(logit_bias={3: 5.0}),
             dict(logprobs=3), dict(prompt_logprobs=2), dict(n=2), dict(min_tokens=4, stop_token_ids=(5, 6)),
             dict(speculative=False)]
    base = prompts()
    rids, greedy = [], {}
    for i in range(20):
        prompt = base[i % len(base)][: int(rng.integers(1, 30))]
        kw = knobs[i % len(knobs)]
        params = SamplingParams(max_tokens=int(rng.integers(4, 28)), ignore_eos=True, **kw)
        rid = engine.add_request(prompt, params)
        rids.append(rid)
        if kw.get("temperature") == 0.0:
            greedy[rid] = (prompt, params)
    finals = {}
    for step in range(400):
        if not engine.has_unfinished():
            break
        if step in (3, 9):
            engine.abort(rids[step])
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert not engine.has_unfinished()
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_draft_tokens"] > 0
    assert_clean(engine)
    for rid, (prompt, params) in greedy.items():
        assert finals[rid].token_ids == plain_engine().generate([prompt], params)[0].token_ids


def test_scheduler_rolls_back_rejected_proposals() -> None:
    sched = Scheduler(num_pages=20, page_size=2, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64,
                      enable_prefix_caching=False)
    sched.add(SequenceGroup.create("r", [1, 2, 3], max_tokens=20))
    plan = sched.schedule()
    sched.update(plan, {("r", 0): 9})  # prompt done, one token out
    (entry,) = sched.schedule().seqs  # decode of token 9 at position 3
    pages, copies = sched.reserve_draft_slots(entry.key, entry.kv_len, 6)  # proposals at positions 4..9
    assert not copies and len(pages) == pages_for_tokens(10, 2)
    spec = entry._replace(token_ids=(9, 4, 4, 4, 4, 4, 4), page_ids=pages, kv_len=10, num_draft=6)
    free = sched.allocator.num_free
    sched.update(StepPlan((spec,), (), (), 7), {("r", 0): (4, 4, 8)})  # two accepted, then 8
    seq = sched.live(("r", 0))
    assert seq.token_ids == [1, 2, 3, 9, 4, 4, 8] and seq.num_computed_tokens == 6
    assert len(seq.page_ids) == pages_for_tokens(7, 2)
    assert sched.allocator.num_free == free + pages_for_tokens(10, 2) - pages_for_tokens(7, 2)


# ------------------------------------------------------------------------------------------ lossless sampling

SMALL_V = 24  # the sampler returns up to 20 alternatives, so the vocabulary has at least that many tokens
SMALL = model_helpers.tiny_config(tie_word_embeddings=False, vocab_size=SMALL_V, eos_token_id=1)
CHI_PROMPT = [3, 4, 5, 3, 4, 6, 3, 4]
CHI_N = 2500


def _peaked(w):  # logits of std ~1.5: a few likely tokens, so proposals are often accepted and often not
    return dataclasses.replace(w, lm_head=w.lm_head * 1.5)


@functools.cache
def small_runner(seed: int):
    """The xla attention (a CPU's default) rather than the reference: these tests are about the verification's
    sampling, which takes the logits as they come, and the reference attends one sequence at a time. A draft
    proposal call took 25-29 ms instead of 8.6 and the five cases 179 -> 149 s alone, from an empty compilation
    cache, with the very same samples (same tables, same p-values)."""
    return model_helpers.build_runner(SMALL, seed=seed, num_pages=240, page_size=PAGE, weights_hook=_peaked,
                                      attention_impl="xla")


@functools.cache
def small_engine(spec_name: str | None) -> Engine:
    spec = {None: None, "ngram": NGRAM,
            "greedy-self": {**DRAFT, "draft_sampling": False}, "sampled-other": DRAFT}[spec_name]
    draft = {"greedy-self": small_runner(0), "sampled-other": small_runner(1)}.get(spec_name)
    engine = Engine(small_runner(0), None, EngineConfig(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=64),
                    CacheConfig(page_size=PAGE), use_tqdm=False, speculative=parse_speculative(spec),
                    draft_runner=draft)
    engine.warmup()
    if engine.spec is not None:
        engine.spec.cost.worth = lambda *args: True
    return engine


def _samples(engine: Engine, first_seed: int, knobs: str) -> list[tuple[int, ...]]:
    params = [SamplingParams(max_tokens=4, temperature=1.0, seed=first_seed + i, ignore_eos=True, **KNOBS[knobs])
              for i in range(CHI_N)]
    return [tuple(o.token_ids) for o in engine.generate([CHI_PROMPT] * CHI_N, params)]


@functools.cache
def plain_samples(knobs: str) -> list[tuple[int, ...]]:
    return _samples(small_engine(None), 0, knobs)


@functools.cache
def _rank_of(context: tuple[int, ...]) -> np.ndarray:
    """1-based rank of every token under the model's raw next-token distribution after `context`."""
    logits = model_helpers.dense_reference_logits(small_runner(0).weights, SMALL, list(context))[-1]
    ranks = np.empty(SMALL_V, np.int64)
    ranks[np.argsort(-logits, kind="stable")] = np.arange(1, SMALL_V + 1)
    return ranks


def _categories(samples: list[tuple[int, ...]]) -> Counter:
    """Each sample's (rank of token 2, rank of token 3) in its context, ranks above 3 pooled as 4 and a
    missing token (a stop) as 0. Errors in accepting proposals move mass between ranks (a greedy draft
    proposes rank 1), which shows far more clearly here than in the token ids, whose best differs by context."""
    out: Counter = Counter()
    for tokens in samples:
        ranks = [_rank_of((*CHI_PROMPT, *tokens[:i]))[tokens[i]] if len(tokens) > i else 0 for i in (1, 2)]
        out[tuple(min(int(r), 4) for r in ranks)] += 1
    return out


KNOBS = {"plain": {}, "knobs": dict(top_k=6, top_p=0.9, repetition_penalty=1.5, logit_bias={5: 1.0}, min_tokens=2,
                                    stop_token_ids=(2,))}


@pytest.mark.parametrize("spec_name, knobs", [("ngram", "knobs"), ("greedy-self", "plain"), ("greedy-self", "knobs"),
                                              ("sampled-other", "plain"), ("sampled-other", "knobs")])
def test_speculative_sampling_has_the_plain_distribution(spec_name: str, knobs: str) -> None:
    """Chi-square test of homogeneity between seeded samples with and without speculation (disjoint seeds),
    over the ranks of the tokens the speculative step verifies (`_categories`). Cells seen fewer than 10 times
    are pooled. Deterministic: fixed seeds, fixed verdict."""
    plain = _categories(plain_samples(knobs))
    engine = small_engine(spec_name)
    before = dict(engine.stats())
    spec = _categories(_samples(engine, 10**6, knobs))
    cells = sorted(set(plain) | set(spec))
    table = np.array([[plain[c] for c in cells], [spec[c] for c in cells]])
    common = table.sum(axis=0) >= 10
    pooled = table[:, ~common].sum(axis=1, keepdims=True)
    table = np.concatenate([table[:, common]] + ([pooled] if pooled.sum() else []), axis=1)
    p_value = chi2_contingency(table)[1]
    assert p_value > 1e-3, (p_value, table)
    drafted = engine.stats()["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = engine.stats()["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert drafted > CHI_N // 4 and 0 < accepted < drafted  # both the acceptance and the rejection paths ran


# ------------------------------------------------------------------------------------------ cost model, n-gram


def test_cost_model_speculates_when_memory_bound_and_not_when_compute_bound() -> None:
    model = SpecCostModel(alpha=0.6)
    for _ in range(3):
        model.record("step", 16, 0.010)
        model.record("spec", 16, 0.011)
        model.record("step", 256, 0.040)
        model.record("spec", 1024, 0.160)
    assert model.worth(rows=4, ks=[4] * 4, plain_tokens=16, spec_tokens=16)
    # 256 decodes with 3 proposals each: four times the tokens cost four times as long; E(0.6, 3) - 1 < 3.
    assert expected_tokens(0.6, 3) == pytest.approx(1 + 0.6 + 0.36 + 0.216)
    refusals = [model.worth(rows=256, ks=[3] * 256, plain_tokens=256, spec_tokens=1024) for _ in range(EXPLORE_EVERY)]
    assert refusals.count(True) == 1 and refusals[-1]  # one exploration in EXPLORE_EVERY refusals
    assert model.worth(rows=1, ks=[4], plain_tokens=32, spec_tokens=32)  # not measured yet: measure it
    model.record_acceptance(0, 10)
    assert model.alpha < 0.6


def test_disable_by_batch_size_turns_speculation_off() -> None:
    engine = make_engine({**NGRAM, "disable_by_batch_size": 2})
    engine.generate(prompts()[:3], GREEDY)  # three decodes at once until the short ones finish
    assert engine.stats()["spec_refused_steps"] > 0
    before = engine.stats()["spec_draft_tokens"]
    engine.generate(prompts()[:1], GREEDY)
    assert engine.stats()["spec_draft_tokens"] > before


def test_ngram_proposals() -> None:
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 3, 1, 3) == [7, 1, 2]  # most recent occurrence
    assert propose_ngram([5, 1, 2, 8, 4, 2, 6, 4, 2], 2, 1, 3) == [6, 4]  # the longest suffix match wins
    assert propose_ngram([1, 2, 3, 1, 2], 5, 2, 2) == [3, 1, 2]  # shorter than k at the end of the history
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []
    assert propose_ngram([7, 7], 2, 1, 1) == [7]
    assert propose_ngram([1, 2, 9, 9, 9, 9, 1, 2], 2, 2, 2, window=5) == []  # the old match is outside the window


def test_a_draft_engine_compiles_no_multi_step_loop_and_an_ngram_engine_does() -> None:
    """Every step of a draft model's engine goes through the speculator, never the multi-step loop, so its
    warmup leaves the loop out; n-gram speculation falls back to the loop for steps without proposals."""
    from jaxinfer.engine import warmup

    def kinds(spec: dict, draft: str | None) -> set[str]:
        engine = Engine(target_runner(), None,
                        EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128),
                        CacheConfig(page_size=PAGE), use_tqdm=False, decode_steps_per_call=4,
                        speculative=parse_speculative(spec), draft_runner=draft_runner(draft) if draft else None)
        return {kind for kind, _, _ in warmup.plan(engine).now}

    assert not set(DECODE_KINDS) & kinds(DRAFT, "self")
    assert set(DECODE_KINDS) & kinds(NGRAM, None)
