"""Mixtral (HF MixtralForCausalLM; GGUF `llama` with `llama.expert_count`, which is how llama.cpp writes it).

Llama attention (jaxinfer.models.llama.attention_block, GQA, RoPE, no QK-norm) with every feed-forward a
mixture of experts (jaxinfer.models.moe): softmax over the experts, top-k (2 of 8 in Mixtral-8x7B), the k
weights renormalized to sum 1, each expert a SwiGLU of width `moe_intermediate_size`. Mixtral has no dense
feed-forward, so HF's `intermediate_size` is the expert width and the config keeps both fields equal.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.checkpoint.assemble import CheckpointError, Part, TensorRule, Transform
from jaxinfer.config import ConfigError, ModelConfig
from jaxinfer.kv_cache import KVCache
from jaxinfer.models import llama
from jaxinfer.linear import DEFAULT_LINEAR, Linear
from jaxinfer.models.common import (
    GEMMA_FIELDS,
    embed_lookup,
    MOE_REQUIRED,
    AttentionFn,
    AttentionMetadata,
    gguf_arch_key,
    hf_num_experts,
    hf_rope_theta,
    layer_program,
    refuse_fields,
    require_fields,
    rms_norm,
    rope_inv_freq,
)
from jaxinfer.models.moe import MoEFn, MoEWeights, moe_block, moe_specs, valid_tokens
from jaxinfer.params import Init, ParamSpec
from jaxinfer.sharding import Logical as L


@struct.dataclass
class MixtralLayer:
    attn_norm: jax.Array  # [D]
    wq: jax.Array  # [D, N, H]
    wk: jax.Array  # [D, K, H]
    wv: jax.Array  # [D, K, H]
    wo: jax.Array  # [N, H, D]
    mlp_norm: jax.Array  # [D]
    moe: MoEWeights


@struct.dataclass
class MixtralWeights:
    embed: jax.Array  # [V, D]
    layers: tuple[MixtralLayer, ...]
    final_norm: jax.Array  # [D]
    lm_head: jax.Array | None  # [D, V]; None when tied to the embedding


def check_config(cfg: ModelConfig) -> None:
    """Refuse what Mixtral would ignore (Gemma and Qwen3-MoE layer-plan fields), require the routing fields."""
    refuse_fields(cfg, (*GEMMA_FIELDS, "decoder_sparse_step", "mlp_only_layers"), "Mixtral")
    require_fields(cfg, MOE_REQUIRED, "Mixtral")
    if cfg.intermediate_size != cfg.moe_intermediate_size:
        raise ConfigError(
            f"ModelConfig.intermediate_size ({cfg.intermediate_size}) must equal moe_intermediate_size "
            f"({cfg.moe_intermediate_size}) for Mixtral, whose only feed-forward is its experts."
        )


def layer_specs(cfg: ModelConfig, dtype: jnp.dtype) -> MixtralLayer:
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_size
    return MixtralLayer(
        attn_norm=ParamSpec((d,), dtype, (L.EMBED,), Init.ONES),
        wq=ParamSpec((d, n, h), dtype, (L.EMBED, L.Q_HEADS, L.HEAD_DIM)),
        wk=ParamSpec((d, k, h), dtype, (L.EMBED, L.KV_HEADS, L.HEAD_DIM)),
        wv=ParamSpec((d, k, h), dtype, (L.EMBED, L.KV_HEADS, L.HEAD_DIM)),
        wo=ParamSpec((n, h, d), dtype, (L.Q_HEADS, L.HEAD_DIM, L.EMBED), fan_in_axes=(0, 1)),
        mlp_norm=ParamSpec((d,), dtype, (L.EMBED,), Init.ONES),
        moe=moe_specs(d, cfg.moe_intermediate_size, cfg.num_experts, dtype),
    )


def param_specs(cfg: ModelConfig, dtype: jnp.dtype) -> MixtralWeights:
    """Every Mixtral weight: shape, dtype, logical axes, initializer."""
    check_config(cfg)
    d, v = cfg.hidden_size, cfg.vocab_size
    return MixtralWeights(
        embed=ParamSpec((v, d), dtype, (L.VOCAB, L.EMBED), fan_in_axes=()),  # row lookup: scale 1
        layers=tuple(layer_specs(cfg, dtype) for _ in range(cfg.num_layers)),
        final_norm=ParamSpec((d,), dtype, (L.EMBED,), Init.ONES),
        lm_head=None if cfg.tie_word_embeddings else ParamSpec((d, v), dtype, (L.EMBED, L.VOCAB)),
    )


def forward(
    weights: MixtralWeights,
    cfg: ModelConfig,
    token_ids: jax.Array,
    md: AttentionMetadata,
    kv_cache: KVCache,
    attn_fn: AttentionFn,
    *,
    moe_fn: MoEFn = moe_block,
    linear: Linear = DEFAULT_LINEAR,
) -> tuple[jax.Array, KVCache, jax.Array]:
    """token_ids [T] -> (final normed hidden states [T, D], the updated cache, tokens routed to each expert
    summed over the layers [E] int32); the layer loop is unrolled, the layer traced once (common.layer_program)."""
    eps = cfg.rms_norm_eps
    inv_freq = rope_inv_freq(cfg.head_size, cfg.rope_theta, cfg)
    x = embed_lookup(weights.embed, token_ids, weights.final_norm.dtype, linear)  # [T, D]
    valid = valid_tokens(md, x.shape[0])  # [T]
    run_layer = layer_program(decoder_layer, cfg=cfg, attn_fn=attn_fn, moe_fn=moe_fn, linear=linear)
    new_k, new_v, counts = [], [], jnp.zeros((cfg.num_experts,), jnp.int32)
    for layer, k_pages, v_pages in zip(weights.layers, kv_cache.k, kv_cache.v):
        x, k_pages, v_pages, layer_counts = run_layer(layer, x, k_pages, v_pages, md, inv_freq, valid)
        new_k.append(k_pages)
        new_v.append(v_pages)
        counts = counts + layer_counts
    x = rms_norm(x, weights.final_norm, eps)
    return x, KVCache(k=tuple(new_k), v=tuple(new_v)), counts


def decoder_layer(layer: MixtralLayer, x: jax.Array, k_pages: jax.Array, v_pages: jax.Array, md: AttentionMetadata,
                  inv_freq: jax.Array, valid: jax.Array, *, cfg: ModelConfig, attn_fn: AttentionFn, moe_fn: MoEFn,
                  linear: Linear) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """x [T, D] -> (x [T, D], the layer's updated pages, tokens per expert [E]) after attention + MoE."""
    h = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
    attn_out, k_pages, v_pages = llama.attention_block(layer, h, k_pages, v_pages, md, inv_freq, attn_fn, linear)
    x = x + attn_out
    h = rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps)
    moe_out, counts = moe_fn(h, layer.moe, top_k=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob,
                             valid=valid)
    return x + moe_out, k_pages, v_pages, counts


