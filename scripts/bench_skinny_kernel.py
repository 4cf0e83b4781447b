"""Device time of a decode step's dense products at batch 1: XLA's GEMMs against the skinny_matmul kernel.

Each candidate runs inside one program over `copies` distinct weights (more bytes than the 50 MB L2 holds), the
products' outputs returned (not summed, so no extra kernels), or, for the residual forms, chained through a float32
residual as a layer does. Timed from the device's own kernel events (jaxinfer.bench.measure.device_events): the
device time a product costs, launch gaps aside, against the measured copy rate.

    JAX_PLATFORMS=cuda PYTHONPATH=$PWD python3 scripts/bench_skinny_kernel.py --out $OUT/skinny_kernel.json

Candidates: `xla` (x @ W, bf16 out, XLA's autotuned GEMM), `xla_split4` (the engine's decode q/k/v: four float32
partial products over K, as norm_rope_write takes them), `xla_residual` (r + x @ W in float32: the engine's output
projection and its residual add), and `skinny_s{S}` / `skinny_acc_s{S}` (pallas_kernels.skinny_matmul: S float32
partials, or added into the residual), each at the tilings given.
"""

from __future__ import annotations

import argparse
import collections
import json
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxinfer.bench.measure import device_events
from pallas_kernels import moe_routing
from pallas_kernels.skinny_matmul import gpu as skinny
from scripts.bench_skinny_gemm import copy_rate

SHAPES = {"qwen3moe_qkv": (2048, 5120), "qwen3moe_o": (4096, 2048), "llama8b_o": (4096, 4096)}
MIN_BYTES = 400 * 2**20


def candidates(tilings: list[skinny.SkinnyTiling], splits: list[int]) -> dict[str, tuple[Callable, bool]]:
    """name -> (product, chained through a residual)."""
    out: dict[str, tuple[Callable, bool]] = {
        "xla": (lambda x, w: jnp.einsum("tk,kn->tn", x, w), False),  # [T, K] x [K, N] -> [T, N]
        "xla_split4": (lambda x, w: moe_routing.split_router_logits(x, w, 4), False),  # [4, T, N] f32
        "xla_residual": (lambda x, w, r: r + jnp.einsum("tk,kn->tn", x, w, preferred_element_type=jnp.float32), True),
    }
    for t in tilings:
        tag = f"n{t.tile_n}k{t.tile_k}x{t.stages}"
        for s in splits:
            out[f"skinny_s{s}_{tag}"] = (lambda x, w, s=s, t=t: skinny.skinny_matmul(x, w, splits=s, tiling=t), False)
            out[f"skinny_acc_s{s}_{tag}"] = (
                lambda x, w, r, s=s, t=t: skinny.skinny_matmul(x, w, r, splits=s, tiling=t), True)
    return out


def time_candidate(fn: Callable, chained: bool, m: int, k: int, n: int) -> dict[str, Any]:
    copies = max(4, -(-MIN_BYTES // (k * n * 2)))
    keys = jax.random.split(jax.random.key(0), copies + 1)
    ws = [jax.random.normal(key, (k, n), jnp.bfloat16) * 0.02 for key in keys[1:]]
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)

    @jax.jit
    def program(x, ws):
        if chained:
            r = jnp.zeros((m, n), jnp.float32)
            for w in ws:
                r = fn(x, w, r)
            return r
        return [fn(x, w) for w in ws]

    jax.block_until_ready(program(x, ws))
    jax.block_until_ready(program(x, ws))
    _, spans = device_events(lambda: jax.block_until_ready(program(x, ws)))
    by_name: dict[str, float] = collections.defaultdict(float)
    for name, ms in spans:
        by_name[name] += ms
    total_us = sum(by_name.values()) * 1e3 / copies
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:3]
    return {"us": total_us, "copies": copies, "kernels": [(name[:60], ms * 1e3 / copies) for name, ms in top]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[2])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--splits", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--tilings", nargs="+", default=["64x128x4", "64x256x3", "64x64x6"],
                   help="tile_n x tile_k x stages")
    p.add_argument("--only", nargs="*", default=None, help="candidate names to run (default: all)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    tilings = [skinny.SkinnyTiling(*map(int, s.split("x"))) for s in args.tilings]
    cands = candidates(tilings, args.splits)
    rate = copy_rate()
    print(f"device {jax.devices()[0].device_kind}  copy {rate / 1e9:.0f} GB/s")
    rows = []
    for shape in args.shapes:
        k, n = SHAPES[shape]
        for m in args.rows:
            for name, (fn, chained) in cands.items():
                if args.only and name not in args.only:
                    continue
                try:
                    r = time_candidate(fn, chained, m, k, n)
                except Exception as e:  # noqa: BLE001 - a tiling the kernel does not take is reported
                    print(f"{shape:14s} M={m} {name:28s} error {type(e).__name__}: {str(e)[:160]}")
                    continue
                pct = 100 * k * n * 2 / rate / (r["us"] * 1e-6)
                r.update(shape=shape, m=m, k=k, n=n, candidate=name, pct_of_copy_rate=pct)
                rows.append(r)
                print(f"{shape:14s} M={m} {name:28s} {r['us']:7.2f} us  {pct:5.1f}%  {r['kernels'][:2]}")
                if args.out:
                    with open(args.out, "w") as f:
                        json.dump({"device": jax.devices()[0].device_kind, "copy_bytes_per_s": rate, "rows": rows}, f,
                                  indent=1)


if __name__ == "__main__":
    main()
