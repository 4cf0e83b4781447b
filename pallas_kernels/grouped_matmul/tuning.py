"""Tile sizes of the grouped matmul kernels, as data.

The GPU table is keyed by (shape class, weight class). The shape class is the mean number of rows
per expert, `M / G`, because that decides what bounds the kernel. With few rows per expert
(decode: M = tokens x top-k spread over 128 experts) every active expert's weights must be
streamed once from HBM and the kernel is bandwidth bound: the "cols" kernel computes
`y^T = W^T x^T`, so 64 output channels are the wgmma M side and the expert's handful of rows is
the narrow N side (`tile_m` = 8..64 rows, a multiple of 8). With many rows per expert (prefill)
each weight tile serves a whole block of rows, the tensor cores carry the work (Qwen3 at 4096
tokens: 103 GFLOP against 587 MB, close to the balance point of an H100), and the "rows" kernel
gives each CTA a `tile_m x tile_n` output block of one expert.

`tile_m` of the cols kernel is sized to hold one expert's rows plus up to 7 rows of offset (work
items start on an 8-row boundary, docs/KERNELS.md), so each active expert's weights are read once
per output tile. `k_splits=None` means: split K until the expected CTAs (active experts x N tiles x
splits) cover the 132 SMs of an H100/H200 twice.

These are first choices made without a GPU (shared-memory budget and the reasoning above);
`scripts/bench_grouped_matmul.py` times the alternatives next to them. Update the table from its
numbers.
"""

from __future__ import annotations

import dataclasses

SMEM_BUDGET = 220 * 1024  # of the 227 KB a Hopper CTA may use; Mosaic's barriers take the rest


@dataclasses.dataclass(frozen=True)
class GpuTiling:
    """One GPU kernel configuration. path: "cols" (decode, weights are wgmma M), "rows", or
    "rows_ws" (rows with a memory warpgroup and two compute warpgroups; 16-bit weights)."""

    path: str
    tile_m: int  # lhs rows per work item (cols: wgmma N, multiple of 8; rows: 64/128; rows_ws: 128)
    tile_n: int  # output channels per CTA (cols: 64 or 128; rows: 64..256)
    tile_k: int  # K per pipeline step
    stages: int  # pipeline depth (emit_pipeline max_concurrent_steps)
    k_splits: int | None = None  # cols only: K slices per work item (None: automatic)


@dataclasses.dataclass(frozen=True)
class TpuTiling:
    tile_m: int
    tile_n: int
    tile_k: int


# (max mean rows per expert, weight class) -> tiling; the first row whose bound >= M / G wins.
# Weight class: "16bit" (bf16/f16 rhs) or "8bit" (int8/fp8 QuantizedExperts).
GPU_TABLE: tuple[tuple[float, str, GpuTiling], ...] = (
    (1.0, "16bit", GpuTiling("cols", tile_m=8, tile_n=64, tile_k=128, stages=4)),
    (1.0, "8bit", GpuTiling("cols", tile_m=8, tile_n=64, tile_k=256, stages=4)),
    (6.0, "16bit", GpuTiling("cols", tile_m=16, tile_n=64, tile_k=128, stages=4)),
    (6.0, "8bit", GpuTiling("cols", tile_m=16, tile_n=64, tile_k=256, stages=4)),
    (20.0, "16bit", GpuTiling("cols", tile_m=32, tile_n=64, tile_k=128, stages=4)),
    (20.0, "8bit", GpuTiling("cols", tile_m=32, tile_n=64, tile_k=256, stages=4)),
    (48.0, "16bit", GpuTiling("cols", tile_m=64, tile_n=64, tile_k=128, stages=4)),
    (48.0, "8bit", GpuTiling("cols", tile_m=64, tile_n=64, tile_k=256, stages=4)),
    (float("inf"), "16bit", GpuTiling("rows", tile_m=128, tile_n=128, tile_k=64, stages=4)),
    (float("inf"), "8bit", GpuTiling("rows", tile_m=128, tile_n=128, tile_k=64, stages=4)),
)

_TPU_TILE_M = 128
_TPU_TILE_N = (512, 256, 128)
_TPU_TILE_K = (512, 256, 128)


def weight_class(rhs_dtype) -> str:
    return "8bit" if rhs_dtype.itemsize == 1 else "16bit"


def gpu_tiling(m: int, k: int, n: int, num_groups: int, rhs_dtype) -> GpuTiling:
    """The table's tiling for this call, with tile_k / tile_n shrunk to divide K and N."""
    rows_per_group = m / max(num_groups, 1)
    wclass = weight_class(rhs_dtype)
    tiling = next(t for bound, c, t in GPU_TABLE if c == wclass and rows_per_group <= bound)
    tile_k = tiling.tile_k
    while tile_k > 64 and k % tile_k:
        tile_k //= 2
    tile_n = tiling.tile_n
    while tile_n > 64 and n % tile_n:
        tile_n //= 2
    return dataclasses.replace(tiling, tile_k=tile_k, tile_n=tile_n)


def tpu_tiling(m: int, k: int, n: int) -> TpuTiling:
    """Lane-aligned N and K blocks that divide the dims (or the whole dim), M blocks of <= 128."""
    tile_m = min(_TPU_TILE_M, -(-m // 16) * 16)
    tile_n = next((t for t in _TPU_TILE_N if n % t == 0), n)
    tile_k = next((t for t in _TPU_TILE_K if k % t == 0), k)
    return TpuTiling(tile_m, tile_n, tile_k)
