"""Bad speculative settings get one clear error naming the field (issue 17), at the door, before any weight
is loaded: the mapping's keys (jaxinfer.spec_config), and what needs the models (jaxinfer.llm, draft_model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxinfer import LLM
from jaxinfer.errors import InvalidInput
from jaxinfer.spec_config import MAX_SPECULATIVE_TOKENS, SpecMethod, parse_speculative

SHAPE = {"architecture": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_layers": 1,
         "num_heads": 2, "num_kv_heads": 1, "head_dim": 16, "max_position_embeddings": 256}


@pytest.mark.parametrize("value, field", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1}, "speculative.num_speculative_tokens"),
    ({"method": "ngram"}, "speculative.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": "4"}, "speculative.num_speculative_tokens"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "speculative.method"),
    ({"num_speculative_tokens": 2}, "speculative.method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "speculative.lookahead"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     "speculative.prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "speculative.model"),
    ({"method": "draft", "num_speculative_tokens": 2}, "speculative.model"),
    ({"method": "draft", "model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
     "speculative.prompt_lookup_max"),
    ({"method": "draft", "model": "x", "num_speculative_tokens": 2, "draft_sampling": "yes"},
     "speculative.draft_sampling"),
    ({"method": "draft", "model": "x", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 0},
     "speculative.draft_tensor_parallel_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "speculative.disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "quantization": "int8"}, "speculative.quantization"),
    ({"method": "draft", "model": "x", "num_speculative_tokens": 2, "quantization": "int3"}, "speculative.quantization"),
    ({"method": "draft", "model": "x", "num_speculative_tokens": 2, "quantization": "fp8:64"},
     "speculative.quantization"),
    ({"method": "draft", "model": "x", "num_speculative_tokens": 2, "quantization": 4}, "speculative.quantization"),
    ("ngram", "speculative"),
    ('{"method": "ngram",', "speculative"),
    ('{"method": "ngram", "num_speculative_tokens": 99}', "speculative.num_speculative_tokens"),
])
def test_bad_mapping_names_the_field(value: object, field: str) -> None:
    with pytest.raises(InvalidInput) as info:
        parse_speculative(value)
    assert info.value.field == field
    assert field in str(info.value)


def test_good_mappings() -> None:
    cfg = parse_speculative({"method": "ngram", "num_speculative_tokens": 4})
    assert cfg.method is SpecMethod.NGRAM and cfg.k == 4 and (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (2, 4)
    cfg = parse_speculative({"model": "m", "num_speculative_tokens": 3})  # method implied by the model
    assert cfg.method is SpecMethod.DRAFT and cfg.draft_sampling and cfg.draft_tensor_parallel_size is None
    assert parse_speculative('{"method": "ngram", "num_speculative_tokens": 2}').k == 2  # the CLI's JSON
    assert parse_speculative(None) is None and parse_speculative(cfg) is cfg
    assert cfg.quantization is None  # the draft's weights as the target's default: auto
    cfg = parse_speculative({"model": "m", "num_speculative_tokens": 3, "quantization": "int4:64"})
    assert cfg.quantization == "int4:64"


def _yaml(tmp_path: Path, name: str, **over: object) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text("".join(f"{k}: {v}\n" for k, v in {**SHAPE, **over}.items()))
    return str(path)


def test_llm_refuses_a_draft_with_another_vocabulary(tmp_path: Path) -> None:
    spec = {"method": "draft", "model": _yaml(tmp_path, "draft", vocab_size=512), "num_speculative_tokens": 2}
    with pytest.raises(InvalidInput, match="vocabulary") as info:
        LLM(_yaml(tmp_path, "target"), random_weights=True, speculative=spec, warmup=False)
    assert info.value.field == "speculative.model"


def test_llm_refuses_k_the_token_budget_cannot_hold(tmp_path: Path) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 8}
    with pytest.raises(InvalidInput) as info:
        LLM(_yaml(tmp_path, "target"), random_weights=True, speculative=spec, max_num_batched_tokens=8, warmup=False)
    assert info.value.field == "speculative.num_speculative_tokens"


def test_llm_refuses_a_draft_tensor_parallel_degree_other_than_1_or_the_targets(tmp_path: Path) -> None:
    spec = {"method": "draft", "model": _yaml(tmp_path, "draft"), "num_speculative_tokens": 2,
            "draft_tensor_parallel_size": 3}
    with pytest.raises(InvalidInput) as info:
        LLM(_yaml(tmp_path, "target"), random_weights=True, speculative=spec, tensor_parallel_size=2, warmup=False)
    assert info.value.field == "speculative.draft_tensor_parallel_size"


def test_llm_refuses_a_draft_quantization_its_weights_cannot_take(tmp_path: Path) -> None:
    spec = {"method": "draft", "model": _yaml(tmp_path, "draft"), "num_speculative_tokens": 2, "quantization": "int4:128"}
    with pytest.raises(InvalidInput, match="K must be a multiple of 128") as info:
        LLM(_yaml(tmp_path, "target"), random_weights=True, speculative=spec, warmup=False)
    assert info.value.field == "speculative.quantization" and "layers.0.wq" in str(info.value)


def test_an_int8_draft_keeps_the_float_targets_greedy_tokens(tmp_path: Path) -> None:
    from jaxinfer import SamplingParams

    kw = dict(random_weights=True, warmup=False, use_tqdm=False, attention_impl="reference", max_num_seqs=2)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    plain = LLM(_yaml(tmp_path, "target"), **kw).generate([[5, 6, 7, 8]], params)[0].token_ids
    spec = {"method": "draft", "model": _yaml(tmp_path, "draft"), "num_speculative_tokens": 2, "quantization": "int8"}
    llm = LLM(_yaml(tmp_path, "target"), speculative=spec, **kw)
    llm.engine.spec.cost.worth = lambda *args: True  # every step speculates
    assert llm.draft.plan and not llm.quant_plan
    assert llm.generate([[5, 6, 7, 8]], params)[0].token_ids == plain
    assert llm.engine_stats()["spec_draft_tokens"] > 0
