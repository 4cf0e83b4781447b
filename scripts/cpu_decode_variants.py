"""CPU batch-32 decode of the bundled SmolLM2-135M under code variants, alternating in one process
(docs/PERFORMANCE.md, "CPU": the thirty-eighth session's variants that did not move `jaxinfer bench --device cpu`).

Why one process: on a shared 2-core VM the same tree's 64-token runs moved 4.5-5.7 s within minutes, so variants
timed in separate processes compare machine states, not code. Here each variant's engine is built with its patch
applied (the sampler's code is read when its programs are traced), then all engines run the same greedy 64-token
batch in turn, `--rounds` times; best and median per variant.

    PYTHONPATH=$PWD python scripts/cpu_decode_variants.py engine tree argmax
    PYTHONPATH=$PWD python scripts/cpu_decode_variants.py engine tree lean_logprobs
    PYTHONPATH=$PWD python scripts/cpu_decode_variants.py engine tree steps16
    PYTHONPATH=$PWD python scripts/cpu_decode_variants.py attention      # 30 layers of decode attention alone
    PYTHONPATH=$PWD python scripts/cpu_decode_variants.py attention --own-kv   # ... each layer its own KV pool
    PYTHONPATH=$PWD python scripts/cpu_decode_variants.py gather         # XLA's page gather against NumPy's
    XLA_FLAGS=--xla_cpu_enable_xprof_traceme=true PYTHONPATH=$PWD python scripts/cpu_decode_variants.py profile tree
                                       # XLA:CPU thunk time by fusion kind and thread, one traced 64-token batch

Variants (engine mode):
    tree           the code as it is
    argmax         jnp.argmax in the sampler as a max and the first index holding it (no variadic reduce)
    lean_logprobs  the chosen token's logprob and rank from the raw logits and their log-sum-exp, with no [S, V]
                   log-softmax array
    steps16        decode_steps_per_call=16 instead of the CPU default
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time
import types

import jax
import jax.numpy as jnp
import numpy as np


def _first_max_index(x: jax.Array, axis: int = -1) -> jax.Array:
    """argmax over the last axis as two plain reductions: [S, V] -> [S]."""
    top = x.max(axis=-1, keepdims=True)  # [S, 1]
    idx = jnp.arange(x.shape[-1], dtype=jnp.int32)  # [V]
    return jnp.min(jnp.where(x == top, idx, x.shape[-1]), axis=-1)


def _lean_logprob_outputs(logits, ids, k, want_top=True, vocab=None):
    """sampling._logprob_outputs' results without materializing log_softmax(logits)."""
    from jaxinfer.engine import sampling

    x = logits.astype(jnp.float32)  # [S, V]
    top = x.max(axis=-1)  # [S]
    lse = top + jnp.log(jnp.sum(jnp.exp(x - top[:, None]), axis=-1))  # [S]
    picked = jnp.take_along_axis(x, jnp.clip(ids, 0, x.shape[1] - 1)[:, None], axis=1)[:, 0]  # [S]
    ranks = 1 + jnp.sum(x > picked[:, None], axis=-1, dtype=jnp.int32)  # [S]
    k = min(k, x.shape[1])
    zeros = lambda: (jnp.zeros((x.shape[0], k), jnp.float32), jnp.zeros((x.shape[0], k), jnp.int32))
    if want_top is False:
        top_lp, top_ids = zeros()
    else:
        top_lp, top_ids = jax.lax.cond(want_top, lambda: tuple(sampling._top_k(x - lse[:, None], k, vocab)), zeros)
    return picked - lse, top_ids.astype(jnp.int32), top_lp, ranks


@contextlib.contextmanager
def _patched(variant: str):
    """The variant's patch on jaxinfer.engine.sampling while its engine traces (nothing for the others)."""
    from jaxinfer.engine import sampling

    saved = sampling.jnp, sampling._logprob_outputs
    if variant == "argmax":
        shim = types.ModuleType("jnp_first_max_index")
        shim.__dict__.update(jnp.__dict__)
        shim.argmax = _first_max_index
        sampling.jnp = shim
    elif variant == "lean_logprobs":
        sampling._logprob_outputs = _lean_logprob_outputs
    try:
        yield
    finally:
        sampling.jnp, sampling._logprob_outputs = saved


