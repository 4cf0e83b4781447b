"""Pieces shared by the model families: norms, rotary embeddings, gated MLPs, attention metadata.

Letter glossary for einsums and shape comments: docs/ARCHITECTURE.md (T tokens, D model, F ffn, V vocab,
N q heads, K kv heads, G = N/K, H head dim, P pages, R page size, S sequences, M page-table width).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.checkpoint.assemble import CheckpointError
from jaxinfer.config import ConfigError, ModelConfig, RopeScaling
from jaxinfer.linear import DEFAULT_LINEAR, Linear, is_quantized
from jaxinfer.models.fused import FusedColumns, split_outputs
from jaxinfer.sharding import Logical
from pallas_kernels.ragged_paged_attention import norm_rope_write
from pallas_kernels.ragged_paged_attention.reference import QuantizedPages, quantize_kv

# ModelConfig fields that only some families read; a family refuses the ones it would ignore.
GEMMA_FIELDS = ("sliding_window", "sliding_window_pattern", "rope_local_theta", "query_pre_attn_scalar",
                "attn_logit_softcap", "final_logit_softcap")
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "decoder_sparse_step", "mlp_only_layers")
MOE_REQUIRED = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")


@struct.dataclass
class AttentionMetadata:
    """Where this step's tokens sit in the paged cache (contract: docs/ARCHITECTURE.md)."""

    positions: jax.Array  # [T] int32
    slot_mapping: jax.Array  # [T] int32, page * R + offset
    cu_q_lens: jax.Array  # [S + 1] int32
    kv_lens: jax.Array  # [S] int32, after this step's writes
    page_indices: jax.Array  # [S, M] int32
    num_seqs: jax.Array  # [1] int32


# Write this step's keys/values into the layer's cache, then attend (jaxinfer.attention builds it):
# (q [T, N, H], k [T, K, H], v [T, K, H], k_pages [P, R, Kc, H], v_pages, md, **layer settings)
#   -> (out [T, N, H], k_pages, v_pages)
AttentionFn = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]


def takes_written(attn_fn: AttentionFn) -> bool:
    """Whether `attn_fn` runs one device's whole step, so that a model may write the step's keys and values into
    the pages itself and call it with k = v = None and `written=True` (jaxinfer.attention.make_attention_fn)."""
    return getattr(attn_fn, "takes_written", False)


# Decode-sized steps on a GPU rotate (Qwen3: norm and rotate) q and k and write k and v into the cache in one kernel
# (pallas_kernels/ragged_paged_attention/norm_rope_write.py says why). "interpret": that kernel interpreted, on any
# backend (tests); None: never (XLA's path).
NORM_ROPE_WRITE: str | None = "gpu"


