"""Batch-1 decode of an MoE model under code variants, in one process: device time per iteration of the 2-row
decode loop, its kernel launches per iteration by name, and the compiled HLO of each variant.

Why one process: the run of record's engine compiles ~36 programs in warmup (~150 s on an H200). Here the engine
starts without warmup, compiles only the prefill of one prompt and, per variant, the one decode loop the bucket
runs, so each extra variant costs one compile. A variant is a patch applied before that compile (the model's code
is read at trace time); each is timed against the same engine, weights and prompt.

    PYTHONPATH=$PWD python3 scripts/moe_b1_variants.py --variants base new --out $OUT/variants.json --hlo-dir $OUT
"""

from __future__ import annotations

import argparse
import collections
import functools
import gzip
import json
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from jaxinfer import LLM, SamplingParams
from jaxinfer.bench.measure import device_events
from jaxinfer.bench.workloads import fixed, prompts
from jaxinfer.engine.runner import decode_kind
from pallas_kernels.grouped_matmul.gpu_swiglu import SwigluTiling


def _slices_combine_parts(parts: jax.Array, mine: jax.Array, weights: jax.Array) -> jax.Array:
    """A combine tried here: the S * k slices summed in one elementwise fusion (one kernel, but 4,096 threads each
    adding 96 values: 4.5 us on an H200)."""
    import jax.numpy as jnp

    out = None
    for slot in range(parts.shape[1]):
        rows = functools.reduce(jnp.add, [parts[i, slot] for i in range(parts.shape[0])])  # [T, D]
        row = jnp.where(mine[:, slot, None], rows * weights[:, slot, None], 0.0)  # [T, D]
        out = row if out is None else out + row
    return out


def _s_then_k_combine_parts(parts: jax.Array, mine: jax.Array, weights: jax.Array) -> jax.Array:
    """A combine tried here: a reduction over S, then the k slots weighted as static slices (XLA fused the
    reduction into the slots' elementwise fusion: one kernel of 5.0 us on an H200)."""
    import jax.numpy as jnp

    rows = jnp.sum(parts, axis=0)  # [k, T, D]
    out = None
    for slot in range(parts.shape[1]):
        row = jnp.where(mine[:, slot, None], rows[slot] * weights[:, slot, None], 0.0)  # [T, D]
        out = row if out is None else out + row
    return out


