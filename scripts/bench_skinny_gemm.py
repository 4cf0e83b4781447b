"""Decode-sized bf16 products (a few activation rows against a whole weight matrix) on a GPU: how close each way
of computing them comes to the measured copy rate.

Why: in Qwen3-30B-A3B's batch-1 decode loop (issue 13, docs/PERFORMANCE.md) XLA's q/k/v product ([2, 2048] x
[2048, 5120], 21 MB) took 9.8 us on an H200, ~59% of the copy rate, where the expert kernel streams its weights at
84-88%. Each product here is timed inside one program that cycles through enough distinct weight copies that
the 50 MB L2 cannot hold them, called back to back; a product's time is the program's time over its products.

    PYTHONPATH=$PWD python3 scripts/bench_skinny_gemm.py --out $OUT/skinny_gemm.json

Candidates: `xla_kn` (the engine's layout, x @ W[K, N]), `xla_nk` (the weight stored [N, K], each output's row
contiguous), `gmm_cols` (pallas_kernels.grouped_matmul's Mosaic GPU cols kernel with one group, its split-K
sum and gather included), `xla_split_k4_norm` (RMSNorm of x, then the product split 4 ways over K: the engine's
decode q/k/v on a GPU with the norm before it), and `xla_kn_norm` / `xla_kn_norm_apart` (RMSNorm of x before the
product, as a layer does, fusable into the GEMM or kept apart by a barrier). The copy rate is read + write of an
elementwise pass; a read-only stream runs faster, so a product can show more than 100%. XLA flags are per process:
run the script again under XLA_FLAGS to compare them.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

# (name, K, N): Qwen3-30B-A3B's q/k/v, attention output, router and lm_head; Llama-3-8B's q/k/v, o, gate/up, down.
SHAPES = [
    ("qwen3moe_qkv", 2048, 5120), ("qwen3moe_o", 4096, 2048), ("qwen3moe_router", 2048, 128),
    ("qwen3moe_lm_head", 2048, 151936), ("llama8b_qkv", 4096, 6144), ("llama8b_o", 4096, 4096),
    ("llama8b_gate_up", 4096, 28672), ("llama8b_down", 14336, 4096),
]
L2_BYTES = 50 * 2**20
MIN_BYTES_PER_CALL = 400 * 2**20  # weights one call streams: long enough that launch gaps are noise


def copy_rate(gib: float = 2.0, reps: int = 20) -> float:
    """Bytes read + written per second by a device copy of a `gib` GiB bf16 array."""
    n = int(gib * 2**30) // 2
    x = jnp.ones((n,), jnp.bfloat16)
    f = jax.jit(lambda a: a + jnp.bfloat16(1))
    f(x).block_until_ready()
    t = time.perf_counter()
    for _ in range(reps):
        y = f(x)
    y.block_until_ready()
    return 2 * n * 2 * reps / (time.perf_counter() - t)


def _xla_kn(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum("tk,kn->tn", x, w)  # [M, K] x [K, N] -> [M, N]


def _xla_nk(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum("tk,nk->tn", x, w)  # [M, K] x [N, K] -> [M, N]


def _gmm_cols(x: jax.Array, w: jax.Array) -> jax.Array:
    from pallas_kernels.grouped_matmul.gpu import grouped_matmul

    sizes = jnp.array([x.shape[0]], jnp.int32)  # one group holding every row
    return grouped_matmul(x, w[None], sizes)  # [M, K] x [1, K, N] -> [M, N]


def _rms_norm(x: jax.Array) -> jax.Array:
    """The engine's RMSNorm before a product (common.rms_norm with a unit weight): float32, back to bf16."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)


def _xla_kn_norm(x: jax.Array, w: jax.Array) -> jax.Array:
    """The product as the engine's layer computes it: RMSNorm of x, then the product (XLA may fuse the two)."""
    return _xla_kn(_rms_norm(x), w)


def _xla_kn_norm_apart(x: jax.Array, w: jax.Array) -> jax.Array:
    """The same with a barrier between the norm and the product, so XLA cannot fuse the norm into the GEMM."""
    return _xla_kn(jax.lax.optimization_barrier(_rms_norm(x)), w)


