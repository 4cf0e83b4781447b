"""Paged attention as the models call it: write this step's keys and values into the cache, then attend.

`make_attention_fn` binds the kernel choice and the static settings once per runner. The model calls the
result once per layer with the new q/k/v and that layer's cache pages and gets the attention output and
the updated pages back:

    out [T, N, H], k_pages, v_pages = attn(q [T, N, H], k [T, K, H], v [T, K, H], k_pages, v_pages, md)

Why the write lives here and not in the model: under tensor parallelism both the scatter into the cache
and the kernel must run per device, on that device's heads and its shard of the pages. A Pallas kernel is
an opaque custom call to XLA's SPMD partitioner, which can only run it replicated: it would all-gather the
whole KV cache and the queries onto every device every layer (that made TP=2 23x slower than one GPU and
ran out of memory compiling). So with a mesh whose `tensor` axis is larger than one, the write and the
kernel run inside one `jax.shard_map` over `tensor`: queries split by head, the cache split by head
(`HeadLayout`), metadata replicated, no collective inside. The jnp reference goes through the same
wrapper, so CPU tests exercise the sharded path the kernels take.

When KV heads are replicated (fewer KV heads than devices), the k/v projections are computed whole on
every device (the weights are small) and each device keeps the one KV head its query heads read.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec as P

from jaxinfer.config import ModelConfig
from jaxinfer.models.common import AttentionFn, AttentionMetadata, write_kv
from jaxinfer.sharding import HeadLayout, axis_size, head_layout
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, resolve_impl

TENSOR = "tensor"
HEADS_SPEC = P(None, TENSOR, None)  # [T, heads, H] split by head
CACHE_SPEC = P(None, None, TENSOR, None)  # [P, R, K, H] split by head


def attention_scale(cfg: ModelConfig) -> float:
    # Gemma 3 scales queries by 1/sqrt(query_pre_attn_scalar), which differs from head_dim on the 27B.
    return (cfg.query_pre_attn_scalar or cfg.head_size) ** -0.5


def _write_and_attend(
    q: jax.Array, k: jax.Array, v: jax.Array, k_pages: jax.Array, v_pages: jax.Array, md: AttentionMetadata,
    *, impl: str, interpret: bool, sm_scale: float, **layer: Any,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One device's (or the whole unsharded) step: scatter k/v [T, K, H] into the pages, attend [T, N, H]."""
    k_pages, v_pages = write_kv(k_pages, v_pages, k, v, md.slot_mapping)
    out = ragged_paged_attention(
        q, k_pages, v_pages, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs,
        sm_scale=sm_scale, impl=impl, interpret=interpret, **layer,
    )
    return out, k_pages, v_pages


def _own_kv_head(x: jax.Array, replicas: int) -> jax.Array:
    """[T, K, H] whole on every device -> [T, 1, H]: the KV head this device's query heads read.

    Device d of the tensor axis holds query heads d*N/tp .. (d+1)*N/tp - 1, all inside group d // replicas.
    """
    head = jax.lax.axis_index(TENSOR) // replicas
    return jax.lax.dynamic_slice_in_dim(x, head, 1, axis=1)  # [T, 1, H]


def _sharded(local: AttentionFn, mesh: Mesh, layout: HeadLayout) -> AttentionFn:
    """Run `local` per device over `tensor`: heads and cache split, metadata replicated."""
    kv_spec = HEADS_SPEC if layout.kv_sharded else P()

    def per_device(q, k, v, k_pages, v_pages, md, **layer):
        if not layout.kv_sharded:
            k, v = _own_kv_head(k, layout.kv_replicas), _own_kv_head(v, layout.kv_replicas)
        return local(q, k, v, k_pages, v_pages, md, **layer)

    def attn(q, k, v, k_pages, v_pages, md, **layer):
        fn = jax.shard_map(
            functools.partial(per_device, **layer), mesh=mesh,
            in_specs=(HEADS_SPEC, kv_spec, kv_spec, CACHE_SPEC, CACHE_SPEC, P()),
            out_specs=(HEADS_SPEC, CACHE_SPEC, CACHE_SPEC),
            # Pallas calls carry no varying-manual-axes annotations for the checker to follow.
            check_vma=False,
        )
        return fn(q, k, v, k_pages, v_pages, md)

    return attn


def make_attention_fn(
    cfg: ModelConfig, impl: str, interpret: bool, mesh: Mesh | None = None, **extra: Any
) -> AttentionFn:
    """The per-layer attention the model calls; sharded over `mesh`'s tensor axis when it has one."""
    impl = resolve_impl(impl)  # resolve now: the platform is fixed for the runner's lifetime
    sm_scale = extra.pop("sm_scale", attention_scale(cfg))
    local = functools.partial(_write_and_attend, impl=impl, interpret=interpret, sm_scale=sm_scale, **extra)
    tp = 1 if mesh is None else axis_size(mesh, TENSOR)
    if tp == 1:
        return local
    return _sharded(local, mesh, head_layout(cfg, tp))


__all__ = ["AttentionFn", "attention_scale", "make_attention_fn"]