def engine_mode(variants: list[str], batch: int, rounds: int) -> None:
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.bench.cpu_vs_hf import MODEL, prompts

    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    llms, rows = {}, None
    for v in variants:
        with _patched(v):
            extra = {"decode_steps_per_call": 16} if v == "steps16" else {}
            llms[v] = LLM(MODEL, max_num_seqs=batch, use_tqdm=False, **extra)
            rows = rows or prompts(llms[v].model_config.vocab_size, batch, 32)
            llms[v].generate(rows, params, use_tqdm=False)  # compiles what the timed runs use
    times, first = {v: [] for v in variants}, {}
    for _ in range(rounds):
        for v in variants:
            start = time.perf_counter()
            out = llms[v].generate(rows, params, use_tqdm=False)
            times[v].append(time.perf_counter() - start)
            first[v] = out[0].outputs[0].token_ids[:6]
    for v in variants:
        t = np.array(times[v])
        print(f"{v:14s} best {t.min():.3f} s  median {np.median(t):.3f} s  ({batch * 64 / t.min():.0f} tok/s)  "
              f"first row {first[v]}")


def profile_mode(variant: str, batch: int) -> None:
    """Where XLA:CPU's threads spend one 64-token batch: a profiler trace of one `generate` (with XLA_FLAGS
    --xla_cpu_enable_xprof_traceme=true, XLA:CPU names its thunks in it), thunk time summed by fusion kind per thread."""
    import collections
    import glob
    import gzip
    import json
    import tempfile

    from jaxinfer import LLM, SamplingParams
    from jaxinfer.bench.cpu_vs_hf import MODEL, prompts

    with _patched(variant):
        llm = LLM(MODEL, max_num_seqs=batch, use_tqdm=False)
    rows = prompts(llm.model_config.vocab_size, batch, 32)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    llm.generate(rows, params, use_tqdm=False)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            llm.generate(rows, params, use_tqdm=False)
        events = json.load(gzip.open(glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)[0]))["traceEvents"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    by_thread = collections.defaultdict(collections.Counter)
    for e in events:
        name = e.get("name", "")
        if e.get("ph") == "X" and not name.startswith("$") and "Execute" not in name and "Await" not in name:
            by_thread[threads.get((e["pid"], e["tid"]), e["tid"])][name.split(".")[0]] += e.get("dur", 0)
    for thread, kinds in by_thread.items():
        if "XLAEigen" not in str(thread):
            continue
        print(f"{thread}: {sum(kinds.values()) / 1e3:.0f} ms of thunks")
        for kind, us in kinds.most_common(8):
            print(f"  {us / 1e3:8.1f} ms  {kind}")


def _all_heads_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                         block_pages: int = 2):
    """Decode attention of each sequence's last token with no transposes: every q head against the rows of all kv
    heads of a gathered block ([S, L*K, H], as stored), the other heads' rows masked; -> [T, N, H]."""
    from pallas_kernels.ragged_paged_attention import xla
    from pallas_kernels.ragged_paged_attention.reference import MASK_VALUE, pad_to_blocks

    page_indices = pad_to_blocks(page_indices)
    num_tokens, heads, dim = q.shape
    seqs, page, kv_heads = kv_lens.shape[0], k_pages.shape[1], k_pages.shape[2]
    rows_per_block = block_pages * page * kv_heads
    live = xla._live(cu_q_lens, num_seqs)  # [S]
    lens = jnp.where(live, kv_lens, 0)  # [S]
    q_last = q[jnp.clip(cu_q_lens[1:] - 1, 0, num_tokens - 1)].astype(jnp.float32)  # [S, N, H]
    own_head = (jnp.arange(heads) // (heads // kv_heads))[None, :, None]  # [1, N, 1]

    def body(b, carry):
        m, l, acc = carry  # [S, N], [S, N], [S, N, H]
        ids = jax.lax.dynamic_slice_in_dim(page_indices, b * block_pages, block_pages, axis=1).reshape(-1)
        k_blk = k_pages[ids].reshape(seqs, rows_per_block, dim)  # [S, J, H], j = (position, kv head)
        v_blk = v_pages[ids].reshape(seqs, rows_per_block, dim)  # [S, J, H]
        j = jnp.arange(rows_per_block, dtype=jnp.int32)  # [J]
        pos = b * block_pages * page + j // kv_heads  # [J]
        mask = (pos[None, None, :] < lens[:, None, None]) & ((j % kv_heads)[None, None, :] == own_head)  # [S, N, J]
        logits = jnp.where(mask, jnp.einsum("snh,sjh->snj", q_last, k_blk) * sm_scale, MASK_VALUE)  # [S, N, J]
        m_new = jnp.maximum(m, logits.max(-1))  # [S, N]
        p = jnp.where(mask, jnp.exp(logits - m_new[..., None]), 0.0)  # [S, N, J]
        alpha = jnp.exp(m - m_new)  # [S, N]
        return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + jnp.einsum("snj,sjh->snh", p, v_blk)

    stats = jnp.full((seqs, heads), MASK_VALUE, jnp.float32)
    init = (stats, jnp.zeros_like(stats), jnp.zeros((seqs, heads, dim), jnp.float32))
    blocks = (jnp.max(lens) + block_pages * page - 1) // (block_pages * page)
    _, l, acc = jax.lax.fori_loop(0, blocks, body, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]  # [S, N, H]
    rows = jnp.where(live, cu_q_lens[1:] - 1, num_tokens)  # [S]
    return jnp.zeros(q.shape, jnp.float32).at[rows].set(out, mode="drop").astype(q.dtype)


def attention_mode(batch: int, ctx: int, rounds: int, own_kv: bool, pool_pages: int) -> None:
    """SmolLM2's decode attention (9 q heads, 3 kv heads, head dim 64, 16-token pages) over 30 layers in one jit.

    By default the 30 layers share one small cache, which stays in the CPU's caches. With `own_kv` each layer reads
    its own pool of `pool_pages` pages, as in the engine, so the KV streams from memory."""
    from pallas_kernels.ragged_paged_attention import xla

    heads, kv_heads, dim, page, layers = 9, 3, 64, 16, 30
    rng = np.random.default_rng(0)
    per_seq = -(-ctx // page)
    num_pages = max(pool_pages, batch * per_seq + 8) if own_kv else batch * per_seq + 8
    pools = [tuple(jnp.asarray(rng.random((num_pages, page, kv_heads, dim), np.float32) - 0.5) for _ in range(2))
             for _ in range(layers if own_kv else 1)]  # [(K [P, R, K, H], V)] per layer, or one shared
    q = jnp.asarray(rng.standard_normal((batch, heads, dim), np.float32))
    table = np.zeros((batch, 2048 // page), np.int32)
    table[:, :per_seq] = rng.permutation(np.arange(1, num_pages))[: batch * per_seq].reshape(batch, per_seq)
    meta = (jnp.asarray(rng.integers(ctx // 2, ctx + 1, batch), jnp.int32), jnp.asarray(table),
            jnp.arange(batch + 1, dtype=jnp.int32), jnp.array([batch], jnp.int32))

    # The pools and the page table are arguments, not constants of the program: XLA:CPU folds a gather from
    # constant pools at constant page ids (outside a loop) into a constant, which times no memory traffic at all.
    def thirty_layers(fn, q, pools, meta):
        if not own_kv:
            k_pages, v_pages = pools[0]
            body = lambda _, acc: acc + fn(q + acc * 1e-3, k_pages, v_pages, *meta, sm_scale=dim ** -0.5)
            return jax.lax.fori_loop(0, layers, body, jnp.zeros_like(q))
        acc = jnp.zeros_like(q)  # unrolled: a loop over stacked pools would slice (copy) a whole pool per layer
        for k_pages, v_pages in pools:
            acc = acc + fn(q + acc * 1e-3, k_pages, v_pages, *meta, sm_scale=dim ** -0.5)
        return acc

    fns = {"tree": xla.ragged_paged_attention, "all_heads": _all_heads_attention}
    compiled = {name: jax.jit(functools.partial(thirty_layers, fn)) for name, fn in fns.items()}
    outs = {name: f(q, pools, meta).block_until_ready() for name, f in compiled.items()}
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, f in compiled.items():
            start = time.perf_counter()
            f(q, pools, meta).block_until_ready()
            times[name].append(time.perf_counter() - start)
    for name in fns:
        t = np.array(times[name]) * 1e3
        err = float(jnp.max(jnp.abs(outs[name] - outs["tree"])))
        print(f"{name:10s} best {t.min():.2f} ms  median {np.median(t):.2f} ms per 30 layers  max |diff| {err:.1e}")


def gather_mode(rounds: int, pool_pages: int) -> None:
    """What the CPU attention's page gather costs: 64 random 16-token pages (SmolLM2's [16, 3, 64] float32, 12 KB
    each; 786 KB, one K block of the batched pass at 32 sequences) out of a pool that does not fit the caches, by
    XLA inside one jitted loop, and by NumPy's fancy indexing (a memcpy per page)."""
    page_floats = 16 * 3 * 64
    rng = np.random.default_rng(0)
    pool = rng.standard_normal((pool_pages, page_floats), np.float32)  # [P, R*K*H]
    ids = rng.permutation(pool_pages)[: 64 * 100].reshape(100, 64)  # 100 blocks of 64 distinct pages
    block_mb = 64 * page_floats * 4 / 1e6
    pool_dev, ids_dev = jnp.asarray(pool), jnp.asarray(ids)
    body = lambda i, acc: acc + pool_dev[ids_dev[i]].reshape(32, 2, page_floats).sum(1)  # [32, R*K*H]
    xla_loop = jax.jit(lambda: jax.lax.fori_loop(0, 100, body, jnp.zeros((32, page_floats), jnp.float32)))
    xla_loop().block_until_ready()
    best = {"xla": 1e9, "numpy": 1e9}
    for _ in range(rounds):
        start = time.perf_counter()
        xla_loop().block_until_ready()
        best["xla"] = min(best["xla"], (time.perf_counter() - start) / 100)
        start = time.perf_counter()
        for i in range(100):
            pool[ids[i]].reshape(32, 2, page_floats).sum(1)
        best["numpy"] = min(best["numpy"], (time.perf_counter() - start) / 100)
    for name, t in best.items():
        rate = block_mb / 1e3 / t  # GB/s
        print(f"{name:6s} gather + pairwise sum of a {block_mb:.2f} MB block: {t * 1e6:.1f} us ({rate:.1f} GB/s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["engine", "attention", "profile", "gather"])
    ap.add_argument("variants", nargs="*", default=["tree", "argmax"],
                    help="engine mode: tree, argmax, lean_logprobs, steps16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=64, help="attention mode: longest context")
    ap.add_argument("--own-kv", action="store_true", help="attention mode: each layer its own pool, as in the engine")
    ap.add_argument("--pool-pages", type=int, default=2048,
                    help="attention --own-kv: pages (12 KB) in each layer's pool; gather: 8x this, past the L3")
    args = ap.parse_args()
    if args.mode == "engine":
        engine_mode(args.variants, args.batch, args.rounds)
    elif args.mode == "profile":
        profile_mode(args.variants[0], args.batch)
    elif args.mode == "gather":
        gather_mode(args.rounds, 8 * args.pool_pages)
    else:
        attention_mode(args.batch, args.ctx, args.rounds * 3, args.own_kv, args.pool_pages)


if __name__ == "__main__":
    main()
