"""Ragged paged attention in jnp shaped for XLA's own code generation: what `impl="auto"` runs on a CPU.

Same semantics as the reference (reference.py, the specification); a different order of work. The reference
walks the sequences one at a time and, inside each, a chunk of up to 64 query rows. A decoding sequence has
one query row, so in a decode step it paid for a whole chunk per sequence, in a loop of S iterations per layer:
on SmolLM2-135M at 32 sequences on 2 CPU cores that loop was ~215 of the 276 ms of a decode step.

Here the last query token of every sequence (in a decode step, its only token) is attended for all sequences
at once: one gather of each sequence's next block of pages, batched einsums over [S, ...] and an online
softmax over kv blocks, for as many blocks as the longest sequence needs. The last token sits at position
kv_len - 1, so it sees every kv position below kv_len (inside the sliding window when there is one) and needs
no causal mask. The other query tokens (those of prefill chunks) then run the reference's per-sequence loop,
over only the sequences that have them: a decode-only step does no loop at all.

Block size: the batched pass gathers BLOCK_PAGES pages per sequence per iteration, [S, BLOCK_PAGES * R, K, H]
for K and for V. 2 pages was the fastest of 1, 2, 4 and 8 on 2 CPU cores (SmolLM2's K = 3, H = 64, R = 16) at
1 to 128 sequences of 33 to 2,000 tokens: 0.77 ms per layer at 32 sequences of 33-96 tokens, against 2.5 ms
with the reference's 8-page blocks, whose [32, 128, 3, 64] fp32 gathers (3 MiB a side) overflow the core's
cache, and 1.5 ms with 1 page (twice the iterations). Memory stays one block per sequence whatever the lengths.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.reference import (
    MASK_VALUE, QuantizedPages, attend_sequence, dequantize_pages, pad_to_blocks, soft_cap_logits,
    split_pages)

BLOCK_PAGES = 2  # pages per sequence per iteration of the batched pass (module docstring)


def _live(cu_q_lens: jax.Array, num_seqs: jax.Array) -> jax.Array:
    """[S] bool: the sequence slots in use that have at least one query token this step."""
    return (jnp.arange(cu_q_lens.shape[0] - 1) < num_seqs[0]) & (cu_q_lens[1:] > cu_q_lens[:-1])


def _gather_blocks(pages: jax.Array | QuantizedPages, block_pages: jax.Array, scale: float | None) -> jax.Array:
    """Every sequence's block of the cache as fp32: page ids [S, B] -> [S, B*R, K, H]."""
    s, b = block_pages.shape
    values, row_scales = split_pages(pages)
    flat = block_pages.reshape(s * b)  # [S*B]
    blocks = dequantize_pages(values[flat], scale, None if row_scales is None else row_scales[flat])  # [S*B, R, K, H]
    _, r, k, h = blocks.shape
    return blocks.reshape(s, b * r, k, h)  # [S, B*R, K, H]


def last_token_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                         sliding_window=None, soft_cap=None, k_scale=None, v_scale=None) -> jax.Array:
    """The attention output of each sequence's last query token, all sequences at once: [S, N, H] fp32
    (zeros for sequences past num_seqs or without a query token). page_indices must be padded to a multiple
    of BLOCK_PAGES (reference.pad_to_blocks pads to a multiple of 8)."""
    num_tokens, num_heads, head_dim = q.shape
    num_slots = kv_lens.shape[0]
    page_size, kv_heads = k_pages.shape[1], k_pages.shape[2]
    group = num_heads // kv_heads
    block = BLOCK_PAGES * page_size
    lens = jnp.where(_live(cu_q_lens, num_seqs), kv_lens, 0)  # [S]
    rows = jnp.clip(cu_q_lens[1:] - 1, 0, num_tokens - 1)  # [S] each sequence's last token
    q_last = q[rows].astype(jnp.float32).reshape(num_slots, kv_heads, group, head_dim)  # [S, K, G, H]
    q_pos = lens - 1  # [S]

    def body(b, carry):
        m, l, acc = carry  # [S, K, G], [S, K, G], [S, K, G, H]
        block_pages = jax.lax.dynamic_slice_in_dim(page_indices, b * BLOCK_PAGES, BLOCK_PAGES, axis=1)  # [S, B]
        k_blk = _gather_blocks(k_pages, block_pages, k_scale)  # [S, L, K, H]
        v_blk = _gather_blocks(v_pages, block_pages, v_scale)  # [S, L, K, H]
        logits = soft_cap_logits(jnp.einsum("skgh,slkh->skgl", q_last, k_blk) * sm_scale, soft_cap)  # [S, K, G, L]
        kv_pos = b * block + jnp.arange(block, dtype=jnp.int32)  # [L]
        mask = kv_pos[None, :] < lens[:, None]  # [S, L]: below the length is at or before the last token
        if sliding_window is not None:
            mask &= kv_pos[None, :] > q_pos[:, None] - sliding_window
        mask = mask[:, None, None, :]  # [S, 1, 1, L]
        logits = jnp.where(mask, logits, MASK_VALUE)
        m_new = jnp.maximum(m, logits.max(axis=-1))  # [S, K, G]
        probs = jnp.where(mask, jnp.exp(logits - m_new[..., None]), 0.0)  # [S, K, G, L]
        alpha = jnp.exp(m - m_new)  # [S, K, G] rescales what earlier blocks accumulated
        acc = acc * alpha[..., None] + jnp.einsum("skgl,slkh->skgh", probs, v_blk)  # [S, K, G, H]
        return m_new, l * alpha + probs.sum(axis=-1), acc

    stats = jnp.full((num_slots, kv_heads, group), MASK_VALUE, jnp.float32)  # [S, K, G]
    init = (stats, jnp.zeros_like(stats), jnp.zeros((num_slots, kv_heads, group, head_dim), jnp.float32))
    num_blocks = (jnp.max(lens) + block - 1) // block
    _, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]  # [S, K, G, H]; a dead sequence has l = 0 and acc = 0
    return out.reshape(num_slots, num_heads, head_dim)  # [S, N, H]


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
    """Ragged paged attention (the reference's contract); returns [T, N, H] in q.dtype, zeros on padding rows."""
    kwargs = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale,
                  v_scale=v_scale)
    page_indices = pad_to_blocks(page_indices)  # [S, M']
    num_tokens = q.shape[0]
    last = last_token_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **kwargs)
    live = _live(cu_q_lens, num_seqs)  # [S]
    rows = jnp.where(live, cu_q_lens[1:] - 1, num_tokens)  # [S]; a dead sequence's row is dropped
    out = jnp.zeros(q.shape, jnp.float32).at[rows].set(last, mode="drop")  # [T, N, H]
    # Sequences with more than one query token, first (a stable sort keeps their order), and how many.
    chunked = live & (cu_q_lens[1:] - cu_q_lens[:-1] > 1)  # [S]
    order = jnp.argsort(~chunked, stable=True)  # [S]
    body = lambda i, out: attend_sequence(order[i], out, q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens,
                                          **kwargs)
    out = jax.lax.fori_loop(0, jnp.sum(chunked), body, out)
    return out.astype(q.dtype)
