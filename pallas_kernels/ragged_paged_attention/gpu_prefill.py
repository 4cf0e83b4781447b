"""The prefill kernel of the Mosaic GPU ragged paged attention (Pallas plgpu, wgmma + TMA); gpu.py dispatches to it.

Long prefill batches (`takes_prefill_kernel`) take `_prefill_kernel` instead of gpu.py's one-warpgroup kernel: a CTA
holds two consecutive 64-row tiles of one sequence, one per compute warpgroup, over shared 128-position kv blocks
that a third warpgroup copies in; the two compute warpgroups alternate on the tensor cores (its docstring and
docs/KERNELS.md have the details).

The work tiles, their table and q gather, the kv block geometry, the swizzle and P @ V are gpu_common.py's, shared
with gpu.py's kernel and imported here at the top; gpu.py imports this module to dispatch, so there is no cycle.

GPU-only modules are imported inside the functions so this file imports on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.gpu_common import (_LOG2E, _MASK_VALUE, _NUM_SMS, _ROWS, _block_pages,
                                                              _pv_accumulate, _smem_transforms, _tile_geometry,
                                                              tile_queries, tile_rows, tile_table)

# The prefill kernel (`_prefill_kernel`): two compute warpgroups per CTA, each with its own 64-row q tile, over
# shared kv blocks of 128 positions, two stages deep (q 32 KB + K/V 128 KB of shared memory at H = 128).
_COMPUTE_WGS = 2
_PREFILL_BLOCK_KV = 128
_PREFILL_STAGES = 2
_PREFILL_MAX_HEAD_DIM = 128  # acc [64, H] and logits [64, 128] f32 in one warpgroup's registers


def _issue_pages(ref, smem, barrier, head, pages):
    """One TMA copy per page of a kv block ([R, H] boxes of one kv head) into `smem` [Bk, H], all on `barrier`."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    page_size = ref.shape[1]
    for p, page in enumerate(pages):
        plgpu.copy_gmem_to_smem(ref.at[page, :, head], smem.at[pl.ds(p * page_size, page_size)], barrier)


