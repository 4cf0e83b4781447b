"""Host time to place one step's arrays on device: packed (jaxinfer.engine.transfer) against one copy per array.

The arguments are the engine's own, at a decode batch of --batch rows: the multi-step decode call's
(batch, sample inputs, decode inputs), the pipelined step's sampler arguments, and its next forward's batch.
Each is placed --calls times, waiting for the arrays each time, packed and then unpacked, twice in turn
(the second round is the one reported; the first warms both paths).

    PYTHONPATH=$PWD python3 scripts/bench_transfer.py --out $OUT/transfer.json
    # on CPU:  ... --dtype float32 --batch 32
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import jax


def _ms_per_call(place: Any, args: Any, calls: int) -> float:
    jax.block_until_ready(place(args))
    start = time.perf_counter()
    for _ in range(calls):
        jax.block_until_ready(place(args))
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--out")
    args = p.parse_args()

    from jaxinfer import LLM

    llm = LLM(args.model, random_weights=True, dtype=args.dtype, max_num_seqs=args.batch,
              max_model_len=args.max_model_len, use_tqdm=False)
    engine = llm.engine
    shape = engine.decode_shape(args.batch)
    batch, inputs, decode = engine.loop.args(shape, [], [], 4)
    cases = {
        "decode_call": (batch, inputs, decode),
        "sampler": (inputs.sampling, inputs.slots, inputs.sample_mask),
        "forward_batch": engine._pack(engine.batch_shape(args.batch), []),
    }
    transfer = engine.runner.transfer
    rows: dict[str, dict[str, float]] = {}
    for _ in range(2):
        for name, case in cases.items():
            leaves = sum(not isinstance(a, jax.Array) for a in jax.tree.leaves(case))
            row = rows[name] = {"host_leaves": leaves}
            for packed in (True, False):
                transfer.enabled = packed
                row["packed_ms" if packed else "per_array_ms"] = _ms_per_call(engine.runner.place, case, args.calls)
            row["speedup"] = row["per_array_ms"] / row["packed_ms"]
    transfer.enabled = True
    result = {"device": jax.devices()[0].device_kind, "model": args.model, "batch": args.batch, "cases": rows,
              "command": "python3 scripts/bench_transfer.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None)}
    print(f"{'arguments':<14} {'leaves':>6} {'per array ms':>13} {'packed ms':>10} {'speedup':>8}")
    for name, row in rows.items():
        print(f"{name:<14} {row['host_leaves']:>6} {row['per_array_ms']:>13.3f} {row['packed_ms']:>10.3f} "
              f"{row['speedup']:>7.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
