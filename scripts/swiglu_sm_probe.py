"""How the fused SwiGLU expert kernel's weight stream scales with the number of CTAs it runs (one H200).

At Qwen3-30B-A3B's batch-1 decode the kernel runs 8 pairs x 12 slices = 96 CTAs on an H200's 132 SMs and moves
75.5 MB in ~22 us (~3.4 TB/s), where XLA's LM-head GEMM over all SMs streams ~4.5 TB/s. Whether the kernel is bound
by what each SM can pull (so more CTAs would stream faster) or by the memory system is what this measures: one token
routed to k experts (k x 12 CTAs) for several k, each call over experts the previous calls did not touch (so L2
holds none of its weights), chained through a float32 residual as the engine's layer is.

    JAX_PLATFORMS=cuda PYTHONPATH=$PWD python3 scripts/swiglu_sm_probe.py --out $OUT/swiglu_sm_probe.json
"""

from __future__ import annotations

import argparse
import collections
import json

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.bench.measure import device_events
from pallas_kernels.grouped_matmul import gpu_swiglu


def time_top_k(top_k: int, tiling: gpu_swiglu.SwigluTiling, d: int, f: int, experts: int,
               calls: int) -> dict:
    """Device us per kernel call with one live token of a 2-token bucket routed to `top_k` experts."""
    kg, ku, kd, kx = jax.random.split(jax.random.key(top_k), 4)
    wg = (jax.random.normal(kg, (experts, d, f), jnp.float32) * d**-0.5).astype(jnp.bfloat16)
    wu = (jax.random.normal(ku, (experts, d, f), jnp.float32) * d**-0.5).astype(jnp.bfloat16)
    wd = (jax.random.normal(kd, (experts, f, d), jnp.float32) * f**-0.5).astype(jnp.bfloat16)
    x = jax.random.normal(kx, (2, d), jnp.bfloat16)
    valid = jnp.asarray([True, False])
    weights = jnp.full((2, top_k), 1.0 / top_k, jnp.float32)
    # Call i's experts follow call i-1's around the expert table, so consecutive calls share none.
    ids = [np.stack([(np.arange(top_k) + i * top_k) % experts] * 2).astype(np.int32) for i in range(calls)]

    @jax.jit
    def program(x, wg, wu, wd, ids):
        r = jnp.zeros((2, d), jnp.float32)
        for i in range(calls):
            r = gpu_swiglu.swiglu_experts(x, wg, wu, wd, ids[i], valid, 0, weights, r, tiling=tiling)
        return r

    args = (x, wg, wu, wd, [jnp.asarray(a) for a in ids])
    jax.block_until_ready(program(*args))
    jax.block_until_ready(program(*args))
    _, spans = device_events(lambda: jax.block_until_ready(program(*args)))
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for name, ms in spans:
        by_name[name].append(ms)
    kernel = [v for k, v in by_name.items() if "swiglu" in k][0]
    us = float(np.median(kernel)) * 1e3
    moved = top_k * 3 * d * f * 2
    return {"top_k": top_k, "ctas": top_k * f // tiling.tile_f, "us": us, "mb": moved / 1e6, "gbs": moved / us / 1e3,
            "calls": len(kernel), "tiling": str(tiling)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--top-k", type=int, nargs="+", default=[4, 6, 8, 9, 10, 11, 12, 16])
    p.add_argument("--tile-d", type=int, nargs="+", default=[128, 256])
    p.add_argument("--calls", type=int, default=24)
    p.add_argument("--out", default="swiglu_sm_probe.json")
    args = p.parse_args()
    rows = []
    for tile_d in args.tile_d:
        tiling = gpu_swiglu.SwigluTiling(stages=4, gate_up="cols", tile_d=tile_d)
        for k in args.top_k:
            r = time_top_k(k, tiling, 2048, 768, 128, args.calls)
            rows.append(r)
            print(f"tile_d {tile_d} top-{k:>2}: {r['ctas']:>3} CTAs, {r['us']:6.2f} us, {r['mb']:6.1f} MB, "
                  f"{r['gbs']:6.0f} GB/s", flush=True)
            with open(args.out, "w") as fh:
                json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
