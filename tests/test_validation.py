"""The door without a model: SamplingParams' table, prompt and message forms, LLM(...) arguments, config types
and config.json checks. Every refusal is an InvalidInput (a ValueError; a TypeError too for wrong types)
whose .field names what the caller wrote."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings

import numpy as np
import pytest

from jaxinfer import InvalidInput, InvalidInputType, Notice, RequestOutputKind, SamplingParams
from jaxinfer.checkpoint import CheckpointError
from jaxinfer.checkpoint.safetensors import SafetensorsCheckpoint
from jaxinfer.config import ConfigError, EngineConfig
from jaxinfer.inputs import Prompt, check_conversation, parse_prompts, split_conversations
from jaxinfer.llm_args import LLM_ARG_RULES, LLMArgs, check_model_limits, resolve_llm_args
from jaxinfer.outputs import FinishReason, Logprob, RequestMetrics
from jaxinfer.validation import SAMPLING_RULES, Limits, check_sampling_fields, normalized_sampling_fields
from tiny_checkpoint import TINY_HF_CONFIG

# ------------------------------------------------------------------------------------------ SamplingParams


def test_the_table_is_the_dataclass() -> None:
    fields = dataclasses.fields(SamplingParams)
    assert [f.name for f in fields] == [r.name for r in SAMPLING_RULES]
    assert all(f.default == r.default for f, r in zip(fields, SAMPLING_RULES))
    assert dataclasses.fields(LLMArgs) and [f.name for f in dataclasses.fields(LLMArgs)] == [r.name for r in
                                                                                          LLM_ARG_RULES]


def test_vllm_forms_are_normalized() -> None:
    p = SamplingParams(stop=None, stop_token_ids=None, bad_words="darn", logit_bias={"7": 1, 9: -2.5},
                       allowed_token_ids=np.array([3, 4]), max_tokens=None, top_k=0, temperature=np.float32(0.5),
                       seed=np.int64(3), output_kind="delta")
    assert p.stop == () and p.stop_token_ids == () and p.bad_words == ("darn",)
    assert p.logit_bias == {7: 1.0, 9: -2.5} and p.allowed_token_ids == (3, 4) and type(p.seed) is int
    assert p.max_tokens is None and p.top_k == 0 and p.temperature == 0.5 and type(p.temperature) is float
    assert p.output_kind is RequestOutputKind.DELTA
    assert SamplingParams(stop="x").stop == ("x",) and SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(output_kind=2).output_kind is RequestOutputKind.FINAL_ONLY


BAD = [
    ("temperature", -0.1, False), ("temperature", math.inf, False), ("temperature", "hot", True),
    ("top_p", 0.0, False), ("top_k", -2, False), ("top_k", 1.5, True), ("n", 0, False), ("n", True, True),
    ("max_tokens", 0, False), ("max_tokens", 2.0, True), ("min_p", math.nan, False),
    ("presence_penalty", 2.5, False), ("repetition_penalty", 0.0, False), ("seed", "1", True),
    ("stop", [""], False), ("stop", [1], True), ("stop", ["\ud800"], False), ("stop_token_ids", [1.0], True),
    ("stop_token_ids", [-1], False), ("logit_bias", {1: 101.0}, False), ("logit_bias", [1, 2], True),
    ("logit_bias", {i: 1.0 for i in range(17)}, False), ("logprobs", 21, False), ("prompt_logprobs", -1, False),
    ("ignore_eos", 1, True), ("detokenize", None, True), ("truncate_prompt_tokens", 0, False),
    ("truncate_prompt_tokens", -2, False), ("allowed_token_ids", [], False), ("allowed_token_ids", [None], True),
    ("allowed_token_ids", list(range(257)), False), ("bad_words", [" "], False), ("bad_words", [3], True),
    ("bad_words", [f"w{i}" for i in range(17)], False), ("output_kind", "partial", True),
    ("output_kind", 3, True), ("extra_args", [1], True), ("extra_args", {1: 2}, True),
]


@pytest.mark.parametrize("field, value, wrong_type", BAD, ids=[f"{f}={v!r}"[:40] for f, v, _ in BAD])
def test_bad_values_name_the_field(field: str, value, wrong_type: bool) -> None:
    with pytest.raises(InvalidInput, match=rf"SamplingParams\.{field} must be .*, got ") as info:
        SamplingParams(**{field: value})
    assert info.value.field == field and isinstance(info.value, ValueError) and isinstance(info.value, ConfigError)
    assert isinstance(info.value, TypeError) == wrong_type


def test_cross_field_rules() -> None:
    with pytest.raises(InvalidInput, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    SamplingParams(min_tokens=50, max_tokens=None)
    with pytest.raises(InvalidInput, match="stop must .*detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)
    values = normalized_sampling_fields(SamplingParams(stop_token_ids=list(range(8)), min_tokens=1))
    with pytest.raises(InvalidInput, match="stop_token_ids") as info:  # 8 ids + EOS do not fit the device's 8
        check_sampling_fields(values, Limits(vocab_size=100, eos_ids=(99,)))
    assert "at most 8 ids together with the EOS ids" in str(info.value)
    with pytest.raises(InvalidInput, match=r"in \[0, 100\)"):
        check_sampling_fields(normalized_sampling_fields(SamplingParams(allowed_token_ids=[100])), Limits(vocab_size=100))
    with pytest.raises(InvalidInput, match=r"truncate_prompt_tokens must be .*\[1, 64\)"):
        check_sampling_fields(normalized_sampling_fields(SamplingParams(truncate_prompt_tokens=64)),
                              Limits(max_model_len=64))
    with pytest.raises(InvalidInput, match="bad_words .*needs a tokenizer"):
        check_sampling_fields(normalized_sampling_fields(SamplingParams(bad_words=["x"])), Limits(has_tokenizer=False))


def test_clone_from_dict_and_replace() -> None:
    p = SamplingParams(logit_bias={1: 1.0}, extra_args={"k": [1]}, seed=3)
    q = p.clone()
    assert q == p and q.logit_bias is not p.logit_bias and q.extra_args["k"] is not p.extra_args["k"]
    assert p.replace(seed=4).seed == 4
    with pytest.raises(InvalidInput, match="record 'r1' sampling: SamplingParams.top_p must be"):
        SamplingParams.from_dict({"top_p": 7}, section="record 'r1' sampling")
    with pytest.raises(InvalidInput, match="unknown key\\(s\\) 'temprature'") as info:
        SamplingParams.from_dict({"temprature": 1})
    assert info.value.field == "temprature"
    with pytest.raises(InvalidInputType, match="expected a mapping"):
        SamplingParams.from_dict(["max_tokens", 3])
    assert SamplingParams.from_dict({"stop": None, "max_tokens": None, "output_kind": "final_only"}).stop == ()


def test_outputs_compare_like_vllm() -> None:
    assert FinishReason.LENGTH == "length" and FinishReason.STOP == "stop" and str(FinishReason.ERROR) == "error"
    lp = Logprob(-0.5, rank=1, decoded_token=" a")
    assert lp.logprob == -0.5 == lp and lp.rank == 1 and lp.decoded_token == " a" and "rank=1" in repr(lp)
    assert json.loads(json.dumps({"lp": lp})) == {"lp": -0.5}
    m = RequestMetrics(arrival_time=1.0, ttft_s=0.5)
    assert m.arrival_time == 1.0 and m.first_token_time is None and m["ttft_s"] == 0.5 and json.dumps(m)


# ------------------------------------------------------------------------------------------ prompts, messages


def test_prompt_forms() -> None:
    ids = [1, 2, 3]
    assert parse_prompts("hi") == [Prompt("hi", None)]
    assert parse_prompts(ids) == parse_prompts(tuple(ids)) == parse_prompts(np.array(ids)) == [Prompt(None, (1, 2, 3))]
    assert parse_prompts([np.int64(1), 2]) == [Prompt(None, (1, 2))]
    assert parse_prompts({"prompt": "hi"}) == [Prompt("hi", None)]
    assert parse_prompts({"prompt_token_ids": ids, "prompt": "t"}) == [Prompt("t", (1, 2, 3))]
    assert parse_prompts(["a", ids, {"prompt": "b"}]) == [Prompt("a", None), Prompt(None, (1, 2, 3)), Prompt("b", None)]
    assert parse_prompts(np.array([[1, 2], [3, 4]])) == [Prompt(None, (1, 2)), Prompt(None, (3, 4))]
    assert parse_prompts([]) == []


@pytest.mark.parametrize(
    "prompts, field",
    [(None, "prompts"), (5, "prompts"), ([1, 2.0], "prompt[1]"), ([504.7], "prompt[0]"), ([True], "prompt[0]"),
     (["a", 5], "prompts[1]"), ([[1, None]], "prompts[0][1]"), ([["a"]], "prompts[0][0]"), ("\ud800x", "prompt"),
     (np.array([1.0, 2.0]), "prompt"), ({"prompt": None}, "prompt.prompt"), ({"prompt_token_ids": "12"},
     "prompt.prompt_token_ids"), ({"multi_modal_data": {}}, "prompt.multi_modal_data"), ({}, "prompt"),
     (object(), "prompts"),
     # past the all-int fast path: a bool (an int subclass) or a float deep in a long prompt is still found
     ([7] * 4000 + [True], "prompt[4000]"), ((7,) * 300 + (3.0,), "prompt[300]")],
)
def test_bad_prompts_name_the_field(prompts, field: str) -> None:
    with pytest.raises(InvalidInput) as info:
        parse_prompts(prompts)
    assert info.value.field == field and field.split("[")[0].split(".")[0] in str(info.value)


def test_message_forms() -> None:
    conv = check_conversation([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                                             "text": "b"}]},
                               {"role": "assistant", "content": None, "tool_calls": []}])
    assert conv == [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": None, "tool_calls": []}]
    assert split_conversations([[{"role": "user", "content": "x"}]] * 2)[1] is True
    assert split_conversations([{"role": "user", "content": "x"}])[1] is False
    bad = [([], "messages"), ("hi", "messages"), ([{"content": "x"}], "messages[0].role"),
           ([{"role": 3, "content": "x"}], "messages[0].role"), ([{"role": "user"}], "messages[0].content"),
           ([{"role": "user", "content": 5}], "messages[0].content"),
           ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]"),
           ([{"role": "user", "content": "\udfff"}], "messages[0].content"), ([None], "messages[0]")]
    for messages, field in bad:
        with pytest.raises(InvalidInput) as info:
            check_conversation(messages)
        assert info.value.field == field, messages


# ------------------------------------------------------------------------------------------ LLM(...) arguments


def test_llm_arguments_vllm_names_aliases_notices_and_refusals() -> None:
    args = resolve_llm_args({"page_size": 8, "gpu_memory_utilization": 0.9, "dtype": "half", "max_model_len": 100})
    # memory_fraction None: the platform default (jaxinfer.platform), filled in by LLM
    assert (args.block_size, args.gpu_memory_utilization, args.dtype, args.memory_fraction) == (8, 0.9, "half", None)
    assert resolve_llm_args({"block_size": 8, "page_size": 8}).block_size == 8
    with pytest.raises(InvalidInput, match="page_size and block_size are the same setting"):
        resolve_llm_args({"block_size": 8, "page_size": 4})
    with pytest.warns(Notice, match="trust_remote_code=True has no effect"):
        resolve_llm_args({"trust_remote_code": True})
    with pytest.warns(Notice, match="enforce_eager=True has no effect"):
        resolve_llm_args({"enforce_eager": True})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_llm_args({"trust_remote_code": False, "revision": None, "download_dir": None})  # vLLM's defaults
    with pytest.raises(InvalidInput, match="revision='v2' is not supported: jaxinfer loads local files only"):
        resolve_llm_args({"revision": "v2"})
    with pytest.raises(InvalidInputType, match="gpu_memory_utilisation is not an argument .*gpu_memory_utilization"):
        resolve_llm_args({"gpu_memory_utilisation": 0.5})
    with pytest.raises(InvalidInput, match="num_pages and gpu_memory_utilization"):
        resolve_llm_args({"num_pages": 10, "gpu_memory_utilization": 0.5})


@pytest.mark.parametrize(
    "name, value, wrong_type",
    [("max_model_len", 0, False), ("max_model_len", "4k", True), ("gpu_memory_utilization", 1.5, False),
     ("max_num_seqs", 0, False), ("block_size", 0, False), ("dtype", "int8", False), ("dtype", 32, True),
     ("quantization", "awq", False), ("kv_cache_dtype", "fp16", False), ("tensor_parallel_size", 0, False),
     ("attention_impl", "flash", False), ("enable_prefix_caching", "yes", True), ("num_pages", 1, False)],
)
def test_llm_argument_ranges(name: str, value, wrong_type: bool) -> None:
    with pytest.raises(InvalidInput, match=rf"LLM argument {name} must be .*, got ") as info:
        resolve_llm_args({name: value})
    assert info.value.field == name and isinstance(info.value, TypeError) == wrong_type


def test_model_bounds_max_model_len() -> None:
    check_model_limits(resolve_llm_args({"max_model_len": 2048}), 2048)
    with pytest.raises(InvalidInput, match=r"max_model_len must be at most the model's max_position_embeddings \(2048\)"):
        check_model_limits(resolve_llm_args({"max_model_len": 1_000_000}), 2048)


# ------------------------------------------------------------------------------------------ config files


def test_config_sections_are_typed() -> None:
    with pytest.raises(InvalidInputType, match="engine.max_num_seqs must be an integer, got 'many'"):
        EngineConfig.from_dict({"max_num_seqs": "many"}, section="engine")
    with pytest.raises(InvalidInputType, match="EngineConfig.max_num_seqs must be an integer"):
        EngineConfig(max_num_seqs=2.5)


@pytest.mark.parametrize(
    "content, message",
    [(b"\xff\xfe{}", "not UTF-8"), (b"[1, 2]", "expected a JSON object at the top level, got list"),
     (b"{bad", "invalid JSON"), (json.dumps({**TINY_HF_CONFIG, "hidden_size": "64"}).encode(),
                                 "hidden_size must be an integer >= 1, got '64'"),
     (json.dumps({**TINY_HF_CONFIG, "vocab_size": 0}).encode(), "vocab_size must be an integer >= 1, got 0"),
     (json.dumps({**TINY_HF_CONFIG, "architectures": "LlamaForCausalLM"}).encode(), "architectures must be a list"),
     (json.dumps({**TINY_HF_CONFIG, "num_key_value_heads": 3}).encode(), "must be a multiple of num_kv_heads")],
)
def test_config_json_problems_name_file_and_key(tmp_path, content: bytes, message: str) -> None:
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(CheckpointError, match=message) as info:
        SafetensorsCheckpoint(tmp_path).config  # noqa: B018
    assert str(tmp_path / "config.json") in str(info.value)


def test_model_argument_type() -> None:
    from jaxinfer.llm_args import resolve_model_name

    for bad in (None, 3, ["a"]):
        with pytest.raises(InvalidInputType, match="LLM argument model must be a path"):
            resolve_model_name(bad)
    with pytest.warns(Notice, match="using the bundled checkpoint 'smollm2-135m-instruct'"):
        assert resolve_model_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "smollm2-135m-instruct"
