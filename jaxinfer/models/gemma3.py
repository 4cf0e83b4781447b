"""Gemma 3 text models (270M, 1B, 4B, 12B, 27B; HF Gemma3ForCausalLM, GGUF arch "gemma3") as pure functions.

Same contract as the Llama family (weights are data, `forward` is a function over the paged KV cache, no
batch axis). What Gemma 3 adds:

- the embedding is scaled by sqrt(D), rounded to the activation dtype first (as HF does);
- RMSNorms multiply by (1 + w), w stored as HF stores it (GGUF loading converts llama.cpp's 1 + w through
  the rules' `gguf_add`; random init gives w = 0, the identity), with four norms per layer:
  before and after attention, before and after the MLP, each post-norm applied to the branch output
  before the residual add;
- QK-norm: RMSNorm over head_dim on queries and keys, before RoPE;
- GeGLU (tanh-approximated gelu) MLP;
- attention scale 1/sqrt(query_pre_attn_scalar) instead of 1/sqrt(head_dim);
- local (sliding-window) and global layers interleaved: every `sliding_window_pattern`-th layer is global.
  Local layers use RoPE base `rope_local_theta` without scaling, global ones `rope_theta` with the
  config's rope scaling (linear, factor 8 on 4B and larger);
- optional tanh soft-capping of attention logits and final logits; tied embeddings. Every published Gemma 3
  config leaves both caps unset. Note that HF transformers (5.23) reads `attn_logit_softcapping` for Gemma 3
  but never applies it; we apply it when a config sets it (as Gemma 2 and Google's reference do), so such a
  config would differ from HF.

KV cache of local layers: every layer, local or global, keeps the full sequence in the same paged cache
(`KVCache`, one `[P, R, K, H]` pair per layer), and local layers pass `sliding_window=W` to the attention
function, which masks keys older than the window (a query at position p sees keys p-W+1 .. p). This costs
memory on long sequences (a window-sized ring per local layer would need 5/6 fewer pages) but keeps one
page table, one allocator and one kernel path for all layers, and prefix caching and preemption work
unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.checkpoint.assemble import CheckpointError, TensorRule, Transform
from jaxinfer.config import ConfigError, ModelConfig, RopeScaling
from jaxinfer.kv_cache import KVCache
from jaxinfer.linear import DEFAULT_LINEAR, Linear
from jaxinfer.models.common import (
    MOE_FIELDS,
    embed_lookup,
    head_projections,
    vocab_logits,
    gguf_arch_key,
    AttentionFn,
    AttentionMetadata,
    apply_rope,
    gated_mlp,
    layer_program,
    output_projection,
    refuse_fields,
    rms_norm,
    rope_inv_freq,
)
from jaxinfer.params import Init, ParamSpec
from jaxinfer.sharding import Logical as L

# Published Gemma 3 values that GGUF metadata leaves implicit (llama.cpp hard-codes the same ones): every 6th
# layer is global, local layers rotate with base 10000. Old HF configs omit them too.
DEFAULT_SLIDING_WINDOW_PATTERN = 6
DEFAULT_ROPE_LOCAL_THETA = 10_000.0
GEMMA3_27B_LAYERS = 62  # how llama.cpp recognizes 27B, the one size whose query scale is 1/sqrt(D/N)
REQUIRED_FIELDS = ("sliding_window", "sliding_window_pattern", "rope_local_theta", "query_pre_attn_scalar")


@dataclasses.dataclass(frozen=True)
class Gemma3Extras:
    """The Gemma-only ModelConfig fields, checked present and narrowed to concrete types."""

    sliding_window: int
    sliding_window_pattern: int
    rope_local_theta: float
    query_pre_attn_scalar: float
    attn_logit_softcap: float | None
    final_logit_softcap: float | None

    def is_global(self, layer: int) -> bool:
        return (layer + 1) % self.sliding_window_pattern == 0


def gemma3_extras(cfg: ModelConfig) -> Gemma3Extras:
    """The config's Gemma fields; a config missing one is an error rather than a guess from the model size."""
    missing = [name for name in REQUIRED_FIELDS if getattr(cfg, name) is None]
    if missing:
        raise ConfigError(
            f"ModelConfig.{missing[0]} is not set, and Gemma 3 needs it "
            f"(set {', '.join(missing)} in the model config; the gemma3-*.yaml presets show the published values)."
        )
    return Gemma3Extras(
        sliding_window=int(cfg.sliding_window),
        sliding_window_pattern=int(cfg.sliding_window_pattern),
        rope_local_theta=float(cfg.rope_local_theta),
        query_pre_attn_scalar=float(cfg.query_pre_attn_scalar),
        attn_logit_softcap=cfg.attn_logit_softcap,
        final_logit_softcap=cfg.final_logit_softcap,
    )