def _prefill_kernel(kv_lens_ref, page_table_ref, cu_ref, seq_ref, tok0_ref,  # int32 metadata, per pair tile
                    q_ref,  # [2W, K, 64, H] gmem: the two 64-row q tiles of pair tile w are 2w and 2w + 1
                    k_ref, v_ref,  # [P, R, K, H] gmem
                    o_ref,  # [K, 2W, 64, H] gmem, the same tile order
                    q_smem,  # [2, 64, H]: each compute warpgroup's q tile, then its output tile
                    k_smem, v_smem,  # [stages, Bk, H]
                    q_barriers, k_barriers, v_barriers, k_free, v_free, schedule,
                    *, sm_scale, sliding_window, soft_cap, group, max_pages, interpret):
    """Warp-specialized prefill attention: CTA (pair tile w, kv head) holds 2 x Bt tokens of one sequence as
    two 64-row q tiles, one per compute warpgroup, over the same kv blocks. Warpgroup 2 only issues the kv
    copies (a slot is refilled once both compute warpgroups have released it: `k_free` / `v_free`), so each
    block is read once for 128 query rows instead of 64, and the copies never wait behind the math. The two
    compute warpgroups take turns on the tensor cores (`schedule`): one's softmax runs while the other's
    QK^T and PV wgmmas do. Blocks that every row of a warpgroup sees whole (below its first position, no
    window) skip the mask."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    tokens_per_tile, used_rows = tile_rows(group)
    stages, block_kv, head_dim = k_smem.shape
    pages_per_block = block_kv // k_ref.shape[1]
    w, head, wg = (jax.lax.axis_index(a) for a in ("tile", "head", "wg"))
    seq, tok0, q_end, offset, kb_lo, kb_hi = _tile_geometry(
        seq_ref, tok0_ref, kv_lens_ref, cu_ref, w, _COMPUTE_WGS * tokens_per_tile, block_kv, sliding_window)
    steps = kb_hi - kb_lo
    pages_of = lambda step: _block_pages(page_table_ref, seq, kb_lo + step, pages_per_block, max_pages)

    def rendezvous():  # both compute warpgroups arrive; each goes on once the other has arrived too
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    @pl.when(wg == _COMPUTE_WGS)
    def _memory_warpgroup():
        if not interpret:
            plgpu.set_max_registers(40, action="decrease")
        for s in range(stages):
            @pl.when(s < steps)
            def _(s=s):
                pages = pages_of(s)
                _issue_pages(k_ref, k_smem.at[s], k_barriers.at[s], head, pages)
                _issue_pages(v_ref, v_smem.at[s], v_barriers.at[s], head, pages)

        def refill(step, carry):
            slot = jax.lax.rem(step, stages)
            pages = pages_of(step)
            plgpu.barrier_wait(k_free.at[slot])
            _issue_pages(k_ref, k_smem.at[slot], k_barriers.at[slot], head, pages)
            plgpu.barrier_wait(v_free.at[slot])
            _issue_pages(v_ref, v_smem.at[slot], v_barriers.at[slot], head, pages)
            return carry

        jax.lax.fori_loop(stages, jnp.maximum(steps, stages), refill, 0)

        def drain(step, carry):  # the last releases: each barrier phase is observed (the interpreter checks)
            plgpu.barrier_wait(k_free.at[jax.lax.rem(step, stages)])
            plgpu.barrier_wait(v_free.at[jax.lax.rem(step, stages)])
            return carry

        jax.lax.fori_loop(jnp.maximum(steps - stages, 0), steps, drain, 0)

    @pl.when(wg < _COMPUTE_WGS)
    def _compute_warpgroup():
        if not interpret:
            plgpu.set_max_registers(232, action="increase")
        q_tile = q_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[_COMPUTE_WGS * w + wg, head], q_tile, q_barriers.at[wg])  # [64, H]
        first_tok = tok0 + wg * tokens_per_tile  # this warpgroup's rows: tokens first_tok .. + Bt - 1
        # Blocks [kb_lo, full_hi) lie wholly at or below this warpgroup's first position: no row masks any of it
        # (rows past the sequence or past G * Bt compute on real keys and are never gathered back).
        full_hi = kb_lo if sliding_window is not None else jnp.clip(
            (first_tok + offset + 1) // block_kv, kb_lo, kb_hi)
        plgpu.barrier_wait(q_barriers.at[wg])

        def kv_step(step, carry, masked):
            acc, m_i, l_i = carry
            slot = jax.lax.rem(step, stages)

            def qk_scope(acc_ref):
                plgpu.wgmma(acc_ref, q_tile, k_smem.at[slot].transpose((1, 0)))
                rendezvous()  # the other warpgroup's softmax ran while this wgmma was issued
                return acc_ref[...]

            logits = pl.run_scoped(qk_scope, plgpu.ACC((_ROWS, block_kv), jnp.float32))  # [64, Bk]
            plgpu.barrier_arrive(k_free.at[slot])
            if soft_cap is None and not masked:
                # The scale rides on the exponent's argument: one fused multiply-add per logit.
                m_new = jnp.maximum(m_i, logits.max(axis=1) * log2_scale)
                p = jnp.exp2(logits * log2_scale - jax.lax.broadcast_in_dim(m_new, logits.shape, [0]))
                return finish_step(acc, m_i, l_i, m_new, p, step, slot)
            if soft_cap is not None:
                logits = soft_cap * jnp.tanh(logits * (sm_scale / soft_cap)) * _LOG2E
            else:
                logits = logits * log2_scale
            mask = None
            if masked:
                row = plgpu.broadcasted_iota(jnp.int32, logits.shape, 0, layout=plgpu.Layout.WGMMA)
                col = plgpu.broadcasted_iota(jnp.int32, logits.shape, 1, layout=plgpu.Layout.WGMMA)
                token = first_tok + jax.lax.rem(row, tokens_per_tile)
                pos = token + offset
                kv_pos = (kb_lo + step) * block_kv + col
                mask = (token < q_end) & (kv_pos <= pos)
                if used_rows < _ROWS:
                    mask = mask & (row < used_rows)
                if sliding_window is not None:
                    mask = mask & (kv_pos > pos - sliding_window)
                logits = jnp.where(mask, logits, _MASK_VALUE)
            m_new = jnp.maximum(m_i, logits.max(axis=1))
            p = jnp.exp2(logits - jax.lax.broadcast_in_dim(m_new, logits.shape, [0]))
            if masked:
                p = jnp.where(mask, p, 0.0)
            return finish_step(acc, m_i, l_i, m_new, p, step, slot)

        def finish_step(acc, m_i, l_i, m_new, p, step, slot):
            """The online softmax's rescale, then P @ V on this warpgroup's turn; the next K block's barrier is
            waited for while that wgmma runs."""
            alpha = jnp.exp2(m_i - m_new)
            l_i = l_i * alpha + p.sum(axis=1)
            acc = acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0])
            p16 = p.astype(v_smem.dtype)
            # Everything of the softmax done before this warpgroup hands the tensor cores back.
            acc, l_i, m_new, p16 = jax.lax.optimization_barrier((acc, l_i, m_new, p16))
            plgpu.barrier_arrive(schedule)
            plgpu.barrier_wait(v_barriers.at[slot])
            plgpu.barrier_wait(schedule)

            def wait_next_k():
                pl.when(step + 1 < steps)(
                    lambda: plgpu.barrier_wait(k_barriers.at[jax.lax.rem(step + 1, stages)]))

            acc = _pv_accumulate(acc, p16, v_smem.at[slot], v_smem.dtype, interpret, while_running=wait_next_k)
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l_i

        acc = plgpu.layout_cast(jnp.zeros((_ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA)
        m_i = plgpu.layout_cast(jnp.full((_ROWS,), _MASK_VALUE, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l_i = plgpu.layout_cast(jnp.zeros((_ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        log2_scale = sm_scale * _LOG2E
        pl.when(steps > 0)(lambda: plgpu.barrier_wait(k_barriers.at[0]))  # later K blocks: see finish_step
        pl.when(wg == 1)(rendezvous)  # offset the two warpgroups by one turn
        carry = jax.lax.fori_loop(0, full_hi - kb_lo, functools.partial(kv_step, masked=False), (acc, m_i, l_i))
        acc, m_i, l_i = jax.lax.fori_loop(full_hi - kb_lo, steps, functools.partial(kv_step, masked=True), carry)
        pl.when(wg == 0)(rendezvous)  # and even the count of turns up again

        l_safe = jnp.maximum(l_i, 1e-30)
        q_tile[...] = (acc / jax.lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(q_tile.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_tile, o_ref.at[head, _COMPUTE_WGS * w + wg])
        plgpu.wait_smem_to_gmem(0)


def takes_prefill_kernel(num_tokens: int, num_slots: int, num_heads: int, kv_heads: int, head_dim: int,
                         quantized: bool) -> bool:
    """Whether a call runs `_prefill_kernel` by default: a 16-bit cache, H <= 128, a batch that is mostly
    prefill (T >= 4 S: many 64-row tiles of short kv walks) and whose 128-row pair tiles alone cover every SM
    twice (so it needs no flash-decoding splits). Decode-like batches keep the one-warpgroup kernel and its
    splits."""
    if quantized or head_dim > _PREFILL_MAX_HEAD_DIM or num_tokens < 4 * num_slots:
        return False
    tokens_per_tile, _ = tile_rows(num_heads // kv_heads)
    return (num_tokens // (_COMPUTE_WGS * tokens_per_tile)) * kv_heads >= 2 * _NUM_SMS


def _prefill_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                       sliding_window, soft_cap, interpret):
    """`_prefill_kernel` over the call's pair tiles: [K, 2W, 64, H] output tiles and the sequences' first 64-row
    tiles."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    num_tokens, num_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    num_slots, max_pages = page_indices.shape
    group = num_heads // kv_heads
    tokens_per_tile, _ = tile_rows(group)
    pair_tokens = _COMPUTE_WGS * tokens_per_tile
    max_pairs = num_tokens // pair_tokens + num_slots
    pair_seq, pair_tok0, pair_base = tile_table(cu_q_lens, num_seqs, pair_tokens, max_pairs)
    # The two 64-row tiles of pair w are tiles 2w and 2w + 1 of Bt tokens each (padding pairs: -1 twice).
    second = jnp.where(pair_tok0 >= 0, pair_tok0 + tokens_per_tile, -1)
    tile_tok0 = jnp.stack([pair_tok0, second], axis=1).reshape(-1)  # [2W]
    q_tiles = tile_queries(q, tile_tok0, group, kv_heads)  # [2W, K, 64, H]
    block_kv = max(_PREFILL_BLOCK_KV, page_size)
    stages = _PREFILL_STAGES
    qt, kvt = _smem_transforms(q.dtype, head_dim), _smem_transforms(k_pages.dtype, head_dim)
    copies = block_kv // page_size
    scratch = [
        plgpu.SMEM((_COMPUTE_WGS, _ROWS, head_dim), q.dtype, transforms=qt),
        plgpu.SMEM((stages, block_kv, head_dim), k_pages.dtype, transforms=kvt),
        plgpu.SMEM((stages, block_kv, head_dim), v_pages.dtype, transforms=kvt),
        plgpu.Barrier(num_arrivals=1, num_barriers=_COMPUTE_WGS),  # q tiles
        plgpu.Barrier(num_arrivals=copies, num_barriers=stages),  # K blocks landed
        plgpu.Barrier(num_arrivals=copies, num_barriers=stages),  # V blocks landed
        plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages),  # K slots released
        plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages),  # V slots released
        plgpu.Barrier(num_arrivals=_COMPUTE_WGS),  # turns on the tensor cores
    ]
    kernel = functools.partial(_prefill_kernel, sm_scale=sm_scale, sliding_window=sliding_window,
                               soft_cap=soft_cap, group=group, max_pages=max_pages, interpret=interpret)
    o_tiles = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((kv_heads, _COMPUTE_WGS * max_pairs, _ROWS, head_dim), q.dtype),
        scratch_types=scratch, grid=(max_pairs, kv_heads), grid_names=("tile", "head"),
        kernel_name="ragged_paged_attention_prefill",
        num_threads=_COMPUTE_WGS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(kv_lens.astype(jnp.int32), page_indices.reshape(-1).astype(jnp.int32), cu_q_lens.astype(jnp.int32),
      pair_seq, pair_tok0, q_tiles, k_pages, v_pages)
    return o_tiles, _COMPUTE_WGS * pair_base
