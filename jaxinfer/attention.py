"""Paged attention as the models call it: write this step's keys and values into the cache, then attend.

`make_attention_fn` binds the kernel choice and the static settings once per runner. The model calls the
result once per layer with the new q/k/v and that layer's cache pages and gets the attention output and
the updated pages back:

    out [T, N, H], k_pages, v_pages = attn(q [T, N, H], k [T, K, H], v [T, K, H], k_pages, v_pages, md)

Why the write lives here and not in the model: under tensor parallelism both the scatter into the cache
and the kernel must run per device, on that device's heads and its shard of the pages. A Pallas kernel is
an opaque custom call to XLA's SPMD partitioner, which can only run it replicated: it would all-gather the
whole KV cache and the queries onto every device every layer (that made TP=2 23x slower than one GPU and
ran out of memory compiling). So with a mesh whose model axes (`expert` x `tensor`, see jaxinfer.sharding)
hold more than one device, the write and the kernel run inside one `jax.shard_map`: queries split by head,
the cache split by head (`HeadLayout`), metadata replicated, no collective inside. With a `seq` axis
(sequence parallelism) each device also takes a contiguous slice of the step's query tokens, with metadata
rewritten for that slice (`local_query_metadata`), while the new keys and values arrive whole: the cache is
replicated over `seq`, so every device writes every new token and attends over the full prefix. The jnp
reference goes through the same wrapper, so CPU tests exercise the sharded path the kernels take.

When KV heads are replicated (fewer KV heads than devices), the k/v projections are computed whole on
every device (the weights are small) and each device keeps the one KV head its query heads read.

A quantized cache (int8 / fp8 KV) is a `QuantizedPages` per layer, values [P, R, K, H] and per-token
scales [P, K, R], both split by head; the write quantizes (jaxinfer.models.common.write_kv) and the
kernels dequantize as they read. Queries, keys and values are rotated into the basis of `kv_rotation` first
and the output rotated back, per device (a head's H is never split).

On a CPU the attention proper (after the write) is a computation of its own in the compiled program, called by
every layer, instead of being inlined 30 times: XLA:CPU's compile time grows with the inlined program (its HLO
passes and LLVM code generation), and the attention's gathers and loops are much of a layer's code. The write stays
inline: XLA's copy insertion does not let a callee update its caller's buffer in place, so a called computation
that wrote the cache would copy the whole cache layer on every call. The bundled SmolLM2's engine compiled its
programs in 26-28 s instead of 34-47, and decoded as fast (docs/PERFORMANCE.md, "CPU"). GPUs and TPUs keep the
attention inlined.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from jaxinfer.config import ModelConfig
from jaxinfer.models.common import AttentionFn, AttentionMetadata, write_kv
from jaxinfer.sharding import attention_axes, attention_parallel_size, axis_size, head_layout
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, resolve_impl
from pallas_kernels.ragged_paged_attention.reference import QuantizedPages

SEQ = "seq"

# The attention's static settings, for `_attend_apart`: ragged_paged_attention's keyword-only arguments.
_ATTEND_STATIC = tuple(name for name, p in inspect.signature(ragged_paged_attention).parameters.items()
                       if p.kind is inspect.Parameter.KEYWORD_ONLY)


def attention_apart(mesh: Mesh | None) -> bool:
    """Whether the attention is its own computation in the compiled program: on a CPU (module docstring)."""
    platform = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
    return platform == "cpu"


def _attend(*args: Any, **static: Any) -> jax.Array:
    return ragged_paged_attention(*args, **static)  # the module's name, looked up when traced


def _attend_apart() -> Callable[..., jax.Array]:
    """`_attend` as a called computation. XLA_LATE keeps the call through XLA:CPU's optimizations, so every
    layer's call site shares one callee (module docstring); the default would inline it before XLA optimizes.
    One per attention function, as common.layer_program makes one per forward: a fresh partial, since jax.jit
    keys its traces on the function, so no trace outlives the runner (or misses a patched kernel in a test)."""
    return jax.jit(functools.partial(_attend), static_argnames=_ATTEND_STATIC, inline=jax.Inline.XLA_LATE)


def attention_scale(cfg: ModelConfig) -> float:
    # Gemma 3 scales queries by 1/sqrt(query_pre_attn_scalar), which differs from head_dim on the 27B.
    return (cfg.query_pre_attn_scalar or cfg.head_size) ** -0.5


def kv_rotation(head_dim: int) -> np.ndarray:
    """An orthonormal [H, H] (block-)Hadamard matrix: the basis a quantized KV cache is stored in.

    Why: a quantized cache keeps one absmax scale per token and KV head, and a few outlier channels (keys
    after RoPE have them) set that scale, so every other channel gets only a few of the 255 int8 levels.
    Rotating keys, values and queries by the same orthonormal R leaves every score q.k and the attention
    output's span unchanged ((qR).(kR) = q.k; sum p (vR) = (sum p v) R, undone by R^T) while spreading each
    outlier over all channels. Sylvester's construction for a power of two; otherwise the largest power-of-two
    block dividing H repeated on the diagonal (H = 80: 16, 96: 32), which spreads outliers within blocks."""
    block = head_dim & -head_dim  # largest power of two dividing head_dim
    h = np.ones((1, 1))
    while h.shape[0] < block:
        h = np.block([[h, h], [h, -h]])
    return np.kron(np.eye(head_dim // block), h / np.sqrt(block)).astype(np.float32)  # [H, H]


def _rotate(x: jax.Array, rotation: np.ndarray) -> jax.Array:
    """x [T, heads, H] @ rotation [H, H] in float32, back in x's dtype."""
    y = jnp.einsum("tnh,hg->tng", x.astype(jnp.float32), rotation, precision=jax.lax.Precision.HIGHEST)
    return y.astype(x.dtype)  # [T, heads, H]


