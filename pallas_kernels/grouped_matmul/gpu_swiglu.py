"""The MoE decode step's experts as one Mosaic GPU kernel: per (token, expert) pair, gate, up, SwiGLU and down.

    parts [S, k, T, D] f32 = swiglu_experts(x [T, D], w_gate [E, D, F], w_up [E, D, F], w_down [E, F, D],
                                            experts [T, k], valid [T], expert_offset)
    sum over s of parts[s, j, t] = silu(x[t] @ Wg[e]) * (x[t] @ Wu[e]) @ Wd[e],  e = experts[t, j] - expert_offset

Why one kernel: at batch 1 an MoE layer's experts were three `gather_matmul` launches plus the SwiGLU and the
picks of their transposed tiles between them, ~9 kernels whose launch gaps and ramps cost more than the
bytes they move (docs/PERFORMANCE.md, issue 13). SwiGLU is elementwise in F, so a slice of F can go all the
way through: the down projection's K dimension is F, and each slice's contribution to the output is a
partial sum.

A CTA is one (token, slot) pair and one slice of `tile_f` intermediate channels (grid (k, T, F / tile_f)):
1. gate and up: `g, u [64, tile_f] = x[row0 : row0 + 64] @ Wg[e][:, slice], ... @ Wu[e][:, slice]`, a
   pipeline over D in `tile_k` steps. wgmma's M side is 64 rows, and a pair has one row: the x tile is the 64
   rows from the 8-row block holding it (row0 = the token rounded down to 8, the TMA tiling of a swizzled tile;
   the TMA zero-fills rows past the last), and rows are independent, so the other 63 rows cost tensor-core time only
   (the kernel is bound by the weight bytes, ~3x over the matmul time at Qwen3-30B-A3B's shapes).
   `gate_up="cols"` (the default at most 16 pairs) turns this around: `g^T, u^T [tile_f, 8] = Wg[e][:, slice]^T
   @ x[row0 : row0 + 8]^T`, the weight tile as wgmma's transposed A operand and only the 8-row block of x staged
   (2 KB a step at tile_k 128 instead of 16 KB; a stage's SMEM 34 KB instead of 48, so 4 stages fit), and step 3
   reads h^T stored transposed into SMEM. At batch 1 on an H200 the kernel went 25.9 -> 22.3 us a layer.
2. h = silu(g) * u, in registers, cast to the weights' dtype.
3. down, per `tile_d` block of D (a second pipeline): "cols" (the default) stages h once in SMEM and computes
   `y^T [tile_d, 8] = Wd[e][slice, d tile]^T @ (rows 0..7 of h)^T`, D channels on wgmma's M side as in
   gather_matmul, then picks the token's column with a masked row sum in registers; "rows" computes
   `y [64, tile_d] = h @ Wd[e][slice, d tile]` with h as the register A operand (the attention kernels' P @ V
   pattern) and stores all 64 fp32 rows to SMEM to send one on, which made it slower. Either way one
   [tile_d] row goes to `parts[slice, slot, token, d tile]` through a two-slot SMEM buffer and a TMA store.
Pairs of padding tokens (valid false) or with an expert held elsewhere (expert parallelism) exit at once and
leave their rows unwritten: the caller masks them (the MoE combine does, with `where`). Given the routing
weights, the kernel scales each row by its pair's weight and those pairs write zero rows instead, so the
combine is a plain sum (at batch 1 that takes the combine's mask fusion out of each layer). The pairs are laid out
slot-major ([k, T]), so the combine's sum over slices and slots is over the two leading axes (no transpose).

The caller sums the S = F / tile_f partials in the reduction that weights and adds the k slots of each token,
so the kernel needs no cross-CTA reduction. Or, given a float32 residual as well as the weights, the kernel adds each
row into the residual with a TMA reduce-add store (the memory system does the cross-CTA sum) and writes no parts.
16-bit weights only (`supported`); quantized experts keep the three-launch `gather_matmul` path. Interpret mode (CPU)
computes step 3's product with a plain dot: the interpreter's wgmma reads only SMEM operands.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul.gpu import _ROW_ALIGN, _interpret_params, _lhs_spec, _transforms

_ROWS = 64  # wgmma M: the x tile's rows, of which one is the pair's


@dataclasses.dataclass(frozen=True)
class SwigluTiling:
    tile_f: int = 64  # intermediate channels per CTA: the partial-sum slices (S = F / tile_f)
    tile_k: int = 128  # hidden channels per gate/up pipeline step
    tile_d: int = 128  # output channels per down pipeline step
    stages: int = 3  # pipeline depth of both phases
    # The down projection's orientation: "cols" computes y^T [tile_d, 8] = Wd^T @ h^T over the 8-row block of h
    # (h staged once through SMEM) and picks the pair's column in registers; "rows" computes y [64, tile_d] =
    # h @ Wd with h in registers and stores all 64 rows to SMEM to send one on.
    down: str = "cols"
    # The gate/up orientation: "rows" computes g [64, tile_f] = x tile @ Wg over a 64-row x tile (the TMA fills the
    # rows past the batch with zeros; one row is the pair's); "cols" computes g^T [tile_f, 8] = Wg^T @ x^T, F
    # channels on wgmma's M side and only the 8-row block of x loaded (2 KB a step instead of 16 at tile_k 128),
    # h^T stored transposed into SMEM for the down projection (which must be "cols").
    gate_up: str = "rows"


def default_tiling(pairs: int, f: int, d: int) -> SwigluTiling:
    """Slices of 64 channels for the batch-1 bucket (16 pairs at top-8: its 8 live pairs x 12 slices of
    Qwen3-30B-A3B's F = 768 are 96 CTAs), of 128 above it, where slices of 64 make more CTAs than the SMs
    take at once and each re-reads the x tile (one H200, one layer at 8 live tokens of a 16-token bucket:
    137.7 against 168.0 us; at 1 live token of a 2-token bucket 25.4 against 32.2 us;
    docs/benchmarks/moe_block_swiglu_h200.json). The batch-1 bucket's gate/up runs "cols" on 4 stages: the
    kernel 25.9 -> 22.3 us a layer at 1 live token of 2, the weight bytes at the measured copy rate (one H200,
    scripts/profile_moe_block.py; 3, 6 and 8 stages and tile_k 256 were 22.7-24.5 us;
    docs/benchmarks/swiglu_cols_h200_2026-11-29.json). At 8 live tokens of 16 "cols" gained ~2% (137.4 against
    140.1 us at 128 x 64 x 4) and "rows" stays. Given D a multiple of 256, that bucket's down projection takes 256 D
    channels a step (Qwen3-30B-A3B: 8 steps of 32 KB, where 128 made 16 of 16 KB): 22.0-22.2 -> 21.7-21.8 us a
    layer in the batch-1 loop on two H200 leases (docs/benchmarks/moe_b1_down_prefetch_h200_2026-11-30.json,
    moe_b1_norm_route_partials_h200_2026-11-30.json)."""
    if pairs > 16 and f % 128 == 0:
        return SwigluTiling(tile_f=128, tile_k=64)
    if d % 256 == 0:
        return SwigluTiling(stages=4, gate_up="cols", tile_d=256)
    return SwigluTiling(stages=4, gate_up="cols")


def smem_bytes(t: SwigluTiling, itemsize: int = 2) -> int:
    """The larger phase's pipeline buffers plus the two-slot fp32 output (and, "cols", the staged h)."""
    x_rows = _ROW_ALIGN if t.gate_up == "cols" else _ROWS
    gate_up = t.stages * (x_rows * t.tile_k + 2 * t.tile_k * t.tile_f) * itemsize
    down = t.stages * t.tile_f * t.tile_d * itemsize
    out = 2 * t.tile_d * 4 + x_rows * t.tile_f * itemsize if t.down == "cols" else 2 * _ROWS * t.tile_d * 4
    return max(gate_up, down) + out


def check_tiling(t: SwigluTiling, d: int, f: int) -> None:
    problems = []
    if t.tile_f % 64 or f % t.tile_f or t.tile_f > 128:
        problems.append(f"tile_f must be 64 or 128 and divide F={f}")
    if t.tile_k % 64 or d % t.tile_k or t.tile_d % 64 or d % t.tile_d or t.tile_d > 256:
        problems.append(f"tile_k and tile_d must be multiples of 64 dividing D={d} (tile_d <= 256)")
    if t.stages < 2:
        problems.append("stages must be >= 2")
    if t.down not in ("cols", "rows"):
        problems.append(f"down must be 'cols' or 'rows', got {t.down!r}")
    if t.gate_up not in ("cols", "rows") or (t.gate_up == "cols" and t.down != "cols"):
        problems.append(f"gate_up must be 'rows' or 'cols' (with down 'cols'), got {t.gate_up!r}")
    from pallas_kernels.grouped_matmul.tuning import SMEM_BUDGET
    if smem_bytes(t) > SMEM_BUDGET:
        problems.append(f"needs {smem_bytes(t)} bytes of shared memory, over {SMEM_BUDGET}")
    if problems:
        raise ValueError(f"bad SwiGLU tiling {t}: " + "; ".join(problems))


def supported(x, w_gate, w_up, w_down) -> bool:
    """16-bit activations with weights of the same dtype (not QuantizedExperts), D a multiple of 128 and F
    of 64 (the default tiles)."""
    if not all(isinstance(a, jax.Array | jax.ShapeDtypeStruct) for a in (w_gate, w_up, w_down)):
        return False
    if x.dtype not in (jnp.bfloat16, jnp.float16) or {w_gate.dtype, w_up.dtype, w_down.dtype} != {x.dtype}:
        return False
    _, d, f = w_gate.shape
    return d % 128 == 0 and f % 64 == 0


def _silu_times(g, u):
    """silu(g) * u in fp32 (exp and a division: what the Mosaic GPU lowering has for the sigmoid)."""
    return g * u / (1.0 + jnp.exp(-g))


def _gate_up(acc_g, acc_u, x_gmem, g_gmem, u_gmem, *, row0, c, t: SwigluTiling):
    """Gate and up over all of D for slice c, returning both values: "rows": acc [64, tile_f] += x tile @ Wg / Wu
    [:, slice] over the 64-row x tile; "cols": acc [tile_f, 8] += (Wg / Wu [:, slice])^T @ (x's 8-row block)^T."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    cols = t.gate_up == "cols"
    steps = x_gmem.shape[1] // t.tile_k
    lag = min(1, steps - 1)  # one pair of wgmmas stays in flight; its slot is released a step late
    x_spec = _lhs_spec(_ROW_ALIGN if cols else _ROWS, t.tile_k, row0, 0, x_gmem.dtype, lag)
    w_spec = plgpu.BlockSpec((t.tile_k, t.tile_f), lambda k: (k, c), transforms=_transforms(g_gmem.dtype, t.tile_f),
                             delay_release=lag)

    def step(_, x_smem, g_smem, u_smem):
        if cols:
            plgpu.wgmma(acc_g, g_smem.T, x_smem.T)  # [tf, tk] @ [tk, 8]
            plgpu.wgmma(acc_u, u_smem.T, x_smem.T)
        else:
            plgpu.wgmma(acc_g, x_smem, g_smem)  # [64, tk] @ [tk, tf]
            plgpu.wgmma(acc_u, x_smem, u_smem)
        plgpu.wgmma_wait(lag)

    plgpu.emit_pipeline(step, grid=(steps,), in_specs=[x_spec, w_spec, w_spec],
                        max_concurrent_steps=t.stages)(x_gmem, g_gmem, u_gmem)
    return acc_g[...], acc_u[...]  # waits for the last wgmmas


def _down_cols(h, h_smem, d_gmem, o_gmem, o_smem, *, p, r, c, scale, t: SwigluTiling, interpret,
               accumulate=False):
    """o_gmem[p, d tile] = (accumulate: +=) scale * row r of h [64, tile_f] (from a "cols" gate/up, column r of
    h^T [tile_f, 8]) @ Wd[slice c, d tile], for every d tile of D, as
    y^T [tile_d, 8] = Wd^T @ (rows 0..7 of h)^T (the gather_matmul orientation: D channels are wgmma's M side)
    and column r of it picked in registers (a masked row sum), so one [tile_d] row goes through SMEM."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if t.gate_up == "cols":  # h is h^T [tf, 8]: stored transposed, h_smem [8, tf] is the block itself
        h_smem.T[...] = h
        block = h_smem
    else:
        h_smem[...] = h  # [64, tf], swizzled: rows 0..7 are the 8-row block holding the pair's row
        block = h_smem.at[pl.ds(0, _ROW_ALIGN)]  # [8, tf]
    plgpu.commit_smem()
    steps = d_gmem.shape[1] // t.tile_d
    w_spec = plgpu.BlockSpec((t.tile_f, t.tile_d), lambda j: (c, j), transforms=_transforms(d_gmem.dtype, t.tile_d))

    def step(idx, w_smem):
        j = idx[0]
        if interpret:
            yt = jax.lax.dot(w_smem[...].T, block[...].T, preferred_element_type=jnp.float32)
        else:
            yt = pl.run_state(lambda acc: plgpu.wgmma(acc, w_smem.T, block.T))(
                plgpu.ACC.init(jnp.zeros((t.tile_d, _ROW_ALIGN), jnp.float32)))  # [td, 8], waited for
        col = plgpu.broadcasted_iota(jnp.int32, yt.shape, 1, layout=plgpu.Layout.WGMMA)
        y = jnp.sum(jnp.where(col == r, yt, 0.0), axis=1)  # [td]: the pair's row
        if scale is not None:
            y = y * scale
        dst = o_gmem.at[p, pl.ds(j * t.tile_d, t.tile_d)]  # [td] f32
        if accumulate and interpret:  # the interpreter has no TMA reductions; it runs the CTAs one after another
            dst[...] = dst[...] + y
            return
        slot = o_smem.at[jax.lax.rem(j, 2)]  # [td] f32
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the store that read this slot two steps ago
        slot[...] = y
        plgpu.commit_smem()
        # accumulate: a TMA reduce-add (each element's add is atomic), the other pairs' and slices' adds in any order
        plgpu.copy_smem_to_gmem(slot, dst, reduction_op="add" if accumulate else None)

    plgpu.emit_pipeline(step, grid=(steps,), in_specs=[w_spec], max_concurrent_steps=t.stages)(d_gmem)
    plgpu.wait_smem_to_gmem(0)


def _down_rows(h, d_gmem, o_gmem, o_smem, *, p, r, c, scale, t: SwigluTiling, interpret):
    """o_gmem[p, d tile] = scale * row r of h [64, tile_f] @ Wd[slice c, d tile], for every d tile of D."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    steps = d_gmem.shape[1] // t.tile_d
    w_spec = plgpu.BlockSpec((t.tile_f, t.tile_d), lambda j: (c, j), transforms=_transforms(d_gmem.dtype, t.tile_d))

    def step(idx, w_smem):
        j = idx[0]
        if interpret:
            y = jax.lax.dot(h, w_smem[...], preferred_element_type=jnp.float32)
        else:
            y = pl.run_state(lambda acc: plgpu.wgmma(acc, h, w_smem))(
                plgpu.ACC.init(jnp.zeros((_ROWS, t.tile_d), jnp.float32)))  # [64, td], waited for
        if scale is not None:
            y = y * scale
        slot = o_smem.at[jax.lax.rem(j, 2)]  # [64, td] f32, unswizzled: any row is a legal TMA source
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the store that read this slot two steps ago
        slot[...] = y
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(slot.at[pl.ds(r, 1)], o_gmem.at[pl.ds(p, 1), pl.ds(j * t.tile_d, t.tile_d)])  # [1, td]

    plgpu.emit_pipeline(step, grid=(steps,), in_specs=[w_spec], max_concurrent_steps=t.stages)(d_gmem)
    plgpu.wait_smem_to_gmem(0)


def _zero_row(o_gmem, o_smem, *, p, t: SwigluTiling):
    """o_gmem[p, :] = 0, one [tile_d] TMA store per d tile from a zeroed output slot: a skipped pair's row, so the
    caller's sum needs no mask."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if t.down == "cols":
        src = o_smem.at[0]  # [td] f32
        src[...] = jnp.zeros((t.tile_d,), jnp.float32)
        dst = lambda j: o_gmem.at[p, pl.ds(j * t.tile_d, t.tile_d)]  # noqa: E731
    else:
        src = o_smem.at[0, pl.ds(0, 1)]  # [1, td] f32
        src[...] = jnp.zeros((1, t.tile_d), jnp.float32)
        dst = lambda j: o_gmem.at[pl.ds(p, 1), pl.ds(j * t.tile_d, t.tile_d)]  # noqa: E731
    plgpu.commit_smem()
    for j in range(o_gmem.shape[1] // t.tile_d):  # D / tile_d stores (16 at Qwen3-30B-A3B), all from one slot
        plgpu.copy_smem_to_gmem(src, dst(j))
    plgpu.wait_smem_to_gmem(0)


def _kernel(experts_ref, valid_ref, offset_ref, weights_ref, x_gmem, g_gmem, u_gmem, d_gmem, o_gmem, o_smem,
            *h_smem, t: SwigluTiling, weighted, accumulate, interpret):
    # experts_ref [T, k] i32 global expert ids; valid_ref [T] i32; offset_ref [1] i32 (the first local expert);
    # weights_ref [T, k] f32 routing weights (read only when `weighted`);
    # x_gmem [T, D], or padded [Tp, D]; g_gmem, u_gmem [E, D, F]; d_gmem [E, F, D]; o_gmem [S, k, T, D] f32, or
    # (accumulate) the residual [T, D] f32 that every pair adds its weighted row into;
    # o_smem [2, tile_d] f32 ("cols", with h_smem [64, tile_f]) or [2, 64, tile_d] f32.
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    slot, token, c = (jax.lax.axis_index(a) for a in ("s", "t", "c"))
    expert = experts_ref[token, slot] - offset_ref[0]
    row0 = token // _ROW_ALIGN * _ROW_ALIGN

    live = (valid_ref[token] != 0) & (expert >= 0) & (expert < g_gmem.shape[0])
    if weighted and not accumulate:  # the caller sums the parts as they are: skipped pairs write zeros
        pl.when(~live)(functools.partial(_zero_row, o_gmem.at[c, slot], o_smem, p=token, t=t))

    @pl.when(live)
    def _():
        gate_up = functools.partial(_gate_up, x_gmem=x_gmem, g_gmem=g_gmem.at[expert], u_gmem=u_gmem.at[expert],
                                    row0=row0, c=c, t=t)
        acc = plgpu.ACC((t.tile_f, _ROW_ALIGN) if t.gate_up == "cols" else (_ROWS, t.tile_f), jnp.float32)
        g, u = pl.run_scoped(gate_up, acc, acc)  # [64, tf] each ("cols": [tf, 8])
        h = _silu_times(g, u).astype(x_gmem.dtype)  # [64, tf] ("cols": h^T [tf, 8]), in registers
        scale = weights_ref[token, slot] if weighted else None
        down = dict(p=token, r=token - row0, c=c, scale=scale, t=t, interpret=interpret)
        if accumulate:
            _down_cols(h, h_smem[0], d_gmem.at[expert], o_gmem, o_smem, accumulate=True, **down)
        elif t.down == "cols":
            _down_cols(h, h_smem[0], d_gmem.at[expert], o_gmem.at[c, slot], o_smem, **down)
        else:
            _down_rows(h, d_gmem.at[expert], o_gmem.at[c, slot], o_smem, **down)


@functools.partial(jax.jit, static_argnames=("tiling", "interpret", "pad_rows"))
def swiglu_experts(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, experts: jax.Array,
                   valid: jax.Array | None = None, expert_offset: jax.Array | int = 0,
                   weights: jax.Array | None = None, residual: jax.Array | None = None, *,
                   tiling: SwigluTiling | None = None, interpret: bool = False,
                   pad_rows: bool | None = None) -> jax.Array:
    """[F / tile_f, k, T, D] float32 partial sums of each token's k SwiGLU experts (module docstring): x [T, D],
    experts [T, k] global ids of which the weights hold expert_offset .. + E - 1, valid [T] bool (None: all).
    Without `weights`, slots of invalid tokens or of experts held elsewhere are left unwritten (mask them); with
    routing weights [T, k], each pair's rows are scaled by its weight and those slots hold zeros, so the MoE output
    is the plain sum over the two leading axes.

    With `weights` and a `residual` [T, D] float32 the result is residual + the MoE output, [T, D] float32: every
    pair adds its weighted rows into the residual's buffer with TMA reduce-add stores (skipped pairs add nothing),
    so no [S, k, T, D] parts are written and no reduction kernel follows. The adds land in any order, so the float32
    sum may differ in its last bits from run to run. The down projection must be "cols". In the batch-1 decode loop
    of Qwen3-30B-A3B on an H200 the combine's kernel left each layer: 2.935 -> 2.819 ms an iteration of device time
    (docs/benchmarks/moe_b1_accumulate_h200_2026-11-29.json).

    pad_rows: x padded to a multiple of 8 rows always (True), or only where Mosaic's TMA tiling asks for it (None: T
    over 8 and not a multiple of it; below 8 rows the x tile's TMA fills the rows past T with zeros). Not padding a
    2-row decode bucket took a kernel out of each MoE layer: one H200, Qwen3-30B-A3B's batch-1 loop 3.243 / 3.242 ->
    3.198 / 3.201 ms an iteration, 837 -> 789 launches (docs/benchmarks/moe_b1_nopad_h200_2026-11-29.json)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if not supported(x, w_gate, w_up, w_down):
        raise NotImplementedError("the fused SwiGLU kernel takes 16-bit x and weights of its dtype, D % 128 == 0 "
                                  f"and F % 64 == 0; got {x.dtype} x, {w_gate.dtype} weights, shape {w_gate.shape}")
    e, d, f = w_gate.shape
    tokens, top_k = experts.shape
    t = tiling or default_tiling(tokens * top_k, f, d)
    check_tiling(t, d, f)
    if pad_rows or (pad_rows is None and tokens > _ROW_ALIGN and tokens % _ROW_ALIGN):
        x = jnp.pad(x, ((0, -(-tokens // _ROW_ALIGN) * _ROW_ALIGN - tokens), (0, 0)))  # [Tp, D]: TMA tiles rows by 8
    valid = jnp.ones((tokens,), jnp.int32) if valid is None else valid.astype(jnp.int32)
    offset = jnp.reshape(jnp.asarray(expert_offset, jnp.int32), (1,))
    weighted = weights is not None
    accumulate = residual is not None
    if accumulate and (not weighted or t.down != "cols" or residual.shape != (tokens, d)
                       or residual.dtype != jnp.float32):
        raise ValueError(f"an accumulating call takes routing weights, a 'cols' down projection and a float32 residual "
                         f"[{tokens}, {d}]; got weights {weighted}, down {t.down!r}, residual "
                         f"{residual.shape} {residual.dtype}")
    weights = jnp.zeros((tokens, top_k), jnp.float32) if weights is None else weights.astype(jnp.float32)
    if t.down == "cols":
        scratch = [plgpu.SMEM((2, t.tile_d), jnp.float32),
                   plgpu.SMEM((_ROW_ALIGN if t.gate_up == "cols" else _ROWS, t.tile_f), x.dtype,
                              transforms=_transforms(x.dtype, t.tile_f))]
    else:
        scratch = [plgpu.SMEM((2, _ROWS, t.tile_d), jnp.float32)]
    operands = (experts.astype(jnp.int32), valid, offset, weights, x, w_gate, w_up, w_down)
    launch = functools.partial(
        plgpu.kernel,
        functools.partial(_kernel, t=t, weighted=weighted, accumulate=accumulate, interpret=bool(interpret)),
        scratch_types=scratch,
        grid=(top_k, tokens, f // t.tile_f), grid_names=("s", "t", "c"), kernel_name="gather_matmul_swiglu",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=_interpret_params(interpret))
    if not accumulate:
        return launch(out_type=jax.ShapeDtypeStruct((f // t.tile_f, top_k, tokens, d), jnp.float32))(*operands)
    import jax.experimental.pallas as pl

    # The residual goes in as a Ref the kernel writes: its buffer is the kernel's output (aliased, updated in place).
    return pl.run_state(lambda out_ref: launch(out_type=())(*operands, out_ref))(residual.astype(jnp.float32))
