"""Grouped matmul for Hopper as Pallas Mosaic GPU kernels (wgmma + TMA pipeline).

Work decomposition (docs/KERNELS.md has the reasoning):

* A *work item* is up to `tile_m` consecutive rows of one group. Its first row is the group's start
  rounded down to a multiple of 8, then every `tile_m` rows after, so a group of s rows starting at
  row r has ceil((s + r % 8) / tile_m) items. The wrapper lists the items of all groups on device
  (`work_items`, from cumsum / searchsorted over group_sizes; "compare_all" searches, which XLA
  fuses into a kernel or two instead of a loop of launches) into a static-size table
  `meta [4, W]` (group, first row, lo, hi): shapes never depend on the routing. Items past the
  real ones have lo == hi and exit at once; empty groups have no items.
* Why 8-row starts: the lhs tile is one TMA copy into 128-byte-swizzled shared memory, which
  Mosaic GPU tiles by 8 rows in GMEM; a copy starting off the 8-row grid zero-fills the rows past
  the grid line instead of reading them (the ragged paged attention bug in KERNELS.md). The rows
  of a neighbouring group that share the tile are computed and thrown away (the `lo`/`hi` mask).
  Tiles running past the last row are zero-filled by the TMA.
* Three kernels share the table, picked by `tuning.GpuTiling.path`:
  - "cols" (decode: a few rows per expert, bound by reading weights): `acc^T [tile_n, tile_m] =
    W^T [tile_n, K] @ x^T [K, tile_m]`. 64 (or 128) output channels are the wgmma M side, the
    item's rows the narrow N side (8..64), so each active expert's weights stream from HBM once per
    output tile and the tensor cores never see 56 padding rows. grid (items, K splits, N tiles).
    Each CTA writes its (scaled) tile to a tile-major buffer `[splits, W, N, tile_m]` (the output
    dtype with one split, fp32 partials otherwise); the wrapper sums splits and gathers the rows
    back to `[M, N]` (a few MB next to the weights). A TMA store cannot transpose, and a
    transposed output tile would overlap the neighbouring groups' rows, hence the gather.
  - "rows" (prefill, compute bound): `acc [tile_m, tile_n] = x [tile_m, K] @ W [K, tile_n]`, one
    output block of one item per CTA, grid (items, N tiles). The block is written straight to
    `out [M, N]`: rows [lo, hi) only, with a ladder of TMA stores of 2^b rows (one per set bit of
    hi - lo) from an unswizzled SMEM tile, so neighbouring groups' rows are never touched. The
    rows past sum(group_sizes) are covered by items of a pseudo-group (-1) that store zeros, so
    the output needs no memset.
  - "rows_ws" (prefill, 16-bit weights): the rows kernel warp-specialized like JAX's Hopper
    matmul: a memory warpgroup issues the TMA copies, two compute warpgroups each own half of a
    `tile_m` (128) row tile against a `tile_n` (up to 256) weight tile, so a CTA tile can be
    128 x 256 (register limit: 64 x 256 fp32 per warpgroup) and the copies never wait behind a
    wgmma issue. Not in the table yet: the bench times it beside "rows".
* Weights: bf16/f16 `[G, K, N]` tiles go to the tensor cores straight from shared memory (the
  cols kernel reads the `[tile_k, tile_n]` tile transposed, an M-major A operand). Quantized
  experts (int8 / e4m3 `[G, N, K]`) are converted to the activation dtype in registers (exact),
  then fed as the register A operand (cols, the quantized_matmul pattern) or stored to a
  double-buffered SMEM staging tile as the K-major B operand (rows). Per-channel scales multiply
  the fp32 accumulator once.
* One warpgroup per CTA (except rows_ws). `emit_pipeline` keeps `stages` tiles in flight;
  SMEM-operand steps leave one wgmma in flight (`delay_release=1`, `wgmma_wait(1)`).
* Interpret mode (CPU): the interpreter's wgmma reads only SMEM operands, so with interpret=True
  the cols kernel stages dequantized weights through SMEM like the rows kernel does. Everything
  else is the same code.

Requirements (`supported`): lhs bf16/f16; rhs of the same dtype or QuantizedExperts; K and N
multiples of 64. `impl="auto"` sends other calls to the reference.

GPU-only modules are imported inside the functions so this file imports on CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import tuning
from pallas_kernels.grouped_matmul.reference import QuantizedExperts, check_args, output_dtype

_ROW_ALIGN = 8  # work items start on this row grid (the TMA tiling of swizzled lhs tiles)
_NUM_SMS = 132  # H100 / H200 SXM


# ----------------------------------------------------------------------------- work items


def max_work_items(num_rows: int, num_groups: int, tile_m: int) -> int:
    """Static bound on the item count: each of at most min(G, M) non-empty groups plus the zero
    tail adds at most one item beyond its rows / tile_m, after up to 7 rows of start offset."""
    segments = min(num_groups, num_rows) + 1
    return max(1, (num_rows + segments * (tile_m + _ROW_ALIGN - 2)) // tile_m)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["meta", "first_item", "starts", "ends"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class WorkItems:
    meta: jax.Array  # [4, W] int32: group (-1: zero rows), first row (multiple of 8), lo, hi
    first_item: jax.Array  # [G] index of each group's first item
    starts: jax.Array  # [G] first row of each group
    ends: jax.Array  # [G] end row of each group (clipped to the row count)


def work_items(group_sizes: jax.Array, num_rows: int, tile_m: int, max_items: int, *,
               zero_tail: bool) -> WorkItems:
    """The ragged (group, row tile) items of one call (module docstring); zero_tail adds items of
    pseudo-group -1 covering rows [sum(group_sizes), num_rows)."""
    num_groups = group_sizes.shape[0]
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), num_rows)  # [G]
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])  # [G]
    seg_lo = jnp.concatenate([starts, ends[-1:]])  # [G+1]: the groups, then the zero tail
    seg_hi = jnp.concatenate([ends, jnp.full((1,), num_rows if zero_tail else 0, jnp.int32)])
    seg_row0 = seg_lo // _ROW_ALIGN * _ROW_ALIGN
    counts = jnp.where(seg_hi > seg_lo, (seg_hi - seg_row0 + tile_m - 1) // tile_m, 0)  # [G+1]
    bounds = jnp.cumsum(counts)
    first = bounds - counts
    w = jnp.arange(max_items, dtype=jnp.int32)
    seg = jnp.searchsorted(bounds, w, side="right", method="compare_all")  # [W]: first bound > w
    seg = jnp.minimum(seg, num_groups).astype(jnp.int32)
    row0 = seg_row0[seg] + (w - first[seg]) * tile_m
    real = w < bounds[-1]
    lo = jnp.where(real, jnp.maximum(row0, seg_lo[seg]), 0)
    hi = jnp.where(real, jnp.minimum(row0 + tile_m, seg_hi[seg]), 0)
    group = jnp.where(seg < num_groups, seg, -1)
    meta = jnp.stack([group, jnp.where(real, row0, 0), lo, hi]).astype(jnp.int32)  # [4, W]
    return WorkItems(meta, first[:num_groups].astype(jnp.int32), starts, ends)


# ----------------------------------------------------------------------------- shared pieces


def _transforms(dtype, minor: int):
    """Tiling + swizzle of an SMEM tile whose minor dimension has `minor` elements."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor * bits)
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def _lhs_spec(tile_m, tile_k, row0, k_offset, dtype, delay_release):
    """lhs rows [row0, row0 + tile_m) x one K tile; row0 is a multiple of 8 by construction."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    return plgpu.BlockSpec((pl.Element(tile_m), tile_k),
                           lambda k: (pl.multiple_of(row0, _ROW_ALIGN), k_offset + k),
                           transforms=_transforms(dtype, tile_k), delay_release=delay_release)


def _dequantized(w_smem, dtype):
    """An int8 / e4m3 SMEM tile in registers, converted exactly to the activation dtype."""
    w = w_smem[...]
    if w.dtype == jnp.float8_e4m3fn:
        # ptxas of CUDA 13.0 converts e4m3 only to f16 directly; through f32 is exact too.
        w = w.astype(jnp.float32)
    return w.astype(dtype)


def _interpret_params(interpret):
    """interpret=True -> default interpreter parameters (NaN-filled fresh memory); a
    plgpu.InterpretGPUParams passes through (e.g. detect_races=True); False -> compile."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if interpret is True:
        return plgpu.InterpretGPUParams()
    return interpret or None


