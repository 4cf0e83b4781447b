"""Does programmatic dependent launch (PDL) overlap a skinny product's weight stream with the kernel in front?

One program chains `rounds` layers of s = s + skinny_matmul(RMSNorm(s), W_i) over distinct weights (more bytes than
L2 holds), s a float32 [2, D] stream: the norm (XLA's fusion, or the skinny norm kernel that releases its
dependents at once), then the product (pdl: its weight requested before it waits for the norm). Wall time a round
(the program timed back to back) and the device's kernel time, for each combination. Run it once as is and once
with XLA_FLAGS=--xla_gpu_enable_command_buffer= to see whether XLA's CUDA graphs keep the PDL launches.

    JAX_PLATFORMS=cuda PYTHONPATH=$PWD python3 scripts/pdl_probe.py --out $OUT/pdl_probe.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time

import jax
import jax.numpy as jnp

from jaxinfer.bench.measure import device_events
from jaxinfer.models.common import rms_norm
from pallas_kernels.skinny_matmul import gpu as skinny
from pallas_kernels.skinny_matmul import norm as skinny_norm


def time_case(norm_kernel: bool, pdl: bool, d: int, rounds: int, calls: int) -> dict:
    keys = jax.random.split(jax.random.key(0), rounds + 1)
    ws = [jax.random.normal(k, (d, d), jnp.bfloat16) * 0.01 for k in keys[1:]]
    norm_w = jnp.ones((d,), jnp.bfloat16)
    s0 = jax.random.normal(keys[0], (2, d), jnp.float32)
    splits, tiling = skinny.plan(d, d, 8)

    @jax.jit
    def program(s, ws):
        for w in ws:
            if norm_kernel:
                h = skinny_norm.rms_norm(s, norm_w, eps=1e-6)
            else:
                h = rms_norm(s, norm_w, 1e-6).astype(jnp.bfloat16)
            s = skinny.skinny_matmul(h, w, s, splits=splits, tiling=tiling, pdl=pdl)
        return s

    out = jax.block_until_ready(program(s0, ws))
    t = time.perf_counter()
    for _ in range(calls):
        out = program(out, ws)
    jax.block_until_ready(out)
    wall_us = (time.perf_counter() - t) / calls / rounds * 1e6
    _, spans = device_events(lambda: jax.block_until_ready(program(s0, ws)))
    by_name: dict[str, float] = collections.defaultdict(float)
    for name, ms in spans:
        by_name[name] += ms
    return {"norm_kernel": norm_kernel, "pdl": pdl, "wall_us_per_round": wall_us,
            "kernel_us_per_round": sum(by_name.values()) * 1e3 / rounds,
            "kernels": {name[:60]: ms * 1e3 / rounds for name, ms in by_name.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=24)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    for norm_kernel, pdl in [(False, False), (False, True), (True, False), (True, True)] * 2:
        r = time_case(norm_kernel, pdl, args.d, args.rounds, args.calls)
        rows.append(r)
        print(f"norm kernel {norm_kernel!s:5} pdl {pdl!s:5}: wall {r['wall_us_per_round']:6.2f} us a round, kernels "
              f"{r['kernel_us_per_round']:6.2f}  {({k: round(v, 2) for k, v in r['kernels'].items()})}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "xla_flags": os.environ.get("XLA_FLAGS", ""),
                       "d": args.d, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
