"""The skinny product as one Pallas Triton kernel: a few rows, RMS-normed in the prologue, against a whole weight.

    parts [S, T, N] f32 (, normed [T, K]) = normed_matmul_parts(x [T, K], w [K, N], norm [K] | None, eps, tiling)

Program (j, s) of the (N / block_n, S) grid reads the weight's [K/S, block_n] block once, in block_k-row steps
(unrolled, so their loads are in flight together), and writes the float32 partial product of its K slice:
the caller sums the S slices, which XLA fuses into whatever reads the product. With a norm, every program first
takes the mean of squares of all of x's T rows (T x K values, from the L2) and scales its slice of them as the
engine's rms_norm does, rounding to x's dtype before the product, so the result is the reference's up to the
order of the float32 sums. With `write_normed`, the programs of column block 0 also store their slice of the
normed rows (a later kernel that needs them, like the MoE experts beside the router, reads them there).

Why a kernel: at decode sizes (2 rows) XLA's Triton GEMM tiles the output 8 x 64 and leaves most SMs idle
for 2,048-wide weights, and the norm before the product is a kernel of its own (1.75 us a layer on an H200 in
Qwen3-30B-A3B's batch-1 loop); see docs/PERFORMANCE.md, issue 13. Rows are products on the CUDA cores (a
[block_k, block_n] block times one row's [block_k] slice, summed over K): two rows are far below a tensor-core
tile, and the weight's bytes, not the arithmetic, bound the kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Columns per program, weight rows per loop step, K slices (grid axis 1), warps and pipeline stages; with
    `block_acc` each row keeps a [block_k, block_n] float32 accumulator and sums it over K once at the end (else
    every step reduces its [block_k, block_n] products to [block_n], a cross-thread reduction per step)."""

    block_n: int = 64
    block_k: int = 64
    splits: int = 4
    warps: int = 4
    stages: int = 3
    block_acc: bool = True
    mma: bool = False


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def takes(tokens: int, k: int, n: int, tiling: Tiling) -> bool:
    """Whether the kernel takes [T, K] x [K, N] with this tiling (Triton blocks are powers of two)."""
    t = tiling
    return (0 < tokens <= 16 and _pow2(t.block_n) and _pow2(t.block_k) and t.splits >= 1
            and n % t.block_n == 0 and k % (t.splits * t.block_k) == 0)


_MMA_ROWS = 16  # the least M of a Triton dot: x is padded to it for the tensor-core form


