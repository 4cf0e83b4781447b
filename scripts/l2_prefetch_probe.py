"""Does warming the L2 with a decode product's weights, while small kernels run, make the product faster? (issue 13)

Why: in Qwen3-30B-A3B's batch-1 decode loop on an H200 each layer runs ~20 us of small kernels (norms, attention,
routing, combine) during which the memory system idles, then weight products that stream their bytes at 2.7-2.9
TB/s (q/k/v 21 MB in 7.3 us, o 16.8 MB in 6.2 us) where the LM head's long stream reaches ~4.5 TB/s: a short product
pays its ramp. A TMA L2 prefetch (`plgpu.async_prefetch`) issued before the small kernels would have the bytes in the
50 MB L2 when the product starts.

Each case runs `rounds` times in one program over `copies` distinct weights (more bytes than L2 holds, so nothing is
warm by accident), one weight per round:
  cold:      small(x) -> x @ W_i
  prefetch:  prefetch(W_i) -> small(x) -> x @ W_i
  hot:       small(x) -> x @ W_0 (the same weight every round: the L2-resident ceiling)
  prefetch_only: prefetch(W_i) -> small(x) (what the prefetch kernel and the small kernels cost by themselves)
  touch:     max(W_i) (an XLA reduction) -> small(x) -> x @ W_i
  twice:     x @ W_i -> small(x) -> x @ W_i
`small` stands in for the attention and its neighbours (XLA made the chain one elementwise kernel of ~4 us). The
device time per kernel name comes from the profiler. Each prefetch kernel is tried at several tunings (--tunings:
box rows x boxes a program; "load": TMA loads into SMEM, waited for, which surely pass through L2).

Result (one H200, 2-row x, Qwen3-30B-A3B's o projection, 16.8 MB; docs/benchmarks/l2_prefetch_h200_2026-11-29*.json):
the product takes 6.1-6.3 us cold and 3.8-3.9 us hot, and 6.0-6.3 us after any prefetch or TMA load of its weight
(every tuning), and 6.1 us after an XLA reduction read it; read by the same product just before ("twice"), the second
read is ~4 us. What one kernel leaves in L2 speeds up the same kernel, not a different one (Hopper's L2 is two
partitions, each caching for its own SMs; which SMs read what differs between kernels). So warming L2 ahead of a
product does not pay, and the prefetch kernel alone costs 2.3-8 us: not kept.

    JAX_PLATFORMS=cuda PYTHONPATH=$PWD python3 scripts/l2_prefetch_probe.py --tokens 2 --shapes o \
        --kinds cold hot touch twice prefetch prefetch_only --tunings 256x8 256x1 64x1 32x4load --out $OUT/l2.json
"""

from __future__ import annotations

import argparse
import collections
import functools
import json

import jax
import jax.numpy as jnp

from jaxinfer.bench.measure import device_events

# The prefetch kernel (Mosaic GPU): kept here, not in pallas_kernels, because it did not pay (module docstring).

BOX = 256  # TMA box edge: at most 256 elements along each axis
BOXES_PER_PROGRAM = 8  # prefetches one program issues (one thread issues them back to back)
TOKEN = jax.ShapeDtypeStruct((8, 128), jnp.float32)  # what orders the kernel: new_token() makes one


