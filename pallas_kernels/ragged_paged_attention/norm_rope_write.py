"""A decode step's q/k heads normed and rotated, and its keys and values written into their cache pages, in one
Pallas Triton kernel (Qwen3's attention on a GPU; Llama's, without the norm).

    q [T, N, H], k_pages, v_pages = norm_rope_write(parts [S, T, (N + 2K) * H], q_norm [H], k_norm [H],
                                                    positions [T], inv_freq [H/2], slot_mapping [T],
                                                    k_pages [P, R, K, H], v_pages, num_q_heads=N, eps=eps)

`parts` is the joined q/k/v product (q heads, then k heads, then v heads) as S float32 partial products over slices
of the model dimension (qwen3.split_k_product), or S = 1 whole product. For token t the kernel computes what the
models' XLA path does, in float32 from the partials to the rounding of its outputs to the pages' dtype: the partials
summed; each q and k head RMSNormed with its weight (`eps=None`: no norm, for Llama); RoPE (rotate-half, angles
positions[t] * inv_freq); then k's and v's [K, H] rows stored at (page, offset) = divmod(slot_mapping[t], R) of the
aliased pages, and q's [N, H] returned. XLA:GPU keeps that excess precision too (it drops a round trip through bf16
between fusions), so on a GPU the kernel rounds where XLA's path does; XLA:CPU rounds between the steps as the code
is written, a few bf16 ulps apart. Padding tokens carry slots in the trash page 0, whose rows nobody reads.

Why a kernel: in Qwen3-30B-A3B's batch-1 decode loop on an H200, XLA ran this as four launches a layer, each moving a
few KB (the joined QK-norm with the partials' sum, q's RoPE, the K write with k's RoPE, the V write: ~1.5 + 1.0 +
2.0 + 1.6 us; docs/PERFORMANCE.md, "thirtieth session"); the step's cost there is launches and their dependent
latency, not bytes. One launch does all of it, a program per token and head.

Triton blocks are powers of two, so the kernel takes power-of-two N, K and H (`takes`) and a 16-bit cache.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.kv_write import _pow2  # the sibling write kernel's power-of-two check

MAX_TOKENS = 8  # decode buckets (longer steps are not bound by launches)
NUM_WARPS = 1  # per program: one head's H values (read when the kernel is traced)


def takes(pages: jax.Array | jax.ShapeDtypeStruct, num_tokens: int, num_q_heads: int) -> bool:
    """Whether the kernel writes a step of `num_tokens` tokens with `num_q_heads` q heads into `pages` [P, R, K, H]:
    a plain 16-bit cache, power-of-two N, K and H, at most MAX_TOKENS tokens."""
    if not isinstance(pages, jax.Array | jax.ShapeDtypeStruct) or pages.ndim != 4:
        return False  # QuantizedPages keep XLA's path (values and scales)
    _, _, kv_heads, head_dim = pages.shape
    return (pages.dtype in (jnp.bfloat16, jnp.float16) and _pow2(num_q_heads) and _pow2(kv_heads)
            and _pow2(head_dim) and head_dim >= 4 and 1 <= num_tokens <= MAX_TOKENS)


def _kernel(pos_ref, slots_ref, parts_ref, qw_ref, kw_ref, freq_ref, k_in, v_in, q_out, k_out, v_out, *,
            num_splits: int, n: int, kv: int, half: int, eps: float | None, page_size: int):
    # One program per (token t, head h of the product's N + 2K): pos_ref, slots_ref [T] i32; parts_ref
    # [S, T, N + 2K, H]; qw_ref, kw_ref [H]; freq_ref [H/2] f32; k_in, v_in: the caches, aliased to k_out, v_out
    # [P, R, K, H]; q_out [T, N, H]. Every program computes the (norm and) rotation and stores only to where its
    # head belongs (masked stores: no branch); a v head stores its product as it is.
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as plt

    del k_in, v_in
    t, h = pl.program_id(0), pl.program_id(1)
    dtype = k_out.dtype
    lo, hi = pl.ds(0, half), pl.ds(half, half)
    f32 = jnp.float32

    def summed(cols) -> jax.Array:  # [H/2]: the partials summed in float32
        return sum(parts_ref[s, t, h, cols].astype(f32) for s in range(num_splits))

    a, b = summed(lo), summed(hi)  # the head's two halves [H/2]
    is_q, is_v = h < n, h >= n + kv
    na, nb = a, b
    if eps is not None:  # QK-norm
        w_a = jnp.where(is_q, qw_ref[lo].astype(f32), kw_ref[lo].astype(f32))  # [H/2]
        w_b = jnp.where(is_q, qw_ref[hi].astype(f32), kw_ref[hi].astype(f32))
        inv = jax.lax.rsqrt((jnp.sum(a * a) + jnp.sum(b * b)) / (2 * half) + eps)
        na, nb = a * inv * w_a, b * inv * w_b  # RMSNorm's output [H/2] each
    angles = pos_ref[t].astype(f32) * freq_ref[...]  # [H/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    out_a = jnp.where(is_v, a, na * cos - nb * sin).astype(dtype)
    out_b = jnp.where(is_v, b, nb * cos + na * sin).astype(dtype)

    slot = slots_ref[t]
    page, offset = slot // page_size, slot % page_size
    mask = lambda cond: jnp.full((half,), cond)  # noqa: E731
    q_head = jnp.minimum(h, n - 1)  # indices kept in bounds where the store is masked off
    k_head, v_head = jnp.clip(h - n, 0, kv - 1), jnp.clip(h - n - kv, 0, kv - 1)
    for cols, out in ((lo, out_a), (hi, out_b)):
        plt.store(q_out.at[t, q_head, cols], out.astype(q_out.dtype), mask=mask(is_q))
        plt.store(k_out.at[page, offset, k_head, cols], out, mask=mask(~is_q & ~is_v))
        plt.store(v_out.at[page, offset, v_head, cols], out, mask=mask(is_v))


@functools.partial(jax.jit, static_argnames=("num_q_heads", "eps", "interpret"))
def norm_rope_write(parts: jax.Array, q_norm: jax.Array | None, k_norm: jax.Array | None, positions: jax.Array,
                    inv_freq: jax.Array, slot_mapping: jax.Array, k_pages: jax.Array, v_pages: jax.Array, *,
                    num_q_heads: int, eps: float | None, interpret: bool = False,
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(q [T, N, H], k_pages, v_pages) for the joined product's partials `parts` [S, T, (N + 2K) * H] (module
    docstring). eps None: no QK-norm (q_norm and k_norm None), only the rotation and the write (Llama)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as plt

    num_splits, num_tokens, width = parts.shape
    _, page_size, kv_heads, head_dim = k_pages.shape
    n = num_q_heads
    if not (takes(k_pages, num_tokens, n) and v_pages.shape == k_pages.shape and v_pages.dtype == k_pages.dtype
            and width == (n + 2 * kv_heads) * head_dim):
        raise ValueError(f"norm_rope_write takes 16-bit pages with power-of-two q heads, kv heads and head dim, at "
                         f"most {MAX_TOKENS} tokens and a product of (N + 2K) * H columns; got pages "
                         f"{k_pages.shape} {k_pages.dtype}, {n} q heads, product {parts.shape}")
    heads = parts.reshape(num_splits, num_tokens, n + 2 * kv_heads, head_dim)  # [S, T, N + 2K, H]
    if eps is None:  # the kernel reads no norm weight; its operands still need arrays
        q_norm = k_norm = jnp.ones((head_dim,), k_pages.dtype)
    return pl.pallas_call(
        functools.partial(_kernel, num_splits=num_splits, n=n, kv=kv_heads, half=head_dim // 2,
                          eps=None if eps is None else float(eps),
                          page_size=page_size),
        out_shape=(jax.ShapeDtypeStruct((num_tokens, n, head_dim), k_pages.dtype),
                   jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)),
        grid=(num_tokens, n + 2 * kv_heads),
        input_output_aliases={6: 1, 7: 2},
        compiler_params=plt.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret, name="norm_rope_write",
    )(positions.astype(jnp.int32), slot_mapping.astype(jnp.int32), heads, q_norm, k_norm,
      inv_freq.astype(jnp.float32), k_pages, v_pages)