def takes_norm_rope_write(wq: Any, x: jax.Array, k_pages: Any, attn_fn: AttentionFn, head_dim: int) -> bool:
    """The kernel serves float q/k/v weights joined at load on one device (`wq` a FusedColumns, N unsplit) whose
    attention runs the whole step (`takes_written`), a plain cache of the activations' dtype, and its shapes."""
    if NORM_ROPE_WRITE is None or (NORM_ROPE_WRITE == "gpu" and jax.default_backend() != "gpu"):
        return False
    return (isinstance(wq, FusedColumns) and wq.shards == 1 and not is_quantized(wq.w) and takes_written(attn_fn)
            and getattr(k_pages, "dtype", None) == x.dtype
            and norm_rope_write.takes(k_pages, x.shape[0], wq.widths[0] // head_dim))


def norm_rope_attention(parts: jax.Array, wq: FusedColumns, q_norm: jax.Array | None, k_norm: jax.Array | None,
                        eps: float | None, md: AttentionMetadata, inv_freq: jax.Array, k_pages: jax.Array,
                        v_pages: jax.Array, attn_fn: AttentionFn) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The joined product's partials `parts` [S, T, (N + 2K) * H] -> (attention out [T, N, H], k_pages, v_pages)
    through the norm_rope_write kernel, where `takes_norm_rope_write` said so; eps None: no QK-norm."""
    head_dim = 2 * inv_freq.shape[0]
    q, k_pages, v_pages = norm_rope_write.norm_rope_write(
        parts, q_norm, k_norm, md.positions, inv_freq, md.slot_mapping, k_pages, v_pages,
        num_q_heads=wq.widths[0] // head_dim, eps=eps, interpret=NORM_ROPE_WRITE == "interpret")  # q [T, N, H]
    return attn_fn(q, None, None, k_pages, v_pages, md, written=True)  # k and v are in the pages already


def layer_program(body: Callable[..., Any], **bound: Any) -> Callable[..., Any]:
    """One decoder layer (`body` with `bound` fixed: config, attention and linear functions) as a jitted
    function that a forward calls once per layer.

    Why: the layer loop is unrolled so that each layer keeps its own cache buffer (ARCHITECTURE.md), which
    made every program trace and lower its layer once per layer: 32 times for Llama-3-8B, and warmup
    traces one program per bucket (~1.6 s each on a GPU host). Calls with the same argument shapes hit
    jax.jit's trace cache, and the lowering emits one function that every call site shares, so a forward
    traces each kind of layer once (tests/models/test_layer_program.py). XLA inlines the calls before it
    optimizes, so the fusions and in-place cache updates are those of the unrolled loop
    (tests/engine/test_no_copies.py holds the updates in place); on a CPU the attention inside stays a called
    computation (jaxinfer.attention).
    Make one per forward: the bound callables are not hashable, and a fresh jit keeps nothing alive."""
    return jax.jit(functools.partial(body, **bound))


def refuse_fields(cfg: ModelConfig, fields: tuple[str, ...], family: str) -> None:
    """A set field the family would silently ignore is an error naming it."""
    for name in fields:
        if getattr(cfg, name) is not None:
            raise ConfigError(f"ModelConfig.{name} is set, but the {family} family does not implement it; remove it.")


def require_fields(cfg: ModelConfig, fields: tuple[str, ...], family: str) -> None:
    missing = [name for name in fields if getattr(cfg, name) is None]
    if missing:
        raise ConfigError(f"ModelConfig.{missing[0]} is not set, and {family} needs it (set {', '.join(missing)}).")


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, offset: float = 0.0) -> jax.Array:
    """RMSNorm computed in float32 whatever the activation dtype (bf16 squares lose too much)."""
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * inv * (offset + weight.astype(jnp.float32))).astype(x.dtype)


def llama3_inv_freq(inv_freq: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Llama 3.1 frequency remapping: keep high frequencies, divide low ones by the factor, blend between."""
    factor = cfg.rope_scaling_factor
    low_wavelen = cfg.rope_original_max_position / cfg.rope_low_freq_factor
    high_wavelen = cfg.rope_original_max_position / cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (cfg.rope_original_max_position / wavelen - cfg.rope_low_freq_factor) / (
        cfg.rope_high_freq_factor - cfg.rope_low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    is_medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return jnp.where(is_medium, blended, scaled)


def rope_inv_freq(head_dim: int, theta: float, cfg: ModelConfig | None = None) -> jax.Array:
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))  # [H/2]
    if cfg is None or cfg.rope_scaling is RopeScaling.NONE:
        return inv_freq
    if cfg.rope_scaling is RopeScaling.LLAMA3:
        return llama3_inv_freq(inv_freq, cfg)
    return inv_freq / cfg.rope_scaling_factor  # LINEAR


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary embedding in the half-split ("rotate_half") convention that HF checkpoints use.

    x: [T, heads, H]; positions: [T]. Angles are computed in float32: at positions in the thousands a
    bf16 angle is off by whole radians.
    """
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, H/2]
    cos = jnp.cos(angles)[:, None, :]  # [T, 1, H/2]
    sin = jnp.sin(angles)[:, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)  # [T, heads, H/2] each
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def project(x: jax.Array, w: Any, spec: str, out_axis: Logical, linear: Linear = DEFAULT_LINEAR,
            out_shape: tuple[int, ...] | None = None) -> jax.Array:
    """x [T, D] times a column-parallel weight: a float weight as the einsum `spec`, a quantized one
    ([D, N] in the kernels' format) through `linear`, reshaped to [T, *out_shape] (e.g. heads)."""
    if not is_quantized(w):
        return jnp.einsum(spec, x, w)
    y = linear.matmul(x, w, Logical.EMBED, out_axis)  # [T, N]
    return y if out_shape is None else y.reshape(x.shape[0], *out_shape)


def joined_projection(x: jax.Array, fused: FusedColumns, out_axis: Logical,
                      linear: Linear = DEFAULT_LINEAR, split: bool = True) -> Any:
    """x [T, D] times weights joined at load (models.fused) -> each part's output [T, N_part]; or, with
    split=False, the joined product [T, S * W] itself (device-major: split_outputs)."""
    if is_quantized(fused.w):
        y = linear.matmul(x, fused.w, Logical.EMBED, out_axis)  # [T, S * W]
    else:
        y = jnp.einsum("td,dn->tn", x, fused.w)  # [T, S * W]
    return split_outputs(y, fused) if split else y


def head_projections(x: jax.Array, wq: Any, wk: Any, wv: Any, head_dim: int,
                     linear: Linear = DEFAULT_LINEAR) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [T, D] -> q [T, N, H], k [T, K, H], v [T, K, H] (float or quantized weights; or q/k/v joined in `wq`,
    a FusedColumns, with wk and wv None)."""
    if isinstance(wq, FusedColumns):
        t = x.shape[0]
        return tuple(y.reshape(t, -1, head_dim) for y in joined_projection(x, wq, Logical.Q_HEADS, linear))

    def heads(w: Any, axis: Logical) -> jax.Array:
        out_shape = None if not is_quantized(w) else (w.out_features // head_dim, head_dim)
        return project(x, w, "td,dnh->tnh", axis, linear, out_shape)

    return heads(wq, Logical.Q_HEADS), heads(wk, Logical.KV_HEADS), heads(wv, Logical.KV_HEADS)


def gated_mlp(x: jax.Array, w_gate: Any, w_up: Any, w_down: Any, act: str,
              linear: Linear = DEFAULT_LINEAR) -> jax.Array:
    """SwiGLU (act="silu") or GeGLU (act="gelu_tanh"): down(act(x @ gate) * (x @ up)); gate and up may come
    joined in `w_gate` (a FusedColumns, w_up None)."""
    if isinstance(w_gate, FusedColumns):
        gate, up = joined_projection(x, w_gate, Logical.FFN, linear)  # [T, F] each
    else:
        gate = project(x, w_gate, "td,df->tf", Logical.FFN, linear)  # [T, F]
        up = project(x, w_up, "td,df->tf", Logical.FFN, linear)  # [T, F]
    if act == "silu":
        h = jax.nn.silu(gate) * up
    elif act == "gelu_tanh":
        h = jax.nn.gelu(gate, approximate=True) * up
    else:
        raise ValueError(f"gated_mlp: unknown activation {act!r}; expected 'silu' or 'gelu_tanh'.")
    if is_quantized(w_down):
        return linear.matmul(h, w_down, Logical.FFN, Logical.EMBED)  # [T, D]
    return jnp.einsum("tf,fd->td", h, w_down)  # [T, D]


def output_projection(attn: jax.Array, wo: Any, linear: Linear = DEFAULT_LINEAR) -> jax.Array:
    """attn [T, N, H] @ wo [N, H, D] -> [T, D], contracted as one [T, N*H] x [N*H, D] matmul.

    Written as the einsum "tnh,nhd->td", XLA's CPU layout assignment contracted (h, n) in that order and
    transposed wo into it: a full copy of the weight on every call, and inside the multi-step decode loop on
    every iteration. Both reshapes here are free (row-major bitcasts), so the weight is read in place.
    A quantized wo is already [D, N*H] values (output-major) and goes through `linear`."""
    t, n, h = attn.shape
    if is_quantized(wo):
        return linear.matmul(attn.reshape(t, n * h), wo, Logical.Q_HEADS, Logical.EMBED)  # [T, D]
    return jnp.einsum("tm,md->td", attn.reshape(t, n * h), wo.reshape(n * h, wo.shape[-1]))  # [T, D]


def embed_lookup(table: Any, token_ids: jax.Array, dtype: Any, linear: Linear = DEFAULT_LINEAR) -> jax.Array:
    """token_ids [T] -> [T, D] rows of the embedding (a quantized table is dequantized to `dtype`)."""
    if is_quantized(table):
        return linear.embed(token_ids, table, dtype)
    return jnp.take(table, token_ids, axis=0)


def vocab_logits(hidden: jax.Array, table: Any, tied: bool, linear: Linear = DEFAULT_LINEAR) -> jax.Array:
    """hidden [S, D] -> logits [S, V] (hidden's dtype) against a tied embedding [V, D] or an LM head [D, V]."""
    if is_quantized(table):
        return linear.matmul(hidden, table, Logical.EMBED, Logical.VOCAB)
    return jnp.einsum("sd,vd->sv" if tied else "sd,dv->sv", hidden, table)


def write_kv(k_pages: Any, v_pages: Any, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> tuple[Any, Any]:
    """Scatter this step's keys/values [T, K, H] into the paged cache [P, R, K, H] at their flat slots.

    Padding tokens carry slots inside page 0, the reserved trash page, so no mask is needed.

    A one-token step (the 1-row decode bucket) writes with a dynamic-update-slice instead. XLA turns a
    one-index scatter into one anyway, but keeps the scatter's drop-out-of-bounds rule by reading the old
    row and selecting, and that read of the old cache beside the in-place write made it copy every cache
    layer on every step (41 instead of 7 ms per token on an H100). A dynamic-update-slice clamps instead,
    which is equivalent here (the slot is always in bounds), so the layer is updated in place.

    Quantized pages (int8 / fp8 KV, `QuantizedPages`) are quantized on write: each new token's row of
    each head gets its own absmax scale (quantize_kv), written into the scale page [P, K, R] beside the
    values the same way (in place for one token).
    """
    return _write_pages(k_pages, k, slot_mapping), _write_pages(v_pages, v, slot_mapping)


# Every real token owns its slot, and every slot is in bounds (the page table holds allocated pages; padding
# tokens write to the trash page, where several of them may share a slot whose content nobody reads). Saying so
# lets XLA drop the scatter's handling of repeated and out-of-bounds indices. One H100, one layer's K write into
# a Llama-3-8B-sized cache (scripts/bench_kernels.py --sections kv_write): 2.55 -> 2.10 us at 192 tokens,
# 39.2 -> 6.1 us at 4,096; in the engine's decode step, ~0.04 ms of its kernels (docs/PERFORMANCE.md).
_SLOT_SCATTER = dict(unique_indices=True, mode="promise_in_bounds")


def _write_pages(pages: Any, x: jax.Array, slot_mapping: jax.Array) -> Any:
    if not isinstance(pages, QuantizedPages):
        return _write_values(pages, x.astype(pages.dtype), slot_mapping)
    codes, scales = quantize_kv(x, pages.dtype)  # [T, K, H], [T, K]
    return QuantizedPages(_write_values(pages.values, codes, slot_mapping),
                          _write_scales(pages.scales, scales, slot_mapping))


def _write_values(pages: jax.Array, x: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    num_pages, page_size, kv_heads, head_dim = pages.shape
    if x.shape[0] == 1:  # no reshape either: a bitcast around the update also cost the in-place write
        slot = slot_mapping[0]
        return jax.lax.dynamic_update_slice(pages, x[None], (slot // page_size, slot % page_size, 0, 0))
    flat_shape = (num_pages * page_size, kv_heads, head_dim)  # [P*R, K, H]
    return pages.reshape(flat_shape).at[slot_mapping].set(x, **_SLOT_SCATTER).reshape(pages.shape)


def _write_scales(scales: jax.Array, s: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """s [T, K] into scales [P, K, R] at each token's (page, :, offset)."""
    page_size = scales.shape[2]
    page, offset = slot_mapping // page_size, slot_mapping % page_size  # [T]
    if s.shape[0] == 1:
        return jax.lax.dynamic_update_slice(scales, s.T[None], (page[0], 0, offset[0]))  # [1, K, 1]
    return scales.at[page, :, offset].set(s, **_SLOT_SCATTER)


def gather_last_tokens(hidden: jax.Array, logits_indices: jax.Array) -> jax.Array:
    """Rows of the final hidden state that produce logits: [T, D] -> [S, D] (only those, not all T)."""
    return jnp.take(hidden, logits_indices, axis=0)


def gguf_arch_key(meta: dict[str, Any]) -> Callable[..., Any]:
    """`key(name, default=None)`: the architecture-prefixed GGUF metadata value (`llama.block_count`, ...);
    a missing key without a default is a CheckpointError naming it."""
    arch = meta["general.architecture"]

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise CheckpointError(f"GGUF metadata lacks {arch}.{name}, which the {arch} architecture needs.")
        return value

    return key


def hf_rope_theta(hf: dict[str, Any], default: float) -> float:
    """rope_theta at the top level (published configs) or inside rope_parameters (transformers 5)."""
    params = hf.get("rope_parameters") or {}
    return float(hf.get("rope_theta", params.get("rope_theta", default)))


def hf_num_experts(hf: dict[str, Any]) -> int:
    """`num_experts` (Qwen's published configs) or `num_local_experts` (Mixtral; transformers 5 writes it for both)."""
    both = [hf[k] for k in ("num_experts", "num_local_experts") if hf.get(k) is not None]
    if not both:
        raise CheckpointError("config.json has neither num_experts nor num_local_experts.")
    if len(set(both)) > 1:
        raise CheckpointError(f"config.json sets num_experts={both[0]} but num_local_experts={both[1]}.")
    return int(both[0])
