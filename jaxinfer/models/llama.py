"""Llama family (Llama 2/3/3.1, SmolLM2, Mistral without sliding window) as pure functions.

Weights are data (`LlamaWeights`, a pytree of arrays); `forward` is a function of weights, token ids,
attention metadata and the paged KV cache. There is no batch axis: tokens of every sequence in the step
are concatenated along T, so prefill chunks and decodes of different sequences share one call.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.checkpoint.assemble import CheckpointError, TensorRule, Transform
from jaxinfer.config import ConfigError, ModelConfig, RopeScaling
from jaxinfer.kv_cache import KVCache
from jaxinfer.linear import DEFAULT_LINEAR, Linear
from jaxinfer.models.common import (
    gguf_arch_key,
    AttentionFn,
    AttentionMetadata,
    apply_rope,
    embed_lookup,
    gated_mlp,
    head_projections,
    joined_projection,
    layer_program,
    norm_rope_attention,
    output_projection,
    rms_norm,
    rope_inv_freq,
    takes_norm_rope_write,
    vocab_logits,
)
from jaxinfer.params import Init, ParamSpec
from jaxinfer.sharding import Logical as L


@struct.dataclass
class LlamaLayer:
    attn_norm: jax.Array  # [D]
    wq: jax.Array  # [D, N, H]
    wk: jax.Array  # [D, K, H]
    wv: jax.Array  # [D, K, H]
    wo: jax.Array  # [N, H, D]
    mlp_norm: jax.Array  # [D]
    w_gate: jax.Array  # [D, F]
    w_up: jax.Array  # [D, F]
    w_down: jax.Array  # [F, D]


@struct.dataclass
class LlamaWeights:
    embed: jax.Array  # [V, D]
    layers: tuple[LlamaLayer, ...]
    final_norm: jax.Array  # [D]
    lm_head: jax.Array | None  # [D, V]; None when tied to the embedding


def layer_specs(cfg: ModelConfig, dtype: jnp.dtype) -> LlamaLayer:
    d, n, k, h, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_size, cfg.intermediate_size
    return LlamaLayer(
        attn_norm=ParamSpec((d,), dtype, (L.EMBED,), Init.ONES),
        wq=ParamSpec((d, n, h), dtype, (L.EMBED, L.Q_HEADS, L.HEAD_DIM)),
        wk=ParamSpec((d, k, h), dtype, (L.EMBED, L.KV_HEADS, L.HEAD_DIM)),
        wv=ParamSpec((d, k, h), dtype, (L.EMBED, L.KV_HEADS, L.HEAD_DIM)),
        wo=ParamSpec((n, h, d), dtype, (L.Q_HEADS, L.HEAD_DIM, L.EMBED), fan_in_axes=(0, 1)),
        mlp_norm=ParamSpec((d,), dtype, (L.EMBED,), Init.ONES),
        w_gate=ParamSpec((d, f), dtype, (L.EMBED, L.FFN)),
        w_up=ParamSpec((d, f), dtype, (L.EMBED, L.FFN)),
        w_down=ParamSpec((f, d), dtype, (L.FFN, L.EMBED)),
    )


_NOT_LLAMA_FIELDS = ("sliding_window", "sliding_window_pattern", "rope_local_theta", "query_pre_attn_scalar",
                     "attn_logit_softcap", "final_logit_softcap", "num_experts", "num_experts_per_tok",
                     "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")


def check_config(cfg: ModelConfig) -> None:
    """Refuse settings this family would silently ignore (e.g. a sliding window copied from another preset)."""
    for name in _NOT_LLAMA_FIELDS:
        if getattr(cfg, name) is not None:
            raise ConfigError(f"ModelConfig.{name} is set, but the Llama family does not implement it; remove it.")


def param_specs(cfg: ModelConfig, dtype: jnp.dtype) -> LlamaWeights:
    """The single declaration of every Llama weight: shape, dtype, logical axes, initializer."""
    check_config(cfg)
    d, v = cfg.hidden_size, cfg.vocab_size
    return LlamaWeights(
        # The embedding is read by row lookup, so its scale is 1 rather than 1/sqrt(V).
        embed=ParamSpec((v, d), dtype, (L.VOCAB, L.EMBED), fan_in_axes=()),
        layers=tuple(layer_specs(cfg, dtype) for _ in range(cfg.num_layers)),
        final_norm=ParamSpec((d,), dtype, (L.EMBED,), Init.ONES),
        lm_head=None if cfg.tie_word_embeddings else ParamSpec((d, v), dtype, (L.EMBED, L.VOCAB)),
    )


def attention_block(
    layer: LlamaLayer,
    x: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    md: AttentionMetadata,
    inv_freq: jax.Array,
    attn_fn: AttentionFn,
    linear: Linear = DEFAULT_LINEAR,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    # RoPE rotates the whole head here, so H = 2 x the frequencies (a quantized weight's heads are flat).
    head_dim = 2 * inv_freq.shape[0]
    if takes_norm_rope_write(layer.wq, x, k_pages, attn_fn, head_dim):  # GPU decode: rotate and write in one kernel
        parts = joined_projection(x, layer.wq, L.Q_HEADS, linear, split=False)[None]  # [1, T, (N + 2K) * H]
        attn, k_pages, v_pages = norm_rope_attention(parts, layer.wq, None, None, None, md, inv_freq, k_pages,
                                                     v_pages, attn_fn)
        return output_projection(attn, layer.wo, linear), k_pages, v_pages  # [T, D]
    q, k, v = head_projections(x, layer.wq, layer.wk, layer.wv, head_dim, linear)  # [T, N|K, H]
    q = apply_rope(q, md.positions, inv_freq)
    k = apply_rope(k, md.positions, inv_freq)
    attn, k_pages, v_pages = attn_fn(q, k, v, k_pages, v_pages, md)  # [T, N, H]
    out = output_projection(attn, layer.wo, linear)  # [T, D]
    return out, k_pages, v_pages


def decoder_layer(layer: LlamaLayer, x: jax.Array, k_pages: jax.Array, v_pages: jax.Array, md: AttentionMetadata,
                  inv_freq: jax.Array, *, cfg: ModelConfig, attn_fn: AttentionFn,
                  linear: Linear) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [T, D] -> x [T, D] after one pre-norm attention + gated MLP block, and the layer's updated pages."""
    h = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
    attn_out, k_pages, v_pages = attention_block(layer, h, k_pages, v_pages, md, inv_freq, attn_fn, linear)
    x = x + attn_out
    h = rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps)
    x = x + gated_mlp(h, layer.w_gate, layer.w_up, layer.w_down, "silu", linear)
    return x, k_pages, v_pages