def _old_normed_qkv(layer: Any, x: jax.Array, eps: float, linear: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """QK-norm before this script's session: q's and k's heads normed separately."""
    from jaxinfer.models.common import head_projections, rms_norm

    q, k, v = head_projections(x, layer.wq, layer.wk, layer.wv, layer.q_norm.shape[0], linear)
    return rms_norm(q, layer.q_norm, eps), rms_norm(k, layer.k_norm, eps), v


def _split_output_projection(attn: jax.Array, wo: Any, linear: Any, splits: int) -> jax.Array:
    """attn [T, N, H] @ wo [N, H, D] as qwen3.split_k_product over N * H (float weights; else the tree's)."""
    from jaxinfer.linear import is_quantized
    from jaxinfer.models import common, qwen3

    if is_quantized(wo) or attn.shape[0] > 8:
        return common.output_projection(attn, wo, linear)
    t, n, h = attn.shape
    return qwen3.split_k_product(attn.reshape(t, n * h), wo.reshape(n * h, wo.shape[-1]), splits)  # [T, D]


def _skinny_output_projection(attn: jax.Array, wo: Any, linear: Any, splits: int) -> jax.Array:
    """attn [T, N, H] @ wo [N, H, D] by pallas_kernels.skinny_matmul's S partials, summed (the tree's elsewhere)."""
    from jaxinfer.models import common
    from pallas_kernels.skinny_matmul import gpu as skinny

    t, n, h = attn.shape
    x = attn.reshape(t, n * h)  # [T, N*H]
    w = wo.reshape(n * h, wo.shape[-1]) if isinstance(wo, jax.Array) else None  # [N*H, D]; None: quantized
    if w is None or not skinny.takes(x, w, splits):
        return common.output_projection(attn, wo, linear)
    return skinny.skinny_matmul(x, w, splits=splits).sum(axis=0).astype(attn.dtype)  # [S, T, D] -> [T, D]


def _skinny_qkv_parts(x: jax.Array, wq: Any, linear: Any, splits: int, saved: Callable) -> jax.Array:
    """The joined q/k/v product's partials for norm_rope_write from pallas_kernels.skinny_matmul (the tree's
    elsewhere)."""
    from pallas_kernels.skinny_matmul import gpu as skinny

    w = getattr(wq, "w", None)
    if isinstance(w, jax.Array) and skinny.takes(x, w, splits):
        return skinny.skinny_matmul(x, w, splits=splits)  # [S, T, W] float32
    return saved(x, wq, linear)


def _pair_kernel(runner: Any, **changes: Any) -> None:
    """The runner's MoE block with its pair kernel's fields changed (e.g. select_top_k=None: XLA's top-k)."""
    import dataclasses

    from jaxinfer.models.moe import moe_block

    pk = runner.moe_fn.keywords["pair_kernel"]
    if pk is None:  # no pair path here (a CPU run of the script)
        return
    pk = dataclasses.replace(pk, **changes)
    runner.moe_fn = functools.partial(moe_block, expert_matmul=runner.moe_fn.keywords["expert_matmul"],
                                      pair_kernel=pk)


_SAVED_ATTENTION: list[Any] = []  # the tree's gpu.ragged_paged_attention while a variant runs


def _fresh_attention(**bound: Any) -> None:
    """A new jit of the GPU attention wrapper (with `bound` keywords, e.g. num_splits), so its trace cache does not
    hand back the tree's trace and the patched globals (decode_merge.takes) are read again."""
    from pallas_kernels.ragged_paged_attention import gpu

    gpu.ragged_paged_attention = jax.jit(functools.partial(_SAVED_ATTENTION[0].__wrapped__, **bound),
                                         static_argnames=gpu.STATIC_ARGNAMES)


def _kernel_write_kv(k_pages: Any, v_pages: Any, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> Any:
    """The cache write tried here: K and V in one launch of pallas_kernels.ragged_paged_attention.kv_write (Pallas
    Triton) where it takes the pages, two scatters otherwise. It replaced the scatters' 2.0 + 1.6 us a layer with
    1.5, but its operands must be buffers of their own: k's RoPE and the slice of v out of the q/k/v product,
    which XLA had fused into the scatters, became two kernels (1.2 + 1.2 us), so the iteration did not move
    (docs/benchmarks/moe_b1_fusion_h200_2026-11-28c.json)."""
    from jaxinfer.models.common import write_kv
    from pallas_kernels.ragged_paged_attention import kv_write

    if kv_write.takes(k_pages, k) and kv_write.takes(v_pages, v):
        return kv_write.write_kv_pages(k_pages, v_pages, k, v, slot_mapping)
    return write_kv(k_pages, v_pages, k, v, slot_mapping)


def _patch(runner: Any, combine: str = "tree", qk: bool = True, routing: bool = True, splits: bool = True,
           weighted: bool = True, attention_splits: int | None = None, merge: bool = True,
           kv_kernel: bool = False, qkv_split_k: int = 0, pad_rows: bool | None = True,
           o_split_k: int = 0, routing_warps: int = 4, merge_warps: int = 4, norm_rope_write: bool = False,
           swiglu_tiling: Any = None, norm_router: tuple[int, int] | None = None, accumulate: bool = False,
           skinny_o: int = 0, skinny_qkv: int = 0, skinny: bool = False) -> None:
    """The tree's code with the named pieces (False) put back as they were before this script's sessions, or with
    a combine it tried ("slices", "s_then_k"), or the attention's split count forced."""
    from jaxinfer.models import common, moe, qwen3

    # The joined q/k/v product of decode-sized steps with K split this many ways (qwen3.QKV_SPLIT_K, 4 in the tree
    # since the 29th session; 0, the default here, is the one product of the variants before it).
    qwen3.QKV_SPLIT_K = qkv_split_k
    # The q/k/v product and the output projection (into a float32 residual stream) by the skinny_matmul kernel
    # (qwen3.SKINNY, on in the tree since the 35th session; False, the default here: XLA's products).
    qwen3.SKINNY = "gpu" if skinny else None
    # The MLP norm and the router's product of decode steps as one kernel, at (router rows a program, warps)
    # (moe.NORM_ROUTER, on in the tree since the 34th session; None, the default here: XLA's two kernels).
    from pallas_kernels.moe_routing import norm_router as nr

    moe.NORM_ROUTER = None if norm_router is None else "gpu"
    if norm_router is not None:
        nr.ROWS_PER_PROGRAM, nr.NUM_WARPS = norm_router
    # QK-norm, RoPE and the K and V writes of decode steps as one kernel (common.NORM_ROPE_WRITE, on in the tree since
    # the 32nd session), or XLA's four kernels (False, the default here: every variant before it).
    common.NORM_ROPE_WRITE = "gpu" if norm_rope_write else None
    if routing_warps != 4 or merge_warps != 4:  # the two Pallas Triton kernels' warps, each re-jitted to trace anew
        from pallas_kernels import moe_routing
        from pallas_kernels.ragged_paged_attention import decode_merge

        moe_routing.NUM_WARPS, decode_merge.NUM_WARPS = routing_warps, merge_warps
        moe_routing._pallas_gpu = jax.jit(moe_routing._pallas_gpu.__wrapped__,
                                          static_argnames=("top_k", "renorm", "interpret"))
        decode_merge.merge_decode_splits = jax.jit(decode_merge.merge_decode_splits.__wrapped__,
                                                   static_argnames=("group", "scale", "interpret"))
        _fresh_attention()
    if o_split_k:  # the output projection as o_split_k float32 partial products over slices of K, summed
        qwen3.output_projection = functools.partial(_split_output_projection, splits=o_split_k)
    if skinny_o:  # the output projection by the skinny_matmul kernel in skinny_o partials, summed by XLA
        qwen3.output_projection = functools.partial(_skinny_output_projection, splits=skinny_o)
    if skinny_qkv:  # norm_rope_write's q/k/v partials from the skinny_matmul kernel
        qwen3._qkv_parts = functools.partial(_skinny_qkv_parts, splits=skinny_qkv, saved=qwen3._qkv_parts)
    if combine != "tree":
        moe._combine_parts = {"slices": _slices_combine_parts, "s_then_k": _s_then_k_combine_parts}[combine]
    if not qk:
        qwen3.normed_qkv = _old_normed_qkv
    if not routing:
        _pair_kernel(runner, select_top_k=None)
    elif not splits:
        _pair_kernel(runner, router_splits=1)
    if not weighted:  # the expert kernel's parts unweighted, masked and weighted by the combine (before 11-28b)
        _pair_kernel(runner, swiglu_weighted=False)
    # The expert kernel's x padded to a multiple of 8 rows always (True: the tree before the 30th session), or only
    # where Mosaic's TMA tiling needs it (None: the tree since; a 2-row bucket's x goes as it is).
    pk = runner.moe_fn.keywords["pair_kernel"] if runner.moe_fn is not None else None  # None: a dense model
    if pk is not None and pk.swiglu is not None:
        # swiglu_tiling: the expert kernel at that SwigluTiling (None: its default_tiling).
        _pair_kernel(runner, swiglu=functools.partial(pk.swiglu, pad_rows=pad_rows, tiling=swiglu_tiling))
        # accumulate: the expert kernel adds its rows into the layer's residual (TMA reduce-add; the tree since the
        # 35th session), or writes [S, k, T, D] parts that a combine kernel sums (False, the default here).
        _pair_kernel(runner, swiglu_accumulates=accumulate)
    if kv_kernel:  # K and V written by the kv_write kernel, not two scatters
        import jaxinfer.attention

        jaxinfer.attention.write_kv = _kernel_write_kv
    if not merge:  # the split merge as XLA ran it before the decode_merge kernel (two kernels a layer)
        from pallas_kernels.ragged_paged_attention import decode_merge

        decode_merge.takes = lambda *a: False
    if attention_splits or not merge:  # attention_splits: the flash-decoding split count forced (32 by default here)
        _fresh_attention(**({"num_splits": attention_splits} if attention_splits else {}))


VARIANTS: dict[str, Callable[[Any], None]] = {
    # The tree before the 11-28b session (the 27th session's "new").
    "base": functools.partial(_patch, weighted=False, merge=False),
    # The expert kernel weights its rows and zeros the skipped ones, so the combine only sums.
    "weighted": functools.partial(_patch, merge=False),
    "weighted_splits16": functools.partial(_patch, merge=False, attention_splits=16),
    "weighted_splits8": functools.partial(_patch, merge=False, attention_splits=8),  # XLA fused its merge
    # The 28th session's tree: "weighted", and the decode attention's split merge one Pallas Triton kernel.
    "merge": _patch,
    "merge_unweighted": functools.partial(_patch, weighted=False),
    "merge_kv": functools.partial(_patch, kv_kernel=True),
    # The tree since the 29th session: "merge", and the decode steps' q/k/v product split 4 ways over K.
    "qkv_split": functools.partial(_patch, qkv_split_k=4),
    "qkv_split2": functools.partial(_patch, qkv_split_k=2),
    # The tree since the 30th session: "qkv_split", and the expert kernel's x of a 2-row bucket not padded to 8 rows.
    "nopad": functools.partial(_patch, qkv_split_k=4, pad_rows=None),
    # The tree of the 32nd session: "nopad", and QK-norm, RoPE and the KV write of decode steps in one kernel.
    "nrw": functools.partial(_patch, qkv_split_k=4, pad_rows=None, norm_rope_write=True,
                             swiglu_tiling=SwigluTiling()),
    # The tree since the 33rd session: "nrw" with the expert kernel's gate/up F channels on wgmma's M side (an
    # 8-row x block a step, not 64 rows) and 4 pipeline stages; or 3 stages of 256 D channels.
    "cols": functools.partial(_patch, qkv_split_k=4, pad_rows=None, norm_rope_write=True),
    # The tree since the 34th session: "cols" with the MLP norm and the router's product in one kernel, 64 router
    # rows a program (32 partials) on 4 warps; and other slices.
    "nr": functools.partial(_patch, qkv_split_k=4, pad_rows=None, norm_rope_write=True, norm_router=(64, 4)),
    # The tree since the 35th session: "nr" with the expert kernel adding its rows into the residual (no combine).
    "acc": functools.partial(_patch, qkv_split_k=4, pad_rows=None, norm_rope_write=True, norm_router=(64, 4),
                             accumulate=True),
    # The tree since the 35th session's second change: "acc" with q/k/v and the output projection by the skinny_matmul
    # kernel, the latter adding into a float32 residual stream (no residual-add kernel).
    "sk": functools.partial(_patch, qkv_split_k=4, pad_rows=None, norm_rope_write=True, norm_router=(64, 4),
                            accumulate=True, skinny=True),
    # "sk" with the expert kernel's down projection in 128-channel tiles (16 steps; the tree's batch-1 tiling before
    # the 37th session, which takes 256: 8 steps).
    "sk_d128": functools.partial(_patch, qkv_split_k=4, pad_rows=None, norm_rope_write=True, norm_router=(64, 4),
                                 accumulate=True, skinny=True, swiglu_tiling=SwigluTiling(stages=4, gate_up="cols")),
    # "acc" with the output projection, or the q/k/v product, by the skinny_matmul kernel (Mosaic GPU), the output
    # projection's partials summed by XLA with the residual (the in-loop measurement that chose the kernel).
    "acc_sko4": functools.partial(_patch, qkv_split_k=4, pad_rows=None, norm_rope_write=True, norm_router=(64, 4),
                                  accumulate=True, skinny_o=4),
    "acc_sko8": functools.partial(_patch, qkv_split_k=4, pad_rows=None, norm_rope_write=True, norm_router=(64, 4),
                                  accumulate=True, skinny_o=8),
    "acc_skqkv4": functools.partial(_patch, qkv_split_k=4, pad_rows=None, norm_rope_write=True, norm_router=(64, 4),
                                    accumulate=True, skinny_qkv=4),
    "acc_skqkv8": functools.partial(_patch, qkv_split_k=4, pad_rows=None, norm_rope_write=True, norm_router=(64, 4),
                                    accumulate=True, skinny_qkv=8),
    "nr_r32": functools.partial(_patch, qkv_split_k=4, pad_rows=None, norm_rope_write=True, norm_router=(32, 4)),
    "nr_r128": functools.partial(_patch, qkv_split_k=4, pad_rows=None, norm_rope_write=True, norm_router=(128, 8)),
    "cols_k256": functools.partial(_patch, qkv_split_k=4, pad_rows=None, norm_rope_write=True,
                                   swiglu_tiling=SwigluTiling(tile_k=256, gate_up="cols")),
    # "nopad" with the output projection split over K (no gain: 3.222 and 3.251 against 3.175 / 3.199 ms; 30th).
    "o_split4": functools.partial(_patch, qkv_split_k=4, pad_rows=None, o_split_k=4),
    "o_split2": functools.partial(_patch, qkv_split_k=4, pad_rows=None, o_split_k=2),
    # "nopad" with the routing kernel's one program, or the decode merge's programs, on fewer warps (shuffle-only
    # reductions at one warp; no gain: 3.179-3.183 against 3.176 ms an iteration, 30th session).
    "route_w1": functools.partial(_patch, qkv_split_k=4, pad_rows=None, routing_warps=1),
    "route_w2": functools.partial(_patch, qkv_split_k=4, pad_rows=None, routing_warps=2),
    "merge_w1": functools.partial(_patch, qkv_split_k=4, pad_rows=None, merge_warps=1),
    "merge_w2": functools.partial(_patch, qkv_split_k=4, pad_rows=None, merge_warps=2),
    "base_27": functools.partial(_patch, qk=False, routing=False, weighted=False, merge=False),  # before the 27th
    "new": functools.partial(_patch, weighted=False, merge=False),
    "new_slices_combine": functools.partial(_patch, combine="slices", weighted=False, merge=False),
    "new_s_then_k_combine": functools.partial(_patch, combine="s_then_k", weighted=False, merge=False),
    "new_old_qk": functools.partial(_patch, qk=False, weighted=False, merge=False),
    "new_old_routing": functools.partial(_patch, routing=False, weighted=False, merge=False),
    "new_unsplit_router": functools.partial(_patch, splits=False, weighted=False, merge=False),
}


def fresh_decode_jit(runner: Any, kind: str) -> None:
    """A new jit of the decode loop (same function and options), so the next call traces the patched code."""
    from jaxinfer.engine.runner import MERGED_DOTS

    old = runner._entry_points[kind]

    # A new partial: jax.jit caches traces by function, and the old one would hand back the unpatched trace.
    runner._entry_points[kind] = jax.jit(functools.partial(old.__wrapped__), donate_argnums=(1, 2),
                                         static_argnames=("max_steps", "branch_free"),
                                         compiler_options=MERGED_DOTS if kind == "small_decode" else None)


def decode_args(llm: LLM, ctx: int, steps: int) -> tuple[Any, Any, list[int]]:
    """One sequence of a `ctx`-token prompt, prefilled; the placed arguments of its decode call in bucket 2."""
    engine, runner = llm.engine, llm.engine.runner
    params = SamplingParams(max_tokens=engine.max_model_len - ctx, ignore_eos=True, temperature=0.0)
    ids = [engine.add_request(p, params) for p in prompts(fixed(ctx, 1, 1), 32000, 1)]
    while any(not engine.requests[i].seqs[0].token_ids for i in ids):
        engine.step()
    engine.flush()
    plan = engine.scheduler.schedule()
    slots = engine._slot_rows(plan)
    shape = engine.decode_shape(1)
    host_args = engine._decode_args(shape, plan.seqs, slots, steps)
    return runner.place(host_args), runner.takes_branch_free(host_args[1].sampling), ids


def run_variant(llm: LLM, name: str, ctx: int, calls: int, hlo_dir: str | None) -> dict[str, Any]:
    engine, runner = llm.engine, llm.engine.runner
    saved_moe_fn = runner.moe_fn
    from jaxinfer.models import common, moe, qwen3

    from pallas_kernels.ragged_paged_attention import decode_merge
    from pallas_kernels.ragged_paged_attention import gpu as attention_gpu

    import jaxinfer.attention

    from pallas_kernels import moe_routing

    from pallas_kernels.moe_routing import norm_router as nr

    saved_nr = (moe.NORM_ROUTER, nr.ROWS_PER_PROGRAM, nr.NUM_WARPS, qwen3._qkv_parts, qwen3.SKINNY)
    saved = (moe._combine_parts, qwen3.normed_qkv, decode_merge.takes, jaxinfer.attention.write_kv,
             qwen3.QKV_SPLIT_K, qwen3.output_projection, moe_routing._pallas_gpu, moe_routing.NUM_WARPS,
             decode_merge.merge_decode_splits, decode_merge.NUM_WARPS, common.NORM_ROPE_WRITE)
    _SAVED_ATTENTION[:] = [attention_gpu.ragged_paged_attention]
    VARIANTS[name](runner)
    args, branch_free, ids = decode_args(llm, ctx, engine.decode_steps_per_call)
    steps = engine.decode_steps_per_call
    kind = decode_kind(args[0].logits_indices.shape[0])
    fresh_decode_jit(runner, kind)
    static = {"max_steps": steps, "branch_free": True} if branch_free else {"max_steps": steps}
    full = (runner.weights, runner.kv_cache, engine.penalties, *args)
    t0 = time.perf_counter()
    exe = runner._jitted(kind).lower(*full, **static).compile()
    compile_s = time.perf_counter() - t0
    runner._executables[runner._key(kind, full, static)] = exe
    if hlo_dir:
        with gzip.open(Path(hlo_dir, f"decode_b1_{name}.hlo.txt.gz"), "wt") as f:
            f.write(exe.as_text())

    tokens = []

    def call():
        engine.penalties, out = runner.decode_steps(engine.penalties, *args, max_steps=steps, branch_free=branch_free)
        return out

    first = call()
    tokens.append(np.asarray(first.sampled.tokens)[:, 0].tolist())
    jax.block_until_ready(call())
    t = time.perf_counter()
    for _ in range(calls - 1):
        call()
    jax.block_until_ready(call())
    ms_iter = (time.perf_counter() - t) / calls / steps * 1e3
    source, events = device_events(lambda: [call() for _ in range(2)])
    per_name = collections.defaultdict(lambda: [0, 0.0])
    for ev_name, ms in events:
        per_name[ev_name][0] += 1
        per_name[ev_name][1] += ms
    iters = 2 * steps
    launches = sum(n for n, _ in per_name.values()) / iters
    kernel_ms = sum(ms for _, ms in per_name.values()) / iters
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1][1])
    for i in ids:
        engine.abort(i)
    runner.moe_fn = saved_moe_fn  # every variant starts from the tree's code
    (moe._combine_parts, qwen3.normed_qkv, decode_merge.takes, jaxinfer.attention.write_kv,
     qwen3.QKV_SPLIT_K, qwen3.output_projection, moe_routing._pallas_gpu, moe_routing.NUM_WARPS,
     decode_merge.merge_decode_splits, decode_merge.NUM_WARPS, common.NORM_ROPE_WRITE) = saved
    attention_gpu.ragged_paged_attention = _SAVED_ATTENTION[0]
    moe.NORM_ROUTER, nr.ROWS_PER_PROGRAM, nr.NUM_WARPS, qwen3._qkv_parts, qwen3.SKINNY = saved_nr
    return {"variant": name, "ms_per_iteration": ms_iter, "compile_s": compile_s, "source": source,
            "launches_per_iteration": launches, "kernel_ms_per_iteration": kernel_ms, "first_tokens": tokens[0],
            "kernels": [{"name": n[:100], "per_iteration": c / iters, "us_per_iteration": ms * 1e3 / iters}
                        for n, (c, ms) in ranked]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--variants", nargs="+", default=["base"])
    p.add_argument("--repeat", type=int, default=1, help="time the variant list this many times (alternating)")
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--memory-fraction", type=float, default=0.85)
    p.add_argument("--out", default="variants.json")
    p.add_argument("--hlo-dir", default=None)
    p.add_argument("--budget-s", type=float, default=1e9, help="start no variant after this many seconds")
    args = p.parse_args()
    start = time.perf_counter()
    llm = LLM(args.model, random_weights=True, dtype="bfloat16", max_num_seqs=2, max_model_len=args.ctx + 1024,
              decode_steps_per_call=args.steps, use_tqdm=False, memory_fraction=args.memory_fraction, warmup=False)
    print(f"engine up in {time.perf_counter() - start:.0f} s", flush=True)
    results = []
    for rep in range(args.repeat):
        for name in args.variants:
            if time.perf_counter() - start > args.budget_s:
                print(f"budget spent: {name} not run", flush=True)
                continue
            r = run_variant(llm, name, args.ctx, args.calls, args.hlo_dir if rep == 0 else None)
            r["repeat"] = rep
            results.append(r)
            Path(args.out).write_text(json.dumps(results, indent=1))
            print(f"{name}: {r['ms_per_iteration']:.3f} ms/iter, {r['launches_per_iteration']:.0f} launches/iter, "
                  f"kernels {r['kernel_ms_per_iteration']:.3f} ms/iter, compile {r['compile_s']:.0f} s, "
                  f"tokens {r['first_tokens']}", flush=True)
    for r in results:
        print(f"{r['variant']:>12} rep {r['repeat']}: {r['ms_per_iteration']:.3f} ms/iter "
              f"{r['launches_per_iteration']:.0f} launches/iter")


if __name__ == "__main__":
    main()
