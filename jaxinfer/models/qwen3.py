"""Qwen3 dense and Qwen3-MoE (HF Qwen3ForCausalLM / Qwen3MoeForCausalLM, GGUF qwen3 / qwen3moe).

Same contract as the Llama family (weights are data, `forward` is a function over the paged KV cache, no
batch axis). What Qwen3 adds to Llama:

- QK-norm: a plain RMSNorm with a learned [H] weight (no Gemma-style 1 + w) over head_dim of every query and
  key head, before RoPE;
- head_dim is its own field (Qwen3-30B-A3B: 32 heads of 128 on a 2048-wide model);
- Qwen3-MoE: the feed-forward of layer i is a routed mixture of experts (jaxinfer.models.moe) when
  `(i + 1) % decoder_sparse_step == 0` and i is not in `mlp_only_layers`, else a dense SwiGLU of width
  `intermediate_size`. Every published Qwen3-MoE has step 1 and no dense layers. Routing is softmax top-k,
  renormalized when `norm_topk_prob` (true in the published configs; HF's default is false).

Both models are one module because they differ only in the feed-forward; they are two families so that
each refuses the other's config (a dense Qwen3 config with experts is a mistake, not a MoE model).
GGUF: llama.cpp keeps HF's Q/K row order for Qwen (no un-permute) and its qwen3moe graph always renormalizes
the top-k weights and makes every layer sparse.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.checkpoint.assemble import CheckpointError, Part, TensorRule, Transform
from jaxinfer.config import ModelConfig
from jaxinfer.kv_cache import KVCache
from jaxinfer.models import llama
from jaxinfer.linear import DEFAULT_LINEAR, Linear, is_quantized
from jaxinfer.models.common import (
    GEMMA_FIELDS,
    embed_lookup,
    head_projections,
    joined_projection,
    MOE_FIELDS,
    MOE_REQUIRED,
    AttentionFn,
    AttentionMetadata,
    apply_rope,
    gated_mlp,
    layer_program,
    output_projection,
    gguf_arch_key,
    hf_num_experts,
    hf_rope_theta,
    refuse_fields,
    require_fields,
    rms_norm,
    norm_rope_attention,
    rope_inv_freq,
    takes_norm_rope_write,
)
from jaxinfer.models.fused import FusedColumns
from jaxinfer.models.moe import (MoEFn, MoEWeights, moe_block, moe_specs, normed_router_input, takes_logits,
                                  valid_tokens)
from jaxinfer.params import Init, ParamSpec
from jaxinfer.sharding import Logical as L
from pallas_kernels import moe_routing
from pallas_kernels.skinny_matmul import gpu as skinny

@struct.dataclass
class DenseMLP:
    w_gate: jax.Array  # [D, F]
    w_up: jax.Array  # [D, F]
    w_down: jax.Array  # [F, D]


@struct.dataclass
class Qwen3Layer:
    attn_norm: jax.Array  # [D] input_layernorm
    wq: jax.Array  # [D, N, H]
    wk: jax.Array  # [D, K, H]
    wv: jax.Array  # [D, K, H]
    q_norm: jax.Array  # [H]
    k_norm: jax.Array  # [H]
    wo: jax.Array  # [N, H, D]
    mlp_norm: jax.Array  # [D] post_attention_layernorm (before the feed-forward)
    mlp: DenseMLP | None  # dense layers
    moe: MoEWeights | None  # mixture-of-experts layers


@struct.dataclass
class Qwen3Weights:
    embed: jax.Array  # [V, D]
    layers: tuple[Qwen3Layer, ...]
    final_norm: jax.Array  # [D]
    lm_head: jax.Array | None  # [D, V]; None when tied to the embedding


def check_dense_config(cfg: ModelConfig) -> None:
    refuse_fields(cfg, GEMMA_FIELDS + MOE_FIELDS, "Qwen3")


def check_moe_config(cfg: ModelConfig) -> None:
    refuse_fields(cfg, GEMMA_FIELDS, "Qwen3-MoE")
    require_fields(cfg, MOE_REQUIRED, "Qwen3-MoE")


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    """HF's rule: sparse when (layer + 1) % decoder_sparse_step == 0 and not listed in mlp_only_layers."""
    if cfg.num_experts is None:
        return False
    step = cfg.decoder_sparse_step or 1
    return (layer + 1) % step == 0 and layer not in (cfg.mlp_only_layers or ())


