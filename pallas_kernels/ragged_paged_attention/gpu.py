"""Ragged paged attention for Hopper as a Pallas Mosaic GPU kernel (plgpu, wgmma + TMA).

Work decomposition (docs/KERNELS.md has the reasoning and the measured numbers):

* A *work tile* is 64 query rows of one sequence and one kv head: `Bt = 64 // G` consecutive new
  tokens of the sequence times the G query heads that share the kv head. Row r of the tile is
  (head g = r // Bt, token t = r % Bt), so each head's rows are one strided TMA copy of q and the
  tile is exactly one wgmma M=64 block. Decode tokens fill G rows of a tile; the rest are masked.
* The wrapper lists the tiles of all sequences (ragged, computed on device from cu_q_lens) into a
  static-size table; grid = (tiles, kv heads, kv splits). Each CTA owns its output tile exclusively
  (tile-major output `[splits, K, W, 64, H]`), so nothing is written twice; the wrapper gathers the
  rows back to `[T, N, H]` and, with splits > 1, merges the splits by their log-sum-exp
  (flash-decoding). Splits are used only when the tiles alone cannot fill the GPU (few sequences,
  long contexts).
* KV is streamed in blocks of `Bk = max(64, R)` positions, one TMA copy per page
  (`k_pages[page, :, kv_head, :]`, a strided `[R, H]` box), `_STAGES`-deep in shared memory, so the
  copies of the next blocks are in flight while the tensor cores work on this one.
* One warpgroup per CTA: QK^T and PV are wgmma, the online softmax runs in registers in the WGMMA
  layout, exponentials in base 2 with log2(e) folded into the scale.

Not supported here yet: int8/fp8 KV (use impl="reference"/"pallas_tpu"); that needs an in-SMEM
dequantize stage before the wgmma. Known bug: G = 1, G = 8 (with H = 256) and soft-capped cases
disagree with the reference on the GPU; `verified_config` keeps impl="auto" off them.

GPU-only modules are imported inside the functions so this file imports on CPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

_ROWS = 64  # wgmma M: query rows per tile
_STAGES = 3  # kv blocks in flight per CTA (2 for H > 128, to fit shared memory)
_NUM_SMS = 132  # H100 / H200 SXM
_LOG2E = math.log2(math.e)
_MASK_VALUE = -1e30


def tile_table(cu_q_lens: jax.Array, num_seqs: jax.Array, tokens_per_tile: int,
               max_tiles: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The ragged list of (sequence, first token) work tiles, padded to max_tiles.

    Returns tile_seq [W], tile_tok0 [W], tile_base [S] (index of each sequence's first tile).
    Tiles past the real ones point at sequence 0 with tile_tok0 = -1 and are skipped.
    """
    num_slots = cu_q_lens.shape[0] - 1
    q_lens = jnp.where(jnp.arange(num_slots) < num_seqs[0], cu_q_lens[1:] - cu_q_lens[:-1], 0)
    tiles = (q_lens + tokens_per_tile - 1) // tokens_per_tile  # [S]
    ends = jnp.cumsum(tiles)  # [S]
    w = jnp.arange(max_tiles, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, w, side="right"), num_slots - 1)  # [W]
    base = ends - tiles  # [S]
    tok0 = cu_q_lens[seq] + (w - base[seq]) * tokens_per_tile
    tok0 = jnp.where(w < ends[-1], tok0, -1)
    return seq.astype(jnp.int32), tok0.astype(jnp.int32), base.astype(jnp.int32)


def _split_range(kb_lo, kb_hi, split, num_splits):
    """The kv blocks [lo, hi) of one flash-decoding split of [kb_lo, kb_hi)."""
    per = (kb_hi - kb_lo + num_splits - 1) // num_splits
    lo = kb_lo + split * per
    return lo, jnp.maximum(jnp.minimum(lo + per, kb_hi), lo)


