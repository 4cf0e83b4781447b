"""Ragged paged attention as a Pallas Mosaic-TPU kernel (also runs in Pallas interpret mode on CPU).

Blocking (see docs/KERNELS.md for the reasoning):

* The grid walks the flat token axis in aligned blocks of `block_q` tokens, so the query and
  output blocks are plain BlockSpecs that Pallas pipelines for us; one block holds all N heads.
* A token block can hold the tail of one sequence, whole short sequences (decodes) and the head of
  the next one. The kernel loops over exactly the sequences that overlap its block (their range is
  precomputed in the wrapper and scalar-prefetched) and, per sequence, over the kv blocks that
  any of its rows may see (causal end, sliding-window start).
* A kv block is `pages_per_block` pages, each copied with one DMA (a page `[R, K, H]` is contiguous
  in the cache) into a double-buffered VMEM slot, so the next block's copy overlaps this block's
  math. Pages past a sequence's page count read page 0 (the trash page) and are masked.
* Rows of one block that belong to different sequences never mix: each row is masked to its own
  sequence, so one online-softmax state ([K, block_q*G] rows) serves every sequence in the block.
* GQA: the G query heads of one kv head are folded into the row axis (`[block_q*G, H]`), so one
  matmul per kv head serves them all and each page is read once for all heads.
* Quantized KV (int8 / fp8): pages are converted to the query dtype in VMEM; `k_scale` folds into
  the softmax scale and `v_scale` into the final normalisation, both exact for scalar scales.
  `QuantizedPages` (a scale per token and KV head) bring their scales `[R]` per (page, head) with one
  more DMA per page beside the values; a key's scale multiplies its logit column and a value's scale
  its probability column before P @ V (sum_j p_j (s_j v_j) = sum_j (p_j s_j) v_j), so the [Bk, H] block
  is never scaled element by element, and int8 / e4m3 codes convert to bf16 exactly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention.reference import split_pages

_MASK_VALUE = -1e30
DEFAULT_BLOCK_Q = 16
DEFAULT_PAGES_PER_BLOCK = 8


def block_sequence_ranges(cu_q_lens: jax.Array, num_seqs: jax.Array, num_tokens: int,
                          block_q: int) -> tuple[jax.Array, jax.Array]:
    """For each token block, the half-open range of sequences whose new tokens overlap it.

    cu_q_lens [S+1], num_seqs [1] -> (first [B], end [B]) int32 with B = num_tokens // block_q.
    """
    num_blocks = num_tokens // block_q
    block_start = jnp.arange(num_blocks, dtype=jnp.int32) * block_q  # [B]
    real = jnp.arange(cu_q_lens.shape[0] - 1) < num_seqs[0]  # [S]
    # Padded sequences get an empty range at +inf so the searches never land on them.
    starts = jnp.where(real, cu_q_lens[:-1], jnp.iinfo(jnp.int32).max)  # [S]
    ends = jnp.where(real, cu_q_lens[1:], jnp.iinfo(jnp.int32).max)  # [S]
    first = jnp.searchsorted(ends, block_start, side="right")  # first s with end > block start
    end = jnp.searchsorted(starts, block_start + block_q, side="left")  # s with start < block end
    return first.astype(jnp.int32), jnp.maximum(end, first).astype(jnp.int32)


def _kv_block_range(first_pos, last_pos, block_kv, sliding_window):
    """kv blocks [lo, hi) that rows with positions first_pos..last_pos may attend to."""
    lo = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)
    return lo // block_kv, (last_pos + block_kv) // block_kv


def _page_copies(pages_hbm, buf, sem, page_table, seq, kv_block, slot, *, pages_per_block,
                 max_pages):
    """The DMAs that bring one kv block (pages_per_block whole pages) into buf[slot]."""
    copies = []
    for p in range(pages_per_block):
        col = jnp.minimum(kv_block * pages_per_block + p, max_pages - 1)
        page = page_table[seq * max_pages + col]
        copies.append(pltpu.make_async_copy(pages_hbm.at[page], buf.at[slot, p], sem.at[slot]))
    return copies


def _online_softmax_step(logits, mask, v, m_ref, l_ref, acc_ref, head, v_cols=None):
    """Folds one kv block into the running (max, sum, acc) of one kv head's rows.

    logits/mask [Rows, Bk], v [Bk, H]; refs indexed by kv head: m/l [K, Rows, 1], acc [K, Rows, H].
    v_cols [1, Bk]: per-token scales of quantized values, applied to p's columns for P @ V only (the
    softmax sum l stays over the unscaled probabilities).
    """
    m_prev = m_ref[head]  # [Rows, 1]
    m_new = jnp.maximum(m_prev, jnp.where(mask, logits, _MASK_VALUE).max(axis=-1, keepdims=True))
    # Masked entries are zeroed explicitly: a row with no visible key yet has m_new == mask value.
    p = jnp.where(mask, jnp.exp(logits - m_new), 0.0)  # [Rows, Bk]
    alpha = jnp.exp(m_prev - m_new)  # [Rows, 1]
    l_ref[head] = alpha * l_ref[head] + p.sum(axis=-1, keepdims=True)
    pv_p = p if v_cols is None else p * v_cols  # [Rows, Bk]
    pv = jnp.dot(pv_p.astype(v.dtype), v, preferred_element_type=jnp.float32)  # [Rows, H]
    acc_ref[head] = alpha * acc_ref[head] + pv
    m_ref[head] = m_new


def _row_positions(block_start, seq_q_start, seq_q_end, seq_kv_len, rows, group):
    """Absolute positions and ownership of the block's rows for one sequence.

    Row r of a block is (token r // G, head r % G). Returns pos [Rows, 1], in_seq [Rows, 1].
    """
    token = block_start + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // group  # [Rows, 1]
    in_seq = (token >= seq_q_start) & (token < seq_q_end)
    pos = seq_kv_len - (seq_q_end - seq_q_start) + (token - seq_q_start)
    return pos, in_seq


def _unpack_refs(refs, quantized):
    """The kernel's refs by name; quantized pages add their scale arrays and buffers."""
    (kv_lens, page_table, cu_q_lens, seq_first, seq_end, q, k_hbm, v_hbm), rest = refs[:8], refs[8:]
    ks_hbm = vs_hbm = ks_buf = vs_buf = None
    if quantized:
        (ks_hbm, vs_hbm), rest = rest[:2], rest[2:]
    o, k_buf, v_buf, rest = rest[0], rest[1], rest[2], rest[3:]
    if quantized:
        (ks_buf, vs_buf), rest = rest[:2], rest[2:]
    sem, m, l, acc = rest
    return dict(kv_lens_ref=kv_lens, page_table_ref=page_table, cu_q_lens_ref=cu_q_lens,
                seq_first_ref=seq_first, seq_end_ref=seq_end, q_ref=q, k_hbm=k_hbm, v_hbm=v_hbm,
                ks_hbm=ks_hbm, vs_hbm=vs_hbm, o_ref=o, k_buf=k_buf, v_buf=v_buf, ks_buf=ks_buf,
                vs_buf=vs_buf, sem=sem, m_ref=m, l_ref=l, acc_ref=acc)


def _scale_columns(scale_buf, slot, head):
    """One kv head's per-token scales of a kv block as a row: [2, PPB, K, R] -> [1, PPB*R]."""
    s = scale_buf[slot][:, head, :]  # [PPB, R]
    return s.reshape(1, s.shape[0] * s.shape[1])  # [1, Bk], the block's kv order (page, slot)


def _attention_kernel(*refs, quantized, **kw):
    _attention_body(**_unpack_refs(refs, quantized), **kw)


def _attention_body(
    # Scalar prefetch (SMEM).
    kv_lens_ref, page_table_ref, cu_q_lens_ref, seq_first_ref, seq_end_ref,
    # Inputs.
    q_ref,  # [Bq, N, H] VMEM block
    k_hbm, v_hbm,  # [P, R, K, H] stay in HBM; pages are DMA'd by hand
    ks_hbm, vs_hbm,  # [P, K, R] f32 per-token scales of QuantizedPages (None otherwise), in HBM
    # Output.
    o_ref,  # [Bq, N, H]
    # Scratch.
    k_buf, v_buf,  # [2, PPB, R, K, H] double buffer
    ks_buf, vs_buf,  # [2, PPB, K, R] f32 double buffer of the scales (None for unscaled pages)
    sem,  # DMA semaphores [2]
    m_ref, l_ref,  # [K, Bq*G, 1] f32
    acc_ref,  # [K, Bq*G, H] f32
    *, sm_scale, sliding_window, soft_cap, v_scale, pages_per_block, max_pages,
):
    block_q, num_heads, head_dim = q_ref.shape
    _, _, page_size, kv_heads, _ = k_buf.shape
    group = num_heads // kv_heads
    rows = block_q * group
    block_kv = pages_per_block * page_size
    block_start = pl.program_id(0) * block_q

    m_ref[...] = jnp.full(m_ref.shape, _MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    copies = functools.partial(_page_copies, page_table=page_table_ref,
                               pages_per_block=pages_per_block, max_pages=max_pages)

    pairs = [(k_hbm, k_buf), (v_hbm, v_buf)] + ([(ks_hbm, ks_buf), (vs_hbm, vs_buf)] if ks_hbm is not None else [])

    def block_copies(seq, kv_block, slot):
        return [c for src, dst in pairs for c in copies(src, dst, sem, seq=seq, kv_block=kv_block, slot=slot)]

    def start_block(seq, kv_block, slot):
        for c in block_copies(seq, kv_block, slot):
            c.start()

    def wait_block(seq, kv_block, slot):
        for c in block_copies(seq, kv_block, slot):
            c.wait()

    def attend_kv_block(kv_block, slot, pos, in_seq, kv_len):
        kv_pos = kv_block * block_kv + jax.lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
        mask = in_seq & (kv_pos <= pos) & (kv_pos < kv_len)  # [Rows, Bk]
        if sliding_window is not None:
            mask &= kv_pos > pos - sliding_window
        k_all = k_buf[slot].reshape(block_kv, kv_heads, head_dim).astype(q_ref.dtype)  # [Bk, K, H]
        v_all = v_buf[slot].reshape(block_kv, kv_heads, head_dim).astype(q_ref.dtype)  # [Bk, K, H]
        for head in range(kv_heads):
            q = q_ref[:, head * group:(head + 1) * group, :].reshape(rows, head_dim)  # [Rows, H]
            logits = jax.lax.dot_general(
                q, k_all[:, head, :], (((1,), (1,)), ((), ())),
                preferred_element_type=jnp.float32) * sm_scale  # [Rows, Bk]
            v_cols = None
            if ks_buf is not None:  # per-token scales: keys' on the logit columns, values' on p's
                logits = logits * _scale_columns(ks_buf, slot, head)
                v_cols = _scale_columns(vs_buf, slot, head)
            if soft_cap is not None:
                logits = soft_cap * jnp.tanh(logits / soft_cap)
            _online_softmax_step(logits, mask, v_all[:, head, :], m_ref, l_ref, acc_ref, head, v_cols)

    def attend_sequence(seq, carry):
        q_start, q_end, kv_len = cu_q_lens_ref[seq], cu_q_lens_ref[seq + 1], kv_lens_ref[seq]
        pos, in_seq = _row_positions(block_start, q_start, q_end, kv_len, rows, group)
        first_token = jnp.maximum(q_start, block_start)
        last_token = jnp.minimum(q_end, block_start + block_q) - 1
        offset = kv_len - q_end  # position = token + offset
        kb_lo, kb_hi = _kv_block_range(first_token + offset, last_token + offset, block_kv,
                                       sliding_window)
        # A sequence with no new tokens (q_len 0) overlaps the block's range but owns no row.
        kb_hi = jnp.where(last_token >= first_token, kb_hi, kb_lo)

        @pl.when(kb_lo < kb_hi)
        def _():
            start_block(seq, kb_lo, 0)

        def kv_body(kv_block, carry):
            slot = (kv_block - kb_lo) % 2

            @pl.when(kv_block + 1 < kb_hi)
            def _():
                start_block(seq, kv_block + 1, 1 - slot)

            wait_block(seq, kv_block, slot)
            attend_kv_block(kv_block, slot, pos, in_seq, kv_len)
            return carry

        return jax.lax.fori_loop(kb_lo, kb_hi, kv_body, carry)

    pid = pl.program_id(0)
    jax.lax.fori_loop(seq_first_ref[pid], seq_end_ref[pid], attend_sequence, 0)

    for head in range(kv_heads):
        # Rows that saw no key (padding tokens) have l == 0 and acc == 0: they come out as 0.
        out = acc_ref[head] * (v_scale / jnp.maximum(l_ref[head], 1e-30))  # [Rows, H]
        o_ref[:, head * group:(head + 1) * group, :] = out.reshape(
            block_q, group, head_dim).astype(o_ref.dtype)


def _pad_tokens(q: jax.Array, block_q: int) -> jax.Array:
    pad = -q.shape[0] % block_q
    return q if pad == 0 else jnp.pad(q, ((0, pad), (0, 0), (0, 0)))


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "k_scale", "v_scale", "block_q", "pages_per_block",
    "interpret"))