def _write_and_attend(
    q: jax.Array, k: jax.Array, v: jax.Array, k_pages: jax.Array, v_pages: jax.Array, md: AttentionMetadata,
    query_md: AttentionMetadata | None = None, *, impl: str, interpret: bool, sm_scale: float,
    attend: Callable[..., jax.Array], written: bool = False, **layer: Any,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One device's (or the whole unsharded) step: scatter k/v [T, K, H] into the pages, attend [Tq, N, H].

    `query_md` describes the queries when they are a slice of the step's tokens (sequence parallelism);
    the writes always cover all of them (`md`). `attend`: `_attend`, or on a CPU `_attend_apart()`.
    `written`: the model has already written this step's keys and values into the (plain) pages, and passes
    k = v = None (`takes_written`)."""
    rotation = None
    if isinstance(k_pages, QuantizedPages):  # stored in a rotated basis: kv_rotation
        rotation = kv_rotation(q.shape[-1])
        q, k, v = _rotate(q, rotation), _rotate(k, rotation), _rotate(v, rotation)
    if not written:
        k_pages, v_pages = write_kv(k_pages, v_pages, k, v, md.slot_mapping)
    qmd = md if query_md is None else query_md
    out = attend(
        q, k_pages, v_pages, qmd.kv_lens, qmd.page_indices, qmd.cu_q_lens, qmd.num_seqs,
        sm_scale=sm_scale, impl=impl, interpret=interpret, **layer,
    )
    if rotation is not None:
        out = _rotate(out, rotation.T)  # [Tq, N, H] back from the rotated basis
    return out, k_pages, v_pages


def _own_kv_head(x: jax.Array, replicas: int, axes: tuple[str, ...]) -> jax.Array:
    """[T, K, H] whole on every device -> [T, 1, H]: the KV head this device's query heads read.

    Device d of the attention axes holds query heads d*N/n .. (d+1)*N/n - 1, all inside group d // replicas.
    """
    head = jax.lax.axis_index(axes) // replicas
    return jax.lax.dynamic_slice_in_dim(x, head, 1, axis=1)  # [T, 1, H]


def local_query_metadata(md: AttentionMetadata, tokens_per_device: int) -> AttentionMetadata:
    """The metadata of this device's slice [a, a + n) of the step's flat tokens (sequence parallelism).

    Sequence s keeps the part of its new tokens inside the slice; its last kept token sits at position
    kv_len - (tokens of s after the slice), so that shortened kv_len keeps the contract that a sequence's new
    tokens end its kv range (keys past it are causally masked anyway). Sequences with no token in the
    slice get zero queries."""
    a = jax.lax.axis_index(SEQ) * tokens_per_device
    ends = jnp.clip(md.cu_q_lens, a, a + tokens_per_device)  # [S+1]
    after = md.cu_q_lens[1:] - ends[1:]  # [S] tokens of each sequence past the slice
    return md.replace(cu_q_lens=(ends - a).astype(jnp.int32), kv_lens=jnp.maximum(md.kv_lens - after, 0))


def _sharded(local: AttentionFn, mesh: Mesh, cfg: ModelConfig) -> AttentionFn:
    """Run `local` per device: heads and cache split over the model axes, and with a `seq` axis each
    device takes a slice of the step's queries (the new keys/values stay whole, so every device writes
    all of them into its copy of the cache and attends over the full prefix)."""
    axes = attention_axes(cfg, dict(mesh.shape))
    layout = head_layout(cfg, attention_parallel_size(cfg, mesh))
    seq = axis_size(mesh, SEQ)
    split = axes if len(axes) != 1 else axes[0]
    heads, values = P(None, split or None, None), P(None, None, split or None, None)
    kv_spec = heads if layout.kv_sharded else P()

    def attn(q, k, v, k_pages, v_pages, md, **layer):
        num_tokens = q.shape[0]
        cache = values  # [P, R, K, H]; quantized pages add scales [P, K, R], split by head as well
        if isinstance(k_pages, QuantizedPages):
            cache = QuantizedPages(values, P(None, split or None, None))
        by_token = seq > 1 and num_tokens % seq == 0  # a 1-row decode bucket runs whole on every device
        q_spec = P(SEQ, split or None, None) if by_token else heads

        def per_device(q, k, v, k_pages, v_pages, md):
            if axes and not layout.kv_sharded:
                k, v = _own_kv_head(k, layout.kv_replicas, axes), _own_kv_head(v, layout.kv_replicas, axes)
            query_md = local_query_metadata(md, num_tokens // seq) if by_token else None
            return local(q, k, v, k_pages, v_pages, md, query_md, **layer)

        fn = jax.shard_map(
            per_device, mesh=mesh,
            in_specs=(q_spec, kv_spec, kv_spec, cache, cache, P()),
            out_specs=(q_spec, cache, cache),
            # Pallas calls carry no varying-manual-axes annotations for the checker to follow.
            check_vma=False,
        )
        return fn(q, k, v, k_pages, v_pages, md)

    return attn


def make_attention_fn(
    cfg: ModelConfig, impl: str, interpret: bool, mesh: Mesh | None = None, **extra: Any
) -> AttentionFn:
    """The per-layer attention the model calls; sharded over `mesh`'s model and seq axes when it has them."""
    resolve_impl(impl)  # validate only: "auto" is resolved per call, where the kernel can fall back
    sm_scale = extra.pop("sm_scale", attention_scale(cfg))
    local = functools.partial(_write_and_attend, impl=impl, interpret=interpret, sm_scale=sm_scale,
                              attend=_attend_apart() if attention_apart(mesh) else _attend, **extra)
    if mesh is None or (attention_parallel_size(cfg, mesh) == 1 and axis_size(mesh, SEQ) == 1):
        local.takes_written = True  # one device's whole step: `written=True` may skip the write (models.common)
        return local
    return _sharded(local, mesh, cfg)


__all__ = ["AttentionFn", "attention_apart", "attention_scale", "kv_rotation", "local_query_metadata", "make_attention_fn"]