def layer_specs(cfg: ModelConfig, dtype: jnp.dtype, moe: bool) -> Qwen3Layer:
    d, n, k, h, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_size, cfg.intermediate_size
    dense = DenseMLP(
        w_gate=ParamSpec((d, f), dtype, (L.EMBED, L.FFN)),
        w_up=ParamSpec((d, f), dtype, (L.EMBED, L.FFN)),
        w_down=ParamSpec((f, d), dtype, (L.FFN, L.EMBED)),
    )
    return Qwen3Layer(
        attn_norm=ParamSpec((d,), dtype, (L.EMBED,), Init.ONES),
        wq=ParamSpec((d, n, h), dtype, (L.EMBED, L.Q_HEADS, L.HEAD_DIM)),
        wk=ParamSpec((d, k, h), dtype, (L.EMBED, L.KV_HEADS, L.HEAD_DIM)),
        wv=ParamSpec((d, k, h), dtype, (L.EMBED, L.KV_HEADS, L.HEAD_DIM)),
        q_norm=ParamSpec((h,), dtype, (L.HEAD_DIM,), Init.ONES),
        k_norm=ParamSpec((h,), dtype, (L.HEAD_DIM,), Init.ONES),
        wo=ParamSpec((n, h, d), dtype, (L.Q_HEADS, L.HEAD_DIM, L.EMBED), fan_in_axes=(0, 1)),
        mlp_norm=ParamSpec((d,), dtype, (L.EMBED,), Init.ONES),
        mlp=None if moe else dense,
        moe=moe_specs(d, cfg.moe_intermediate_size, cfg.num_experts, dtype) if moe else None,
    )


def _param_specs(cfg: ModelConfig, dtype: jnp.dtype) -> Qwen3Weights:
    d, v = cfg.hidden_size, cfg.vocab_size
    return Qwen3Weights(
        embed=ParamSpec((v, d), dtype, (L.VOCAB, L.EMBED), fan_in_axes=()),  # row lookup: scale 1
        layers=tuple(layer_specs(cfg, dtype, is_moe_layer(cfg, i)) for i in range(cfg.num_layers)),
        final_norm=ParamSpec((d,), dtype, (L.EMBED,), Init.ONES),
        lm_head=None if cfg.tie_word_embeddings else ParamSpec((d, v), dtype, (L.EMBED, L.VOCAB)),
    )


def param_specs(cfg: ModelConfig, dtype: jnp.dtype) -> Qwen3Weights:
    """Every Qwen3 (dense) weight: shape, dtype, logical axes, initializer."""
    check_dense_config(cfg)
    return _param_specs(cfg, dtype)


def moe_param_specs(cfg: ModelConfig, dtype: jnp.dtype) -> Qwen3Weights:
    """Every Qwen3-MoE weight; MoE layers carry `moe`, dense ones `mlp`."""
    check_moe_config(cfg)
    return _param_specs(cfg, dtype)


# Steps of at most this many tokens (decode buckets) norm q and k in one pass (normed_qkv).
QK_NORM_JOIN_MAX_TOKENS = 64
# On a GPU, steps of at most QKV_SPLIT_K_MAX_TOKENS tokens over float q/k/v weights at most QKV_SPLIT_K_MAX_IN wide
# compute the joined product as QKV_SPLIT_K partial products over slices of K, summed in float32 (0: never).
# Why: for Qwen3-30B-A3B's [2, 2048] x [2048, 5120] XLA's Triton GEMM tiles the output 8 x 64, 80 CTAs for the
# H200's 132 SMs, and streams the 21 MB at 62% of the copy rate (10.2 us alone); split 4 ways by hand, sum
# included, 8.0 us (79%), and the batch-1 decode loop's iteration 3.378/3.374 -> 3.250/3.248 ms, alternating in one
# process (2 ways, another process: 3.280). Llama-3-8B's 4096-wide q/k/v already runs at ~96% unsplit, hence the width bound
# (scripts/bench_skinny_gemm.py, docs/benchmarks/skinny_gemm_h200_2026-11-28.json, docs/PERFORMANCE.md).
QKV_SPLIT_K = 4
QKV_SPLIT_K_MAX_TOKENS = 8
QKV_SPLIT_K_MAX_IN = 2048


