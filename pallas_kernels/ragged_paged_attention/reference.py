"""Ragged paged attention in plain jnp: the specification every kernel is tested against.

Layout and metadata are those of docs/ARCHITECTURE.md: queries are token-major and ragged over
sequences (`cu_q_lens`), the KV cache is paged (`k_pages[P, R, K, H]`) and addressed through a
per-sequence page table. The new tokens of sequence s sit at the end of its kv range, so token i of
them has absolute position `kv_lens[s] - q_len_s + i` and sees kv positions `0 .. that position`
(only the last `sliding_window` of those when a window is given).

Memory: the reference walks the sequences with a `fori_loop` and, inside one sequence, walks its
query tokens in chunks of `_Q_CHUNK`. Only one sequence's pages (`[M*R, K, H]`) and one chunk's
logits (`[_Q_CHUNK, K, G, M*R]`) are live at a time, never a per-token gather of the cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Query tokens handled at once inside one sequence. Small enough that the logits of a chunk stay
# far below the cache itself, large enough that prefill does not loop per token.
_Q_CHUNK = 64
_MASK_VALUE = -1e30


def dequantize_pages(pages: jax.Array, scale: float | None) -> jax.Array:
    """fp32 view of a (possibly int8/fp8) KV block: value * scale."""
    x = pages.astype(jnp.float32)
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


def _gather_sequence_kv(pages: jax.Array, page_row: jax.Array, scale: float | None) -> jax.Array:
    """One sequence's cache as a contiguous fp32 block: [M] page ids -> [M*R, K, H]."""
    seq_pages = dequantize_pages(pages[page_row], scale)  # [M, R, K, H]
    m, r, k, h = seq_pages.shape
    return seq_pages.reshape(m * r, k, h)  # [M*R, K, H]


def _attend_chunk(q_chunk, k_seq, v_seq, q_pos, row_valid, kv_len, *, sm_scale,
                  sliding_window, soft_cap):
    """Attention of one chunk of query rows over one sequence's whole cache.

    q_chunk [C, N, H], k_seq/v_seq [L, K, H] fp32, q_pos [C], row_valid [C] -> [C, N, H] fp32.
    Rows that are not valid (other sequences, padding) come out as zeros.
    """
    c, n, h = q_chunk.shape
    kv_heads = k_seq.shape[1]
    q4 = q_chunk.astype(jnp.float32).reshape(c, kv_heads, n // kv_heads, h)  # [C, K, G, H]
    logits = jnp.einsum("ckgh,lkh->ckgl", q4, k_seq) * sm_scale  # [C, K, G, L]
    logits = soft_cap_logits(logits, soft_cap)
    kv_pos = jnp.arange(k_seq.shape[0], dtype=jnp.int32)
    mask = attention_mask(q_pos, kv_pos, kv_len, sliding_window) & row_valid[:, None]  # [C, L]
    logits = jnp.where(mask[:, None, None, :], logits, _MASK_VALUE)
    probs = jnp.exp(logits - logits.max(axis=-1, keepdims=True))  # [C, K, G, L]
    probs = jnp.where(mask[:, None, None, :], probs, 0.0)
    denom = jnp.maximum(probs.sum(axis=-1, keepdims=True), 1e-30)  # [C, K, G, 1]
    out = jnp.einsum("ckgl,lkh->ckgh", probs / denom, v_seq)  # [C, K, G, H]
    return out.reshape(c, n, h)  # [C, N, H]


def _attend_sequence(s, out, q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, *, sm_scale,
                     sliding_window, soft_cap, k_scale, v_scale):
    """Writes the outputs of sequence s into out [T, N, H] (fp32), chunk by chunk."""
    num_tokens = q.shape[0]
    chunk = min(_Q_CHUNK, num_tokens)
    k_seq = _gather_sequence_kv(k_pages, page_indices[s], k_scale)  # [M*R, K, H]
    v_seq = _gather_sequence_kv(v_pages, page_indices[s], v_scale)  # [M*R, K, H]
    q_start, q_end, kv_len = cu_q_lens[s], cu_q_lens[s + 1], kv_lens[s]
    first_pos = kv_len - (q_end - q_start)

    def chunk_body(i, out):
        # dynamic_slice clamps the start so the chunk stays inside [0, T); the row ids below are
        # computed from the clamped start, so reads and writes stay aligned.
        start = jnp.clip(q_start + i * chunk, 0, num_tokens - chunk)
        rows = start + jnp.arange(chunk, dtype=jnp.int32)  # [C]
        row_valid = (rows >= q_start + i * chunk) & (rows < q_end)
        q_chunk = jax.lax.dynamic_slice_in_dim(q, start, chunk)  # [C, N, H]
        o = _attend_chunk(q_chunk, k_seq, v_seq, first_pos + rows - q_start, row_valid, kv_len,
                          sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
        old = jax.lax.dynamic_slice_in_dim(out, start, chunk)  # [C, N, H]
        new = jnp.where(row_valid[:, None, None], o, old)
        return jax.lax.dynamic_update_slice_in_dim(out, new, start, 0)

    num_chunks = (q_end - q_start + chunk - 1) // chunk
    return jax.lax.fori_loop(0, num_chunks, chunk_body, out)


def ragged_paged_attention(
    q: jax.Array,  # [T, N, H]
    k_pages: jax.Array,  # [P, R, K, H]
    v_pages: jax.Array,  # [P, R, K, H]
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
    body = lambda s, out: _attend_sequence(
        s, out, q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale)
    out = jnp.zeros(q.shape, jnp.float32)  # [T, N, H]
    out = jax.lax.fori_loop(0, num_seqs[0], body, out)
    return out.astype(q.dtype)