def ragged_paged_attention(
    q: jax.Array,  # [T, N, H]
    k_pages: jax.Array,  # [P, R, K, H] or QuantizedPages (values [P, R, K, H], scales [P, K, R])
    v_pages: jax.Array,  # [P, R, K, H] or QuantizedPages
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
    block_q: int = DEFAULT_BLOCK_Q,
    pages_per_block: int = DEFAULT_PAGES_PER_BLOCK,
    interpret: bool = False,
) -> jax.Array:
    """Pallas TPU ragged paged attention with the reference's semantics; returns [T, N, H]."""
    num_tokens, num_heads, head_dim = q.shape
    (k_pages, k_scales), (v_pages, v_scales) = split_pages(k_pages), split_pages(v_pages)
    quantized = k_scales is not None
    _, page_size, kv_heads, _ = k_pages.shape
    num_seqs_max, max_pages = page_indices.shape
    group = num_heads // kv_heads
    pages_per_block = min(pages_per_block, max_pages)
    block_q = min(block_q, num_tokens)
    q_padded = _pad_tokens(q, block_q)  # [T', N, H]
    num_blocks = q_padded.shape[0] // block_q
    seq_first, seq_end = block_sequence_ranges(cu_q_lens, num_seqs, q_padded.shape[0], block_q)

    kernel = functools.partial(
        _attention_kernel, sm_scale=sm_scale * (1.0 if k_scale is None else k_scale),
        sliding_window=sliding_window, soft_cap=soft_cap,
        v_scale=1.0 if v_scale is None else v_scale, pages_per_block=pages_per_block,
        max_pages=max_pages, quantized=quantized)
    q_spec = pl.BlockSpec((block_q, num_heads, head_dim), lambda i, *_: (i, 0, 0))
    kv_buf = pltpu.VMEM((2, pages_per_block, page_size, kv_heads, head_dim), k_pages.dtype)
    in_hbm = 4 if quantized else 2  # k, v [, k scales, v scales]: stay in HBM, copied by hand
    scale_buf = [pltpu.VMEM((2, pages_per_block, kv_heads, page_size), jnp.float32)] * 2 if quantized else []
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(num_blocks,),
        in_specs=[q_spec] + [pl.BlockSpec(memory_space=pl.ANY)] * in_hbm,
        out_specs=q_spec,
        scratch_shapes=[
            kv_buf, kv_buf, *scale_buf, pltpu.SemaphoreType.DMA((2,)),
            pltpu.VMEM((kv_heads, block_q * group, 1), jnp.float32),
            pltpu.VMEM((kv_heads, block_q * group, 1), jnp.float32),
            pltpu.VMEM((kv_heads, block_q * group, head_dim), jnp.float32),
        ],
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q_padded.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
    )(kv_lens.astype(jnp.int32), page_indices.reshape(num_seqs_max * max_pages).astype(jnp.int32),
      cu_q_lens.astype(jnp.int32), seq_first, seq_end, q_padded, k_pages, v_pages,
      *((k_scales, v_scales) if quantized else ()))
    return out[:num_tokens]
