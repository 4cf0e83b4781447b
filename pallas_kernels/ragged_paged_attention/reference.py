"""Ragged paged attention in plain jnp: the specification every kernel is tested against.

Layout and metadata are those of docs/ARCHITECTURE.md: queries are token-major and ragged over
sequences (`cu_q_lens`), the KV cache is paged (`k_pages[P, R, K, H]`) and addressed through a
per-sequence page table. The new tokens of sequence s sit at the end of its kv range, so token i of
them has absolute position `kv_lens[s] - q_len_s + i` and sees kv positions `0 .. that position`
(only the last `sliding_window` of those when a window is given).

Memory and work: the reference walks the sequences with a `fori_loop`, inside one sequence its query
tokens in chunks of `_Q_CHUNK`, and for each chunk the sequence's kv in blocks of `KV_BLOCK_PAGES`
pages with an online (flash-style) softmax, stopping at the last block below kv_len. So only one block
of pages and one chunk's block of logits are live at a time, and the work follows the real lengths,
not the page table's width.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

# Query tokens handled at once inside one sequence. Small enough that the logits of a chunk stay
# far below the cache itself, large enough that prefill does not loop per token.
_Q_CHUNK = 64
# Pages per kv block of the online softmax; a sequence costs ceil(kv_len / (block * R)) iterations.
KV_BLOCK_PAGES = 8
MASK_VALUE = -1e30


KV_QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


@functools.partial(jax.tree_util.register_dataclass, data_fields=["values", "scales"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class QuantizedPages:
    """One layer's K (or V) pages stored int8 / e4m3 with a scale per token and KV head.

    values [P, R, K, H] int8 | float8_e4m3fn: the page layout of docs/ARCHITECTURE.md;
    scales [P, K, R] fp32: position r of page p, head k is `values[p, r, k, :] * scales[p, k, r]`.
    The scales are head-major inside a page so a (page, head) row is R contiguous floats: the GPU
    kernel copies it with one TMA beside the `[R, H]` box of values, the TPU kernel with the page's DMA.
    Why per token and head (not one scale per tensor or per page): keys carry a few outlier channels
    whose size varies from token to token and head to head, so one scale wide enough for the largest
    would leave typical tokens a handful of int8 levels; a row's own absmax keeps every row's rounding
    error under 1/254 of that row's largest value. It costs 4 bytes per 128 (H = 128), and the write
    needs no read of what the page already holds (a token's scale depends on that token alone).
    """

    values: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def dtype(self) -> jnp.dtype:
        return self.values.dtype

    @property
    def sharding(self):
        return self.values.sharding


def quantize_kv(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """New keys or values [T, K, H] -> (codes [T, K, H] in `dtype`, scales [T, K] fp32): absmax per row."""
    x32 = x.astype(jnp.float32)
    qmax = KV_QMAX[jnp.dtype(dtype)]
    scale = jnp.max(jnp.abs(x32), axis=-1) / qmax  # [T, K]
    safe = jnp.where(scale > 0, scale, 1.0)
    y = x32 / safe[..., None]
    if jnp.dtype(dtype) == jnp.int8:
        y = jnp.clip(jnp.round(y), -qmax, qmax)
    return y.astype(dtype), scale


def split_pages(pages) -> tuple[jax.Array, jax.Array | None]:
    """(values, per-token scales or None) of plain or QuantizedPages."""
    if isinstance(pages, QuantizedPages):
        return pages.values, pages.scales
    return pages, None


def dequantize_pages(pages: jax.Array, scale: float | None, row_scales: jax.Array | None = None) -> jax.Array:
    """fp32 view of a (possibly int8/fp8) KV block [B, R, K, H]: value * scale, or value * its row's
    scale (row_scales [B, K, R], QuantizedPages)."""
    x = pages.astype(jnp.float32)
    if row_scales is not None:
        x = x * jnp.swapaxes(row_scales, 1, 2)[..., None]  # [B, R, K, 1]
    return x if scale is None else x * jnp.float32(scale)


def soft_cap_logits(logits: jax.Array, soft_cap: float | None) -> jax.Array:
    """Gemma-style logit capping, applied after the softmax scale and before masking."""
    if soft_cap is None:
        return logits
    return soft_cap * jnp.tanh(logits / soft_cap)


def attention_mask(q_pos: jax.Array, kv_pos: jax.Array, kv_len: jax.Array,
                   sliding_window: int | None) -> jax.Array:
    """Which (query, key) pairs may attend: causal, inside the kv length, inside the window.

    q_pos: [Q] absolute query positions, kv_pos: [C] key positions -> [Q, C] bool.
    """
    q = q_pos[:, None]  # [Q, 1]
    kv = kv_pos[None, :]  # [1, C]
    mask = (kv <= q) & (kv < kv_len)
    if sliding_window is not None:
        mask &= kv > q - sliding_window
    return mask


def _kv_block(pages, block_row: jax.Array, scale: float | None) -> jax.Array:
    """One block of a sequence's cache as fp32: [B] page ids -> [B*R, K, H]."""
    values, row_scales = split_pages(pages)
    block = dequantize_pages(values[block_row], scale, None if row_scales is None else row_scales[block_row])
    b, r, k, h = block.shape
    return block.reshape(b * r, k, h)  # [B*R, K, H]


def _attend_chunk(q_chunk, k_pages, v_pages, page_row, q_pos, row_valid, kv_len, *, sm_scale,
                  sliding_window, soft_cap, k_scale, v_scale):
    """Attention of one chunk of query rows over one sequence's cache, block by block.

    q_chunk [C, N, H], page_row [M'] (padded to whole blocks), q_pos [C], row_valid [C] -> [C, N, H] fp32.
    The loop runs only over the blocks below kv_len (a dynamic trip count), with an online softmax, so the
    cost follows the sequence's length rather than the page table's width. Invalid rows come out as zeros.
    """
    c, n, h = q_chunk.shape
    kv_heads, page_size = k_pages.shape[2], k_pages.shape[1]  # QuantizedPages has the values' shape
    block_pages = KV_BLOCK_PAGES
    block = block_pages * page_size
    q4 = q_chunk.astype(jnp.float32).reshape(c, kv_heads, n // kv_heads, h)  # [C, K, G, H]

    def body(b, carry):
        m, l, acc = carry  # [C, K, G], [C, K, G], [C, K, G, H]
        block_row = jax.lax.dynamic_slice_in_dim(page_row, b * block_pages, block_pages)  # [B]
        k_blk = _kv_block(k_pages, block_row, k_scale)  # [L, K, H]
        v_blk = _kv_block(v_pages, block_row, v_scale)  # [L, K, H]
        logits = soft_cap_logits(jnp.einsum("ckgh,lkh->ckgl", q4, k_blk) * sm_scale, soft_cap)  # [C, K, G, L]
        kv_pos = b * block + jnp.arange(block, dtype=jnp.int32)  # [L]
        mask = (attention_mask(q_pos, kv_pos, kv_len, sliding_window) & row_valid[:, None])[:, None, None, :]
        logits = jnp.where(mask, logits, MASK_VALUE)
        m_new = jnp.maximum(m, logits.max(axis=-1))  # [C, K, G]
        probs = jnp.where(mask, jnp.exp(logits - m_new[..., None]), 0.0)  # [C, K, G, L]
        alpha = jnp.exp(m - m_new)  # [C, K, G] rescales what earlier blocks accumulated
        acc = acc * alpha[..., None] + jnp.einsum("ckgl,lkh->ckgh", probs, v_blk)  # [C, K, G, H]
        return m_new, l * alpha + probs.sum(axis=-1), acc

    stats = jnp.full((c, kv_heads, n // kv_heads), MASK_VALUE, jnp.float32)  # [C, K, G]
    init = (stats, jnp.zeros_like(stats), jnp.zeros((c, kv_heads, n // kv_heads, h), jnp.float32))
    num_blocks = (kv_len + block - 1) // block
    _, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]  # [C, K, G, H]
    return out.reshape(c, n, h)  # [C, N, H]


def attend_sequence(s, out, q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, *, sm_scale,
                    sliding_window, soft_cap, k_scale, v_scale):
    """Writes the outputs of sequence s into out [T, N, H] (fp32), chunk by chunk."""
    num_tokens = q.shape[0]
    chunk = min(_Q_CHUNK, num_tokens)
    page_row = page_indices[s]  # [M'] already padded to whole kv blocks
    q_start, q_end, kv_len = cu_q_lens[s], cu_q_lens[s + 1], kv_lens[s]
    first_pos = kv_len - (q_end - q_start)

    def chunk_body(i, out):
        # dynamic_slice clamps the start so the chunk stays inside [0, T); the row ids below are
        # computed from the clamped start, so reads and writes stay aligned.
        start = jnp.clip(q_start + i * chunk, 0, num_tokens - chunk)
        rows = start + jnp.arange(chunk, dtype=jnp.int32)  # [C]
        row_valid = (rows >= q_start + i * chunk) & (rows < q_end)
        q_chunk = jax.lax.dynamic_slice_in_dim(q, start, chunk)  # [C, N, H]
        o = _attend_chunk(q_chunk, k_pages, v_pages, page_row, first_pos + rows - q_start, row_valid, kv_len,
                          sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                          k_scale=k_scale, v_scale=v_scale)
        old = jax.lax.dynamic_slice_in_dim(out, start, chunk)  # [C, N, H]
        new = jnp.where(row_valid[:, None, None], o, old)
        return jax.lax.dynamic_update_slice_in_dim(out, new, start, 0)

    num_chunks = (q_end - q_start + chunk - 1) // chunk
    return jax.lax.fori_loop(0, num_chunks, chunk_body, out)


def pad_to_blocks(page_indices: jax.Array) -> jax.Array:
    """[S, M] -> [S, M'] with M' a multiple of the kv block, padded with the trash page (masked anyway)."""
    extra = -page_indices.shape[1] % KV_BLOCK_PAGES
    return jnp.pad(page_indices, ((0, 0), (0, extra))) if extra else page_indices


def ragged_paged_attention(
    q: jax.Array,  # [T, N, H]
    k_pages: jax.Array | QuantizedPages,  # [P, R, K, H]
    v_pages: jax.Array | QuantizedPages,  # [P, R, K, H]
    kv_lens: jax.Array,  # [S] int32
    page_indices: jax.Array,  # [S, M] int32
    cu_q_lens: jax.Array,  # [S+1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> jax.Array:
    """Reference ragged paged attention; returns [T, N, H] in q.dtype (zeros on padding rows)."""
    page_indices = pad_to_blocks(page_indices)  # [S, M']
    body = lambda s, out: attend_sequence(
        s, out, q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale)
    out = jnp.zeros(q.shape, jnp.float32)  # [T, N, H]
    out = jax.lax.fori_loop(0, num_seqs[0], body, out)
    return out.astype(q.dtype)