def _matrix(w: jax.Array) -> tuple[int, int]:
    """The 2-D view [R, C] a weight is prefetched as: its leading axes flattened."""
    return (w.size // w.shape[-1], w.shape[-1]) if w.ndim >= 2 else (1, w.size)


def _box(w: jax.Array, box_rows: int = BOX) -> tuple[int, int] | None:
    """The TMA box [br, bc] that tiles w's 2-D view exactly, or None."""
    r, c = _matrix(w)
    br, bc = min(box_rows, r), min(BOX, c)
    if r % br or c % bc or (bc * w.dtype.itemsize) % 16:
        return None
    return br, bc


def _kernel(token_ref, *refs, boxes, per_program, load):
    # token_ref [8, 128] f32 in GMEM; refs: the weights' 2-D views [R, C] in GMEM, then the scratch (token_smem
    # [8, 128] f32, a barrier, and with `load` a box buffer per weight). boxes: per weight (row boxes, column
    # boxes, br, bc). Program p takes boxes p * per_program .. + per_program - 1 of every weight (row-major box
    # order). Program 0 also copies the token through SMEM back onto itself, so the kernel writes it: XLA then
    # sees the token that comes out as the kernel's output (a custom call without outputs would be dead code).
    # `load` (a measurement aid): TMA loads into SMEM, waited for, instead of prefetches.
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    n = len(boxes)
    weights, (token_smem, barrier), bufs = refs[:n], refs[n:n + 2], refs[n + 2:]
    p = jax.lax.axis_index("p")
    for wi, (rows, cols, br, bc) in enumerate(boxes):
        for k in range(per_program):
            b = p * per_program + k

            @pl.when(b < rows * cols)
            def _(b=b, wi=wi, cols=cols, br=br, bc=bc):
                box = weights[wi].at[pl.ds(b // cols * br, br), pl.ds(b % cols * bc, bc)]
                if load:
                    plgpu.copy_gmem_to_smem(box, bufs[wi], barrier)
                    plgpu.barrier_wait(barrier)
                else:
                    plgpu.async_prefetch(box)

    @pl.when(p == 0)
    def _():
        plgpu.copy_gmem_to_smem(token_ref, token_smem, barrier)
        plgpu.barrier_wait(barrier)
        plgpu.copy_smem_to_gmem(token_smem, token_ref)
        plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("box_rows", "per_program", "load"))
def _prefetch(token: jax.Array, *weights: jax.Array, box_rows: int = BOX, per_program: int = BOXES_PER_PROGRAM,
              load: bool = False) -> jax.Array:
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    views = [w.reshape(_matrix(w)) for w in weights]  # [R, C] each: a bitcast of the contiguous array
    boxes = []
    for v, w in zip(views, weights):
        br, bc = _box(w, box_rows)
        boxes.append((v.shape[0] // br, v.shape[1] // bc, br, bc))
    programs = max(-(-rows * cols // per_program) for rows, cols, _, _ in boxes)
    scratch = [plgpu.SMEM(TOKEN.shape, TOKEN.dtype), plgpu.Barrier()]
    if load:
        scratch += [plgpu.SMEM((br, bc), w.dtype) for (_, _, br, bc), w in zip(boxes, weights)]
    issue = plgpu.kernel(functools.partial(_kernel, boxes=tuple(boxes), per_program=per_program, load=load),
                         out_type=(), grid=(programs,), grid_names=("p",), kernel_name="l2_prefetch",
                         scratch_types=scratch)

    # The kernel takes the token as a Ref that it writes (run_state): the token that comes out is an output of the
    # kernel, so XLA keeps the kernel and runs it before the token's consumers.
    def stateful(refs):
        issue(*refs)

    token, *_ = pl.run_state(stateful)((token, *views))
    return token


def new_token() -> jax.Array:
    """What orders a prefetch kernel before the small kernels: zeros [8, 128] float32, passed through it."""
    return jnp.zeros(TOKEN.shape, TOKEN.dtype)


def l2_prefetch(token: jax.Array, w: jax.Array, **tuning) -> jax.Array:
    """`token` unchanged, after a kernel that issued TMA L2 prefetches (or, with load=True, TMA loads) of `w`."""
    if _box(w, tuning.get("box_rows", BOX)) is None:
        raise ValueError(f"weight {w.shape} does not tile into TMA boxes")
    return _prefetch(token, w, **tuning)


SHAPES = {"o": (4096, 2048), "qkv": (2048, 5120)}  # Qwen3-30B-A3B's attention output and joined q/k/v [K, N]


def _small(x: jax.Array, n: int) -> jax.Array:
    for _ in range(n):
        x = jax.lax.optimization_barrier(jnp.tanh(x) * 0.5 + x)  # [T, K], one small kernel each
    return x


def _case(kind: str, x: jax.Array, ws: list[jax.Array], small: int, tuning: dict) -> jax.Array:
    """One round per weight copy; x [T, K], ws C x [K, N] (separate arrays: slicing a stacked one made XLA copy the
    slice) -> the sum of the products [T, N]."""
    out, token = None, new_token()
    for i in range(len(ws)):
        w = ws[0] if kind == "hot" else ws[i]  # [K, N]
        if kind in ("prefetch", "prefetch_only"):
            token = l2_prefetch(token, w, **tuning)
        if kind == "touch":  # an XLA reduction reads W first (plain loads, not TMA): is the product faster then?
            token = token + jnp.max(w).astype(token.dtype) * 0
        if kind == "twice":  # the same product just before: the ceiling for what a read leaves in L2
            token = token + jnp.einsum("tk,kn->tn", x, w, preferred_element_type=jnp.float32)[:1, :1] * 0
        h = _small(x + token[:1, :1].astype(x.dtype), small)  # every case adds the (zero) token: same kernels
        if kind == "prefetch_only":
            out = h if out is None else out + h[:, :1]
            continue
        y = jnp.einsum("tk,kn->tn", h, w, preferred_element_type=jnp.float32).astype(x.dtype)  # [T, N]
        out = y if out is None else out + y
        x = x + y[:, :1]  # the next round depends on this one
    return out


def _kind_of(kernel: str) -> str:
    """Kernel names without XLA's numbering (each round's copy of a fusion gets its own suffix)."""
    return kernel.rstrip("0123456789").rstrip("_")


def measure(shape: str, kind: str, tokens: int, copies: int, small: int, reps: int, tuning: dict) -> dict:
    k, n = SHAPES[shape]
    ws = [jax.random.normal(jax.random.key(c), (k, n), jnp.bfloat16) for c in range(copies)]  # C x [K, N]
    x = jax.random.normal(jax.random.key(1), (tokens, k), jnp.bfloat16)  # [T, K]
    fn = jax.jit(functools.partial(_case, kind, small=small, tuning=tuning))
    jax.block_until_ready(fn(x, ws))

    def run():
        out = None
        for _ in range(reps):
            out = fn(x, ws)
        return jax.block_until_ready(out)

    source, spans = device_events(run)
    per = collections.defaultdict(float)
    for name, ms in spans:
        per[_kind_of(name)] += ms * 1e3 / (reps * copies)  # us per round
    kernels = sorted(per.items(), key=lambda kv: -kv[1])
    return {"shape": shape, "kind": kind, "tuning": tuning, "tokens": tokens, "weight_mb": k * n * 2 / 1e6, "source": source,
            "us_per_round": sum(per.values()),
            "kernels_us_per_round": [{"name": name[:80], "us": us} for name, us in kernels[:8]]}


def _tuning(spec: str) -> dict:
    """'256x8' -> box_rows 256, per_program 8; '64x4load' -> TMA loads; '-' -> none."""
    if spec == "-":
        return {}
    load = spec.endswith("load")
    rows, per = spec.removesuffix("load").split("x")
    return {"box_rows": int(rows), "per_program": int(per), "load": load}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--kinds", nargs="+", default=["cold", "prefetch", "hot", "prefetch_only"])
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--copies", type=int, default=8)
    p.add_argument("--small", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--tunings", nargs="+", default=["256x8"],
                   help="prefetch kernels to try: ROWSxPER (box rows, boxes a program), 'load' suffix: TMA loads")
    p.add_argument("--out")
    a = p.parse_args()
    rows = []
    for s in a.shapes:
        for kind in a.kinds:
            for spec in (a.tunings if kind.startswith("prefetch") else ["-"]):
                rows.append(measure(s, kind, a.tokens, a.copies, a.small, a.reps, _tuning(spec)))
    print(f"{'shape':6} {'kind':14} {'tuning':12} {'us/round':>9}  top kernels (us)")
    for r in rows:
        top = ", ".join(f"{k['name'][:28]} {k['us']:.2f}" for k in r["kernels_us_per_round"][:4])
        tuning = "x".join(str(v) for v in r["tuning"].values()) or "-"
        print(f"{r['shape']:6} {r['kind']:14} {tuning:12} {r['us_per_round']:9.2f}  {top}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": str(jax.devices()[0].device_kind), "args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