def _item(meta_ref, w):
    return tuple(meta_ref[i, w] for i in range(4))  # group, row0, lo, hi


# ----------------------------------------------------------------------------- cols kernel


def _cols_pipeline(acc_ref, x_gmem, w_gmem, stage_smem, *, row0, ni, k0, k_steps, tiling,
                   quantized, a_in_registers):
    """acc^T [tile_n, tile_m] += W^T @ x^T over this split's K steps."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    tm, tn, tk = tiling.tile_m, tiling.tile_n, tiling.tile_k
    # SMEM operands: leave one wgmma in flight (its slots are released a step late). Register or
    # restaged A: each step waits for its wgmma. A single step has nothing to overlap.
    lag = 0 if quantized or k_steps == 1 else 1
    x_spec = _lhs_spec(tm, tk, row0, k0, x_gmem.dtype, delay_release=lag)
    if quantized:
        w_spec = plgpu.BlockSpec((tn, tk), lambda k: (ni, k0 + k),
                                 transforms=_transforms(w_gmem.dtype, tk))  # values [N, K]

        def step(_, x_smem, w_smem):
            w = _dequantized(w_smem, x_smem.dtype)  # [tn, tk]
            if not a_in_registers:
                stage_smem[...] = w
                plgpu.commit_smem()
                w = stage_smem
            plgpu.wgmma(acc_ref, w, x_smem.T)  # [tn, tk] @ [tk, tm]
            plgpu.wgmma_wait(0)
    else:
        w_spec = plgpu.BlockSpec((tk, tn), lambda k: (k0 + k, ni),
                                 transforms=_transforms(w_gmem.dtype, tn), delay_release=lag)

        def step(_, x_smem, w_smem):
            plgpu.wgmma(acc_ref, w_smem.T, x_smem.T)  # [tn, tk] (M-major A) @ [tk, tm]
            plgpu.wgmma_wait(lag)

    plgpu.emit_pipeline(step, grid=(k_steps,), in_specs=[x_spec, w_spec],
                        max_concurrent_steps=tiling.stages)(x_gmem, w_gmem)
    return acc_ref[...]


def _cols_kernel(meta_ref, x_gmem, w_gmem, *refs, tiling, k_steps, quantized, a_in_registers):
    # meta_ref [4, W] i32; x_gmem [Mp, K]; w_gmem [G, K, N] (16-bit) or [G, N, K] (8-bit values);
    # quantized: s_gmem [G, N] f32. o_gmem [splits, W, N, tile_m] partials (transposed; the output
    # dtype when there is one split, else f32); o_smem [tile_n, tile_m] of that dtype;
    # quantized: s_smem [tile_n] f32, s_barrier, and in interpret mode the staging tile.
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if quantized:
        s_gmem, o_gmem, o_smem, s_smem, s_barrier, *stage = refs
    else:
        (o_gmem, o_smem), stage = refs, ()
    wi, ks, ni = (jax.lax.axis_index(a) for a in ("w", "k", "n"))
    group, row0, lo, hi = _item(meta_ref, wi)
    tm, tn = tiling.tile_m, tiling.tile_n

    @pl.when((hi > lo) & (group >= 0))
    def _():
        if quantized:
            plgpu.copy_gmem_to_smem(s_gmem.at[group, pl.ds(ni * tn, tn)], s_smem, s_barrier)
        pipeline = functools.partial(
            _cols_pipeline, x_gmem=x_gmem, w_gmem=w_gmem.at[group], stage_smem=stage[0] if stage else None,
            row0=row0, ni=ni, k0=ks * k_steps, k_steps=k_steps, tiling=tiling, quantized=quantized,
            a_in_registers=a_in_registers)
        acc = pl.run_scoped(pipeline, plgpu.ACC((tn, tm), jnp.float32))  # [tn, tm]
        if quantized:  # per-channel scales: one per row of the transposed tile
            plgpu.barrier_wait(s_barrier)
            acc = acc * jax.lax.broadcast_in_dim(s_smem[...], (tn, tm), [0])
        o_smem[...] = acc.astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[ks, wi, pl.ds(ni * tn, tn)])  # [tn, tm]
        plgpu.wait_smem_to_gmem(0)


def default_k_splits(num_rows: int, num_groups: int, n_tiles: int, k_steps: int) -> int:
    """Split K until the CTAs of the expected active items (one per non-empty group, at most
    min(G, M)) cover every SM twice, keeping whole steps per split and at least two of them (so
    each split still overlaps a copy with a wgmma)."""
    ctas = max(1, min(num_groups, num_rows)) * n_tiles
    want = max(1, -(-2 * _NUM_SMS // ctas))
    return max(d for d in range(1, max(1, min(want, k_steps // 2)) + 1) if k_steps % d == 0)


def _gather_cols(parts, items: WorkItems, m: int) -> jax.Array:
    """[splits, W, N, tile_m] partials -> [M, N] rows, zeros past the last group. Row r of group g
    is column (r - first row of g's items) of g's run of items: item first_item[g] + that // tile_m."""
    splits, num_items, n, tile_m = parts.shape
    r = jnp.arange(m, dtype=jnp.int32)
    grp = jnp.searchsorted(items.ends, r, side="right", method="compare_all")  # [M]: the row's group
    grp = jnp.minimum(grp, items.ends.shape[0] - 1)
    flat = items.first_item[grp] * tile_m + r - items.starts[grp] // _ROW_ALIGN * _ROW_ALIGN  # [M]
    flat = jnp.clip(flat, 0, num_items * tile_m - 1)
    # Gathered straight from the tile-major layout (no transposed copy), and before the splits are summed: the
    # table is sized for the worst routing, so most items of a decode call are empty and never written.
    item, col = (flat // tile_m)[:, None], (flat % tile_m)[:, None]  # [M, 1] each
    rows = parts[:, item, jnp.arange(n)[None, :], col]  # [splits, M, N]
    rows = rows[0] if splits == 1 else rows.astype(jnp.float32).sum(axis=0)  # [M, N]
    return jnp.where((r < items.ends[-1])[:, None], rows, 0)


def _cols_parts(meta, x, w, scales, splits, part_dtype, tiling, interpret):
    """The cols kernel over the work items in meta [4, W]: [splits, W, N, tile_m] partial tiles."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    k = x.shape[1]
    quantized = scales is not None
    n = w.shape[1] if quantized else w.shape[2]
    tm, tn, tk = tiling.tile_m, tiling.tile_n, tiling.tile_k
    num_items = meta.shape[1]
    a_in_registers = quantized and not interpret  # the interpreter's wgmma reads SMEM only
    scratch = [plgpu.SMEM((tn, tm), part_dtype)]
    operands = [meta, x, w]
    if quantized:
        operands.append(scales)
        scratch += [plgpu.SMEM((tn,), jnp.float32), plgpu.Barrier(num_arrivals=1)]
        if not a_in_registers:
            scratch.append(plgpu.SMEM((tn, tk), x.dtype, transforms=_transforms(x.dtype, tk)))
    kernel = functools.partial(_cols_kernel, tiling=tiling, k_steps=k // tk // splits,
                               quantized=quantized, a_in_registers=a_in_registers)
    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((splits, num_items, n, tm), part_dtype),
        scratch_types=scratch, grid=(num_items, splits, n // tn), grid_names=("w", "k", "n"),
        kernel_name="grouped_matmul_cols",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=_interpret_params(interpret),
    )(*operands)


def _run_cols(x, w, scales, group_sizes, m, out_dtype, tiling, interpret):
    mp, k = x.shape
    n = w.shape[1] if scales is not None else w.shape[2]
    k_steps = k // tiling.tile_k
    splits = tiling.k_splits or default_k_splits(m, group_sizes.shape[0], n // tiling.tile_n, k_steps)
    part_dtype = out_dtype if splits == 1 else jnp.float32  # split partials are summed in fp32
    items = work_items(group_sizes, mp, tiling.tile_m, max_work_items(mp, group_sizes.shape[0], tiling.tile_m),
                       zero_tail=False)
    parts = _cols_parts(items.meta, x, w, scales, splits, part_dtype, tiling, interpret)
    return _gather_cols(parts, items, m)


# ----------------------------------------------------------------------------- rows kernel


def _rows_pipeline(acc_ref, x_gmem, w_gmem, stage_smem, *, row0, ni, tiling, quantized):
    """acc [tile_m, tile_n] += x @ W over all of K; one wgmma stays in flight across steps."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    tm, tn, tk = tiling.tile_m, tiling.tile_n, tiling.tile_k
    k_steps = x_gmem.shape[1] // tk
    lag = min(1, k_steps - 1)  # a pipeline of one step has nothing to overlap
    x_spec = _lhs_spec(tm, tk, row0, 0, x_gmem.dtype, delay_release=lag)
    if quantized:
        # Read into registers at the start of its step, so it could be released at once; one delay
        # level for both specs keeps each pipeline slot's two copies on the same schedule.
        w_spec = plgpu.BlockSpec((tn, tk), lambda k: (ni, k), transforms=_transforms(w_gmem.dtype, tk),
                                 delay_release=lag)  # values [N, K]

        def step(idx, x_smem, w_smem):
            # Two staging buffers: the previous step's wgmma may still read the other one.
            stage = stage_smem.at[jax.lax.rem(idx[0], 2)]  # [tn, tk]
            stage[...] = _dequantized(w_smem, x_smem.dtype)
            plgpu.commit_smem()
            plgpu.wgmma(acc_ref, x_smem, stage.T)  # [tm, tk] @ [tk, tn] (K-major B)
            plgpu.wgmma_wait(lag)
    else:
        w_spec = plgpu.BlockSpec((tk, tn), lambda k: (k, ni),
                                 transforms=_transforms(w_gmem.dtype, tn), delay_release=lag)

        def step(_, x_smem, w_smem):
            plgpu.wgmma(acc_ref, x_smem, w_smem)  # [tm, tk] @ [tk, tn]
            plgpu.wgmma_wait(lag)

    plgpu.emit_pipeline(step, grid=(k_steps,), in_specs=[x_spec, w_spec],
                        max_concurrent_steps=tiling.stages)(x_gmem, w_gmem)
    return acc_ref[...]  # waits for the last wgmma


def _store_rows(o_smem, o_gmem, row0, lo, hi, col0):
    """Rows [lo, hi) of the tile (tile row i is output row row0 + i) to o_gmem[lo:hi, col0:].

    TMA boxes have static shapes, so the dynamic count hi - lo is stored as one copy of 2^b rows
    per set bit, largest first. The SMEM tile is unswizzled: any row offset is a legal TMA source
    (a row is >= 128 bytes)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    tile_m, tile_n = o_smem.shape
    count, offset = hi - lo, lo - row0
    rows = tile_m
    while rows >= 1:
        done = count & ~(2 * rows - 1)  # rows already stored by the larger copies

        @pl.when((count & rows) != 0)
        def _(rows=rows, done=done):
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(offset + done, rows)],
                                    o_gmem.at[pl.ds(lo + done, rows), pl.ds(col0, tile_n)])

        rows //= 2
    plgpu.wait_smem_to_gmem(0)


def _rows_kernel(meta_ref, x_gmem, w_gmem, *refs, tiling, quantized):
    # meta_ref [4, W] i32; x_gmem [Mp, K]; w_gmem [G, K, N] (16-bit) or [G, N, K] (8-bit values);
    # quantized: s_gmem [G, N] f32. o_gmem [Mp, N]; o_smem [tile_m, tile_n] (unswizzled);
    # quantized: stage_smem [2, tile_n, tile_k], s_smem [tile_n] f32, s_barrier.
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if quantized:
        s_gmem, o_gmem, o_smem, stage_smem, s_smem, s_barrier = refs
    else:
        (o_gmem, o_smem), stage_smem = refs, None
    wi, ni = jax.lax.axis_index("w"), jax.lax.axis_index("n")
    group, row0, lo, hi = _item(meta_ref, wi)
    tm, tn = tiling.tile_m, tiling.tile_n

    @pl.when((hi > lo) & (group >= 0))
    def _():
        if quantized:
            plgpu.copy_gmem_to_smem(s_gmem.at[group, pl.ds(ni * tn, tn)], s_smem, s_barrier)
        pipeline = functools.partial(_rows_pipeline, x_gmem=x_gmem, w_gmem=w_gmem.at[group],
                                     stage_smem=stage_smem, row0=row0, ni=ni, tiling=tiling,
                                     quantized=quantized)
        acc = pl.run_scoped(pipeline, plgpu.ACC((tm, tn), jnp.float32))  # [tm, tn]
        if quantized:
            plgpu.barrier_wait(s_barrier)
            acc = acc * jax.lax.broadcast_in_dim(s_smem[...], (tm, tn), [1])
        o_smem[...] = acc.astype(o_smem.dtype)

    @pl.when((hi > lo) & (group < 0))
    def _():
        o_smem[...] = jnp.zeros((tm, tn), o_smem.dtype)  # rows past sum(group_sizes)

    @pl.when(hi > lo)
    def _():
        plgpu.commit_smem()
        _store_rows(o_smem, o_gmem, row0, lo, hi, ni * tn)


def _rows_ws_kernel(meta_ref, x_gmem, w_gmem, o_gmem, o_smem, *, tiling):
    # Warp-specialized rows kernel (16-bit weights): warpgroups 0 and 1 each compute half of the
    # item's rows, acc [tile_m / 2, tile_n], from the same SMEM tiles; warpgroup 2 only issues the
    # TMA copies (emit_pipeline_warp_specialized). o_smem [tile_m, tile_n]: each compute
    # warpgroup writes and stores its own half, so no CTA-wide barrier is needed.
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    wi, ni, wg = (jax.lax.axis_index(a) for a in ("w", "n", "wg"))
    group, row0, lo, hi = _item(meta_ref, wi)
    tm, tn, tk = tiling.tile_m, tiling.tile_n, tiling.tile_k
    half = tm // 2
    k_steps = x_gmem.shape[1] // tk
    lag = min(1, k_steps - 1)
    mine = pl.ds(wg * half, half)  # this compute warpgroup's rows of the tile

    @pl.when((hi > lo) & (group >= 0))
    def _():
        def compute_context(eval_pipeline):
            def acc_scope(acc_ref):
                eval_pipeline(acc_ref)
                o_smem.at[mine][...] = acc_ref[...].astype(o_smem.dtype)  # [half, tn]

            pl.run_scoped(acc_scope, plgpu.ACC((half, tn), jnp.float32))

        def step(_, x_smem, w_smem, acc_ref):
            plgpu.wgmma(acc_ref, x_smem.at[mine], w_smem)  # [half, tk] @ [tk, tn]
            plgpu.wgmma_wait(lag)
            return acc_ref

        w_spec = plgpu.BlockSpec((tk, tn), lambda k: (k, ni), transforms=_transforms(w_gmem.dtype, tn),
                                 delay_release=lag)
        plgpu.emit_pipeline_warp_specialized(
            step, grid=(k_steps,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
            in_specs=[_lhs_spec(tm, tk, row0, 0, x_gmem.dtype, delay_release=lag), w_spec],
            max_concurrent_steps=tiling.stages, compute_context=compute_context,
        )(x_gmem, w_gmem.at[group])

    @pl.when((hi > lo) & (group < 0) & (wg < 2))
    def _():
        o_smem.at[mine][...] = jnp.zeros((half, tn), o_smem.dtype)  # rows past sum(group_sizes)

    @pl.when((hi > lo) & (wg < 2))
    def _():
        plgpu.commit_smem()
        first = row0 + wg * half
        _store_rows(o_smem.at[mine], o_gmem, first, jnp.clip(lo, first, first + half),
                    jnp.clip(hi, first, first + half), ni * tn)


def _run_rows(x, w, scales, group_sizes, out_dtype, tiling, interpret):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    mp, _ = x.shape
    quantized = scales is not None
    n = w.shape[1] if quantized else w.shape[2]
    tm, tn, tk = tiling.tile_m, tiling.tile_n, tiling.tile_k
    num_items = max_work_items(mp, group_sizes.shape[0], tm)
    items = work_items(group_sizes, mp, tm, num_items, zero_tail=True)
    scratch = [plgpu.SMEM((tm, tn), out_dtype)]
    operands = [items.meta, x, w]
    if quantized:
        operands.append(scales)
        scratch += [plgpu.SMEM((2, tn, tk), x.dtype, transforms=_transforms(x.dtype, tk)),
                    plgpu.SMEM((tn,), jnp.float32), plgpu.Barrier(num_arrivals=1)]
    if tiling.path == "rows_ws":
        body = functools.partial(_rows_ws_kernel, tiling=tiling)
        threads = dict(num_threads=3, thread_name="wg")  # 2 compute + 1 memory warpgroup
    else:
        body = functools.partial(_rows_kernel, tiling=tiling, quantized=quantized)
        threads = {}
    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((mp, n), out_dtype), scratch_types=scratch,
        grid=(num_items, n // tn), grid_names=("w", "n"), **threads, kernel_name="grouped_matmul_rows",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=_interpret_params(interpret),
    )(*operands)


# ----------------------------------------------------------------------------- entry point


def smem_bytes(tiling: tuning.GpuTiling, x_dtype, w_dtype, out_dtype, *, interpret=False) -> int:
    """Shared memory of one CTA: the pipeline's tiles, the output tile and staging buffers."""
    tm, tn, tk = tiling.tile_m, tiling.tile_n, tiling.tile_k
    xb, wb = jnp.dtype(x_dtype).itemsize, jnp.dtype(w_dtype).itemsize
    total = tiling.stages * (tm * tk * xb + tn * tk * wb)
    quantized = wb == 1
    if tiling.path == "cols":
        total += tn * tm * 4 + (tn * 4 + (tn * tk * xb if interpret else 0) if quantized else 0)
    else:
        total += tm * tn * jnp.dtype(out_dtype).itemsize
        total += 2 * tn * tk * xb + tn * 4 if quantized else 0
    return total


def choose_tiling(m: int, k: int, n: int, num_groups: int, x_dtype, w_dtype, out_dtype) -> tuning.GpuTiling:
    """tuning.gpu_tiling's entry for the shape, with K steps (then stages) cut to fit SMEM."""
    tiling = tuning.gpu_tiling(m, k, n, num_groups, jnp.dtype(w_dtype))
    while smem_bytes(tiling, x_dtype, w_dtype, out_dtype) > tuning.SMEM_BUDGET:
        if tiling.tile_k > 64:
            tiling = dataclasses.replace(tiling, tile_k=tiling.tile_k // 2)
        elif tiling.stages > 2:
            tiling = dataclasses.replace(tiling, stages=tiling.stages - 1)
        elif tiling.tile_n > 64:
            tiling = dataclasses.replace(tiling, tile_n=tiling.tile_n // 2)
        else:
            break
    return tiling


def supported(lhs, rhs) -> bool:
    """Whether the kernels take this call: bf16/f16 lhs, rhs of the same dtype or quantized
    (int8 / e4m3) experts, K and N multiples of 64."""
    try:
        _check_supported(lhs, rhs)
    except NotImplementedError:
        return False
    return True


def _check_supported(lhs, rhs) -> None:
    if lhs.dtype not in (jnp.bfloat16, jnp.float16):
        raise NotImplementedError(f"GPU grouped matmul takes bf16/f16 lhs, got {lhs.dtype}")
    if not isinstance(rhs, QuantizedExperts) and rhs.dtype != lhs.dtype:
        raise NotImplementedError(
            f"GPU grouped matmul takes rhs of the lhs dtype or QuantizedExperts, got {rhs.dtype}")
    _, k, n = rhs.shape
    if k % 64 or n % 64:
        raise NotImplementedError(f"GPU grouped matmul needs K and N multiples of 64, got K={k}, N={n}")


_MAX_TILE_REGS = 128  # fp32 accumulator / register-A registers per thread of the warpgroup (of 255)


def check_tiling(tiling: tuning.GpuTiling, k: int, n: int, *, quantized: bool = False) -> None:
    """A clear error for a tiling the kernels cannot run."""
    t = tiling
    problems = []
    rows_per_wg = t.tile_m // 2 if t.path == "rows_ws" else t.tile_m
    if rows_per_wg * t.tile_n // 128 > _MAX_TILE_REGS:
        problems.append(f"the fp32 accumulator needs tile_m * tile_n <= {128 * _MAX_TILE_REGS} "
                        "per compute warpgroup")
    if quantized and t.path == "cols" and t.tile_n * t.tile_k * 2 // (4 * 128) > _MAX_TILE_REGS // 2:
        problems.append("the cols kernel's register weight tile needs tile_n * tile_k <= 16384")
    if t.path not in ("rows", "rows_ws", "cols"):
        problems.append(f"path must be 'rows', 'rows_ws' or 'cols', got {t.path!r}")
    if t.tile_k % 64 or k % t.tile_k or t.tile_n % 64 or n % t.tile_n:
        problems.append(f"tile_k and tile_n must be multiples of 64 dividing K={k} and N={n}")
    if t.path == "rows" and (t.tile_m % 64 or t.tile_n > 256):
        problems.append("the rows kernel needs tile_m a multiple of 64 (wgmma M) and tile_n <= 256")
    if t.path == "rows_ws" and (t.tile_m % 128 or t.tile_n > 256 or quantized):
        problems.append("the rows_ws kernel takes 16-bit weights, tile_m a multiple of 128 (two "
                        "warpgroups of wgmma M) and tile_n <= 256")
    if t.path == "cols" and (t.tile_m % 8 or t.tile_m > 256):
        problems.append("the cols kernel needs tile_m a multiple of 8 and <= 256 (wgmma N)")
    if t.k_splits and (k // t.tile_k) % t.k_splits:
        problems.append(f"k_splits={t.k_splits} must divide the {k // t.tile_k} K steps")
    if t.stages < 2:
        problems.append("stages must be >= 2 (a slot is released one step late)")
    if problems:
        raise ValueError(f"bad GPU tiling {tiling}: " + "; ".join(problems))


def _operands(lhs, rhs, preferred_element_type):
    """A kernel call's checked operands: lhs padded to the 8-row grid [Mp, K] (the TMA tiling needs M % 8 == 0),
    the weights, their scales (None for 16-bit experts) and the output dtype."""
    _check_supported(lhs, rhs)
    w, scales = (rhs.values, rhs.scales) if isinstance(rhs, QuantizedExperts) else (rhs, None)
    m = lhs.shape[0]
    x = jnp.pad(lhs, ((0, -(-m // _ROW_ALIGN) * _ROW_ALIGN - m), (0, 0)))  # [Mp, K]
    return x, w, scales, output_dtype(lhs, preferred_element_type)


@functools.partial(jax.jit, static_argnames=("preferred_element_type", "tiling", "interpret"))
def grouped_matmul(lhs: jax.Array, rhs, group_sizes: jax.Array, *, preferred_element_type=None,
                   tiling: tuning.GpuTiling | None = None, interpret: bool = False) -> jax.Array:
    """Mosaic GPU grouped matmul with `jax.lax.ragged_dot` semantics; [M, N]."""
    check_args(lhs, rhs, group_sizes)
    x, w, scales, out_dtype = _operands(lhs, rhs, preferred_element_type)
    m, k = lhs.shape
    num_groups, _, n = rhs.shape
    tiling = tiling or choose_tiling(m, k, n, num_groups, lhs.dtype, w.dtype, out_dtype)
    check_tiling(tiling, k, n, quantized=scales is not None)
    gs = group_sizes.astype(jnp.int32)
    if tiling.path == "cols":
        return _run_cols(x, w, scales, gs, m, out_dtype, tiling, interpret).astype(out_dtype)
    return _run_rows(x, w, scales, gs, out_dtype, tiling, interpret)[:m]


# ----------------------------------------------------------------------------- per-pair form

# Live pairs assumed when splitting K for the per-pair form: a batch-1 decode step of a top-8 model. Its
# table has a work item per pair of the token bucket, most of them skipped, so the bucket says little.
_PAIR_SPLIT_LIVE = 8


def pair_tiling(k: int, n: int, rhs_dtype, tiling: tuning.GpuTiling | None = None) -> tuning.GpuTiling:
    """The cols tiling of the per-pair form: 8-row items; K split (at most tiling.k_splits, rounded down to
    a divisor of the K steps) so that the CTAs of _PAIR_SPLIT_LIVE live pairs cover the SMs."""
    base = tiling or tuning.gpu_tiling(1, k, n, 1, jnp.dtype(rhs_dtype))  # the one-row-per-expert entry
    k_steps = k // base.tile_k
    want = base.k_splits or max(1, -(-_NUM_SMS // (_PAIR_SPLIT_LIVE * (n // base.tile_n))))
    splits = max(d for d in range(1, max(1, min(want, k_steps)) + 1) if k_steps % d == 0)
    return dataclasses.replace(base, path="cols", tile_m=_ROW_ALIGN, k_splits=splits)


@functools.partial(jax.jit, static_argnames=("preferred_element_type", "tiling", "interpret"))
def gather_matmul(lhs: jax.Array, rhs, rows: jax.Array, experts: jax.Array, *, preferred_element_type=None,
                  tiling: tuning.GpuTiling | None = None, interpret: bool = False) -> jax.Array:
    """out[p] = lhs[rows[p]] @ rhs[experts[p]] for P pairs, zeros where experts[p] is outside [0, G); [P, N].

    The cols kernel with one work item per pair and no sort: item p reads the 8-row lhs tile holding row
    rows[p] and its expert's weights, and keeps that row's column of the transposed output tile. For decode
    steps of a few tokens (each pair of a top-k token mostly has an expert of its own) this replaces the
    sort, the work-item table and the un-permute of the grouped form with one elementwise table; pairs that
    share an expert read its tiles once each (from L2 when they run together)."""
    x, w, scales, out_dtype = _operands(lhs, rhs, preferred_element_type)
    k = lhs.shape[1]
    g, _, n = rhs.shape
    tiling = pair_tiling(k, n, w.dtype, tiling)
    check_tiling(tiling, k, n, quantized=scales is not None)
    rows, experts = rows.astype(jnp.int32), experts.astype(jnp.int32)
    live = (experts >= 0) & (experts < g)  # [P]
    meta = jnp.stack([jnp.where(live, experts, -1), rows // _ROW_ALIGN * _ROW_ALIGN,
                      jnp.where(live, rows, 0), jnp.where(live, rows + 1, 0)])  # [4, P]
    splits = tiling.k_splits
    parts = _cols_parts(meta, x, w, scales, splits, out_dtype if splits == 1 else jnp.float32, tiling,
                        interpret)  # [splits, P, N, 8]
    p = rows.shape[0]
    picked = parts[:, jnp.arange(p)[:, None], jnp.arange(n)[None, :], (rows % _ROW_ALIGN)[:, None]]  # [splits, P, N]
    out = picked[0] if splits == 1 else picked.astype(jnp.float32).sum(axis=0)  # [P, N]
    return jnp.where(live[:, None], out, 0).astype(out_dtype)