def forward(
    weights: LlamaWeights,
    cfg: ModelConfig,
    token_ids: jax.Array,
    md: AttentionMetadata,
    kv_cache: KVCache,
    attn_fn: AttentionFn,
    *,
    linear: Linear = DEFAULT_LINEAR,
) -> tuple[jax.Array, KVCache]:
    """token_ids [T] -> final normed hidden states [T, D] and the updated cache.

    The layer loop is unrolled in Python so each layer's cache is its own buffer (ARCHITECTURE.md); every
    layer calls one jitted `decoder_layer`, traced once (common.layer_program).
    `linear` applies quantized weights (jaxinfer.linear); float weights never use it.
    """
    inv_freq = rope_inv_freq(cfg.head_size, cfg.rope_theta, cfg)
    x = embed_lookup(weights.embed, token_ids, weights.final_norm.dtype, linear)  # [T, D]
    run_layer = layer_program(decoder_layer, cfg=cfg, attn_fn=attn_fn, linear=linear)
    new_k, new_v = [], []
    for layer, k_pages, v_pages in zip(weights.layers, kv_cache.k, kv_cache.v):
        x, k_pages, v_pages = run_layer(layer, x, k_pages, v_pages, md, inv_freq)
        new_k.append(k_pages)
        new_v.append(v_pages)
    x = rms_norm(x, weights.final_norm, cfg.rms_norm_eps)
    return x, KVCache(k=tuple(new_k), v=tuple(new_v))


