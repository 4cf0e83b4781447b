"""Mixtral forward vs an independent float64 NumPy model, its configs (HF, GGUF, preset) and full shape."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import ConfigError, ModelConfig
from jaxinfer.models import GEMMA3, LLAMA, MIXTRAL, family_for_gguf, family_for_hf
from jaxinfer.models.mixtral import config_from_gguf, config_from_hf
from jaxinfer.params import count_params
from jaxinfer.presets import load_preset
from model_helpers import rel_err, run_chunks
from moe_reference import reference_logits
from test_qwen3 import _abstract_forward, build_runner

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=48, moe_intermediate_size=48, num_layers=3,
             num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2)


def tiny_config(**overrides) -> ModelConfig:
    return load_preset("mixtral-8x7b").replace(**{**SMALL, **overrides})


@pytest.mark.parametrize("overrides", [{}, dict(num_experts_per_tok=1, tie_word_embeddings=True, num_kv_heads=4)],
                         ids=["top2-gqa", "top1-tied-mha"])
def test_paged_forward_matches_dense_reference(overrides: dict) -> None:
    cfg = tiny_config(**overrides)
    runner = build_runner(cfg, MIXTRAL, seed=1)
    ids = list(np.random.default_rng(0).integers(0, cfg.vocab_size, 11))
    ref = reference_logits(runner.weights, cfg, ids)
    for chunk in (1, 5):
        ends = [min(s + chunk, len(ids)) - 1 for s in range(0, len(ids), chunk)]
        assert rel_err(run_chunks(runner, ids, chunk=chunk, pages=[3 + chunk, 7, 1]), ref[ends]) < 1e-5


def test_full_size_preset_traces() -> None:
    cfg = load_preset("mixtral-8x7b")
    assert count_params(MIXTRAL.param_specs(cfg, jnp.bfloat16)) / 1e9 == pytest.approx(46.70, rel=0.005)
    hidden, cache, counts = _abstract_forward(cfg)
    assert hidden.shape == (256, 4096) and len(cache.k) == 32 and counts.shape == (8,)


def test_config_refusals() -> None:
    with pytest.raises(ConfigError, match="ModelConfig.mlp_only_layers is set, but the Mixtral family"):
        MIXTRAL.param_specs(tiny_config(mlp_only_layers=(0,)), jnp.float32)
    with pytest.raises(ConfigError, match=r"intermediate_size \(96\) must equal moe_intermediate_size \(48\)"):
        MIXTRAL.param_specs(tiny_config(intermediate_size=96), jnp.float32)
    with pytest.raises(ConfigError, match="ModelConfig.num_experts is set, but the Gemma 3 family"):
        GEMMA3.param_specs(load_preset("gemma3-270m").replace(num_experts=8, num_experts_per_tok=2), jnp.float32)


HF = {"architectures": ["MixtralForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 48,
      "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
      "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "sliding_window": None, "tie_word_embeddings": False}


@pytest.mark.parametrize("spelling", [
    {"num_local_experts": 8, "rope_theta": 1e6},  # published
    {"num_experts": 8, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}},
])
def test_hf_config_spellings(spelling: dict) -> None:
    cfg = config_from_hf({**HF, **spelling})
    assert (cfg.architecture, cfg.num_experts, cfg.moe_intermediate_size, cfg.rope_theta) == ("mixtral", 8, 48, 1e6)
    assert cfg.norm_topk_prob is True and family_for_hf(HF["architectures"]) is MIXTRAL


def test_gguf_llama_with_experts_is_mixtral() -> None:
    meta = {"general.architecture": "llama", "llama.block_count": 3, "llama.embedding_length": 64,
            "llama.feed_forward_length": 48, "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
            "llama.vocab_size": 256, "llama.expert_count": 8, "llama.expert_used_count": 2}
    assert family_for_gguf("llama", meta) is MIXTRAL
    assert family_for_gguf("llama", {**meta, "llama.expert_count": 0}) is LLAMA
    assert family_for_gguf("llama") is LLAMA
    cfg = config_from_gguf(meta)
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
        "mixtral", 8, 2, 48)