def _mma_kernel(*refs, eps: float, block_k: int, normed: bool, k_chunk: int):
    # The tensor-core form: x_ref [16, K] (padded rows are zero), g_ref [K], w_ref [K/S, BN], o_ref [16, BN].
    import jax.experimental.pallas as pl

    x_ref, refs = refs[0], refs[1:]
    g_ref, refs = (refs[0], refs[1:]) if normed else (None, refs)
    w_ref, o_ref = refs
    k_all = x_ref.shape[1]
    k_slice, block_n = w_ref.shape
    base = pl.program_id(1) * k_slice
    f32 = jnp.float32
    inv = None
    if normed:
        sums = None
        for c in range(k_all // k_chunk):
            xc = x_ref[:, c * k_chunk:(c + 1) * k_chunk].astype(f32)  # [16, KC]
            part = jnp.sum(xc * xc, axis=1)  # [16]
            sums = part if sums is None else sums + part
        inv = jax.lax.rsqrt(sums / k_all + eps)  # [16]
    acc = jnp.zeros((_MMA_ROWS, block_n), f32)
    for i in range(k_slice // block_k):
        cols = pl.ds(base + i * block_k, block_k)
        xs = x_ref[:, cols]  # [16, BK]
        if normed:
            xs = (xs.astype(f32) * inv[:, None] * g_ref[cols].astype(f32)[None, :]).astype(xs.dtype)
        w = w_ref[i * block_k:(i + 1) * block_k, :]  # [BK, BN]
        acc += jnp.dot(xs, w, preferred_element_type=f32)  # [16, BK] x [BK, BN] -> [16, BN]
    o_ref[...] = acc


def _kernel(*refs, eps: float, block_k: int, block_acc: bool, normed: bool, write_normed: bool):
    # x_ref [T, K] (all of x: only slices are loaded), g_ref [K] (with a norm), w_ref [K/S, BN] (this program's
    # block), o_ref [T, BN] float32 (its partial product), n_ref [T, K] (the normed rows, with write_normed).
    import jax.experimental.pallas as pl

    x_ref, refs = refs[0], refs[1:]
    g_ref, refs = (refs[0], refs[1:]) if normed else (None, refs)
    w_ref, o_ref = refs[0], refs[1]
    n_ref = refs[2] if write_normed else None
    tokens, k_all = x_ref.shape
    k_slice, block_n = w_ref.shape
    base = pl.program_id(1) * k_slice
    steps = k_slice // block_k
    f32 = jnp.float32

    # Every loop below is unrolled in Python: a fori_loop's steps each waited on their loads (the Triton
    # pipeliner did not take them; one H200, ~1 us a step), while unrolled loads are independent and issue together.
    inv = [None] * tokens
    if normed:  # the mean of squares of each whole row, one [K] load a row
        for t in range(tokens):
            row = x_ref[t, :].astype(f32)  # [K]
            inv[t] = jax.lax.rsqrt(jnp.sum(row * row) / k_all + eps)

    def row_slice(t: int, cols) -> jax.Array:
        """Row t of x over `cols`, normed (in x's dtype, as the reference rounds it) when there is a norm."""
        row = x_ref[t, cols]  # [BK]
        if not normed:
            return row
        return (row.astype(f32) * inv[t] * g_ref[cols].astype(f32)).astype(row.dtype)

    acc = [None] * tokens  # per row: [BK, BN] float32 (block_acc) or [BN]
    for i in range(steps):
        cols = pl.ds(base + i * block_k, block_k)
        w = w_ref[i * block_k:(i + 1) * block_k, :].astype(f32)  # [BK, BN]
        for t in range(tokens):
            prod = row_slice(t, cols).astype(f32)[:, None] * w  # [BK, 1] * [BK, BN]
            prod = prod if block_acc else jnp.sum(prod, axis=0)  # [BN]
            acc[t] = prod if acc[t] is None else acc[t] + prod
    for t in range(tokens):
        o_ref[t, :] = jnp.sum(acc[t], axis=0) if block_acc else acc[t]  # [BN]
    if write_normed:
        @pl.when(pl.program_id(0) == 0)
        def _():
            for i in range(steps):
                cols = pl.ds(base + i * block_k, block_k)
                for t in range(tokens):
                    n_ref[t, cols] = row_slice(t, cols)


def _mma_parts(x: jax.Array, w: jax.Array, norm: jax.Array | None, eps: float, t: Tiling,
               interpret: bool) -> jax.Array:
    """The tensor-core form: x padded to 16 rows, [S, 16, N] float32 parts."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as plt

    tokens, k = x.shape
    n = w.shape[1]
    xp = jnp.pad(x, ((0, _MMA_ROWS - tokens), (0, 0)))  # [16, K]
    k_slice = k // t.splits
    operands = [xp] + ([norm] if norm is not None else []) + [w]
    in_specs = [pl.BlockSpec((_MMA_ROWS, k), lambda j, s: (0, 0))]
    if norm is not None:
        in_specs.append(pl.BlockSpec((k,), lambda j, s: (0,)))
    in_specs.append(pl.BlockSpec((k_slice, t.block_n), lambda j, s: (s, j)))
    return pl.pallas_call(
        functools.partial(_mma_kernel, eps=float(eps), block_k=t.block_k, normed=norm is not None,
                          k_chunk=min(k, 256)),
        out_shape=jax.ShapeDtypeStruct((t.splits, _MMA_ROWS, n), jnp.float32), grid=(n // t.block_n, t.splits),
        in_specs=in_specs, out_specs=pl.BlockSpec((None, _MMA_ROWS, t.block_n), lambda j, s: (s, 0, j)),
        compiler_params=plt.CompilerParams(num_warps=t.warps, num_stages=t.stages),
        interpret=interpret, name="skinny_matmul_mma",
    )(*operands)


@functools.partial(jax.jit, static_argnames=("eps", "tiling", "write_normed", "interpret"))
def normed_matmul_parts(x: jax.Array, w: jax.Array, norm: jax.Array | None = None, *, eps: float = 1e-6,
                        tiling: Tiling = Tiling(), write_normed: bool = False, interpret: bool = False):
    """x [T, K], w [K, N], norm [K] or None -> parts [S, T, N] float32 (module docstring); with write_normed also
    the normed rows [T, K] in x's dtype."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as plt

    tokens, k = x.shape
    n = w.shape[1]
    if w.shape[0] != k or (norm is not None and norm.shape != (k,)):
        raise ValueError(f"skinny product: x {x.shape}, w {w.shape}, norm {None if norm is None else norm.shape}")
    if not takes(tokens, k, n, tiling):
        raise ValueError(f"the skinny product kernel takes 1-16 rows, N a multiple of block_n and K of splits x "
                         f"block_k (powers of two), got x {x.shape} @ w {w.shape} with {tiling}")
    if write_normed and norm is None:
        raise ValueError("write_normed needs a norm")
    t = tiling
    k_slice = k // t.splits
    if t.mma and not write_normed:
        return _mma_parts(x, w, norm, eps, t, interpret)[:, :tokens]  # [S, T, N]
    operands = [x] + ([norm] if norm is not None else []) + [w]
    in_specs = [pl.BlockSpec((tokens, k), lambda j, s: (0, 0))]
    if norm is not None:
        in_specs.append(pl.BlockSpec((k,), lambda j, s: (0,)))
    in_specs.append(pl.BlockSpec((k_slice, t.block_n), lambda j, s: (s, j)))
    out_shape = [jax.ShapeDtypeStruct((t.splits, tokens, n), jnp.float32)]
    out_specs = [pl.BlockSpec((None, tokens, t.block_n), lambda j, s: (s, 0, j))]
    if write_normed:
        out_shape.append(jax.ShapeDtypeStruct((tokens, k), x.dtype))
        out_specs.append(pl.BlockSpec((tokens, k), lambda j, s: (0, 0)))
    out = pl.pallas_call(
        functools.partial(_kernel, eps=float(eps), block_k=t.block_k, block_acc=t.block_acc, normed=norm is not None,
                          write_normed=write_normed),
        out_shape=out_shape, grid=(n // t.block_n, t.splits), in_specs=in_specs, out_specs=out_specs,
        compiler_params=plt.CompilerParams(num_warps=t.warps, num_stages=t.stages),
        interpret=interpret, name="skinny_matmul",
    )(*operands)
    return tuple(out) if write_normed else out[0]
