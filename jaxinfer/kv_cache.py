"""The paged KV cache pytree (layout: docs/ARCHITECTURE.md) and its allocation on the mesh.

`kv_cache_dtype` "int8" / "fp8" stores each layer's K and V as `QuantizedPages`: int8 or e4m3 values
plus one fp32 scale per token and KV head (pallas_kernels.ragged_paged_attention.reference explains
the choice), quantized as they are written and dequantized inside the attention kernels. They hold keys
and values in a rotated basis (jaxinfer.attention.kv_rotation), so only attention reads them as they are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh, NamedSharding

from jaxinfer.config import ModelConfig
from jaxinfer.sharding import Logical, ShardingRules, attention_parallel_size, cache_heads
from pallas_kernels.ragged_paged_attention.reference import QuantizedPages

CACHE_AXES = (Logical.PAGES, Logical.PAGE_SLOT, Logical.KV_CACHE_HEADS, Logical.HEAD_DIM)
SCALE_AXES = (Logical.PAGES, Logical.KV_CACHE_HEADS, Logical.PAGE_SLOT)  # QuantizedPages.scales [P, K, R]
QUANTIZED_KV = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
FLOAT_KV = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}


def kv_storage(kv_cache_dtype: str, model_dtype: jnp.dtype) -> tuple[jnp.dtype, bool]:
    """(values dtype, quantized) for a kv_cache_dtype setting ("auto": the model dtype)."""
    if kv_cache_dtype in QUANTIZED_KV:
        return jnp.dtype(QUANTIZED_KV[kv_cache_dtype]), True
    return jnp.dtype(FLOAT_KV.get(kv_cache_dtype, model_dtype)), False


@struct.dataclass
class KVCache:
    k: tuple[jax.Array | QuantizedPages, ...]  # L x [P, R, K, H]
    v: tuple[jax.Array | QuantizedPages, ...]  # L x [P, R, K, H]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]


def bytes_per_page(cfg: ModelConfig, page_size: int, dtype: jnp.dtype, mesh: Mesh | None = None,
                   quantized: bool = False) -> int:
    """Bytes one page costs on each device of `mesh`, across all layers (K and V); the whole page without one.
    Quantized pages add their fp32 scales, one per token and head."""
    heads_per_device = cache_heads(cfg, mesh) // attention_parallel_size(cfg, mesh)
    per_row = cfg.head_size * jnp.dtype(dtype).itemsize + (4 if quantized else 0)
    return 2 * cfg.num_layers * page_size * heads_per_device * per_row


def cache_sharding(mesh: Mesh, rules: ShardingRules) -> NamedSharding:
    return rules.sharding(mesh, CACHE_AXES)


def cache_shardings(cache: KVCache, mesh: Mesh, rules: ShardingRules) -> KVCache:
    """The sharding of every leaf of `cache` (values and, for quantized pages, their scales)."""
    values, scales = rules.sharding(mesh, CACHE_AXES), rules.sharding(mesh, SCALE_AXES)

    def layer(pages: jax.Array | QuantizedPages) -> NamedSharding | QuantizedPages:
        return QuantizedPages(values, scales) if isinstance(pages, QuantizedPages) else values

    return KVCache(k=tuple(layer(p) for p in cache.k), v=tuple(layer(p) for p in cache.v))


def allocate_kv_cache(
    cfg: ModelConfig, num_pages: int, page_size: int, dtype: jnp.dtype, mesh: Mesh, rules: ShardingRules,
    quantized: bool = False,
) -> KVCache:
    """Zeroed cache created directly with its sharding: split by head over `tensor` (replicated KV heads
    count once per device that keeps one, see jaxinfer.sharding.HeadLayout). `quantized`: `dtype` is int8
    or float8_e4m3fn and every layer is QuantizedPages (values and per-token scales)."""
    heads = cache_heads(cfg, mesh)
    shape = (num_pages, page_size, heads, cfg.head_size)  # [P, R, Kc, H]
    make = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=cache_sharding(mesh, rules))
    if quantized:
        make_scales = jax.jit(lambda: jnp.zeros((num_pages, heads, page_size), jnp.float32),  # [P, Kc, R]
                              out_shardings=rules.sharding(mesh, SCALE_AXES))
        layer = lambda: QuantizedPages(make(), make_scales())  # noqa: E731
    else:
        layer = make
    return KVCache(k=tuple(layer() for _ in range(cfg.num_layers)), v=tuple(layer() for _ in range(cfg.num_layers)))
