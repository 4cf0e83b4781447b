"""Qwen3 and Qwen3-MoE forward: paged/ragged path vs an independent float64 NumPy model, configs, full shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.attention import make_attention_fn
from jaxinfer.config import ConfigError, ModelConfig
from jaxinfer.engine.batcher import BatchShape, SeqChunk, pack
from jaxinfer.models import LLAMA, QWEN3, QWEN3_MOE, ModelFamily, family_for_config, family_for_gguf, family_for_hf
from jaxinfer.models.qwen3 import config_from_hf, is_moe_layer, moe_config_from_gguf, moe_config_from_hf
from jaxinfer.params import abstract_params, count_params
from jaxinfer.presets import load_preset
from model_helpers import build_runner as shared_build_runner
from model_helpers import QWEN3_SMALL_MOE, abstract_forward_inputs, rel_err, run_chunks, tiny_qwen3_dense, tiny_qwen3_moe
from moe_reference import reference_logits

tiny_dense, tiny_moe = tiny_qwen3_dense, tiny_qwen3_moe


def perturb(weights, seed: int):
    """Random init leaves norms at 1 and routers near uniform; spread both so conventions and routing matter."""
    rng = np.random.default_rng(seed + 100)

    def one(path, w):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            w = 1.0 + rng.normal(0.0, 0.3, w.shape)
        elif "router" in name:
            w = np.asarray(w) * 3.0
        else:
            return w
        return jax.device_put(np.asarray(w, np.float32), w.sharding if hasattr(w, "sharding") else None)

    return jax.tree_util.tree_map_with_path(one, weights)


def build_runner(cfg: ModelConfig, family: ModelFamily, tp: int = 1, seed: int = 0):
    return shared_build_runner(cfg, tp, seed, family=family, weights_hook=lambda w: perturb(w, seed))


CASES = {  # untied heads and dense layers: the moe cases (layer 2 stays dense there)
    "dense-tied-mqa": (tiny_dense, QWEN3, dict(tie_word_embeddings=True, num_kv_heads=1)),
    "moe-renorm": (tiny_moe, QWEN3_MOE, {}),
    "moe-step2-no-renorm": (tiny_moe, QWEN3_MOE, dict(norm_topk_prob=False, decoder_sparse_step=2,
                                                      mlp_only_layers=(), num_experts_per_tok=3)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_paged_forward_matches_dense_reference(case: str) -> None:
    make, family, overrides = CASES[case]
    cfg = make(**overrides)
    runner = build_runner(cfg, family, seed=1)
    ids = list(np.random.default_rng(0).integers(0, cfg.vocab_size, 11))
    ref = reference_logits(runner.weights, cfg, ids)
    ours = run_chunks(runner, ids, chunk=1, pages=[3, 7, 1, 9])  # decode one token at a time
    assert rel_err(ours, ref) < 1e-5


@pytest.mark.parametrize("chunk", [4, 11])
def test_chunked_prefill_equals_full_prefill(chunk: int) -> None:
    cfg = tiny_moe()
    runner = build_runner(cfg, QWEN3_MOE, seed=2)
    ids = list(np.random.default_rng(1).integers(0, cfg.vocab_size, 11))
    ref = reference_logits(runner.weights, cfg, ids)
    ours = run_chunks(runner, ids, chunk=chunk, pages=[5, 2, 8])
    ends = [min(s + chunk, len(ids)) - 1 for s in range(0, len(ids), chunk)]
    assert rel_err(ours, ref[ends]) < 1e-5


def test_mixed_ragged_batch_matches_separate_runs() -> None:
    """A prefill chunk and a decode of two sequences share one step (and one expert dispatch)."""
    cfg = tiny_moe()
    runner = build_runner(cfg, QWEN3_MOE, seed=3)
    a = list(np.random.default_rng(2).integers(0, cfg.vocab_size, 9))
    b = list(np.random.default_rng(3).integers(0, cfg.vocab_size, 6))
    ref_a, ref_b = reference_logits(runner.weights, cfg, a), reference_logits(runner.weights, cfg, b)
    shape = BatchShape(tokens=32, seqs=4, pages_per_seq=16)
    pa, pb = [1, 2, 3], [4, 5]
    first = np.asarray(runner.logits(runner.place(pack([SeqChunk(a[:8], 0, pa), SeqChunk(b[:5], 0, pb)], shape, 4))))
    second = np.asarray(runner.logits(runner.place(pack([SeqChunk(b[5:], 5, pb), SeqChunk(a[8:], 8, pa)], shape, 4))))
    assert rel_err(first[0], ref_a[7]) < 1e-5 and rel_err(first[1], ref_b[4]) < 1e-5
    assert rel_err(second[0], ref_b[5]) < 1e-5 and rel_err(second[1], ref_a[8]) < 1e-5


def test_dense_qwen3_tensor_parallel_equals_unsharded() -> None:
    cfg = tiny_dense()
    ids = list(np.random.default_rng(4).integers(0, cfg.vocab_size, 11))
    ref = run_chunks(build_runner(cfg, QWEN3, tp=1, seed=5), ids, chunk=4, pages=[1, 2, 3])
    ours = run_chunks(build_runner(cfg, QWEN3, tp=2, seed=5), ids, chunk=4, pages=[1, 2, 3])
    assert rel_err(ours, ref) < 1e-5


def test_layer_plan_follows_step_and_mlp_only_layers() -> None:
    cfg = tiny_moe(num_layers=6, decoder_sparse_step=2, mlp_only_layers=(3,))
    assert [is_moe_layer(cfg, i) for i in range(6)] == [False, True, False, False, False, True]
    specs = QWEN3_MOE.param_specs(cfg, jnp.float32)
    assert [layer.moe is not None for layer in specs.layers] == [is_moe_layer(cfg, i) for i in range(6)]
    assert all((layer.mlp is None) != (layer.moe is None) for layer in specs.layers)
    assert specs.layers[1].moe.w_gate.shape == (8, 64, 32) and specs.layers[0].mlp.w_gate.shape == (64, 96)


def _abstract_forward(cfg: ModelConfig, tokens: int = 256, seqs: int = 8, pages: int = 64, page_size: int = 16):
    family, weights, token_ids, md, cache = abstract_forward_inputs(cfg, tokens, seqs, pages, page_size)
    attn = make_attention_fn(cfg, "reference", False)
    return jax.eval_shape(lambda w, t, m, c: family.forward(w, cfg, t, m, c, attn), weights, token_ids, md, cache)


@pytest.mark.parametrize("name, params_b", [("qwen3-8b", 8.19), ("qwen3-30b-a3b", 30.53), ("qwen3-235b-a22b", 235.09)])
def test_full_size_presets_trace(name: str, params_b: float) -> None:
    """Parameter counts of the published models; the forward traced at full size (each kind of layer once,
    so 235B's 94 layers trace as fast as 8B's 36)."""
    cfg = load_preset(name)
    family = family_for_config(cfg)
    specs = family.param_specs(cfg, jnp.bfloat16)
    assert count_params(specs) / 1e9 == pytest.approx(params_b, rel=0.005)
    w = abstract_params(specs)
    assert w.layers[-1].moe is None if cfg.num_experts is None else w.layers[-1].moe.w_up.shape == (
        cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
    hidden, cache, counts = _abstract_forward(cfg)
    assert hidden.shape == (256, cfg.hidden_size) and len(cache.k) == cfg.num_layers
    assert counts.shape == (cfg.num_experts or 0,)


def test_configs_refuse_what_the_family_would_ignore() -> None:
    with pytest.raises(ConfigError, match="ModelConfig.num_experts is set, but the Qwen3 family does not implement"):
        QWEN3.param_specs(tiny_dense(num_experts=8, num_experts_per_tok=2), jnp.float32)
    with pytest.raises(ConfigError, match="ModelConfig.sliding_window is set, but the Qwen3-MoE family"):
        QWEN3_MOE.param_specs(tiny_moe(sliding_window=64), jnp.float32)
    with pytest.raises(ConfigError, match="ModelConfig.norm_topk_prob is not set, and Qwen3-MoE needs it"):
        QWEN3_MOE.param_specs(tiny_moe(norm_topk_prob=None), jnp.float32)
    with pytest.raises(ConfigError, match="ModelConfig.num_experts is set, but the Llama family"):
        LLAMA.param_specs(tiny_moe(architecture="llama", decoder_sparse_step=None, mlp_only_layers=None,
                                   moe_intermediate_size=None, norm_topk_prob=None), jnp.float32)


@pytest.mark.parametrize("bad, message", [
    (dict(num_experts_per_tok=9), r"ModelConfig.num_experts_per_tok \(9\) must be <= num_experts \(8\)"),
    (dict(num_experts=None), "ModelConfig.num_experts and num_experts_per_tok must be set together"),
    (dict(mlp_only_layers=(4,)), r"ModelConfig.mlp_only_layers holds 4, outside the model's layers 0..3"),
    (dict(decoder_sparse_step=0), "ModelConfig.decoder_sparse_step must be > 0 when set, got 0"),
    (dict(moe_intermediate_size=0), "ModelConfig.moe_intermediate_size must be > 0 when set, got 0"),
])
def test_bad_moe_fields_name_field_and_limit(bad: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        tiny_moe(**bad)


def test_mlp_only_layers_from_yaml_list_is_a_tuple() -> None:
    cfg = ModelConfig.from_dict({**{k: v for k, v in QWEN3_SMALL_MOE.items() if k != "mlp_only_layers"},
                                 "architecture": "qwen3_moe", "mlp_only_layers": [0, 2]})
    assert cfg.mlp_only_layers == (0, 2) and hash(cfg)


HF_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
          "moe_intermediate_size": 32, "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
          "mlp_only_layers": [2], "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


@pytest.mark.parametrize("spelling", [
    {"num_experts": 8, "rope_theta": 5e5},  # the published configs
    {"num_local_experts": 8, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}},  # transformers 5
])
def test_hf_config_spellings(spelling: dict) -> None:
    cfg = moe_config_from_hf({**HF_MOE, **spelling})
    assert (cfg.num_experts, cfg.rope_theta, cfg.mlp_only_layers, cfg.norm_topk_prob) == (8, 5e5, (2,), True)
    assert family_for_hf(HF_MOE["architectures"]) is QWEN3_MOE and family_for_config(cfg) is QWEN3_MOE


def test_hf_config_refusals() -> None:
    from jaxinfer.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="num_experts=8 but num_local_experts=4"):
        moe_config_from_hf({**HF_MOE, "num_experts": 8, "num_local_experts": 4})
    with pytest.raises(CheckpointError, match="use_sliding_window=true"):
        config_from_hf({**HF_MOE, "architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True})
    with pytest.raises(CheckpointError, match="rope type 'yarn' is not supported for Qwen3"):
        config_from_hf({**HF_MOE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_gguf_qwen3moe_config() -> None:
    meta = {"general.architecture": "qwen3moe", "qwen3moe.block_count": 4, "qwen3moe.embedding_length": 64,
            "qwen3moe.feed_forward_length": 96, "qwen3moe.attention.head_count": 4,
            "qwen3moe.attention.head_count_kv": 2, "qwen3moe.attention.key_length": 32, "qwen3moe.vocab_size": 256,
            "qwen3moe.expert_count": 8, "qwen3moe.expert_used_count": 2, "qwen3moe.expert_feed_forward_length": 32}
    cfg = moe_config_from_gguf(meta)
    assert (cfg.architecture, cfg.num_experts, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (
        "qwen3_moe", 8, 32, True)
    assert family_for_gguf("qwen3moe", meta) is QWEN3_MOE and family_for_gguf("qwen3") is QWEN3
