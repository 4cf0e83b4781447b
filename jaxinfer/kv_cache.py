"""The paged KV cache pytree (layout: docs/ARCHITECTURE.md) and its allocation on the mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh, NamedSharding

from jaxinfer.config import ModelConfig
from jaxinfer.sharding import Logical, ShardingRules, attention_parallel_size, cache_heads

CACHE_AXES = (Logical.PAGES, Logical.PAGE_SLOT, Logical.KV_CACHE_HEADS, Logical.HEAD_DIM)


@struct.dataclass
class KVCache:
    k: tuple[jax.Array, ...]  # L x [P, R, K, H]
    v: tuple[jax.Array, ...]  # L x [P, R, K, H]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]


def bytes_per_page(cfg: ModelConfig, page_size: int, dtype: jnp.dtype, mesh: Mesh | None = None) -> int:
    """Bytes one page costs on each device of `mesh`, across all layers (K and V); the whole page without one."""
    heads_per_device = cache_heads(cfg, mesh) // attention_parallel_size(cfg, mesh)
    return 2 * cfg.num_layers * page_size * heads_per_device * cfg.head_size * jnp.dtype(dtype).itemsize


def cache_sharding(mesh: Mesh, rules: ShardingRules) -> NamedSharding:
    return rules.sharding(mesh, CACHE_AXES)


def allocate_kv_cache(
    cfg: ModelConfig, num_pages: int, page_size: int, dtype: jnp.dtype, mesh: Mesh, rules: ShardingRules
) -> KVCache:
    """Zeroed cache created directly with its sharding: split by head over `tensor` (replicated KV heads
    count once per device that keeps one, see jaxinfer.sharding.HeadLayout)."""
    shape = (num_pages, page_size, cache_heads(cfg, mesh), cfg.head_size)  # [P, R, Kc, H]
    sharding = cache_sharding(mesh, rules)
    make = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return KVCache(
        k=tuple(make() for _ in range(cfg.num_layers)),
        v=tuple(make() for _ in range(cfg.num_layers)),
    )