def _tile_geometry(seq_ref, tok0_ref, kv_lens_ref, cu_ref, w, tokens_per_tile, block_kv,
                   sliding_window):
    """Scalars of one work tile: first token, end of the sequence's tokens, position offset, kv blocks."""
    seq, tok0 = seq_ref[w], tok0_ref[w]
    q_end, kv_len = cu_ref[seq + 1], kv_lens_ref[seq]
    offset = kv_len - q_end  # position = token + offset
    last_tok = jnp.minimum(tok0 + tokens_per_tile, q_end) - 1
    first_pos = tok0 + offset
    kb_lo = (0 if sliding_window is None
             else jnp.maximum(first_pos - sliding_window + 1, 0) // block_kv)
    kb_hi = jnp.where(tok0 >= 0, (last_tok + offset + block_kv) // block_kv, 0)
    return seq, tok0, q_end, offset, kb_lo, jnp.maximum(kb_hi, kb_lo)


def _attention_kernel(kv_lens_ref, page_table_ref, cu_ref, seq_ref, tok0_ref,  # int32 metadata
                      q_ref,  # [T + Bt, N, H] gmem
                      k_ref, v_ref,  # [P, R, K, H] gmem
                      o_ref,  # [splits, K, W, 64, H] gmem
                      lse_ref,  # [splits, K, W, 64] f32 gmem
                      q_smem,  # [64, H], reused for the output tile once the loop is done
                      k_smem, v_smem,  # [stages, Bk, H]
                      lse_smem,  # [64] f32
                      q_barrier, k_barriers, v_barriers,
                      *, sm_scale, sliding_window, soft_cap, group, max_pages, num_splits):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    tokens_per_tile = _ROWS // group
    stages, block_kv, head_dim = k_smem.shape
    page_size = k_ref.shape[1]
    pages_per_block = block_kv // page_size
    w, head, split = (jax.lax.axis_index(a) for a in ("tile", "head", "split"))
    seq, tok0, q_end, offset, kb_lo, kb_hi = _tile_geometry(
        seq_ref, tok0_ref, kv_lens_ref, cu_ref, w, tokens_per_tile, block_kv, sliding_window)
    kb_lo, kb_hi = _split_range(kb_lo, kb_hi, split, num_splits)
    steps = kb_hi - kb_lo
    safe_tok0 = jnp.maximum(tok0, 0)

    for g in range(group):
        plgpu.copy_gmem_to_smem(
            q_ref.at[pl.ds(safe_tok0, tokens_per_tile), head * group + g],  # [Bt, H]
            q_smem.at[pl.ds(g * tokens_per_tile, tokens_per_tile)], q_barrier)

    def issue(step):
        slot = jax.lax.rem(step, stages)
        kv_block = kb_lo + step
        for p in range(pages_per_block):
            col = jnp.minimum(kv_block * pages_per_block + p, max_pages - 1)
            page = page_table_ref[seq * max_pages + col]
            rows = pl.ds(p * page_size, page_size)
            plgpu.copy_gmem_to_smem(k_ref.at[page, :, head], k_smem.at[slot, rows],
                                    k_barriers.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[page, :, head], v_smem.at[slot, rows],
                                    v_barriers.at[slot])

    for s in range(stages - 1):
        pl.when(s < steps)(functools.partial(issue, s))
    plgpu.barrier_wait(q_barrier)

    row = plgpu.broadcasted_iota(jnp.int32, (_ROWS, block_kv), 0, layout=plgpu.Layout.WGMMA)
    col = plgpu.broadcasted_iota(jnp.int32, (_ROWS, block_kv), 1, layout=plgpu.Layout.WGMMA)
    token = tok0 + jax.lax.rem(row, tokens_per_tile)  # [64, Bk]
    row_ok = token < q_end
    pos = token + offset

    def kv_step(step, carry):
        acc, m_i, l_i = carry
        slot = jax.lax.rem(step, stages)
        pl.when(step + stages - 1 < steps)(functools.partial(issue, step + stages - 1))
        plgpu.barrier_wait(k_barriers.at[slot])

        def qk_scope(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
            return acc_ref[...]

        logits = pl.run_scoped(qk_scope, plgpu.ACC((_ROWS, block_kv), jnp.float32)) * sm_scale
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        kv_pos = (kb_lo + step) * block_kv + col
        mask = row_ok & (kv_pos <= pos)
        if sliding_window is not None:
            mask = mask & (kv_pos > pos - sliding_window)
        logits = jnp.where(mask, logits * _LOG2E, _MASK_VALUE)  # base-2 logits [64, Bk]
        m_new = jnp.maximum(m_i, logits.max(axis=1))
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.where(mask, jnp.exp2(logits - jax.lax.broadcast_in_dim(m_new, logits.shape, [0])),
                      0.0)
        l_i = l_i * alpha + p.sum(axis=1)
        acc = acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0])
        plgpu.barrier_wait(v_barriers.at[slot])

        def pv_scope(acc_ref):
            plgpu.wgmma(acc_ref, p.astype(v_smem.dtype), v_smem.at[slot])

        acc = pl.run_state(pv_scope)(plgpu.ACC.init(acc))
        return acc, m_new, l_i

    acc = plgpu.layout_cast(jnp.zeros((_ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA)
    m_i = plgpu.layout_cast(jnp.full((_ROWS,), _MASK_VALUE, jnp.float32),
                            plgpu.Layout.WGMMA.reduce(1))
    l_i = plgpu.layout_cast(jnp.zeros((_ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    acc, m_i, l_i = jax.lax.fori_loop(0, steps, kv_step, (acc, m_i, l_i))

    l_safe = jnp.maximum(l_i, 1e-30)
    q_smem[...] = (acc / jax.lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(q_smem.dtype)
    lse_smem[...] = m_i + jnp.log2(l_safe)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, o_ref.at[split, head, w])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[split, head, w])
    plgpu.wait_smem_to_gmem(0)


def _smem_transforms(dtype, minor: int):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor * bits)
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def default_num_splits(num_tiles: int, kv_heads: int, max_kv_blocks: int) -> int:
    """Enough kv splits that the grid covers every SM twice, never more than there are blocks."""
    ctas = num_tiles * kv_heads
    if ctas >= 2 * _NUM_SMS:
        return 1
    return max(1, min(-(-2 * _NUM_SMS // ctas), max_kv_blocks))


def _combine_splits(o_parts, lse_parts):
    """Merges flash-decoding splits: [splits, K, W, 64, H], [splits, K, W, 64] -> [K, W, 64, H]."""
    if o_parts.shape[0] == 1:
        return o_parts[0]
    lse_max = lse_parts.max(axis=0, keepdims=True)  # [1, K, W, 64]
    weights = jnp.exp2(lse_parts - lse_max)  # [splits, K, W, 64]
    weights = weights / weights.sum(axis=0, keepdims=True)
    return jnp.einsum("skwr,skwrh->kwrh", weights, o_parts.astype(jnp.float32))


def _gather_rows(o_tiles, cu_q_lens, num_seqs, tile_base, num_tokens, group):
    """Tile-major [K, W, 64, H] back to token-major [T, N, H]; padding tokens get zeros."""
    kv_heads, num_tiles, _, head_dim = o_tiles.shape
    tokens_per_tile = _ROWS // group
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    real_end = cu_q_lens[num_seqs[0]]
    seq = jnp.clip(jnp.searchsorted(cu_q_lens[1:], t, side="right"), 0, tile_base.shape[0] - 1)
    within = t - cu_q_lens[seq]
    tile = jnp.clip(tile_base[seq] + within // tokens_per_tile, 0, num_tiles - 1)  # [T]
    r = within % tokens_per_tile  # [T]
    by_head = o_tiles.reshape(kv_heads, num_tiles, group, tokens_per_tile, head_dim)
    rows = by_head[:, tile, :, r, :]  # [T, K, G, H]
    rows = jnp.where((t < real_end)[:, None, None, None], rows, 0)
    return rows.reshape(num_tokens, kv_heads * group, head_dim)  # [T, N, H]


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "k_scale", "v_scale", "num_splits", "interpret"))
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
    num_splits: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Mosaic GPU ragged paged attention with the reference's semantics; returns [T, N, H]."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    num_tokens, num_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    num_slots, max_pages = page_indices.shape
    group = num_heads // kv_heads
    _check_supported(q, k_pages, group, page_size, k_scale, v_scale)
    tokens_per_tile = _ROWS // group
    block_kv = max(64, page_size)
    max_tiles = num_tokens // tokens_per_tile + num_slots
    max_kv_blocks = -(-max_pages * page_size // block_kv)
    num_splits = num_splits or default_num_splits(max_tiles, kv_heads, max_kv_blocks)
    tile_seq, tile_tok0, tile_base = tile_table(cu_q_lens, num_seqs, tokens_per_tile, max_tiles)
    # Bt padding tokens so the last tile's q copy stays in bounds, rounded to the TMA's 8-row tiling.
    padded_tokens = -(-(num_tokens + tokens_per_tile) // 8) * 8
    q_padded = jnp.pad(q, ((0, padded_tokens - num_tokens), (0, 0), (0, 0)))  # [T', N, H]

    kernel = functools.partial(
        _attention_kernel, sm_scale=sm_scale * (k_scale or 1.0), sliding_window=sliding_window,
        soft_cap=soft_cap, group=group, max_pages=max_pages, num_splits=num_splits)
    qt = _smem_transforms(q.dtype, head_dim)
    out_types = (
        jax.ShapeDtypeStruct((num_splits, kv_heads, max_tiles, _ROWS, head_dim), q.dtype),
        jax.ShapeDtypeStruct((num_splits, kv_heads, max_tiles, _ROWS), jnp.float32),
    )
    stages = _STAGES if head_dim <= 128 else 2
    scratch = [
        plgpu.SMEM((_ROWS, head_dim), q.dtype, transforms=qt),
        plgpu.SMEM((stages, block_kv, head_dim), k_pages.dtype, transforms=qt),
        plgpu.SMEM((stages, block_kv, head_dim), v_pages.dtype, transforms=qt),
        plgpu.SMEM((_ROWS,), jnp.float32),
        plgpu.Barrier(num_arrivals=group),
        plgpu.Barrier(num_arrivals=block_kv // page_size, num_barriers=stages),
        plgpu.Barrier(num_arrivals=block_kv // page_size, num_barriers=stages),
    ]
    o_parts, lse_parts = plgpu.kernel(
        kernel, out_type=out_types, scratch_types=scratch,
        grid=(max_tiles, kv_heads, num_splits), grid_names=("tile", "head", "split"),
        # Lane semantics: the kernel places its register arrays in the WGMMA layout itself; the
        # warpgroup layout inference of 0.11.2 rejects TMA copies at data-dependent row offsets.
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(kv_lens.astype(jnp.int32), page_indices.reshape(-1).astype(jnp.int32),
      cu_q_lens.astype(jnp.int32), tile_seq, tile_tok0, q_padded, k_pages, v_pages)
    o_tiles = _combine_splits(o_parts, lse_parts)  # [K, W, 64, H]
    out = _gather_rows(o_tiles, cu_q_lens, num_seqs, tile_base, num_tokens, group)
    if v_scale is not None:
        out = out.astype(jnp.float32) * v_scale
    return out.astype(q.dtype)


def verified_config(q: jax.Array, k_pages: jax.Array, soft_cap: float | None) -> bool:
    """Configurations on which this kernel has passed its GPU tests (the H200 run in docs/KERNELS.md).

    G = 4 query heads per kv head (Llama-3-8B and the tests' GQA-4 cases), bf16/f16 KV, no soft-cap.
    The G = 1, G = 8 and soft-capped cases still disagree with the reference on the GPU (open bug),
    so impl="auto" routes them to the reference until they pass.
    """
    group = q.shape[1] // k_pages.shape[2]
    return group == 4 and soft_cap is None and k_pages.dtype == q.dtype and q.dtype in (
        jnp.bfloat16, jnp.float16)


def _check_supported(q, k_pages, group, page_size, k_scale, v_scale) -> None:
    if _ROWS % group:
        raise NotImplementedError(f"GPU kernel needs 64 % (q heads per kv head) == 0, got {group}")
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k_pages.dtype != q.dtype:
        raise NotImplementedError(
            f"GPU kernel takes bf16/f16 q and KV of the same dtype, got q {q.dtype}, "
            f"KV {k_pages.dtype}; use impl='reference' for quantized KV")
    if page_size % 8 or (page_size < 64 and 64 % page_size) or (page_size > 64 and page_size % 64):
        raise NotImplementedError(f"page size must divide 64 or be a multiple of 64, got {page_size}")