@struct.dataclass
class Gemma3Layer:
    attn_norm: jax.Array  # [D] input_layernorm
    wq: jax.Array  # [D, N, H]
    wk: jax.Array  # [D, K, H]
    wv: jax.Array  # [D, K, H]
    q_norm: jax.Array  # [H]
    k_norm: jax.Array  # [H]
    wo: jax.Array  # [N, H, D]
    post_attn_norm: jax.Array  # [D] post_attention_layernorm (on the attention output)
    mlp_norm: jax.Array  # [D] pre_feedforward_layernorm
    w_gate: jax.Array  # [D, F]
    w_up: jax.Array  # [D, F]
    w_down: jax.Array  # [F, D]
    post_mlp_norm: jax.Array  # [D] post_feedforward_layernorm


@struct.dataclass
class Gemma3Weights:
    embed: jax.Array  # [V, D], also the output projection (tied)
    layers: tuple[Gemma3Layer, ...]
    final_norm: jax.Array  # [D]


def _norm_spec(size: int, axis: L | None, dtype: jnp.dtype) -> ParamSpec:
    # Zeros: the multiplier is 1 + w, so random weights get identity norms.
    return ParamSpec((size,), dtype, (axis,), Init.ZEROS)


def _norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm: the stored weight is HF's w and the multiplier 1 + w."""
    return rms_norm(x, w, eps, offset=1.0)


def layer_specs(cfg: ModelConfig, dtype: jnp.dtype) -> Gemma3Layer:
    d, n, k, h, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_size, cfg.intermediate_size
    return Gemma3Layer(
        attn_norm=_norm_spec(d, L.EMBED, dtype),
        wq=ParamSpec((d, n, h), dtype, (L.EMBED, L.Q_HEADS, L.HEAD_DIM)),
        wk=ParamSpec((d, k, h), dtype, (L.EMBED, L.KV_HEADS, L.HEAD_DIM)),
        wv=ParamSpec((d, k, h), dtype, (L.EMBED, L.KV_HEADS, L.HEAD_DIM)),
        q_norm=_norm_spec(h, L.HEAD_DIM, dtype),
        k_norm=_norm_spec(h, L.HEAD_DIM, dtype),
        wo=ParamSpec((n, h, d), dtype, (L.Q_HEADS, L.HEAD_DIM, L.EMBED), fan_in_axes=(0, 1)),
        post_attn_norm=_norm_spec(d, L.EMBED, dtype),
        mlp_norm=_norm_spec(d, L.EMBED, dtype),
        w_gate=ParamSpec((d, f), dtype, (L.EMBED, L.FFN)),
        w_up=ParamSpec((d, f), dtype, (L.EMBED, L.FFN)),
        w_down=ParamSpec((f, d), dtype, (L.FFN, L.EMBED)),
        post_mlp_norm=_norm_spec(d, L.EMBED, dtype),
    )


def param_specs(cfg: ModelConfig, dtype: jnp.dtype) -> Gemma3Weights:
    """The single declaration of every Gemma 3 weight: shape, dtype, logical axes, initializer."""
    refuse_fields(cfg, MOE_FIELDS, "Gemma 3")
    d, v = cfg.hidden_size, cfg.vocab_size
    return Gemma3Weights(
        # Row lookup, so scale 1 (the sqrt(D) embedding scale brings it to the residual stream's size).
        embed=ParamSpec((v, d), dtype, (L.VOCAB, L.EMBED), fan_in_axes=()),
        layers=tuple(layer_specs(cfg, dtype) for _ in range(cfg.num_layers)),
        final_norm=_norm_spec(d, L.EMBED, dtype),
    )


@dataclasses.dataclass(frozen=True)
class LayerAttention:
    """Static per-layer attention settings, resolved once per trace."""

    inv_freq: jax.Array  # [H/2]
    kwargs: dict[str, Any]  # forwarded to the attention function (sliding_window, soft_cap)