def compute_logits(weights: LlamaWeights, cfg: ModelConfig, hidden: jax.Array, *,
                   linear: Linear = DEFAULT_LINEAR) -> jax.Array:
    """hidden [S, D] -> float32 logits [S, V]."""
    tied = weights.lm_head is None
    logits = vocab_logits(hidden, weights.embed if tied else weights.lm_head, tied, linear)  # [S, V]
    return logits.astype(jnp.float32)


def checkpoint_rules() -> list[TensorRule]:
    """Declarative name map for GGUF (llama.cpp names) and HF safetensors checkpoints."""
    T = Transform
    return [
        TensorRule("embed", "token_embd.weight", "model.embed_tokens.weight"),
        TensorRule("final_norm", "output_norm.weight", "model.norm.weight"),
        TensorRule("lm_head", "output.weight", "lm_head.weight", T.LINEAR),
        TensorRule("layers.{i}.attn_norm", "blk.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
        TensorRule("layers.{i}.wq", "blk.{i}.attn_q.weight", "model.layers.{i}.self_attn.q_proj.weight",
                   T.LINEAR_TO_HEADS, gguf_unpermute="q"),
        TensorRule("layers.{i}.wk", "blk.{i}.attn_k.weight", "model.layers.{i}.self_attn.k_proj.weight",
                   T.LINEAR_TO_HEADS, gguf_unpermute="k"),
        TensorRule("layers.{i}.wv", "blk.{i}.attn_v.weight", "model.layers.{i}.self_attn.v_proj.weight",
                   T.LINEAR_TO_HEADS),
        TensorRule("layers.{i}.wo", "blk.{i}.attn_output.weight", "model.layers.{i}.self_attn.o_proj.weight",
                   T.LINEAR_FROM_HEADS),
        TensorRule("layers.{i}.mlp_norm", "blk.{i}.ffn_norm.weight",
                   "model.layers.{i}.post_attention_layernorm.weight"),
        TensorRule("layers.{i}.w_gate", "blk.{i}.ffn_gate.weight", "model.layers.{i}.mlp.gate_proj.weight", T.LINEAR),
        TensorRule("layers.{i}.w_up", "blk.{i}.ffn_up.weight", "model.layers.{i}.mlp.up_proj.weight", T.LINEAR),
        TensorRule("layers.{i}.w_down", "blk.{i}.ffn_down.weight", "model.layers.{i}.mlp.down_proj.weight", T.LINEAR),
    ]


def config_from_gguf(meta: dict[str, Any]) -> ModelConfig:
    """ModelConfig from llama.cpp metadata keys (`llama.*`)."""
    arch = meta["general.architecture"]
    key = gguf_arch_key(meta)
    n_heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    return ModelConfig(
        architecture="llama",
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=n_heads,
        num_kv_heads=int(key("attention.head_count_kv", n_heads)),
        head_dim=int(key("attention.key_length", hidden // n_heads)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=RopeScaling.LINEAR if scaling == "linear" else RopeScaling.NONE,
        rope_scaling_factor=float(meta.get(f"{arch}.rope.scaling.factor", 1.0)),
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings=False,  # decided by the presence of output.weight in the loader
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
    )


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig from an HF `config.json` (LlamaForCausalLM / MistralForCausalLM)."""
    if hf.get("sliding_window") and hf.get("use_sliding_window", True) and hf["sliding_window"] < hf.get(
        "max_position_embeddings", 0
    ):
        raise CheckpointError(
            f"config.json sets sliding_window={hf['sliding_window']}, which the Llama-family model does not "
            "implement; use a checkpoint without sliding-window attention."
        )
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3", "linear"):
        raise CheckpointError(f"config.json rope_scaling type {rope_type!r} is not supported (default, llama3, linear).")
    eos = hf.get("eos_token_id")
    return ModelConfig(
        architecture="llama",
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim"),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        rope_theta=hf.get("rope_theta", rope.get("rope_theta", 10000.0)),
        rope_scaling=RopeScaling(rope_type) if rope_type != "default" else RopeScaling.NONE,
        rope_scaling_factor=rope.get("factor", 1.0),
        rope_low_freq_factor=rope.get("low_freq_factor", 1.0),
        rope_high_freq_factor=rope.get("high_freq_factor", 4.0),
        rope_original_max_position=rope.get("original_max_position_embeddings", 8192),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
    )