compute_logits = llama.compute_logits  # hidden [S, D] -> float32 [S, V]

_LLAMA_DENSE_MLP = ("layers.{i}.w_gate", "layers.{i}.w_up", "layers.{i}.w_down")


def checkpoint_rules() -> list[TensorRule]:
    """Llama's attention rules plus the experts, in every layout a Mixtral checkpoint comes in.

    HF published: `block_sparse_moe.gate` and `block_sparse_moe.experts.{e}.w1/w3/w2` (gate/up/down);
    transformers 5 fused: `mlp.gate`, `mlp.experts.gate_up_proj` [E, 2F, D], `mlp.experts.down_proj` [E, D, F];
    GGUF: stacked `ffn_*_exps` (llama.cpp since 2024), or one `ffn_*.{e}` tensor per expert (older files).
    """
    T = Transform
    hf, moe = "model.layers.{i}.", "model.layers.{i}.block_sparse_moe."
    fused = hf + "mlp.experts.gate_up_proj"
    attention = [r for r in llama.checkpoint_rules() if r.path not in _LLAMA_DENSE_MLP]
    return [
        *attention,
        TensorRule("layers.{i}.moe.router", "blk.{i}.ffn_gate_inp.weight",
                   (moe + "gate.weight", hf + "mlp.gate.weight"), T.LINEAR),
        TensorRule("layers.{i}.moe.w_gate", ("blk.{i}.ffn_gate_exps.weight", "blk.{i}.ffn_gate.{e}.weight"),
                   (moe + "experts.{e}.w1.weight", Part(fused, 0, 2)), T.LINEAR),
        TensorRule("layers.{i}.moe.w_up", ("blk.{i}.ffn_up_exps.weight", "blk.{i}.ffn_up.{e}.weight"),
                   (moe + "experts.{e}.w3.weight", Part(fused, 1, 2)), T.LINEAR),
        TensorRule("layers.{i}.moe.w_down", ("blk.{i}.ffn_down_exps.weight", "blk.{i}.ffn_down.{e}.weight"),
                   (moe + "experts.{e}.w2.weight", hf + "mlp.experts.down_proj"), T.LINEAR),
    ]


def config_from_gguf(meta: dict[str, Any]) -> ModelConfig:
    """Llama metadata plus `llama.expert_count` / `expert_used_count` (llama.cpp always renormalizes top-k)."""
    key = gguf_arch_key(meta)
    base = llama.config_from_gguf(meta)
    return base.replace(architecture="mixtral", num_experts=int(key("expert_count")),
                        num_experts_per_tok=int(key("expert_used_count")),
                        moe_intermediate_size=base.intermediate_size, norm_topk_prob=True)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig from an HF `config.json` (MixtralForCausalLM)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json hidden_act {hf['hidden_act']!r} is not supported for Mixtral (silu).")
    base = llama.config_from_hf({**hf, "rope_theta": hf_rope_theta(hf, 1_000_000.0)})
    return base.replace(architecture="mixtral", num_experts=hf_num_experts(hf),
                        num_experts_per_tok=hf.get("num_experts_per_tok", 2),
                        moe_intermediate_size=base.intermediate_size, norm_topk_prob=True)