def layer_attention_settings(cfg: ModelConfig, ex: Gemma3Extras) -> list[LayerAttention]:
    """Global layers: rope_theta with the config's scaling, full causal span. Local: local base, window."""
    global_freq = rope_inv_freq(cfg.head_size, cfg.rope_theta, cfg)
    local_freq = rope_inv_freq(cfg.head_size, ex.rope_local_theta)  # local layers are never rope-scaled
    cap = {} if ex.attn_logit_softcap is None else {"soft_cap": ex.attn_logit_softcap}
    out = []
    for i in range(cfg.num_layers):
        if ex.is_global(i):
            out.append(LayerAttention(global_freq, cap))
        else:
            out.append(LayerAttention(local_freq, {**cap, "sliding_window": ex.sliding_window}))
    return out


def attention_block(
    layer: Gemma3Layer,
    x: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    md: AttentionMetadata,
    settings: LayerAttention,
    cfg: ModelConfig,
    attn_fn: AttentionFn,
    linear: Linear = DEFAULT_LINEAR,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    eps = cfg.rms_norm_eps
    q, k, v = head_projections(x, layer.wq, layer.wk, layer.wv, cfg.head_size, linear)  # [T, N|K, H]
    q = _norm(q, layer.q_norm, eps)  # over H, per head
    k = _norm(k, layer.k_norm, eps)
    q = apply_rope(q, md.positions, settings.inv_freq)
    k = apply_rope(k, md.positions, settings.inv_freq)
    attn, k_pages, v_pages = attn_fn(q, k, v, k_pages, v_pages, md, **settings.kwargs)  # [T, N, H]
    out = output_projection(attn, layer.wo, linear)  # [T, D]
    return out, k_pages, v_pages


def embed_tokens(weights: Gemma3Weights, token_ids: jax.Array, linear: Linear = DEFAULT_LINEAR) -> jax.Array:
    """token_ids [T] -> [T, D] scaled by sqrt(D); the scale is rounded to the weights' dtype like HF's."""
    x = embed_lookup(weights.embed, token_ids, weights.final_norm.dtype, linear)  # [T, D]
    return x * jnp.asarray(math.sqrt(x.shape[1]), x.dtype)


def decoder_layer(layer: Gemma3Layer, x: jax.Array, k_pages: jax.Array, v_pages: jax.Array, md: AttentionMetadata,
                  inv_freq: jax.Array, *, attn_kwargs: dict[str, Any], cfg: ModelConfig, attn_fn: AttentionFn,
                  linear: Linear) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [T, D] -> x [T, D] after one sandwich-normed attention + GeGLU block, and the layer's updated pages."""
    eps = cfg.rms_norm_eps
    h = _norm(x, layer.attn_norm, eps)
    h, k_pages, v_pages = attention_block(layer, h, k_pages, v_pages, md, LayerAttention(inv_freq, attn_kwargs), cfg,
                                          attn_fn, linear)
    x = x + _norm(h, layer.post_attn_norm, eps)
    h = _norm(x, layer.mlp_norm, eps)
    h = gated_mlp(h, layer.w_gate, layer.w_up, layer.w_down, "gelu_tanh", linear)
    return x + _norm(h, layer.post_mlp_norm, eps), k_pages, v_pages


def forward(
    weights: Gemma3Weights,
    cfg: ModelConfig,
    token_ids: jax.Array,
    md: AttentionMetadata,
    kv_cache: KVCache,
    attn_fn: AttentionFn,
    *,
    linear: Linear = DEFAULT_LINEAR,
) -> tuple[jax.Array, KVCache]:
    """token_ids [T] -> final normed hidden states [T, D] and the updated cache (layer loop unrolled, each
    kind of layer traced once: common.layer_program)."""
    ex = gemma3_extras(cfg)
    eps = cfg.rms_norm_eps
    settings = layer_attention_settings(cfg, ex)
    x = embed_tokens(weights, token_ids, linear)  # [T, D]
    programs: dict[tuple[Any, ...], Any] = {}  # one jitted layer per kind of attention (local, global)
    new_k, new_v = [], []
    for layer, k_pages, v_pages, s in zip(weights.layers, kv_cache.k, kv_cache.v, settings):
        kind = tuple(sorted(s.kwargs.items()))
        if kind not in programs:
            programs[kind] = layer_program(decoder_layer, attn_kwargs=s.kwargs, cfg=cfg, attn_fn=attn_fn,
                                           linear=linear)
        x, k_pages, v_pages = programs[kind](layer, x, k_pages, v_pages, md, s.inv_freq)
        new_k.append(k_pages)
        new_v.append(v_pages)
    x = _norm(x, weights.final_norm, eps)
    return x, KVCache(k=tuple(new_k), v=tuple(new_v))


def compute_logits(weights: Gemma3Weights, cfg: ModelConfig, hidden: jax.Array, *,
                   linear: Linear = DEFAULT_LINEAR) -> jax.Array:
    """hidden [S, D] -> float32 logits [S, V] (tied head), tanh-capped when the config says so."""
    logits = vocab_logits(hidden, weights.embed, True, linear).astype(jnp.float32)  # [S, V]
    cap = gemma3_extras(cfg).final_logit_softcap
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def checkpoint_rules() -> list[TensorRule]:
    """Declarative name map for GGUF (llama.cpp names) and HF safetensors checkpoints.

    Gemma GGUFs keep HF's Q/K row order (llama.cpp permutes only Llama-architecture files), so no
    un-permute here. Their norms hold 1 + w (llama.cpp's converter adds HF's 1), hence gguf_add=-1.
    """
    T = Transform
    hf = "model.layers.{i}."

    def norm_rule(path: str, gguf_name: str, hf_name: str) -> TensorRule:
        return TensorRule(path, gguf_name, hf_name, gguf_add=-1.0)

    return [
        TensorRule("embed", "token_embd.weight", "model.embed_tokens.weight"),
        norm_rule("final_norm", "output_norm.weight", "model.norm.weight"),
        norm_rule("layers.{i}.attn_norm", "blk.{i}.attn_norm.weight", hf + "input_layernorm.weight"),
        TensorRule("layers.{i}.wq", "blk.{i}.attn_q.weight", hf + "self_attn.q_proj.weight", T.LINEAR_TO_HEADS),
        TensorRule("layers.{i}.wk", "blk.{i}.attn_k.weight", hf + "self_attn.k_proj.weight", T.LINEAR_TO_HEADS),
        TensorRule("layers.{i}.wv", "blk.{i}.attn_v.weight", hf + "self_attn.v_proj.weight", T.LINEAR_TO_HEADS),
        norm_rule("layers.{i}.q_norm", "blk.{i}.attn_q_norm.weight", hf + "self_attn.q_norm.weight"),
        norm_rule("layers.{i}.k_norm", "blk.{i}.attn_k_norm.weight", hf + "self_attn.k_norm.weight"),
        TensorRule("layers.{i}.wo", "blk.{i}.attn_output.weight", hf + "self_attn.o_proj.weight",
                   T.LINEAR_FROM_HEADS),
        norm_rule("layers.{i}.post_attn_norm", "blk.{i}.post_attention_norm.weight",
                  hf + "post_attention_layernorm.weight"),
        norm_rule("layers.{i}.mlp_norm", "blk.{i}.ffn_norm.weight", hf + "pre_feedforward_layernorm.weight"),
        TensorRule("layers.{i}.w_gate", "blk.{i}.ffn_gate.weight", hf + "mlp.gate_proj.weight", T.LINEAR),
        TensorRule("layers.{i}.w_up", "blk.{i}.ffn_up.weight", hf + "mlp.up_proj.weight", T.LINEAR),
        TensorRule("layers.{i}.w_down", "blk.{i}.ffn_down.weight", hf + "mlp.down_proj.weight", T.LINEAR),
        norm_rule("layers.{i}.post_mlp_norm", "blk.{i}.post_ffw_norm.weight",
                  hf + "post_feedforward_layernorm.weight"),
    ]


def llama_cpp_query_pre_attn_scalar(num_layers: int, hidden_size: int, num_heads: int, head_dim: int) -> float:
    """GGUF metadata has no query_pre_attn_scalar; llama.cpp derives it from the size, and so do we.

    Gemma 3 27B (recognized by its layer count) scales queries by 1/sqrt(D/N) = 1/sqrt(168), every other
    size by 1/sqrt(head_dim).
    """
    return hidden_size / num_heads if num_layers == GEMMA3_27B_LAYERS else float(head_dim)


def config_from_gguf(meta: dict[str, Any]) -> ModelConfig:
    """ModelConfig from llama.cpp metadata (`gemma3.*`); what the metadata omits is the published value."""
    arch = meta["general.architecture"]
    key = gguf_arch_key(meta)
    n_heads = int(key("attention.head_count"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    cfg = ModelConfig(
        architecture="gemma3",
        vocab_size=int(vocab),
        hidden_size=int(key("embedding_length")),
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=n_heads,
        num_kv_heads=int(key("attention.head_count_kv", n_heads)),
        head_dim=int(key("attention.key_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 1_000_000.0)),
        rope_scaling=RopeScaling.LINEAR if scaling == "linear" else RopeScaling.NONE,
        rope_scaling_factor=float(meta.get(f"{arch}.rope.scaling.factor", 1.0)),
        max_position_embeddings=int(key("context_length", 32768)),
        tie_word_embeddings=True,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        sliding_window=int(key("attention.sliding_window")),
        sliding_window_pattern=DEFAULT_SLIDING_WINDOW_PATTERN,
        rope_local_theta=DEFAULT_ROPE_LOCAL_THETA,
        attn_logit_softcap=meta.get(f"{arch}.attn_logit_softcapping"),
        final_logit_softcap=meta.get(f"{arch}.final_logit_softcapping"),
    )
    scalar = llama_cpp_query_pre_attn_scalar(cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.head_size)
    return cfg.replace(query_pre_attn_scalar=scalar)


def window_pattern_from_layer_types(layer_types: list[str]) -> int:
    """HF `layer_types` -> the period P with layers P-1, 2P-1, ... global; other layouts are rejected."""
    period = next((i + 1 for i, t in enumerate(layer_types) if t == "full_attention"), len(layer_types) + 1)
    expected = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(len(layer_types))]
    if list(layer_types) != expected:
        raise CheckpointError(
            "config.json layer_types is not a periodic pattern of sliding_attention layers followed by one "
            "full_attention layer; jaxinfer's Gemma 3 supports only that layout."
        )
    return period


def _hf_rope(hf: dict[str, Any]) -> tuple[dict[str, Any], float, float]:
    """(global rope scaling dict, global theta, local theta) from old- or new-style HF rope fields."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers >= 5: one dict per layer type
        full, local = params["full_attention"] or {}, params.get("sliding_attention") or {}
        return full, full.get("rope_theta", 1_000_000.0), local.get("rope_theta", DEFAULT_ROPE_LOCAL_THETA)
    scaling = hf.get("rope_scaling") or params
    return scaling, hf.get("rope_theta", 1_000_000.0), hf.get("rope_local_base_freq", DEFAULT_ROPE_LOCAL_THETA)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig from an HF `config.json` (Gemma3ForCausalLM); absent fields take HF's Gemma3TextConfig defaults."""
    if not hf.get("tie_word_embeddings", True):
        raise CheckpointError("config.json sets tie_word_embeddings=false; Gemma 3 checkpoints tie them.")
    scaling, theta, local_theta = _hf_rope(hf)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ("default", "linear"):
        raise CheckpointError(f"config.json rope type {rope_type!r} is not supported for Gemma 3 (default, linear).")
    n_layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types")
    pattern = window_pattern_from_layer_types(layer_types) if layer_types else hf.get("sliding_window_pattern", 6)
    eos = hf.get("eos_token_id", 1)
    return ModelConfig(
        architecture="gemma3",
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=n_layers,
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim", 256),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=RopeScaling.LINEAR if rope_type == "linear" else RopeScaling.NONE,
        rope_scaling_factor=scaling.get("factor", 1.0),
        max_position_embeddings=hf.get("max_position_embeddings", 131072),
        tie_word_embeddings=True,
        bos_token_id=hf.get("bos_token_id", 2),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        sliding_window=int(hf.get("sliding_window", 4096)),
        sliding_window_pattern=pattern,
        rope_local_theta=float(local_theta),
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        attn_logit_softcap=hf.get("attn_logit_softcapping"),
        final_logit_softcap=hf.get("final_logit_softcapping"),
    )