# On a GPU, decode steps (at most skinny_matmul.MAX_TOKENS tokens) of a model at most SKINNY_MAX_HIDDEN wide that take
# norm_rope_write (float weights, one device) compute the joined q/k/v product and the output projection with the
# skinny_matmul kernel (Mosaic GPU, up to SKINNY_SPLITS slices of K), and the output projection adds into a float32
# residual stream: XLA's sum of its split product and the residual add, a kernel a layer, goes. One H200,
# Qwen3-30B-A3B's batch-1 loop: q/k/v 7.2 -> 6.7 us, the output projection 6.3 -> 5.8 us a layer
# (docs/PERFORMANCE.md, "thirty-fifth session"). "interpret": the kernel interpreted (tests); None: XLA's products.
SKINNY: str | None = "gpu"
SKINNY_SPLITS = 8
SKINNY_MAX_HIDDEN = 2048


def skinny_plan(x: jax.Array, w: Any) -> tuple[int, Any] | None:
    """(splits, tiling) where the skinny_matmul kernel computes x [T, K] @ w [K, N] for this model (SKINNY), else
    None. The caller asks only on norm_rope_write's path, so one device holds the whole weight."""
    if SKINNY is None or (SKINNY == "gpu" and jax.default_backend() != "gpu") or not isinstance(w, jax.Array):
        return None
    plan = skinny.plan(w.shape[0], w.shape[-1], SKINNY_SPLITS) if w.ndim == 2 else None
    if plan is None or not skinny.takes(x, w, *plan) or min(x.shape[1], w.shape[1]) > SKINNY_MAX_HIDDEN:
        return None
    return plan


def _skinny_product(x: jax.Array, w: jax.Array, residual: jax.Array | None = None) -> jax.Array:
    """skinny_matmul by skinny_plan: [S, T, N] float32 partials, or residual + x @ w [T, N] float32."""
    splits, tiling = skinny_plan(x, w)
    return skinny.skinny_matmul(x, w, residual, splits=splits, tiling=tiling, interpret=SKINNY == "interpret")


def _output_weight(wo: Any) -> jax.Array | None:
    """wo [N, H, D] as the output projection's [N*H, D] matrix (a free reshape), or None for quantized weights."""
    return wo.reshape(-1, wo.shape[-1]) if isinstance(wo, jax.Array) else None


def f32_residual(layer: Any, x: jax.Array, k_pages: Any, attn_fn: AttentionFn) -> bool:
    """Whether a step's residual stream is float32 from the embedding on: the first layer's output projection adds
    into it (skinny_plan on norm_rope_write's path; the other layers are alike). x: the embedded tokens [T, D]."""
    wo = _output_weight(layer.wo)  # [N*H, D]
    return (wo is not None and takes_norm_rope_write(layer.wq, x, k_pages, attn_fn, layer.q_norm.shape[0])
            and skinny_plan(jax.ShapeDtypeStruct((x.shape[0], wo.shape[0]), x.dtype), wo) is not None)


def split_k_product(x: jax.Array, w: jax.Array, splits: int) -> jax.Array:
    """x [T, K] @ w [K, N] as `splits` float32 partial products over slices of K, summed: [T, N] in x.dtype. The
    partials are the MoE router's split product (any [K, N] weight takes it)."""
    parts = moe_routing.split_router_logits(x, w, splits)  # [S, T, N] float32
    return parts.sum(axis=0).astype(x.dtype)  # [T, N]


def _takes_split_k(x: jax.Array, wq: FusedColumns) -> bool:
    k = x.shape[1]
    return (QKV_SPLIT_K > 1 and jax.default_backend() == "gpu" and not is_quantized(wq.w)
            and x.shape[0] <= QKV_SPLIT_K_MAX_TOKENS and k <= QKV_SPLIT_K_MAX_IN and k % QKV_SPLIT_K == 0)


