"""Grouped matmul as a Pallas Mosaic TPU kernel (runs in interpret mode on CPU).

Work decomposition (megablox-style):

* lhs rows are cut into aligned tiles of `tile_m` rows. A *work item* is one (row tile, group)
  pair whose rows overlap: a tile holding the end of group g and the start of group g+1 is
  visited twice, once with each group's weights. The wrapper lists the items on device, in row
  order, into a static-size table (`tile_items`: at most `tiles + min(G, M)` items), and
  scalar-prefetches it, so the grid never depends on the routing.
* grid = (N tiles, items, K steps), K innermost: one fp32 VMEM accumulator per item collects the
  K sum; Pallas pipelines the lhs / weight blocks (the weight block of an item is
  `rhs[group, k, n]`, picked by the index map from the prefetched table).
* The output block index is the item's row tile, so consecutive items of the same tile keep the
  block resident in VMEM (the item axis is "arbitrary": sequential). At an item's last K step its
  rows [lo, hi) are written, the other rows keep what earlier items of the tile wrote; the first
  item of a tile starts from zeros. Rows past sum(group_sizes) are zeros: tiles with no group rows
  get one item of pseudo-group -1 that computes nothing.
* Quantized experts (int8 / e4m3 values `[G, N, K]`): the weight block is converted to the lhs
  dtype in VMEM (exact), contracted over K of both operands, and the per-channel scales multiply
  the finished fp32 tile.
* f32 operands use HIGHEST precision (on a TPU the default would be one bf16 pass).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.grouped_matmul import tuning
from pallas_kernels.grouped_matmul.reference import QuantizedExperts, check_args, output_dtype


def tile_items(group_sizes: jax.Array, num_rows: int, num_tiles: int, tile_m: int,
               max_items: int) -> jax.Array:
    """The (row tile, group) items of one call: [5, W] int32 rows = tile, group (-1: none),
    lo, hi (the rows this item writes), first (1 for a tile's first item). Padding items repeat
    the last tile with an empty row range."""
    num_groups = group_sizes.shape[0]
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), num_rows)  # [G]
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])  # [G]
    zero_tile0 = (ends[-1] + tile_m - 1) // tile_m  # first tile with no group rows
    counts = jnp.where(ends > starts, (ends - 1) // tile_m - starts // tile_m + 1, 0)  # [G]
    counts = jnp.concatenate([counts, (num_tiles - zero_tile0)[None]])  # [G+1]: groups, zero tiles
    bounds = jnp.cumsum(counts)
    w = jnp.arange(max_items, dtype=jnp.int32)
    seg = jnp.searchsorted(bounds, w, side="right", method="compare_all")  # [W]: first bound > w
    seg = jnp.minimum(seg, num_groups).astype(jnp.int32)
    j = w - (bounds - counts)[seg]
    is_group = seg < num_groups
    g = jnp.minimum(seg, num_groups - 1)
    tile = jnp.where(is_group, starts[g] // tile_m + j, zero_tile0 + j)
    real = w < bounds[-1]
    tile = jnp.where(real, tile, num_tiles - 1)
    lo = jnp.where(real & is_group, jnp.maximum(starts[g], tile * tile_m), 0)
    hi = jnp.where(real & is_group, jnp.minimum(ends[g], (tile + 1) * tile_m), 0)
    first = jnp.concatenate([jnp.ones((1,), jnp.int32), (tile[1:] != tile[:-1]).astype(jnp.int32)])
    group = jnp.where(real & is_group, seg, -1)
    return jnp.stack([tile, group, lo, hi, first]).astype(jnp.int32)  # [5, W]


def _gmm_kernel(items_ref, x_ref, w_ref, *refs, quantized, k_steps, precision):
    # items_ref [5 * W] i32 (SMEM, scalar prefetch); x_ref [tm, tk]; w_ref [tk, tn] (16/32-bit) or
    # [tn, tk] (8-bit values); quantized: s_ref [1, tn] f32. o_ref [tm, tn]; acc_ref [tm, tn] f32.
    s_ref, o_ref, acc_ref = refs if quantized else (None, *refs)
    num_items = pl.num_programs(1)
    w, k = pl.program_id(1), pl.program_id(2)
    tile, group, lo, hi, first = (items_ref[i * num_items + w] for i in range(5))

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(group >= 0)
    def _():
        x = x_ref[...]
        wt = w_ref[...].astype(x.dtype)
        dims = (((1,), (1,)), ((), ())) if quantized else (((1,), (0,)), ((), ()))
        acc_ref[...] += jax.lax.dot_general(x, wt, dims, precision=precision,
                                            preferred_element_type=jnp.float32)  # [tm, tn]

    @pl.when(k == k_steps - 1)
    def _():
        out = acc_ref[...] * s_ref[...] if quantized else acc_ref[...]  # [tm, tn]
        rows = tile * x_ref.shape[0] + jax.lax.broadcasted_iota(jnp.int32, out.shape, 0)
        mine = (rows >= lo) & (rows < hi)
        kept = jnp.where(first == 1, 0.0, o_ref[...].astype(jnp.float32))  # earlier items' rows
        o_ref[...] = jnp.where(mine, out, kept).astype(o_ref.dtype)


def _specs(quantized: bool, tiling: tuning.TpuTiling, num_items: int):
    tm, tn, tk = tiling.tile_m, tiling.tile_n, tiling.tile_k
    item = lambda items, i, w: items[i * num_items + w]
    grp = lambda items, w: jnp.maximum(item(items, 1, w), 0)
    x_spec = pl.BlockSpec((tm, tk), lambda n, w, k, items: (item(items, 0, w), k))
    if quantized:
        w_spec = pl.BlockSpec((None, tn, tk), lambda n, w, k, items: (grp(items, w), n, k))
        s_spec = pl.BlockSpec((None, 1, tn), lambda n, w, k, items: (grp(items, w), 0, n))
        in_specs = [x_spec, w_spec, s_spec]
    else:
        in_specs = [x_spec, pl.BlockSpec((None, tk, tn), lambda n, w, k, items: (grp(items, w), k, n))]
    out_spec = pl.BlockSpec((tm, tn), lambda n, w, k, items: (item(items, 0, w), n))
    return in_specs, out_spec


@functools.partial(jax.jit, static_argnames=("preferred_element_type", "tiling", "interpret"))
def grouped_matmul(lhs: jax.Array, rhs, group_sizes: jax.Array, *, preferred_element_type=None,
                   tiling: tuning.TpuTiling | None = None, interpret: bool = False) -> jax.Array:
    """Pallas TPU grouped matmul with `jax.lax.ragged_dot` semantics; [M, N]."""
    check_args(lhs, rhs, group_sizes)
    m, k = lhs.shape
    num_groups, _, n = rhs.shape
    tiling = tiling or tuning.tpu_tiling(m, k, n)
    if k % tiling.tile_k or n % tiling.tile_n or tiling.tile_m % 8:
        raise ValueError(f"tiling {tiling} must divide K={k} and N={n}, with tile_m a multiple of 8")
    quantized = isinstance(rhs, QuantizedExperts)
    num_tiles = -(-m // tiling.tile_m)
    num_items = num_tiles + min(num_groups, m)
    items = tile_items(group_sizes, m, num_tiles, tiling.tile_m, num_items).reshape(-1)  # [5 * W]
    x = jnp.pad(lhs, ((0, num_tiles * tiling.tile_m - m), (0, 0)))  # [Mp, K]
    if quantized:
        operands = [x, rhs.values, rhs.scales[:, None, :]]  # scales [G, 1, N]
        compute = lhs.dtype
    else:
        compute = jnp.promote_types(lhs.dtype, rhs.dtype)
        operands = [x.astype(compute), rhs.astype(compute)]
    precision = jax.lax.Precision.HIGHEST if compute == jnp.float32 else None
    in_specs, out_spec = _specs(quantized, tiling, num_items)
    out = pl.pallas_call(
        functools.partial(_gmm_kernel, quantized=quantized, k_steps=k // tiling.tile_k,
                          precision=precision),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(n // tiling.tile_n, num_items, k // tiling.tile_k),
            in_specs=in_specs, out_specs=out_spec,
            scratch_shapes=[pltpu.VMEM((tiling.tile_m, tiling.tile_n), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct((num_tiles * tiling.tile_m, n),
                                       output_dtype(lhs, preferred_element_type)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
    )(items, *operands)
    return out[:m]