def _xla_split_k(x: jax.Array, w: jax.Array, splits: int) -> jax.Array:
    """K split by hand, as the engine's Qwen3 q/k/v product of decode steps on a GPU (qwen3.split_k_product)."""
    from jaxinfer.models.qwen3 import split_k_product

    return split_k_product(x, w, splits)


CANDIDATES: dict[str, tuple[Callable[..., jax.Array], bool]] = {  # name -> (product, weight stored [N, K])
    "xla_split_k2": (lambda x, w: _xla_split_k(x, w, 2), False),
    "xla_split_k4": (lambda x, w: _xla_split_k(x, w, 4), False),
    # The engine's decode q/k/v on a GPU with the attention norm before it: the RMSNorm, then the product split 4 ways.
    "xla_split_k4_norm": (lambda x, w: _xla_split_k(_rms_norm(x), w, 4), False),
    "xla_kn": (_xla_kn, False), "xla_nk": (_xla_nk, True), "gmm_cols": (_gmm_cols, False),
    "xla_kn_norm": (_xla_kn_norm, False), "xla_kn_norm_apart": (_xla_kn_norm_apart, False),
}


def time_product(product: Callable[..., jax.Array], m: int, k: int, n: int, transposed: bool,
                 calls: int = 20) -> float:
    """Seconds per product: one program applies it to `copies` distinct weights (more bytes than L2 holds)."""
    w_bytes = k * n * 2
    copies = max(2, -(-MIN_BYTES_PER_CALL // w_bytes), -(-2 * L2_BYTES // w_bytes))
    keys = jax.random.split(jax.random.key(0), copies + 1)
    shape = (n, k) if transposed else (k, n)
    ws = [jax.random.normal(key, shape, jnp.bfloat16) * 0.02 for key in keys[1:]]
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)

    @jax.jit
    def program(x: jax.Array, ws: list[jax.Array]) -> jax.Array:
        acc = jnp.zeros((m, n), jnp.float32)
        for i, w in enumerate(ws):  # unrolled: `copies` products, each reading its own weight
            acc = acc + product(x + jnp.bfloat16(i), w).astype(jnp.float32)  # its own x: no shared prologue
        return acc

    program(x, ws).block_until_ready()
    t = time.perf_counter()
    for _ in range(calls):
        out = program(x, ws)
    out.block_until_ready()
    return (time.perf_counter() - t) / (calls * copies)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8])
    p.add_argument("--candidates", nargs="+", default=list(CANDIDATES))
    p.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rate = copy_rate()
    rows: list[dict[str, Any]] = []
    print(f"device {jax.devices()[0].device_kind}  copy {rate / 1e9:.0f} GB/s  XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}")
    for name, k, n in SHAPES:
        if name not in args.shapes:
            continue
        for m in args.rows:
            for cand in args.candidates:
                fn, transposed = CANDIDATES[cand]
                try:
                    s = time_product(fn, m, k, n, transposed)
                except Exception as e:  # noqa: BLE001 - a candidate that cannot take the shape is reported
                    rows.append({"shape": name, "k": k, "n": n, "m": m, "candidate": cand,
                                 "error": f"{type(e).__name__}: {str(e)[:200]}"})
                    print(f"{name:18s} M={m:<2d} {cand:9s} error {type(e).__name__}: {str(e)[:300]}")
                    continue
                ideal = k * n * 2 / rate
                rows.append({"shape": name, "k": k, "n": n, "m": m, "candidate": cand, "us": s * 1e6,
                             "pct_of_copy_rate": 100 * ideal / s})
                print(f"{name:18s} M={m:<2d} {cand:9s} {s * 1e6:8.2f} us  {100 * ideal / s:5.1f}% of copy rate")
                if args.out:  # after every row: a run cut short by its time limit keeps what it measured
                    with open(args.out, "w") as f:
                        json.dump({"device": jax.devices()[0].device_kind, "copy_bytes_per_s": rate,
                                   "xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
