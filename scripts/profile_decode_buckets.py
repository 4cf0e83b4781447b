"""Where a multi-step decode call spends its time, per row bucket: device time per iteration of the compiled
decode call at each requested bucket (one real row or full), its kernel breakdown, and optionally the
compiled HLO, so a regression confined to one bucket (the 1-row bucket of batch-1 decode, say) shows
which bucket and which kernels.

    PYTHONPATH=$PWD python3 scripts/profile_decode_buckets.py --rows 1 16 --out $OUT/buckets.json --hlo-dir $OUT
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax

from jaxinfer import LLM
from jaxinfer.bench.measure import kernel_profile
from jaxinfer.bench.workloads import fixed, prompts
from jaxinfer.engine.runner import DECODE_KINDS


def time_bucket(llm: LLM, rows: int, real: int, ctx: int, steps: int, calls: int, top: int = 12) -> dict:
    """Device time of `calls` back-to-back decode calls over bucket `rows` holding `real` sequences."""
    engine, runner = llm.engine, llm.engine.runner
    ids = [engine.add_request(p, _greedy(engine.max_model_len - ctx)) for p in prompts(fixed(ctx, 1, real), 32000, rows)]
    while any(not engine.requests[i].seqs[0].token_ids for i in ids):
        engine.step()
    engine.flush()
    plan = engine.scheduler.schedule()
    slots = engine._slot_rows(plan)
    shape = engine.decode_shape(rows)
    host_args = engine._decode_args(shape, plan.seqs, slots, steps)
    args, branch_free = runner.place(host_args), runner.takes_branch_free(host_args[1].sampling)  # as the engine

    def call():
        engine.penalties, out = runner.decode_steps(engine.penalties, *args, max_steps=engine.decode_steps_per_call,
                                                    branch_free=branch_free)
        return out

    jax.block_until_ready(call())
    t = time.perf_counter()
    for _ in range(calls - 1):
        call()
    jax.block_until_ready(call())
    per_iteration_ms = (time.perf_counter() - t) / calls / steps * 1e3
    profile = kernel_profile(lambda: [call() for _ in range(2)], calls=2, top=top)
    for i in ids:
        engine.abort(i)
    return {"rows_bucket": shape.seqs, "real_rows": real, "ms_per_iteration": per_iteration_ms, "kernels": profile}


def _greedy(n: int):
    from jaxinfer import SamplingParams

    return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)


def force_int4_pack(pack: int) -> None:
    """Make the quantizer store every int4 weight with packing chunk `pack` (an experiment: the engine picks the
    chunk by backend and group size, quantization.fit_packs; 2 is plain order, 64 chunk halves for groups of 32)."""
    import jaxinfer.quantization as q

    q.NATURAL_INT4_BACKENDS = ()
    q.default_pack = lambda group, k: pack


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--rows", type=int, nargs="*", default=[1, 16])
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--out", default="buckets.json")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--hlo-dir", default=None, help="write each decode executable's compiled HLO here")
    p.add_argument("--max-num-seqs", type=int, default=64, help="the largest bucket (fewer buckets warm up faster)")
    p.add_argument("--memory-fraction", type=float, default=0.5)
    p.add_argument("--top", type=int, default=12, help="kernels listed per bucket, by device time")
    p.add_argument("--quantization", default=None, help="LLM(quantization=...): int8, int4, int4:128, fp8")
    p.add_argument("--int4-pack", type=int, default=None,
                   help="store int4 weights with this packing chunk (2: plain int4 order; 64: chunk halves for "
                        "groups of 32) instead of the backend's choice")
    args = p.parse_args()
    if args.int4_pack:
        force_int4_pack(args.int4_pack)
    llm = LLM(args.model, random_weights=True, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_model_len=args.ctx + 256, decode_steps_per_call=args.steps, use_tqdm=False,
              memory_fraction=args.memory_fraction, quantization=args.quantization)
    print(f"weights {llm.engine_stats()['weight_bytes'] / 1e9:.2f} GB", flush=True)
    llm.wait_for_background_compile()  # steady-state speed
    results = []
    for rows in args.rows:
        results.append(time_bucket(llm, rows, 1, args.ctx, args.steps, args.calls, args.top))
        if rows > 1:
            results.append(time_bucket(llm, rows, rows, args.ctx, args.steps, args.calls, args.top))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "kernels"}), flush=True)
    if args.hlo_dir:
        for branch_free in (False, True):  # runner.takes_branch_free: the two builds of the loop (GPU)
            decodes = [exe for key, exe in llm.engine.runner._executables.items()
                       if key[0] in DECODE_KINDS and dict(key[2]).get("branch_free", False) == branch_free]
            wanted = {llm.engine.decode_shape(r).seqs for r in args.rows}  # the buckets the rows asked for land in
            for rows, exe in zip(llm.engine.decode_row_buckets, decodes):  # warmup compiles them in this order
                if rows in wanted:
                    name = f"decode_rows{rows}{'_branch_free' if branch_free else ''}.hlo.txt"
                    Path(args.hlo_dir, name).write_text(exe.as_text())
    Path(args.out).write_text(json.dumps(results, indent=1))
    for r in results:
        k = r["kernels"]
        print(f"bucket {r['rows_bucket']:>3} real {r['real_rows']:>3}: {r['ms_per_iteration']:.2f} ms/iteration; "
              f"kernels/call {json.dumps(k.get('ms_per_call_by_class'))}; top {[t['name'] for t in k.get('top', [])[:4]]}")


if __name__ == "__main__":
    main()
