"""The `LLM` surface over a tiny random model built from a ModelConfig: generate, stream, stats, options."""

from __future__ import annotations

import pytest

from jaxinfer import LLM, FinishReason, SamplingParams
from jaxinfer.config import ConfigError
from jaxinfer.presets import load_preset

CFG = load_preset("smollm2-135m").replace(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    tie_word_embeddings=False,
)
KW = dict(random_weights=True, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, page_size=16,
          num_pages=24, attention_impl="reference", use_tqdm=False)
PROMPTS = [[5, 9, 200, 17], [1], list(range(30, 70)), [250, 3, 3, 3, 8, 100, 7]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(CFG, decode_steps_per_call=4, **KW)


def test_generate_returns_in_input_order_with_multi_step_equal_to_single_step(llm: LLM) -> None:
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    assert all(len(o.token_ids) == 12 and o.finish_reason is FinishReason.LENGTH for o in outs)
    single = LLM(CFG, decode_steps_per_call=1, warmup=False, **KW)
    single.engine.runner = llm.engine.runner  # same weights and compiled step; only the engine loop differs
    assert [o.token_ids for o in single.generate(PROMPTS, GREEDY)] == [o.token_ids for o in outs]
    assert llm.engine.num_steps < single.engine.num_steps


def test_engine_stats_after_a_mixed_run(llm: LLM) -> None:
    llm.generate(PROMPTS, [GREEDY, SamplingParams(n=2, seed=1, max_tokens=5), GREEDY,
                           SamplingParams(temperature=0.5, logprobs=2, prompt_logprobs=1)])
    stats = llm.engine_stats()
    for key in ("num_compiles_after_warmup", "num_preemptions", "prefix_cache_hit_rate", "free_pages",
                "total_pages", "num_running", "num_waiting"):
        assert key in stats
    assert stats["num_compiles_after_warmup"] == 0
    assert stats["free_pages"] == stats["total_pages"] == 23
    assert stats["num_running"] == stats["num_waiting"] == 0


def test_stream_yields_deltas_that_add_up(llm: LLM) -> None:
    tokens: dict[str, list[int]] = {}
    finals = {}
    for out in llm.stream(PROMPTS[:2], GREEDY):
        tokens.setdefault(out.request_id, []).extend(out.outputs[0].delta_token_ids)
        if out.finished:
            finals[out.request_id] = out.token_ids
    assert finals and all(tokens[rid] == ids for rid, ids in finals.items())


def test_long_prefill_token_threshold_gives_the_same_tokens_over_more_steps(llm: LLM) -> None:
    """Prompts prefilled at most 4 tokens a step (vLLM's long_prefill_token_threshold): the same greedy tokens,
    more steps; a negative threshold is refused by name before anything loads."""
    before = llm.engine.num_steps
    want = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    uncapped_steps = llm.engine.num_steps - before
    capped = LLM(CFG, decode_steps_per_call=4, long_prefill_token_threshold=4, warmup=False, **KW)
    capped.engine.runner = llm.engine.runner  # same weights and compiled steps; only the scheduling differs
    assert [o.token_ids for o in capped.generate(PROMPTS, GREEDY)] == want
    assert capped.engine.num_steps > uncapped_steps
    with pytest.raises(ValueError, match="long_prefill_token_threshold.*>= 0"):
        LLM(CFG, long_prefill_token_threshold=-1, warmup=False, **KW)
    # Its mixed-step sibling, off unless asked for, reaches the scheduler the same way.
    assert llm.engine.scheduler.mixed_prefill_token_cap == 0
    assert LLM(CFG, mixed_prefill_token_cap=4, warmup=False, **KW).engine.scheduler.mixed_prefill_token_cap == 4
    with pytest.raises(ValueError, match="mixed_prefill_token_cap.*>= 0"):
        LLM(CFG, mixed_prefill_token_cap=-1, warmup=False, **KW)


def test_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="random_weights"):
        LLM(CFG, **{**KW, "random_weights": False})
    with pytest.raises(ValueError, match="decode_steps_per_call"):
        LLM(CFG, decode_steps_per_call=0, warmup=False, **KW)


