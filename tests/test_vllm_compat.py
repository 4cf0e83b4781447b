"""vLLM's offline API on the shared `text_llm` (tiny random Llama, SmolLM2's real tokenizer): every prompt form,
SamplingParams field, output field and LLM method, each against a hand-computed expectation. Random weights
make the text gibberish, but greedy decoding is deterministic, so a plain greedy run is the reference."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from jaxinfer import (
    LLM,
    FinishReason,
    InvalidInput,
    Logprob,
    Notice,
    RequestOutputKind,
    SamplingParams,
    TextPrompt,
    TokensPrompt,
)
from model_helpers import assert_clean

PROMPT = "The capital of France is"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def greedy(**kw) -> SamplingParams:
    return GREEDY.replace(**kw)


@pytest.fixture(scope="module")
def llm(text_llm: LLM) -> LLM:
    yield text_llm
    assert_clean(text_llm)


@pytest.fixture(scope="module")
def free(llm: LLM):
    """The plain greedy output of PROMPT: the reference most tests cut and compare."""
    return llm.generate(PROMPT, GREEDY)[0]


# ------------------------------------------------------------------------------------------ prompts


def test_every_prompt_form_gives_the_same_request(llm: LLM, free) -> None:
    ids = free.prompt_token_ids
    forms = [PROMPT, ids, tuple(ids), np.array(ids), TextPrompt(prompt=PROMPT), TokensPrompt(prompt_token_ids=ids),
             {"prompt_token_ids": ids, "prompt": "mine"}]
    outs = llm.generate(forms, GREEDY)
    assert all(o.token_ids == free.token_ids and o.prompt_token_ids == ids for o in outs)
    assert [o.prompt for o in outs] == [PROMPT] * 6 + ["mine"]  # token prompts report their decoded text
    assert llm.generate(ids, GREEDY)[0].token_ids == free.token_ids  # one token prompt, not a batch of ints
    assert llm.generate([], GREEDY) == []


def test_per_prompt_params_and_priorities(llm: LLM, free) -> None:
    outs = llm.generate([PROMPT, PROMPT], [greedy(max_tokens=3), greedy(max_tokens=5)], priority=[1, 0])
    assert [o.token_ids for o in outs] == [free.token_ids[:3], free.token_ids[:5]]
    with pytest.raises(InvalidInput, match="got 1 sampling_params for 2 prompts"):
        llm.generate([PROMPT, PROMPT], [GREEDY])
    with pytest.raises(InvalidInput, match="sampling_params must be a SamplingParams .*SamplingParams\\(\\*\\*d\\)"):
        llm.generate(PROMPT, {"temperature": 0})


def test_a_bad_prompt_refuses_the_whole_batch_before_any_step(llm: LLM) -> None:
    steps = llm.engine.num_steps
    with pytest.raises(InvalidInput, match=r"prompt 1: .*outside the vocabulary") as info:
        llm.generate([PROMPT, [5, llm.tokenizer.vocab_size]], GREEDY)
    assert info.value.field == "prompt[1]" and llm.engine.num_steps == steps
    assert_clean(llm)


# ------------------------------------------------------------------------------------------ stopping


def test_finish_and_stop_reasons(llm: LLM, free) -> None:
    stop_id = free.token_ids[4]
    eos = llm.get_tokenizer().eos_token_id
    by_id, by_eos, by_len = llm.generate([PROMPT] * 3, [greedy(stop_token_ids=[stop_id]),
                                                  greedy(ignore_eos=False, logit_bias={eos: 100.0}), GREEDY])
    assert by_id.finish_reason == "stop" and by_id.outputs[0].stop_reason == stop_id
    assert by_id.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
    assert by_eos.finish_reason == FinishReason.STOP and by_eos.outputs[0].stop_reason is None
    assert by_len.finish_reason == "length" and by_len.outputs[0].stop_reason is None


def test_stop_strings_and_include_stop_str_in_output(llm: LLM, free) -> None:
    stop = free.text[6:9]
    cut = free.text.index(stop)
    plain, kept = llm.generate([PROMPT] * 2, [greedy(stop=[stop, "never there"]),
                                        greedy(stop=[stop], include_stop_str_in_output=True)])
    assert plain.text == free.text[:cut] and plain.outputs[0].stop_reason == stop
    assert kept.text == plain.text + stop and kept.token_ids == plain.token_ids


def test_a_stop_tokens_text_is_left_out_unless_included(llm: LLM, free) -> None:
    stop_id = free.token_ids[3]
    first = free.token_ids.index(stop_id)
    tok = llm.tokenizer
    out, kept = llm.generate([PROMPT] * 2, [greedy(stop_token_ids=[stop_id]),
                                      greedy(stop_token_ids=[stop_id], include_stop_str_in_output=True)])
    assert out.text == tok.decode(free.token_ids[:first]) and kept.text == tok.decode(free.token_ids[: first + 1])


def test_min_tokens_holds_stops_back(llm: LLM, free) -> None:
    stop_id = free.token_ids[1]
    out = llm.generate(PROMPT, greedy(stop_token_ids=[stop_id], min_tokens=6, stop=[free.text[:4]]))[0]
    assert len(out.token_ids) >= 6


def test_max_tokens_none_runs_to_max_model_len(llm: LLM) -> None:
    out = llm.generate(PROMPT, greedy(max_tokens=None))[0]
    assert len(out.prompt_token_ids) + len(out.token_ids) == 64 and out.finish_reason == "length"


# ------------------------------------------------------------------------------------------ logprobs


def test_logprobs_are_logprob_objects_with_ranks(llm: LLM, free) -> None:
    out = llm.generate(PROMPT, greedy(logprobs=3, prompt_logprobs=2))[0]
    tok = llm.tokenizer
    assert out.token_ids == free.token_ids and len(out.outputs[0].logprobs) == len(out.token_ids)
    for token, step in zip(out.token_ids, out.outputs[0].logprobs):
        assert isinstance(step[token], Logprob) and step[token].rank == 1  # greedy: the most likely token
        assert sorted(lp.rank for lp in step.values()) == [1, 2, 3]
        assert all(lp.decoded_token == tok.decode([i], skip_special_tokens=False) for i, lp in step.items())
        assert all(lp.logprob <= step[token].logprob for lp in step.values())
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(step[t].logprob for t, step in zip(out.token_ids, out.outputs[0].logprobs)), abs=1e-4)
    prompt = out.prompt_logprobs
    assert prompt[0] is None and len(prompt) == len(out.prompt_token_ids)
    for actual, position in zip(out.prompt_token_ids[1:], prompt[1:]):
        assert actual in position and {1, 2} <= {lp.rank for lp in position.values()}
        assert position[actual].rank >= 1


def test_sampled_token_is_present_with_its_rank_and_detokenize_false(llm: LLM) -> None:
    out = llm.generate(PROMPT, SamplingParams(temperature=1.5, seed=5, max_tokens=8, logprobs=0, detokenize=False,
                                              ignore_eos=True))[0]
    assert out.text == "" and len(out.token_ids) == 8
    for token, step in zip(out.token_ids, out.outputs[0].logprobs):
        assert list(step) == [token] and step[token].rank >= 1 and step[token].decoded_token is None


# ------------------------------------------------------------------------------------------ output kinds


def test_delta_outputs_concatenate_to_the_cumulative_text(llm: LLM, free) -> None:
    deltas = list(llm.stream(PROMPT, greedy(output_kind=RequestOutputKind.DELTA, logprobs=1)))
    assert "".join(d.outputs[0].text for d in deltas) == free.text
    assert sum((d.outputs[0].token_ids for d in deltas), []) == free.token_ids
    assert sum(len(d.outputs[0].logprobs) for d in deltas) == len(free.token_ids)
    cumulative = list(llm.stream(PROMPT, GREEDY))
    assert cumulative[-1].text == free.text and all(c.text.startswith(d.text) for d, c in zip(cumulative, cumulative[1:]))
    final = list(llm.stream(PROMPT, greedy(output_kind="final_only")))
    assert len(final) == 1 and final[0].finished and final[0].text == free.text
    assert llm.generate(PROMPT, greedy(output_kind=RequestOutputKind.DELTA))[0].text == free.text  # always whole


def test_add_request_and_step_honor_output_kind(llm: LLM, free) -> None:
    rid = llm.add_request(PROMPT, greedy(output_kind=RequestOutputKind.DELTA), request_id="delta")
    text = ""
    while llm.has_unfinished():
        text += "".join(o.outputs[0].text for o in llm.step() if o.request_id == rid)
    assert text == free.text


# ------------------------------------------------------------------------------------------ token masks


def test_allowed_token_ids_are_the_only_ones_sampled(llm: LLM) -> None:
    allowed = [11, 500, 1234]
    outs = llm.generate([PROMPT] * 3, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True,
                                                     allowed_token_ids=allowed, n=1))
    tokens = {t for o in outs for t in o.token_ids}
    assert tokens <= set(allowed) and len(tokens) > 1
    assert llm.engine_stats()["num_compiles_after_warmup"] == 0


def test_bad_words_never_appear(llm: LLM, free) -> None:
    tok, ids = llm.tokenizer, free.token_ids
    word, at = _word_encoded_as(tok, ids, start=5)  # its prefix comes out inside a multi-step call
    single = tok.decode([ids[2]]).strip()
    outs = llm.generate([PROMPT] * 2, [greedy(bad_words=[word]), greedy(bad_words=[single])])
    assert outs[0].token_ids[:at + 1] == ids[:at + 1] and outs[0].token_ids[at + 1] != ids[at + 1]
    for out, banned in zip(outs, [ids[at : at + 2], ids[2:3]]):
        assert not _contains(out.token_ids, banned)
    assert llm.engine_stats()["num_compiles_after_warmup"] == 0


def _word_encoded_as(tok, ids: list[int], start: int) -> tuple[str, int]:
    """A two-token word of the output (from `start` on) that encodes back to exactly those two tokens."""
    for i in range(start, len(ids) - 1):
        word = tok.decode(ids[i : i + 2])
        variants = [tok.encode(w, add_special_tokens=False) for w in (word.lstrip(), " " + word.lstrip())]
        if ids[i : i + 2] in variants:
            return word, i
    raise AssertionError("no two-token word that encodes back to its tokens")


def _contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


# ------------------------------------------------------------------------------------------ other fields


def test_truncate_prompt_tokens_keeps_the_last_n(llm: LLM) -> None:
    ids = list(range(100, 180))  # longer than max_model_len
    short, longest = llm.generate([ids, ids], [greedy(max_tokens=2, truncate_prompt_tokens=5),
                                               greedy(max_tokens=2, truncate_prompt_tokens=-1)])
    assert short.prompt_token_ids == ids[-5:] and longest.prompt_token_ids == ids[-63:]
    assert short.token_ids == llm.generate(ids[-5:], greedy(max_tokens=2))[0].token_ids


def test_n_seed_clone_extra_args_and_spaces_between_special_tokens(llm: LLM) -> None:
    p = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=6, ignore_eos=True, extra_args={"tag": 1})
    a, b = llm.generate([PROMPT, PROMPT], [p, p.clone()])
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs] and len({tuple(c.token_ids)
                                                                                         for c in a.outputs}) == 3
    special = "<|im_start|>user\nhi<|im_end|>"
    texts = [llm.generate(special, greedy(max_tokens=2, skip_special_tokens=False,
                                          spaces_between_special_tokens=s))[0].text for s in (True, False)]
    assert texts[0] == texts[1]  # as with HF's fast tokenizers (and vLLM on them): no effect


def test_prefix_cache_hits_and_metrics(llm: LLM) -> None:
    ids = list(range(200, 240))  # two full pages of 16
    llm.generate(ids, greedy(max_tokens=2))
    out = llm.generate(ids, greedy(max_tokens=2))[0]
    assert out.num_cached_tokens == 32
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert m["ttft_s"] == pytest.approx(m.first_token_time - m.arrival_time, abs=1e-3)
    # reset_prefix_cache (vLLM's): the same prompt computes its whole prompt again, with the same tokens.
    assert llm.reset_prefix_cache() is True
    again = llm.generate(ids, greedy(max_tokens=2))[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == out.outputs[0].token_ids
    assert llm.generate(ids, greedy(max_tokens=2))[0].num_cached_tokens == 32  # and caches it anew


def test_cpu_bench_times_each_call_from_an_empty_prefix_cache(llm: LLM) -> None:
    """`jaxinfer bench --device cpu` repeats its prompts; HF keeps nothing between calls, so neither may we."""
    from jaxinfer.bench.cpu_vs_hf import prompts, run_ours

    rec = run_ours(llm, prompts(llm.model_config.vocab_size, 2, 32), 3, rounds=2)
    assert rec["timed_prefix_cache_hit_tokens"] == 0  # without the resets: a page of each prompt, every call
    assert rec["output_tokens"] == 6 and len(rec["times_s"]) == 2


# ------------------------------------------------------------------------------------------ tokenizer, chat


def test_get_tokenizer_has_hf_signatures(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    ids = tok.encode("Hello world")
    assert ids == llm.tokenizer.encode("Hello world") and tok(["a", "b"])["input_ids"] == [tok.encode("a"),
                                                                                          tok.encode("b")]
    assert tok.eos_token_id == llm.tokenizer.eos_token_id and tok.vocab_size == len(tok) == 49152
    special = tok.encode("<|im_end|>")
    assert tok.decode(special) == "<|im_end|>" and tok.decode(special, skip_special_tokens=True) == ""  # HF defaults
    conv = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(conv) == tok.encode(tok.apply_chat_template(conv, tokenize=False))
    assert not tok.apply_chat_template(conv, tokenize=False).endswith("<|im_start|>assistant\n")
    assert tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True).endswith("<|im_start|>assistant\n")
    assert tok.apply_chat_template([conv, conv], tokenize=False)[1] == tok.apply_chat_template(conv, tokenize=False)


def test_chat_keywords(llm: LLM) -> None:
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    one, = llm.chat(conv, greedy(max_tokens=3), use_tqdm=False)
    assert one.prompt.endswith("<|im_start|>assistant\n") and one.prompt.startswith("<|im_start|>system\nBe brief.")
    assert len(llm.chat([conv, conv], greedy(max_tokens=3))) == 2
    no_turn, = llm.chat(conv, greedy(max_tokens=3), add_generation_prompt=False)
    assert no_turn.prompt.endswith("<|im_end|>\n")
    partial = conv + [{"role": "assistant", "content": "The color is"}]
    cont, = llm.chat(partial, greedy(max_tokens=3), add_generation_prompt=False, continue_final_message=True)
    assert cont.prompt.endswith("<|im_start|>assistant\nThe color is")
    template = "{% for m in messages %}{{ greeting }} {{ m['content'] }}{% endfor %}{{ tools | length }}"
    custom, = llm.chat(conv[1:], greedy(max_tokens=2), chat_template=template,
                       chat_template_kwargs={"greeting": "Hey"}, tools=[{"type": "function"}])
    assert custom.prompt == "Hey Name a color.1"
    with pytest.raises(InvalidInput, match="add_generation_prompt and continue_final_message"):
        llm.chat(partial, continue_final_message=True)
    with pytest.raises(InvalidInput, match=r"messages\[1\]: the chat template refused"):
        llm.chat([conv, [{"role": "user", "content": "x"}]],
                 chat_template="{% if messages[0]['content'] == 'x' %}{{ raise_exception('no x') }}{% endif %}ok")
    with pytest.raises(InvalidInput) as info:
        llm.chat([{"content": "no role"}])
    assert info.value.field == "messages[0].role"


# ------------------------------------------------------------------------------------------ LLM(...) arguments


def test_llm_arguments_are_checked_before_anything_loads(smollm2_path) -> None:
    with pytest.raises(InvalidInput, match="revision='main' is not supported"):
        LLM(model=str(smollm2_path), revision="main")
    with pytest.raises(InvalidInput, match=r"max_model_len must be at most the model's max_position_embeddings"):
        LLM(model=str(smollm2_path), max_model_len=1_000_000)
    with pytest.raises(InvalidInput, match="no tokenizer"):
        LLM("smollm2-135m", random_weights=True, warmup=False, num_pages=4).get_tokenizer()


def test_gpu_memory_utilization_sizes_the_cache(text_llm: LLM) -> None:
    from jaxinfer.kv_cache import bytes_per_page

    cfg = text_llm.model_config
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = LLM(cfg, random_weights=True, warmup=False, gpu_memory_utilization=0.01, page_size=8, max_model_len=64,
                  trust_remote_code=True, use_tqdm=False)
    assert [str(w.message) for w in caught if w.category is Notice] == [
        "LLM argument trust_remote_code=True has no effect: jaxinfer never runs code from a checkpoint; its "
        "architectures are built in."]
    per_page = bytes_per_page(cfg, 8, llm.dtype, llm.mesh)
    assert llm.cache_config.page_size == 8 and llm.engine_stats()["total_pages"] == int((2 << 30) * 0.01) // per_page - 1
