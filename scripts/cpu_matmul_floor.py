"""The matmul floor of SmolLM2-135M's decode step on this CPU: every projection of the 30 layers plus the LM
head (float32, 538 MB) applied to M rows, in one jitted XLA program and with NumPy (OpenBLAS), under each
XLA:CPU flag set given. It says how fast a decode step could be if only its matmuls ran, which bounds what
issue 14's "2x HF at batch 32 on CPU" can reach (docs/PERFORMANCE.md, "CPU").

    python scripts/cpu_matmul_floor.py --rows 1 32 --flags= --flags=--xla_cpu_use_onednn=true

Each flag set runs in a child process (XLA reads XLA_FLAGS once); one JSON line per (flags, rows).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

LAYERS, D, F, KV, V = 30, 576, 1536, 192, 49152  # SmolLM2-135M: hidden, ffn, kv width (3 heads x 64), vocab


def shapes() -> list[tuple[int, int]]:
    """[K, N] of every weight a decode step multiplies by: q, k, v, o, gate, up, down per layer, then the head."""
    per_layer = [(D, D), (D, KV), (D, KV), (D, D), (D, F), (D, F), (F, D)]
    return per_layer * LAYERS + [(D, V)]


def measure(rows: int, repeats: int) -> dict[str, float]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    weights = [rng.standard_normal(s, np.float32) for s in shapes()]
    xs = {k: rng.standard_normal((rows, k), np.float32) for k in (D, F)}
    nbytes = sum(w.nbytes for w in weights)

    def numpy_step() -> None:
        for w in weights:
            xs[w.shape[0]] @ w  # [M, K] @ [K, N]

    @jax.jit
    def xla_step(x_d: jax.Array, x_f: jax.Array, ws: list[jax.Array]) -> jax.Array:
        # Summing each product keeps every matmul live without materializing the outputs together.
        return sum(((x_f if w.shape[0] == F else x_d) @ w).sum() for w in ws)

    dev = [jnp.asarray(w) for w in weights]
    x_d, x_f = jnp.asarray(xs[D]), jnp.asarray(xs[F])

    def timed(fn) -> float:
        fn()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats

    t_np = timed(numpy_step)
    t_xla = timed(lambda: xla_step(x_d, x_f, dev).block_until_ready())
    flops = 2 * rows * nbytes / 4
    return {"rows": rows, "weight_mb": nbytes / 1e6, "numpy_ms": t_np * 1e3, "xla_ms": t_xla * 1e3,
            "xla_gflop_s": flops / t_xla / 1e9, "xla_weight_gb_s": nbytes / t_xla / 1e9}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    p.add_argument("--flags", action="append", default=None,
                   help="an XLA_FLAGS value (repeatable, written --flags=VALUE; default: none set), one child each")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        for rows in args.rows:
            print(json.dumps({"xla_flags": os.environ.get("XLA_FLAGS", ""), **measure(rows, args.repeats)}), flush=True)
        return
    for flags in args.flags or [""]:
        cmd = [sys.executable, __file__, "--child", "--repeats", str(args.repeats), "--rows", *map(str, args.rows)]
        subprocess.run(cmd, env={**os.environ, "XLA_FLAGS": flags}, check=True)


if __name__ == "__main__":
    main()