def test_add_request_step_interface_for_servers(llm: LLM) -> None:
    """A server's loop: add, step until done, abort one mid-way; a bad request is refused on its own."""
    keep = llm.add_request(PROMPTS[0], GREEDY, request_id="keep")
    drop = llm.add_request(PROMPTS[2], GREEDY, request_id="drop")
    with pytest.raises(ValueError, match="temperature"):
        llm.add_request(PROMPTS[1], _bad_temperature())
    texts: dict[str, list[int]] = {keep: [], drop: []}
    finished = set()
    aborted = None
    while llm.has_unfinished():
        for out in llm.step():
            texts[out.request_id].extend(out.outputs[0].delta_token_ids)
            if out.finished:
                finished.add(out.request_id)
        if aborted is None and len(texts[drop]) >= 2:
            aborted = llm.abort(drop)
    assert finished == {keep} and aborted.finished and aborted.outputs[0].finish_reason is FinishReason.ABORT
    assert texts[keep] == llm.generate([PROMPTS[0]], GREEDY)[0].token_ids
    stats = llm.engine_stats()
    assert stats["free_pages"] == stats["total_pages"] and stats["num_running"] == stats["num_waiting"] == 0


def _bad_temperature() -> SamplingParams:
    # SamplingParams refuses a negative temperature itself; bypass it to check the engine's own admission check.
    params = SamplingParams(temperature=0.5)
    object.__setattr__(params, "temperature", -1.0)
    return params


def test_multi_step_engages_for_rows_at_different_page_offsets() -> None:
    # Prompts of lengths 5..8 leave every row at a different offset in its 4-token pages. Without pages
    # reserved ahead, the smallest room in any last page (often 1) bounded every call to one iteration.
    kw = {**KW, "page_size": 4, "num_pages": 96}
    multi = LLM(CFG, decode_steps_per_call=4, **kw)
    prompts = [list(range(10, 10 + n)) for n in (5, 6, 7, 8)]
    params = SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True)
    outs = multi.generate(prompts, params)
    single = LLM(CFG, decode_steps_per_call=1, warmup=False, **kw)
    single.engine.runner = multi.engine.runner
    assert [o.token_ids for o in single.generate(prompts, params)] == [o.token_ids for o in outs]
    # 2 prefill steps (16-token budget), then 16 decode tokens at up to 4 per call.
    assert multi.engine.num_steps <= 2 + 16 // 4 + 2 < single.engine.num_steps
    stats = multi.engine_stats()
    assert stats["free_pages"] == stats["total_pages"] and stats["num_compiles_after_warmup"] == 0


def test_compilation_cache_setting(tmp_path, monkeypatch) -> None:
    import jax

    from jaxinfer.llm import COMPILATION_CACHE_ENV, default_compilation_cache_dir, use_compilation_cache

    monkeypatch.setenv(COMPILATION_CACHE_ENV, str(tmp_path / "env-dir"))
    assert default_compilation_cache_dir() == tmp_path / "env-dir"
    before = {k: getattr(jax.config, k) for k in ("jax_compilation_cache_dir", "jax_compilation_cache_max_size",
                                                  "jax_persistent_cache_min_compile_time_secs")}
    try:
        assert use_compilation_cache(None) is None and use_compilation_cache("auto") is None  # CPU: off
        assert jax.config.jax_compilation_cache_dir == before["jax_compilation_cache_dir"]
        path = use_compilation_cache(tmp_path / "cache")
        assert path == tmp_path / "cache" and path.is_dir() and (path.stat().st_mode & 0o777) == 0o700
        assert jax.config.jax_compilation_cache_dir == str(path)
    finally:
        for key, value in before.items():
            jax.config.update(key, value)
