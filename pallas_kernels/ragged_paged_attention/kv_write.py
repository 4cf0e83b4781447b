"""A step's keys and values written into their cache pages in place, both in one Pallas Triton kernel.

    k_pages, v_pages = write_kv_pages(k_pages [P, R, K, H], v_pages, k [T, K, H], v [T, K, H], slot_mapping [T])

Token t's rows go to (page, offset) = divmod(slot_mapping[t], R) of each cache; the pages are aliased to the
outputs, so nothing else of the cache is read or written. The same result as two scatters (jaxinfer.models.common
write_kv's for T > 1) when no two tokens share a slot; padding tokens, which share slots of the trash page, leave
whichever of their rows lands last there, which nobody reads.

Why a kernel: XLA runs the two scatters as two launches in every layer (one H200, Qwen3-30B-A3B's batch-1 decode:
2.0 + 1.6 us a layer, each moving 1 KB); one program per token stores both of its rows (1.5 us). Not in the engine's
path: a custom call's operands are buffers of their own, so k's RoPE and the slice of v out of the joined q/k/v
product, which XLA had fused into the scatters, became two kernels of their own (1.2 + 1.2 us) and the iteration did
not move (scripts/moe_b1_variants.py's "merge_kv"; docs/benchmarks/moe_b1_fusion_h200_2026-11-28c.json). It would pay
where k and v arrive as whole buffers, or with the RoPE inside it.

Triton blocks are powers of two, so the kernel takes power-of-two K * H rows (`takes`) of a 16-bit cache.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Decode buckets: a program per token; longer steps (prefill) keep XLA's scatter, which spreads a token's row
# over many threads.
MAX_TOKENS = 256


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def takes(pages: jax.Array | jax.ShapeDtypeStruct, new: jax.Array | jax.ShapeDtypeStruct) -> bool:
    """Whether the kernel writes `new` [T, K, H] into `pages` [P, R, K, H]: a plain 16-bit cache of new's dtype,
    power-of-two K and H, at most MAX_TOKENS tokens."""
    if not isinstance(pages, jax.Array | jax.ShapeDtypeStruct) or pages.ndim != 4:
        return False  # QuantizedPages keep the scatters (values and scales)
    _, _, kv_heads, head_dim = pages.shape
    return (pages.dtype in (jnp.bfloat16, jnp.float16) and new.dtype == pages.dtype and _pow2(kv_heads)
            and _pow2(head_dim) and new.shape[1:] == pages.shape[2:] and new.shape[0] <= MAX_TOKENS)


def _kernel(slots_ref, k_ref, v_ref, k_in, v_in, k_out, v_out, *, page_size: int):
    # slots_ref [T] i32; k_ref, v_ref [T, K, H]; k_in, v_in: the caches, aliased to k_out, v_out [P, R, K, H].
    import jax.experimental.pallas as pl

    del k_in, v_in
    t = pl.program_id(0)
    slot = slots_ref[t]
    page, offset = slot // page_size, slot % page_size
    k_out[page, offset] = k_ref[t]  # [K, H]
    v_out[page, offset] = v_ref[t]


@functools.partial(jax.jit, static_argnames=("interpret",))
def write_kv_pages(k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array,
                   *, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """(k_pages, v_pages) with token t's k[t], v[t] [K, H] at flat slot slot_mapping[t] (module docstring)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as plt

    if not (takes(k_pages, k) and takes(v_pages, v)):
        raise ValueError(f"the KV write kernel takes 16-bit pages with power-of-two K and H and at most {MAX_TOKENS} "
                         f"tokens of their dtype, got pages {k_pages.shape} {k_pages.dtype}, new {k.shape} {k.dtype}")
    num_tokens = k.shape[0]
    return pl.pallas_call(
        functools.partial(_kernel, page_size=k_pages.shape[1]),
        out_shape=(jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype), jax.ShapeDtypeStruct(v_pages.shape,
                                                                                             v_pages.dtype)),
        grid=(num_tokens,),
        input_output_aliases={3: 0, 4: 1},
        compiler_params=plt.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret, name="kv_write",
    )(slot_mapping.astype(jnp.int32), k, v, k_pages, v_pages)
