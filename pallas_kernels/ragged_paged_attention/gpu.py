"""Ragged paged attention for Hopper as a Pallas Mosaic GPU kernel (plgpu, wgmma + TMA).

This module holds the entry point (`ragged_paged_attention`, `supported_config`) and the one-warpgroup kernel. Long
prefill batches run gpu_prefill.py's kernel; the pieces both kernels share (the 64-row work tiles, their table and
q gather, the kv block geometry, the swizzle, P @ V) are gpu_common.py's, whose docstring describes the work tiles.
That module is separate so that this one and gpu_prefill.py both import it at the top, with no import cycle.

Work decomposition (docs/KERNELS.md has the reasoning and the measured numbers):

* A decode step (`one_token_per_seq`, the caller's promise) takes one-token tiles instead of gpu_common's 64-row
  work tiles (`tile_layout`): the q and output arrays keep only the G head rows of each tile, rounded up to 8.
* grid = (tiles, kv splits, kv heads). Each CTA owns its output tile exclusively (tile-major
  output `[splits, K, W, 64, H]`), so nothing is written twice; the wrapper gathers the rows back
  to `[T, N, H]` and, with splits > 1, merges the splits by their log-sum-exp (flash-decoding).
  Splits are used only when the tiles alone cannot fill the GPU (few sequences, long contexts). A decode
  step (one-token tiles) takes a power-of-two split count and merges in one Pallas Triton kernel
  (decode_merge.py), where XLA ran two kernels a layer.
* KV is streamed in blocks of `Bk = max(64, R)` positions, one TMA copy per page
  (`k_pages[page, :, kv_head, :]`, a strided `[R, H]` box), 2 stages deep in shared memory
  (`_STAGES`: two CTAs per SM), so the copies of the next blocks are in flight while the tensor cores work
  on this one. The page ids of a block are loaded from the page table one step before its copies
  are issued and carried through the loop, so the global-memory latency of that load is not on
  every step's critical path.
* One warpgroup per CTA: QK^T and PV are wgmma, the online softmax runs in registers in the WGMMA
  layout, exponentials in base 2 with log2(e) folded into the scale.
* Long prefill batches (`takes_prefill_kernel`) take gpu_prefill.py's `_prefill_kernel` instead (its module
  docstring and docs/KERNELS.md have the details).

* A quantized cache (int8 / e4m3 `QuantizedPages`: codes [P, R, K, H] and a scale per token and head,
  [P, K, R]) is streamed as it is stored: each page's codes and its R scales arrive by TMA, so a kv block
  moves half the bytes of a bf16 one. wgmma takes 16-bit operands from shared memory here, so each step
  widens the block's codes into one bf16 staging tile (exact: int8 and e4m3 values are bf16 values), and the
  scales, which belong to kv positions, multiply the logits' columns (K) and the probabilities' columns
  before P @ V (V): the sum over positions of p * scale * code is the sum of p * value.

`supported_config` / `unsupported_reason` tell impl="auto" which calls it can take (the rest run on the
reference, with one warning per reason).

GPU-only modules are imported inside the functions so this file imports on CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention import decode_merge
from pallas_kernels.ragged_paged_attention.gpu_common import (_LOG2E, _MASK_VALUE, _NUM_SMS, _ROWS, _block_pages,
                                                              _pv_accumulate, _smem_transforms, _tile_geometry,
                                                              tile_queries, tile_rows, tile_table)
from pallas_kernels.ragged_paged_attention.gpu_prefill import (_PREFILL_MAX_HEAD_DIM, _prefill_attention,
                                                               takes_prefill_kernel)
from pallas_kernels.ragged_paged_attention.reference import QuantizedPages

_MAX_GROUP = _ROWS  # a tile holds at least one token of every query head of its kv head
# Head dims the kernel takes, each in the GPU test sweep (docs/KERNELS.md). Other multiples of 16 up
# to 256 would lower the same way (swizzle from the row width) but stay out until tested there.
HEAD_DIMS = (64, 80, 96, 128, 192, 256)
QUANTIZED_KV_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
_MAX_BLOCK_KV = 128  # kv positions per step: the [64, Bk] f32 logits live in registers
_SMEM_BUDGET = 220 * 1024  # of the 227 KB a Hopper block may use, leaving room for barriers
# KV pipeline depth. At 2 stages a CTA holds q [64, H] + 2 x (K + V) [64, H] blocks (80 KB at H = 128), so two
# CTAs share an SM; at 3 (~113 KB) only one does. One warpgroup waits on a block, then does its math: a second
# resident CTA runs its math in the first's waits, which a deeper pipeline cannot do. H200, 16-token pages
# (scripts/attention_access_ceiling.py, docs/KERNELS.md): decode 64 x 4k 274 us at 2 stages against 330 at 3
# (93% of the copy rate against 77%), 192 x 1.5k 340 against 401 us, 4k prefill 514 against 694 us; an int8 /
# fp8 cache (32-token pages, two bf16 staging tiles more) 362 / 340 us against 369 / 357.
_STAGES = 2


@dataclasses.dataclass(frozen=True)
class TileLayout:
    """How one call of the one-warpgroup kernel lays its queries into 64-row wgmma tiles."""
    tokens: int  # Bt: consecutive new tokens of one sequence per tile
    used_rows: int  # rows that hold a query (G * Bt); the rest of the 64 are masked
    stored_rows: int  # rows of each tile in the q and output arrays; the shared-memory tile always has 64


def tile_layout(group: int, one_token_per_seq: bool) -> TileLayout:
    """The tile layout of a call. With `one_token_per_seq` (the caller's promise, a decode step) each tile holds
    one token: its G query heads are the tile's first rows, and the q and output arrays keep only those rows,
    rounded up to 8 (the tiling of a swizzled TMA copy). With 64 // G tokens a tile, a decode token used 4 of 64
    rows at G = 4, yet the call wrote and read all 64 of every tile: at 192 sequences, ~27 MB of q tiles and as
    much output per layer (docs/KERNELS.md). One-token tiles are correct for any batch, but a sequence with n
    new tokens then reads its kv blocks n times instead of n / Bt times, so without the promise (prefill, mixed
    steps, chunks of long prompts) tiles keep Bt = 64 // G tokens."""
    if one_token_per_seq:
        return TileLayout(1, group, -(-group // 8) * 8)
    tokens, used = tile_rows(group)
    return TileLayout(tokens, used, _ROWS)


def _split_range(kb_lo, kb_hi, split, num_splits):
    """The kv blocks [lo, hi) of one flash-decoding split of [kb_lo, kb_hi)."""
    per = (kb_hi - kb_lo + num_splits - 1) // num_splits
    lo = kb_lo + split * per
    return lo, jnp.maximum(jnp.minimum(lo + per, kb_hi), lo)


def _issue_kv_block(k_ref, v_ref, k_smem, v_smem, k_barriers, v_barriers, slot, head, pages, scales=None):
    """One TMA copy per page of a kv block into stage `slot` (K and V on their own barriers); with a quantized
    cache (`scales` = (ks_ref [P, K, R], vs_ref, ks_smem [stages, Bk], vs_smem)) also each page's R scales."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    page_size = k_ref.shape[1]
    for p, page in enumerate(pages):
        rows = pl.ds(p * page_size, page_size)
        plgpu.copy_gmem_to_smem(k_ref.at[page, :, head], k_smem.at[slot, rows],  # [R, H]
                                k_barriers.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[page, :, head], v_smem.at[slot, rows],  # [R, H]
                                v_barriers.at[slot])
        if scales is not None:
            ks_ref, vs_ref, ks_smem, vs_smem = scales
            plgpu.copy_gmem_to_smem(ks_ref.at[page, head], ks_smem.at[slot, rows], k_barriers.at[slot])  # [R]
            plgpu.copy_gmem_to_smem(vs_ref.at[page, head], vs_smem.at[slot, rows], v_barriers.at[slot])  # [R]


def _widened(codes_smem, staging_smem):
    """A kv block's 8-bit codes [Bk, H] in shared memory -> the bf16 staging tile, exactly, for the wgmma.

    Loaded in the layout Mosaic GPU has for 8-bit values bound for 16-bit wgmma operands (32-bit shared-memory
    loads), widened in registers, moved to the WGMMA layout (one warp shuffle) and stored swizzled."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    codes = plgpu.load(codes_smem, layout=plgpu.Layout.WGMMA_UPCAST_2X)
    if codes.dtype == jnp.float8_e4m3fn:
        codes = codes.astype(jnp.float32)  # ptxas of CUDA 13.0 converts e4m3 directly only to f16
    staging_smem[...] = plgpu.layout_cast(codes.astype(staging_smem.dtype), plgpu.Layout.WGMMA)
    plgpu.commit_smem()
    return staging_smem


def _column_scales(scales_smem, shape):
    """A block's per-position scales [Bk] (shared memory) broadcast over the rows of a [64, Bk] tile."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    col = plgpu.load(scales_smem, layout=plgpu.Layout.WGMMA.reduce(0))  # [Bk]
    return jax.lax.broadcast_in_dim(col, shape, [1])


def _attention_kernel(kv_lens_ref, page_table_ref, cu_ref, seq_ref, tok0_ref,  # int32 metadata
                      q_ref,  # [W, K, rows, H] gmem, tile-major, rows = layout.stored_rows (module docstring)
                      k_ref, v_ref,  # [P, R, K, H] gmem (codes, with a quantized cache)
                      *refs, sm_scale, sliding_window, soft_cap, layout, max_pages, num_splits,
                      interpret, quantized):
    # refs: [ks_ref, vs_ref ([P, K, R] f32 gmem), quantized only,]
    #   o_ref [splits, K, W, rows, H] gmem, lse_ref [splits, K, W, 64] f32 gmem,
    #   q_smem [64, H] (reused for the output tile once the loop is done), k_smem, v_smem [stages, Bk, H],
    #   lse_smem [64] f32, q_barrier, k_barriers, v_barriers,
    #   [k16_smem, v16_smem [Bk, H] bf16 staging, ks_smem, vs_smem [stages, Bk] f32, quantized only]
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    scales = None
    if quantized:
        ks_ref, vs_ref, *refs = refs
        *refs, k16_smem, v16_smem, ks_smem, vs_smem = refs
        scales = (ks_ref, vs_ref, ks_smem, vs_smem)
    o_ref, lse_ref, q_smem, k_smem, v_smem, lse_smem, q_barrier, k_barriers, v_barriers = refs

    tokens_per_tile, used_rows = layout.tokens, layout.used_rows
    # The tile's stored rows (all 64, or a decode tile's first G rounded to 8); the rest of q_smem is never
    # written, and masked like every row past used_rows.
    q_rows = q_smem if layout.stored_rows == _ROWS else q_smem.at[pl.ds(0, layout.stored_rows)]
    stages, block_kv, head_dim = k_smem.shape
    pages_per_block = block_kv // k_ref.shape[1]
    w, head, split = (jax.lax.axis_index(a) for a in ("tile", "head", "split"))
    seq, tok0, q_end, offset, kb_lo, kb_hi = _tile_geometry(
        seq_ref, tok0_ref, kv_lens_ref, cu_ref, w, tokens_per_tile, block_kv, sliding_window)
    kb_lo, kb_hi = _split_range(kb_lo, kb_hi, split, num_splits)
    steps = kb_hi - kb_lo

    plgpu.copy_gmem_to_smem(q_ref.at[w, head], q_rows, q_barrier)  # [stored rows, H]
    pages_of = lambda step: _block_pages(page_table_ref, seq, kb_lo + step, pages_per_block,
                                         max_pages)
    issue = lambda step, pages: _issue_kv_block(
        k_ref, v_ref, k_smem, v_smem, k_barriers, v_barriers, jax.lax.rem(step, stages), head,
        pages, scales)
    for s in range(stages - 1):
        pl.when(s < steps)(functools.partial(issue, s, pages_of(s)))
    plgpu.barrier_wait(q_barrier)

    row = plgpu.broadcasted_iota(jnp.int32, (_ROWS, block_kv), 0, layout=plgpu.Layout.WGMMA)
    col = plgpu.broadcasted_iota(jnp.int32, (_ROWS, block_kv), 1, layout=plgpu.Layout.WGMMA)
    token = tok0 + jax.lax.rem(row, tokens_per_tile)  # [64, Bk]
    row_ok = token < q_end
    if used_rows < _ROWS:  # G does not divide 64: the last rows of the tile hold no query
        row_ok = row_ok & (row < used_rows)
    pos = token + offset

    def kv_step(step, carry):
        acc, m_i, l_i, next_pages = carry
        slot = jax.lax.rem(step, stages)
        ahead = step + stages - 1
        pl.when(ahead < steps)(functools.partial(issue, ahead, next_pages))
        # Loaded now, used by the next step's issue: the load's latency hides behind this step.
        next_pages = pages_of(ahead + 1)
        plgpu.barrier_wait(k_barriers.at[slot])
        k_block = _widened(k_smem.at[slot], k16_smem) if quantized else k_smem.at[slot]

        def qk_scope(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_block.transpose((1, 0)))
            return acc_ref[...]

        logits = pl.run_scoped(qk_scope, plgpu.ACC((_ROWS, block_kv), jnp.float32)) * sm_scale
        if quantized:  # each key's scale: q . (scale * code) = scale * (q . code)
            logits = logits * _column_scales(ks_smem.at[slot], logits.shape)
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
        v_block = v_smem.at[slot]
        if quantized:  # sum of p * (scale * code) = sum of (p * scale) * code
            p = p * _column_scales(vs_smem.at[slot], p.shape)
            v_block = _widened(v_block, v16_smem)
        acc = _pv_accumulate(acc, p, v_block, v_block.dtype, interpret)
        return acc, m_new, l_i, next_pages

    acc = plgpu.layout_cast(jnp.zeros((_ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA)
    m_i = plgpu.layout_cast(jnp.full((_ROWS,), _MASK_VALUE, jnp.float32),
                            plgpu.Layout.WGMMA.reduce(1))
    l_i = plgpu.layout_cast(jnp.zeros((_ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    carry = (acc, m_i, l_i, pages_of(stages - 1))
    acc, m_i, l_i, _ = jax.lax.fori_loop(0, steps, kv_step, carry)

    l_safe = jnp.maximum(l_i, 1e-30)
    q_smem[...] = (acc / jax.lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(q_smem.dtype)
    lse_smem[...] = m_i + jnp.log2(l_safe)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_rows, o_ref.at[split, head, w])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[split, head, w])
    plgpu.wait_smem_to_gmem(0)


def smem_bytes(head_dim: int, block_kv: int, stages: int, itemsize: int = 2, kv_itemsize: int | None = None) -> int:
    """Shared memory of one CTA: the q/output tile, `stages` K and V blocks, the LSE row; with an 8-bit cache
    (kv_itemsize 1) also the two bf16 staging tiles and `stages` rows of K and V scales."""
    kv_itemsize = kv_itemsize or itemsize
    base = _ROWS * head_dim * itemsize + 2 * stages * block_kv * head_dim * kv_itemsize + _ROWS * 4
    if kv_itemsize == itemsize:
        return base
    return base + 2 * block_kv * head_dim * itemsize + 2 * stages * block_kv * 4


def _grid(num_tiles: int, kv_heads: int, num_splits: int) -> dict:
    """Launch grid; the kernel reads its coordinates by name, so the order is free to choose.

    Mosaic GPU maps the last grid axis to blockIdx.x, the fastest-varying in launch order: the K
    CTAs of one tile run together and read the interleaved `[.., K, H]` rows of the same pages at
    the same time. (Making tiles the fastest axis instead measured the same on the H200.)
    """
    axes = (("tile", num_tiles), ("split", num_splits), ("head", kv_heads))
    return dict(grid=tuple(n for _, n in axes), grid_names=tuple(a for a, _ in axes))


def default_block_kv(page_size: int) -> int:
    """KV positions per step: 64 (wgmma N for QK^T), or one page when pages are larger."""
    return max(64, page_size)


def default_num_splits(num_tiles: int, kv_heads: int, max_kv_blocks: int, pow2: bool = False) -> int:
    """Enough kv splits that the grid covers every SM twice, never more than there are blocks; with `pow2` (a
    decode step, whose merge is the decode_merge kernel's) rounded down to a power of two, which that kernel
    takes (Qwen3-30B-A3B's batch-1 bucket: 33 -> 32)."""
    ctas = num_tiles * kv_heads
    if ctas >= 2 * _NUM_SMS:
        return 1
    splits = max(1, min(-(-2 * _NUM_SMS // ctas), max_kv_blocks))
    return 1 << (splits.bit_length() - 1) if pow2 else splits


# Up to this many splits the merge is written out split by split (_combine_splits). Four KV heads at batch 1 ask
# for 33 (Qwen3-30B-A3B: 2 tiles x 4 heads x 33 covers 2 x 132 SMs), which at a limit of 32 fell back to a chain of
# five kernels per layer.
_UNROLLED_SPLITS = 64


def _combine_splits(o_parts, lse_parts):
    """Merges flash-decoding splits: [splits, K, W, 64, H], [splits, K, W, 64] -> [K, W, 64, H].

    Written as elementwise work over the (static, few) splits rather than reductions over a splits axis, so
    XLA can fuse it: as reductions, max, exp2, sum, divide and the weighted sum ran as a chain of kernels in
    every layer, and a batch-1 step is bound by the host's kernel launches (this form took an H100's batch-1
    token from 7.85 to 7.10 ms; docs/PERFORMANCE.md, twelfth session)."""
    num_splits = o_parts.shape[0]
    if num_splits == 1:
        return o_parts[0]
    lse_parts = lse_parts[..., :o_parts.shape[3]]  # a decode tile stores fewer than its 64 rows
    if num_splits > _UNROLLED_SPLITS:  # one or two KV heads (up to 2 x SMs splits): keep the HLO small
        lse_max = lse_parts.max(axis=0, keepdims=True)  # [1, K, W, 64]
        weights = jnp.exp2(lse_parts - lse_max)  # [splits, K, W, 64]
        weights = weights / weights.sum(axis=0, keepdims=True)
        return jnp.einsum("skwr,skwrh->kwrh", weights, o_parts.astype(jnp.float32))
    lse = [lse_parts[s] for s in range(num_splits)]  # splits x [K, W, 64]
    lse_max = functools.reduce(jnp.maximum, lse)  # [K, W, 64]
    weights = [jnp.exp2(x - lse_max) for x in lse]  # splits x [K, W, 64]
    total = functools.reduce(jnp.add, weights)  # [K, W, 64]
    acc = functools.reduce(jnp.add, [w[..., None] * o_parts[s].astype(jnp.float32)
                                     for s, w in enumerate(weights)])  # [K, W, 64, H]
    return acc / total[..., None]


def decode_queries(q, kv_heads: int, rows: int):
    """q [T, N, H] -> [T, K, rows, H] for one-token tiles (tile_layout of a decode step): tile w holds
    token w (tile_table lists one tile per token, in token order), its rows the G q heads of each kv head,
    zero-padded to `rows`. A reshape and a small pad, where tile_queries gathers."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // kv_heads
    tiles = q.reshape(num_tokens, kv_heads, group, head_dim)  # [T, K, G, H]
    if rows > group:
        tiles = jnp.pad(tiles, ((0, 0), (0, 0), (0, rows - group), (0, 0)))  # [T, K, rows, H]
    return tiles


def _decode_rows(o_tiles, cu_q_lens, num_seqs, num_tokens, group):
    """decode_queries' inverse: output tiles [K, T, rows, H] -> [T, N, H]; padding tokens get zeros."""
    kv_heads, _, _, head_dim = o_tiles.shape
    rows = o_tiles[:, :num_tokens, :group].transpose(1, 0, 2, 3)  # [T, K, G, H]
    real = jnp.arange(num_tokens, dtype=jnp.int32) < cu_q_lens[num_seqs[0]]
    rows = jnp.where(real[:, None, None, None], rows, 0)
    return rows.reshape(num_tokens, kv_heads * group, head_dim)  # [T, N, H]


def _gather_rows(o_tiles, cu_q_lens, num_seqs, tile_base, num_tokens, group):
    """Tile-major [K, W, 64, H] back to token-major [T, N, H]; padding tokens get zeros."""
    kv_heads, num_tiles, _, head_dim = o_tiles.shape
    tokens_per_tile, used_rows = tile_rows(group)
    if used_rows < _ROWS:
        o_tiles = o_tiles[:, :, :used_rows]  # [K, W, G*Bt, H]: the padding rows hold no query
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    real_end = cu_q_lens[num_seqs[0]]
    seq = jnp.clip(jnp.searchsorted(cu_q_lens[1:], t, side="right", method="compare_all"), 0,
                   tile_base.shape[0] - 1)  # [T]; loop-free, see tile_table
    within = t - cu_q_lens[seq]
    tile = jnp.clip(tile_base[seq] + within // tokens_per_tile, 0, num_tiles - 1)  # [T]
    r = within % tokens_per_tile  # [T]
    by_head = o_tiles.reshape(kv_heads, num_tiles, group, tokens_per_tile, head_dim)
    rows = by_head[:, tile, :, r, :]  # [T, K, G, H]
    rows = jnp.where((t < real_end)[:, None, None, None], rows, 0)
    return rows.reshape(num_tokens, kv_heads * group, head_dim)  # [T, N, H]


STATIC_ARGNAMES = ("sm_scale", "sliding_window", "soft_cap", "k_scale", "v_scale", "num_splits", "stages", "block_kv",
                   "one_token_per_seq", "warp_specialized", "interpret")


@functools.partial(jax.jit, static_argnames=STATIC_ARGNAMES)
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
    stages: int | None = None,
    block_kv: int | None = None,
    one_token_per_seq: bool = False,
    warp_specialized: bool | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Mosaic GPU ragged paged attention with the reference's semantics; returns [T, N, H].

    one_token_per_seq: the caller promises at most one new token per sequence (a decode step), which takes
    one-token tiles (`tile_layout`); a broken promise costs speed, never correctness.

    num_splits / stages / block_kv override the flash-decoding split count, the kv pipeline depth (_STAGES)
    and the kv positions per step (default_block_kv) of the one-warpgroup kernel. `warp_specialized` picks the
    prefill kernel (True) or the one-warpgroup kernel (False); None: `takes_prefill_kernel` decides.
    """
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k_pages.shape[2]
    quantized = isinstance(k_pages, QuantizedPages)
    _check_supported(q, k_pages)
    if warp_specialized is None:
        forced = num_splits is not None or stages is not None or block_kv is not None or one_token_per_seq
        warp_specialized = not forced and takes_prefill_kernel(
            num_tokens, page_indices.shape[0], num_heads, kv_heads, head_dim, quantized)
    if warp_specialized and (quantized or head_dim > _PREFILL_MAX_HEAD_DIM):
        raise NotImplementedError(
            f"the prefill kernel takes a 16-bit cache and head dims up to {_PREFILL_MAX_HEAD_DIM}, got "
            f"{'a quantized cache' if quantized else f'head dim {head_dim}'}")
    args = (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    knobs = dict(sm_scale=sm_scale * (k_scale or 1.0), sliding_window=sliding_window, soft_cap=soft_cap,
                 interpret=interpret)
    group = num_heads // kv_heads
    if warp_specialized:
        o_tiles, tile_base = _prefill_attention(*args, **knobs)
    else:
        o_parts, lse_parts, tile_base = _one_warpgroup_attention(
            *args, **knobs, num_splits=num_splits, stages=stages, block_kv=block_kv,
            one_token_per_seq=one_token_per_seq)  # [splits, K, W, rows, H], [splits, K, W, 64]
        if tile_base is None and decode_merge.takes(o_parts.shape[0], head_dim):  # one launch, not two
            out = decode_merge.merge_decode_splits(o_parts, lse_parts, cu_q_lens[num_seqs[0]], group=group,
                                                   scale=v_scale or 1.0, interpret=interpret)  # [T, K, G, H]
            return out.reshape(num_tokens, num_heads, head_dim)
        o_tiles = _combine_splits(o_parts, lse_parts)  # [K, W, rows, H]
    if tile_base is None:  # one-token tiles
        out = _decode_rows(o_tiles, cu_q_lens, num_seqs, num_tokens, group)
    else:
        out = _gather_rows(o_tiles, cu_q_lens, num_seqs, tile_base, num_tokens, group)
    if v_scale is not None:
        out = out.astype(jnp.float32) * v_scale
    return out.astype(q.dtype)


def _one_warpgroup_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                             sliding_window, soft_cap, interpret, num_splits, stages, block_kv,
                             one_token_per_seq):
    """`_attention_kernel` over the call's tiles: [splits, K, W, rows, H] output tiles, their [splits, K, W, 64]
    log-sum-exps (base 2) and the sequences' first tiles (None for one-token tiles, where tile w is token w)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    num_tokens, num_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    quantized = isinstance(k_pages, QuantizedPages)
    num_slots, max_pages = page_indices.shape
    group = num_heads // kv_heads
    layout = tile_layout(group, one_token_per_seq)
    block_kv = block_kv or default_block_kv(page_size)
    if block_kv % page_size or block_kv % 64 or block_kv > _MAX_BLOCK_KV:  # 64: PV's wgmma K step
        raise ValueError(f"block_kv {block_kv} must be a multiple of the page size {page_size} and of 64, "
                         f"at most {_MAX_BLOCK_KV}")
    # One-token tiles: exactly one per token. Otherwise each sequence's last tile may be partial.
    max_tiles = num_tokens if one_token_per_seq else num_tokens // layout.tokens + num_slots
    max_kv_blocks = -(-max_pages * page_size // block_kv)
    num_splits = num_splits or default_num_splits(max_tiles, kv_heads, max_kv_blocks, pow2=one_token_per_seq)
    tile_seq, tile_tok0, tile_base = tile_table(cu_q_lens, num_seqs, layout.tokens, max_tiles)
    if one_token_per_seq:
        q_tiles, tile_base = decode_queries(q, kv_heads, layout.stored_rows), None  # [T, K, rows, H]
    else:
        q_tiles = tile_queries(q, tile_tok0, group, kv_heads)  # [W, K, 64, H]

    kernel = functools.partial(
        _attention_kernel, sm_scale=sm_scale, sliding_window=sliding_window,
        soft_cap=soft_cap, layout=layout, max_pages=max_pages, num_splits=num_splits,
        interpret=interpret, quantized=quantized)
    qt = _smem_transforms(q.dtype, head_dim)
    out_types = (
        jax.ShapeDtypeStruct((num_splits, kv_heads, max_tiles, layout.stored_rows, head_dim), q.dtype),
        jax.ShapeDtypeStruct((num_splits, kv_heads, max_tiles, _ROWS), jnp.float32),
    )
    stages = stages or _STAGES
    kvt = _smem_transforms(k_pages.dtype, head_dim)  # 8-bit codes: the swizzle of an H-byte row
    copies = (block_kv // page_size) * (2 if quantized else 1)  # per stage and side: pages (+ their scales)
    scratch = [
        plgpu.SMEM((_ROWS, head_dim), q.dtype, transforms=qt),
        plgpu.SMEM((stages, block_kv, head_dim), k_pages.dtype, transforms=kvt),
        plgpu.SMEM((stages, block_kv, head_dim), v_pages.dtype, transforms=kvt),
        plgpu.SMEM((_ROWS,), jnp.float32),
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
        plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
    ]
    kv_args = (k_pages, v_pages)
    if quantized:
        scratch += [plgpu.SMEM((block_kv, head_dim), q.dtype, transforms=qt),  # K / V staging, bf16
                    plgpu.SMEM((block_kv, head_dim), q.dtype, transforms=qt),
                    plgpu.SMEM((stages, block_kv), jnp.float32), plgpu.SMEM((stages, block_kv), jnp.float32)]
        kv_args = (k_pages.values, v_pages.values, k_pages.scales, v_pages.scales)
    o_parts, lse_parts = plgpu.kernel(
        kernel, out_type=out_types, scratch_types=scratch,
        **_grid(max_tiles, kv_heads, num_splits), kernel_name="ragged_paged_attention_decode",
        # Lane semantics: the kernel places its register arrays in the WGMMA layout itself; the
        # warpgroup layout inference of 0.11.2 rejects TMA copies at data-dependent row offsets.
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(kv_lens.astype(jnp.int32), page_indices.reshape(-1).astype(jnp.int32),
      cu_q_lens.astype(jnp.int32), tile_seq, tile_tok0, q_tiles, *kv_args)
    return o_parts, lse_parts, tile_base


def supported_config(q: jax.Array, k_pages: jax.Array) -> bool:
    """Whether this kernel takes the call: the one decision impl="auto" follows on a GPU (the rest
    run on the reference). `unsupported_reason` says why not."""
    return unsupported_reason(q, k_pages) is None


def unsupported_reason(q: jax.Array, k_pages: jax.Array) -> str | None:
    """None when the kernel takes (q [T, N, H], k_pages [P, R, K, H]); else one sentence why not."""
    try:
        _check_supported(q, k_pages)
    except NotImplementedError as e:
        return str(e)
    return None


def _check_supported(q, k_pages) -> None:
    """Raises NotImplementedError naming the first limit the call is outside of.

    Takes: bf16/f16 q with KV of the same dtype, or an int8 / e4m3 `QuantizedPages` cache; G = N / K from 1
    to 64 (a 64-row tile holds at least one token of each of the G heads); head dims in HEAD_DIMS (a quantized
    cache: those whose 8-bit rows are a multiple of 32 bytes, the narrowest swizzle, and pages of 32 tokens or
    more: platform.QUANTIZED_KV_GPU_PAGE_SIZE); pages of 8, 16, 32, 64 or 128 tokens (a kv step of
    max(64, R) <= 128 positions is whole pages, each a TMA box with 8-row tiles), within the shared-memory
    budget at 2 pipeline stages.
    """
    _, num_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pages.shape
    quantized = isinstance(k_pages, QuantizedPages)
    if num_heads % kv_heads or not 1 <= num_heads // kv_heads <= _MAX_GROUP:
        raise NotImplementedError(
            f"GPU kernel needs q heads a multiple of kv heads with 1 <= q heads per kv head <= "
            f"{_MAX_GROUP}, got {num_heads} q heads and {kv_heads} kv heads")
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        raise NotImplementedError(f"GPU kernel takes bf16/f16 q, got q {q.dtype}")
    if quantized and jnp.dtype(k_pages.dtype) not in QUANTIZED_KV_DTYPES:
        raise NotImplementedError(f"GPU kernel takes an int8 or float8_e4m3fn quantized cache, got {k_pages.dtype}")
    if not quantized and k_pages.dtype != q.dtype:
        raise NotImplementedError(
            f"GPU kernel takes KV of q's dtype or a quantized (int8 / fp8) cache, got q {q.dtype}, "
            f"KV {k_pages.dtype}; fp32 KV runs on impl='reference'")
    if head_dim not in HEAD_DIMS:
        # wgmma N (the PV output width) is at most 256; each listed dim passed the GPU tests.
        raise NotImplementedError(f"head dim must be one of {HEAD_DIMS}, got {head_dim}")
    if quantized and head_dim % 32:
        raise NotImplementedError(f"a quantized cache needs a head dim that is a multiple of 32, got {head_dim}")
    if quantized and page_size * 4 % 128:
        raise NotImplementedError(
            f"a quantized cache needs pages of at least 32 tokens here (each page's row of per-token scales is one "
            f"TMA copy, which must be a multiple of 128 bytes), got {page_size}")
    if page_size % 8 or (page_size < 64 and 64 % page_size) or (
            page_size > 64 and (page_size % 64 or page_size > _MAX_BLOCK_KV)):
        raise NotImplementedError(f"page size must be 8, 16, 32, 64 or 128, got {page_size}")
    block_kv = default_block_kv(page_size)
    need = smem_bytes(head_dim, block_kv, 2, q.dtype.itemsize, jnp.dtype(k_pages.dtype).itemsize)
    if need > _SMEM_BUDGET:
        raise NotImplementedError(
            f"page size {page_size} with head dim {head_dim} needs {need // 1024} KB of shared "
            f"memory at 2 stages, over the {_SMEM_BUDGET // 1024} KB budget")