def normed_qkv(layer: Qwen3Layer, x: jax.Array, eps: float,
               linear: Linear = DEFAULT_LINEAR) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [T, D] -> q [T, N, H], k [T, K, H] after QK-norm, and v [T, K, H].

    With q/k/v joined at load on one device (FusedColumns, N not split), the q and k heads are consecutive in the
    product and take one RMSNorm over [T, N + K, H], each head its own weight: separately they were two norm
    kernels per layer in the batch-1 decode loop (1.4 us each on an H200; joined, XLA also fused q's RoPE into the
    norm: one kernel a layer fewer, docs/benchmarks/moe_b1_fusion_h200_2026-11-28.json). Split over devices, q's
    and k's heads sit in different blocks, and each is normed on its own. So are steps over QK_NORM_JOIN_MAX_TOKENS
    tokens (prefill), whose norms are not bound by kernel launches: joined there too, the GPU parity test's 300-token
    prefill (tests/test_parity_moe.py) came out 0.1017 from the reference path against its bound of 0.1 (the
    rounding of XLA's other fusions; the margin before the join was not measured)."""
    head_dim = layer.q_norm.shape[0]
    wq = layer.wq
    if not (isinstance(wq, FusedColumns) and wq.shards == 1 and x.shape[0] <= QK_NORM_JOIN_MAX_TOKENS):
        q, k, v = head_projections(x, wq, layer.wk, layer.wv, head_dim, linear)  # [T, N|K, H]
        return rms_norm(q, layer.q_norm, eps), rms_norm(k, layer.k_norm, eps), v
    t, (n, kv) = x.shape[0], (wq.widths[0] // head_dim, wq.widths[1] // head_dim)
    if _takes_split_k(x, wq):
        y = split_k_product(x, wq.w, QKV_SPLIT_K)  # [T, (N + 2K) * H]
    else:
        y = joined_projection(x, wq, L.Q_HEADS, linear, split=False)  # [T, (N + 2K) * H]
    # Sliced before the split into heads: a slice of the heads axis of the [T, N + 2K, H] view was copied out in a
    # kernel of its own, a slice of the flat product is read in place by the norm.
    qk = y[:, :(n + kv) * head_dim].reshape(t, n + kv, head_dim)  # [T, N + K, H]
    is_q = jnp.arange(n + kv)[:, None] < n  # [N + K, 1]
    weight = jnp.where(is_q, layer.q_norm[None, :], layer.k_norm[None, :])  # [N + K, H]
    qk = rms_norm(qk, weight, eps)  # [T, N + K, H]
    return qk[:, :n], qk[:, n:], y[:, (n + kv) * head_dim:].reshape(t, kv, head_dim)


def _qkv_parts(x: jax.Array, wq: FusedColumns, linear: Linear) -> jax.Array:
    """x [T, D] -> the joined q/k/v product as partials [S, T, (N + 2K) * H] for the kernel to sum: normed_qkv's
    split product unsummed (float32), or S = 1, the one product in x's dtype."""
    if skinny_plan(x, wq.w) is not None:
        return _skinny_product(x, wq.w)  # [S, T, W] float32
    if _takes_split_k(x, wq):
        return moe_routing.split_router_logits(x, wq.w, QKV_SPLIT_K)  # [S, T, W] float32
    return joined_projection(x, wq, L.Q_HEADS, linear, split=False)[None]  # [1, T, W]


def attention_block(
    layer: Qwen3Layer,
    x: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    md: AttentionMetadata,
    inv_freq: jax.Array,
    eps: float,
    attn_fn: AttentionFn,
    linear: Linear = DEFAULT_LINEAR,
    residual: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [T, D] the normed input -> (the attention's output [T, D], or residual + it given the residual, the layer's
    updated pages). Where the skinny kernel takes the output projection (decode on a GPU), it adds into a float32
    copy of the residual (a no-op copy where the stream is float32 already, f32_residual), and the sum is float32."""
    if takes_norm_rope_write(layer.wq, x, k_pages, attn_fn, layer.q_norm.shape[0]):  # decode on a GPU: one kernel
        attn, k_pages, v_pages = norm_rope_attention(_qkv_parts(x, layer.wq, linear), layer.wq, layer.q_norm,
                                                     layer.k_norm, eps, md, inv_freq, k_pages, v_pages, attn_fn)
        t, n, h = attn.shape
        flat, wo = attn.reshape(t, n * h), _output_weight(layer.wo)  # [T, N*H], [N*H, D]
        if residual is not None and skinny_plan(flat, wo) is not None:
            return _skinny_product(flat, wo, residual.astype(jnp.float32)), k_pages, v_pages
    else:
        q, k, v = normed_qkv(layer, x, eps, linear)  # [T, N|K, H], q and k normed over H per head
        q = apply_rope(q, md.positions, inv_freq)
        k = apply_rope(k, md.positions, inv_freq)
        attn, k_pages, v_pages = attn_fn(q, k, v, k_pages, v_pages, md)  # [T, N, H]
    out = output_projection(attn, layer.wo, linear)  # [T, D]
    return (out if residual is None else residual + out), k_pages, v_pages


def feed_forward(layer: Qwen3Layer, h: jax.Array, x: jax.Array, cfg: ModelConfig, valid: jax.Array, moe_fn: MoEFn,
                 linear: Linear = DEFAULT_LINEAR, logits: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(h [T, D] the normed input, x [T, D] the residual) -> (x + the MLP or MoE output [T, D], tokens routed to each
    expert [E] int32; zeros for a dense layer). `logits`: the MoE router's product of h computed already
    (moe.normed_router_input), or None. A MoE block that takes the residual (one device's whole block) adds it
    itself: the GPU's fused expert kernel adds its rows into it."""
    if layer.moe is None:
        out = gated_mlp(h, layer.mlp.w_gate, layer.mlp.w_up, layer.mlp.w_down, "silu", linear)
        return x + out, no_expert_counts(cfg)
    kwargs = dict(top_k=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob, valid=valid)
    if not takes_logits(moe_fn):
        out, counts = moe_fn(h, layer.moe, **kwargs)
        return x + out, counts
    return moe_fn(h, layer.moe, **kwargs, logits=logits, residual=x)


def no_expert_counts(cfg: ModelConfig) -> jax.Array:
    return jnp.zeros((cfg.num_experts or 0,), jnp.int32)  # [E]


def decoder_layer(layer: Qwen3Layer, x: jax.Array, k_pages: jax.Array, v_pages: jax.Array, md: AttentionMetadata,
                  inv_freq: jax.Array, valid: jax.Array, *, cfg: ModelConfig, attn_fn: AttentionFn, moe_fn: MoEFn,
                  linear: Linear) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """x [T, D] -> (x [T, D], the layer's updated pages, tokens per expert [E]) after attention + MLP or MoE."""
    eps = cfg.rms_norm_eps
    # The residual stream x may be float32 (f32_residual); the norms hand the products the weights' dtype.
    h = rms_norm(x, layer.attn_norm, eps).astype(layer.attn_norm.dtype)
    x, k_pages, v_pages = attention_block(layer, h, k_pages, v_pages, md, inv_freq, eps, attn_fn, linear, residual=x)
    if layer.moe is None:
        h, logits = rms_norm(x, layer.mlp_norm, eps).astype(layer.mlp_norm.dtype), None
    else:  # decode steps on a GPU: the norm and the router's product in one kernel
        h, logits = normed_router_input(x, layer.mlp_norm, layer.moe, eps, moe_fn)
    x, counts = feed_forward(layer, h, x, cfg, valid, moe_fn, linear, logits)
    return x, k_pages, v_pages, counts


def forward(
    weights: Qwen3Weights,
    cfg: ModelConfig,
    token_ids: jax.Array,
    md: AttentionMetadata,
    kv_cache: KVCache,
    attn_fn: AttentionFn,
    *,
    moe_fn: MoEFn = moe_block,
    linear: Linear = DEFAULT_LINEAR,
) -> tuple[jax.Array, KVCache, jax.Array]:
    """token_ids [T] -> (final normed hidden states [T, D], the updated cache, the tokens routed to each expert
    summed over the sparse layers [E] int32). The layer loop is unrolled, each kind of layer (dense, sparse)
    traced once (common.layer_program).

    `moe_fn` replaces the MoE block of sparse layers (a Pallas grouped matmul, expert-parallel dispatch);
    `linear` applies quantized weights (jaxinfer.linear).
    """
    eps = cfg.rms_norm_eps
    inv_freq = rope_inv_freq(cfg.head_size, cfg.rope_theta, cfg)
    x = embed_lookup(weights.embed, token_ids, weights.final_norm.dtype, linear)  # [T, D]
    if weights.layers and f32_residual(weights.layers[0], x, kv_cache.k[0], attn_fn):
        x = x.astype(jnp.float32)  # every layer then takes and gives the same dtype: one trace of each kind
    valid = valid_tokens(md, x.shape[0])  # [T]
    run_layer = layer_program(decoder_layer, cfg=cfg, attn_fn=attn_fn, moe_fn=moe_fn, linear=linear)
    new_k, new_v, counts = [], [], no_expert_counts(cfg)
    for layer, k_pages, v_pages in zip(weights.layers, kv_cache.k, kv_cache.v):
        x, k_pages, v_pages, layer_counts = run_layer(layer, x, k_pages, v_pages, md, inv_freq, valid)
        new_k.append(k_pages)
        new_v.append(v_pages)
        counts = counts + layer_counts
    x = rms_norm(x, weights.final_norm, eps).astype(weights.final_norm.dtype)
    return x, KVCache(k=tuple(new_k), v=tuple(new_v)), counts


compute_logits = llama.compute_logits  # hidden [S, D] -> float32 [S, V], tied or not


def checkpoint_rules() -> list[TensorRule]:
    """Declarative name map for GGUF (llama.cpp names) and HF safetensors checkpoints.

    Expert weights load from HF's published per-expert tensors (`{e}`), transformers 5's fused
    `experts.gate_up_proj` [E, 2F, D] / `experts.down_proj` [E, D, F], or GGUF's stacked `ffn_*_exps`.
    """
    T = Transform
    hf = "model.layers.{i}."
    fused = hf + "mlp.experts.gate_up_proj"
    return [
        TensorRule("embed", "token_embd.weight", "model.embed_tokens.weight"),
        TensorRule("final_norm", "output_norm.weight", "model.norm.weight"),
        TensorRule("lm_head", "output.weight", "lm_head.weight", T.LINEAR),
        TensorRule("layers.{i}.attn_norm", "blk.{i}.attn_norm.weight", hf + "input_layernorm.weight"),
        TensorRule("layers.{i}.wq", "blk.{i}.attn_q.weight", hf + "self_attn.q_proj.weight", T.LINEAR_TO_HEADS),
        TensorRule("layers.{i}.wk", "blk.{i}.attn_k.weight", hf + "self_attn.k_proj.weight", T.LINEAR_TO_HEADS),
        TensorRule("layers.{i}.wv", "blk.{i}.attn_v.weight", hf + "self_attn.v_proj.weight", T.LINEAR_TO_HEADS),
        TensorRule("layers.{i}.q_norm", "blk.{i}.attn_q_norm.weight", hf + "self_attn.q_norm.weight"),
        TensorRule("layers.{i}.k_norm", "blk.{i}.attn_k_norm.weight", hf + "self_attn.k_norm.weight"),
        TensorRule("layers.{i}.wo", "blk.{i}.attn_output.weight", hf + "self_attn.o_proj.weight",
                   T.LINEAR_FROM_HEADS),
        TensorRule("layers.{i}.mlp_norm", "blk.{i}.ffn_norm.weight", hf + "post_attention_layernorm.weight"),
        TensorRule("layers.{i}.mlp.w_gate", "blk.{i}.ffn_gate.weight", hf + "mlp.gate_proj.weight", T.LINEAR),
        TensorRule("layers.{i}.mlp.w_up", "blk.{i}.ffn_up.weight", hf + "mlp.up_proj.weight", T.LINEAR),
        TensorRule("layers.{i}.mlp.w_down", "blk.{i}.ffn_down.weight", hf + "mlp.down_proj.weight", T.LINEAR),
        TensorRule("layers.{i}.moe.router", "blk.{i}.ffn_gate_inp.weight", hf + "mlp.gate.weight", T.LINEAR),
        TensorRule("layers.{i}.moe.w_gate", "blk.{i}.ffn_gate_exps.weight",
                   (hf + "mlp.experts.{e}.gate_proj.weight", Part(fused, 0, 2)), T.LINEAR),
        TensorRule("layers.{i}.moe.w_up", "blk.{i}.ffn_up_exps.weight",
                   (hf + "mlp.experts.{e}.up_proj.weight", Part(fused, 1, 2)), T.LINEAR),
        TensorRule("layers.{i}.moe.w_down", "blk.{i}.ffn_down_exps.weight",
                   (hf + "mlp.experts.{e}.down_proj.weight", hf + "mlp.experts.down_proj"), T.LINEAR),
    ]


def _gguf_base(meta: dict[str, Any], architecture: str) -> dict[str, Any]:
    """ModelConfig fields common to GGUF qwen3 and qwen3moe."""
    arch = meta["general.architecture"]
    key = gguf_arch_key(meta)
    n_heads = int(key("attention.head_count"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    return dict(
        architecture=architecture,
        vocab_size=int(vocab),
        hidden_size=int(key("embedding_length")),
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=n_heads,
        num_kv_heads=int(key("attention.head_count_kv", n_heads)),
        head_dim=int(key("attention.key_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 1_000_000.0)),
        max_position_embeddings=int(key("context_length", 40960)),
        tie_word_embeddings=False,  # decided by the presence of output.weight in the loader
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
    )


def config_from_gguf(meta: dict[str, Any]) -> ModelConfig:
    """ModelConfig from llama.cpp `qwen3.*` metadata."""
    return ModelConfig(**_gguf_base(meta, "qwen3"))


def moe_config_from_gguf(meta: dict[str, Any]) -> ModelConfig:
    """ModelConfig from llama.cpp `qwen3moe.*` metadata: every layer sparse, top-k renormalized (as llama.cpp)."""
    key = gguf_arch_key(meta)
    return ModelConfig(
        **_gguf_base(meta, "qwen3_moe"),
        num_experts=int(key("expert_count")),
        num_experts_per_tok=int(key("expert_used_count")),
        moe_intermediate_size=int(key("expert_feed_forward_length")),
        norm_topk_prob=bool(key("expert_weights_norm", True)),
    )


def _check_hf_attention(hf: dict[str, Any], family: str) -> None:
    """Refuse what this family does not implement instead of computing something else."""
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(f"config.json rope type {rope_type!r} is not supported for {family} (default only).")
    if hf.get("use_sliding_window"):
        raise CheckpointError(f"config.json sets use_sliding_window=true, which jaxinfer's {family} does not implement.")
    if hf.get("attention_bias"):
        raise CheckpointError(f"config.json sets attention_bias=true, which jaxinfer's {family} does not implement.")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json hidden_act {hf['hidden_act']!r} is not supported for {family} (silu).")


def _hf_base(hf: dict[str, Any], architecture: str) -> dict[str, Any]:
    eos = hf.get("eos_token_id")
    return dict(
        architecture=architecture,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim"),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=hf_rope_theta(hf, 10000.0),
        max_position_embeddings=hf.get("max_position_embeddings", 32768),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
    )


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig from an HF `config.json` (Qwen3ForCausalLM)."""
    _check_hf_attention(hf, "Qwen3")
    return ModelConfig(**_hf_base(hf, "qwen3"))


def moe_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig from an HF `config.json` (Qwen3MoeForCausalLM); absent fields take HF's defaults."""
    _check_hf_attention(hf, "Qwen3-MoE")
    return ModelConfig(
        **_hf_base(hf, "qwen3_moe"),
        num_experts=hf_num_experts(hf),
        num_experts_per_tok=hf.get("num_experts_per_tok", 8),
        moe_intermediate_size=hf.get("moe_intermediate_size", 768),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        decoder_sparse_step=hf.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
    )

