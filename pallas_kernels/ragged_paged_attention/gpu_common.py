"""What both Mosaic GPU ragged paged attention kernels share: gpu.py's one-warpgroup kernel and gpu_prefill.py's
prefill kernel. The work tiles (`tile_rows`), their table (`tile_table`) and q gather (`tile_queries`), a tile's
kv blocks (`_tile_geometry`, `_block_pages`), the shared-memory swizzle (`swizzle_bytes`, `_smem_transforms`) and
P @ V (`_pv_accumulate`).

A module of its own so that there is no import cycle: gpu.py imports gpu_prefill.py to dispatch to it, and both
import this one at the top (gpu_common <- gpu_prefill <- gpu), where keeping these pieces in gpu.py would have
gpu_prefill import gpu back and gpu import gpu_prefill lazily inside the dispatch.

Work decomposition (docs/KERNELS.md has the reasoning and the measured numbers):

* A *work tile* is 64 query rows of one sequence and one kv head: `Bt = 64 // G` consecutive new
  tokens of the sequence times the G query heads that share the kv head. Row r < G * Bt of the tile
  is (head g = r // Bt, token t = r % Bt), and the tile is exactly one wgmma M=64 block. When G does
  not divide 64 (G = 3, 5, 6, 7, 9..15), the last `64 - G * Bt` rows (at most 12) hold no query:
  they are zeros in the gathered q, masked in the kernel and dropped by the gather back. Any G from 1
  to 64 works this way.
* The wrapper lists the tiles of all sequences (ragged, computed on device from cu_q_lens) into a
  static-size table and gathers q into that tile-major order (`[W, K, 64, H]`), so each CTA loads
  its q tile with one TMA copy at a row offset that is a multiple of 64. Why not copy straight out
  of `[T, N, H]`: Mosaic GPU tiles the GMEM rows of a swizzled copy by 8, and a copy starting at a
  token that is not a multiple of 8 splits into (tile, row-in-tile) coordinates whose row-in-tile
  box runs out of bounds, so the TMA zero-fills those rows instead of reading the next tile (this
  was the G = 1 / G = 8 / soft-cap bug).
* Head dims that are not a multiple of 64 (80, 96) keep their true width everywhere: the shared
  memory tiles use the widest swizzle that divides a row (`H * 2` bytes: 128 B for 64/128/192/256,
  64 B for 96, 32 B for 80), which wgmma and the TMA both accept. Nothing is padded, so the TMA boxes
  read exactly the head's `[R, H]` bytes of each page. (Padding the head to 128 would need the
  cache itself padded, a copy of the whole cache per call, or boxes that read the neighbouring
  head's columns.)

GPU-only modules are imported inside the functions so this file imports on CPU.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_ROWS = 64  # wgmma M: query rows per tile
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
    # "compare_all": the default "scan" search is a while loop, and XLA's GPU runtime reads a while loop's
    # predicate back to the host every iteration, so the host could not queue a step's kernels ahead of the
    # device (this and _gather_rows' search were the only loops of a decode forward; docs/PERFORMANCE.md,
    # twelfth session). Comparing every tile with every sequence end is one small fused kernel.
    seq = jnp.minimum(jnp.searchsorted(ends, w, side="right", method="compare_all"), num_slots - 1)  # [W]
    base = ends - tiles  # [S]
    tok0 = cu_q_lens[seq] + (w - base[seq]) * tokens_per_tile
    tok0 = jnp.where(w < ends[-1], tok0, -1)
    return seq.astype(jnp.int32), tok0.astype(jnp.int32), base.astype(jnp.int32)


def tile_rows(group: int) -> tuple[int, int]:
    """(tokens per tile Bt = 64 // G, rows that hold a query G * Bt); rows past G * Bt are padding."""
    tokens = _ROWS // group
    return tokens, tokens * group


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


def _block_pages(page_table_ref, seq, kv_block, pages_per_block, max_pages):
    """Page ids of one kv block of one sequence (columns past the table clamp to its last entry)."""
    pages = []
    for p in range(pages_per_block):
        col = jnp.minimum(kv_block * pages_per_block + p, max_pages - 1)
        pages.append(page_table_ref[seq * max_pages + col])
    return tuple(pages)


def _pv_accumulate(acc, p, v_block, dtype, interpret: bool, while_running=None):
    """acc [64, H] f32 += p [64, Bk] (f32, cast to the KV dtype) @ v_block [Bk, H], in place; `while_running()`,
    when given, is called after the wgmma is issued and before it is waited for.

    On the GPU a wgmma with P from registers, exactly as before any-G/H support (the cast inside the
    scope keeps the lowered kernel byte-identical). Pallas' GPU interpreter (0.11.2) runs a wgmma
    only with A in shared memory and has no rule for the discharged `pl.run_state`, so interpret
    mode reads the V block and multiplies with a plain dot: same math, used only on CPU.
    """
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if interpret:
        acc = acc + jax.lax.dot(p.astype(dtype), v_block[...], preferred_element_type=jnp.float32)
        if while_running is not None:
            while_running()
        return acc

    def pv_scope(acc_ref):
        plgpu.wgmma(acc_ref, p.astype(dtype), v_block)
        if while_running is not None:
            while_running()

    return pl.run_state(pv_scope)(plgpu.ACC.init(acc))


def swizzle_bytes(head_dim: int, itemsize: int = 2) -> int:
    """The widest shared-memory swizzle (128, 64 or 32 bytes) that divides one row of the tiles.

    wgmma needs the same swizzle on q and k, and its K step is one swizzle width (64 elements at
    128 B, 32 at 64 B, 16 at 32 B for 16-bit types), so it must divide H; the TMA box's inner
    extent is one swizzle width too. H = 80 (160-byte rows) gets 32 B, H = 96 gets 64 B.
    """
    row = head_dim * itemsize
    for swizzle in (128, 64, 32):
        if row % swizzle == 0:
            return swizzle
    raise NotImplementedError(f"head dim {head_dim} has no 32-byte multiple per row")


def _smem_transforms(dtype, minor: int):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    itemsize = jnp.dtype(dtype).itemsize
    swizzle = swizzle_bytes(minor, itemsize)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def tile_queries(q, tile_tok0, group: int, kv_heads: int):
    """q [T, N, H] -> tile-major [W, K, 64, H]: row g * Bt + t of tile w, kv head k holds token
    tile_tok0[w] + t of q head k * G + g. Rows past T (and padding tiles) repeat a real token; the
    kernel masks them. When G does not divide 64, rows G * Bt .. 63 are zeros (masked too)."""
    num_tokens, _, head_dim = q.shape
    tokens_per_tile, used_rows = tile_rows(group)
    tok = jnp.clip(tile_tok0[:, None] + jnp.arange(tokens_per_tile, dtype=jnp.int32), 0,
                   num_tokens - 1)  # [W, Bt]
    tiles = q[tok].reshape(-1, tokens_per_tile, kv_heads, group, head_dim)  # [W, Bt, K, G, H]
    tiles = tiles.transpose(0, 2, 3, 1, 4).reshape(-1, kv_heads, used_rows, head_dim)  # [W, K, G*Bt, H]
    if used_rows < _ROWS:
        tiles = jnp.pad(tiles, ((0, 0), (0, 0), (0, _ROWS - used_rows), (0, 0)))  # [W, K, 64, H]
    return tiles
