"""Benchmarks of the Pallas kernels on the GPU machine, against ceilings measured in the same run.

    PYTHONPATH=$PWD python3 scripts/bench_kernels.py --out $OUT/bench.json

Measures the copy bandwidth (best of a jnp copy, a Pallas copy and torch if present) and the bf16
matmul rate first, then decode attention (64 seqs x 4k context, Llama-3-8B heads), prefill attention
(4k tokens; Llama-3-8B and Qwen3-30B-A3B heads), and int8/int4 weight matmuls at M = 1..64 with
Llama-3-8B shapes, each next to the XLA-compiled reference and JAX's bundled kernels where they exist
(for prefill, JAX's Hopper flash attention on contiguous K/V). Every section is independent: a
failing one is logged and the rest still run. Prints a table last and writes JSON to --out.

`--sections ceilings,kv8` times decode attention (64 x 4k, 32-token pages) over a bf16, an int8 and an e4m3
cache (QuantizedPages), each against the bytes it stores.

`--sections kv_write` times one layer's K write into a Llama-3-8B-sized paged cache (25,192 pages of 16 tokens,
what the engine holds on an H100) at 2 to 4,096 tokens, as the engine writes it (`models.common._write_values`)
and as a plain `.at[slots].set` scatter, each in place (the cache donated from call to call).

`--sections ceilings,heads` times our attention kernel alone over head layouts (not in the default
set): decode 64 x 4k at G = 3, 4, 8, 16 and H = 64, 128, 256 (plus 80 and 96 at G = 3, 4) with 8 kv
heads, and 4k prefill at G = 3, 4 and H = 64, 128; `ceilings` gives the % of copy bandwidth.

Timing: warmup, then batches of calls that rotate through several input sets (so the L2 cache does not
serve repeated inputs). Each row reports the device time per call, summed over the device kernels of
one batch in a JAX profiler trace (the wrapper's own XLA ops included), and the wall time per call (the
median over batches, block_until_ready at each batch end), which for short kernels is host dispatch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback

import jax
import jax.numpy as jnp

from jaxinfer.bench.measure import device_spans
from pallas_kernels.quantized_matmul import quantize_weights
from pallas_kernels.quantized_matmul import gpu as qmm_gpu
from pallas_kernels.quantized_matmul import reference as qmm_ref
from pallas_kernels.ragged_paged_attention import gpu as rpa_gpu
from pallas_kernels.ragged_paged_attention import reference as rpa_ref

LLAMA_HEADS = dict(num_heads=32, kv_heads=8, head_dim=128)
QWEN3_MOE_HEADS = dict(num_heads=32, kv_heads=4, head_dim=128)  # G = 8
# The `heads` section: (G, H) layouts with 8 kv heads. G = 4, 8, 16 at H = 64/128/256 are shapes the
# kernel took before it handled every G; G = 3 (SmolLM2) and H = 80/96 are new.
HEAD_SWEEP_KV_HEADS = 8
HEAD_SWEEP_DECODE = [(g, h) for h in (64, 128, 256) for g in (3, 4, 8, 16)] + [
    (g, h) for h in (80, 96) for g in (3, 4)]
HEAD_SWEEP_PREFILL = [(g, h) for h in (64, 128) for g in (3, 4)]
# Tuning variants of our attention kernel timed beside the default (same run, same inputs).
# `ours` is what the call takes by default: the warp-specialized prefill kernel for the 4k prefills, the
# one-warpgroup kernel (whose depth the stages variants set) otherwise.
ATTENTION_VARIANTS = {"one warpgroup": dict(warp_specialized=False), "stages=2": dict(stages=2),
                      "stages=3": dict(stages=3)}
LLAMA_MATMULS = {"qkv 4096x6144": (4096, 6144), "up 4096x14336": (4096, 14336),
                 "down 14336x4096": (14336, 4096)}


def time_fn(fn, arg_sets, *, warmup=2, repeats=7, batch=10) -> dict[str, float]:
    """Seconds per call: `wall`, the median over `repeats` batches of `batch` calls rotating through
    arg_sets, and `device`, the device kernels of one more such batch summed from a profiler trace.

    The device figure is the one compared with the ceilings: a kernel of tens of microseconds is shorter
    than a Python dispatch of its jitted wrapper, so wall time would measure the host instead.
    """
    for i in range(warmup):
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))

    def run_batch():
        out = None
        for i in range(batch):
            out = fn(*arg_sets[i % len(arg_sets)])
        return out

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run_batch())
        times.append((time.perf_counter() - start) / batch)
    wall = statistics.median(times)
    source, spans = device_spans(run_batch)
    return dict(wall=wall, device=sum(spans.values()) / 1e3 / batch if source == "device" else wall)


class Results:
    """Rows of the final table plus a JSON record, filled section by section."""

    def __init__(self):
        self.rows, self.errors, self.ceilings = [], {}, {}

    def add(self, section, name, timing, *, bytes_moved=None, flops=None):
        """One row; `timing` is time_fn's dict, or plain seconds where only a wall time exists."""
        if not isinstance(timing, dict):
            timing = dict(wall=timing, device=timing)
        seconds = timing["device"]
        row = dict(section=section, name=name, us=seconds * 1e6, wall_us=timing["wall"] * 1e6)
        if bytes_moved:
            row["GB/s"] = bytes_moved / seconds / 1e9
            if "copy_GBps" in self.ceilings:
                row["%BW"] = 100 * row["GB/s"] / self.ceilings["copy_GBps"]
        if flops:
            row["TFLOP/s"] = flops / seconds / 1e12
            if "matmul_TFLOPs" in self.ceilings:
                row["%MM"] = 100 * row["TFLOP/s"] / self.ceilings["matmul_TFLOPs"]
        self.rows.append(row)
        print(json.dumps(row), flush=True)

    def run(self, section, name, thunk):
        try:
            thunk()
        except Exception as e:  # a failing variant must not stop the other measurements
            self.errors[f"{section}/{name}"] = f"{type(e).__name__}: {e}"[:2000]
            print(f"[error] {section}/{name}: {traceback.format_exc()[-3000:]}", flush=True)


def _pallas_copy(x):
    """A Mosaic GPU copy: 512 CTAs, each pipelining its share of [16, 1024] blocks."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    # pallas_call finds the Mosaic GPU lowering only once this module has registered it (0.11.2).
    from jax._src.pallas.mosaic_gpu import pallas_call_registration  # noqa: F401

    flat = x.reshape(-1, 1024)  # [rows, 1024]
    ctas, rows = 512, 16
    steps = flat.shape[0] // rows // ctas

    def body(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    spec = pl.BlockSpec((rows, 1024), lambda i, j: (i * steps + j, 0))
    out = pl.pallas_call(
        body, out_shape=jax.ShapeDtypeStruct(flat.shape, flat.dtype), grid=(ctas, steps),
        in_specs=[spec], out_specs=spec,
        compiler_params=plgpu.CompilerParams(dimension_semantics=["parallel", "sequential"],
                                             max_concurrent_steps=2))(flat)
    return out.reshape(x.shape)


def measure_ceilings(res: Results):
    n = 1 << 30  # 1 Gi bf16 elements = 2 GiB read + 2 GiB written
    xs = [jnp.ones((n // 8192, 8192), jnp.bfloat16) * i for i in range(2)]
    copies = {"jnp negate": jax.jit(lambda x: -x), "pallas copy": jax.jit(_pallas_copy)}
    best = 0.0
    for name, fn in copies.items():
        def one(name=name, fn=fn):
            nonlocal best
            t = time_fn(fn, [(x,) for x in xs], repeats=5, batch=3)
            best = max(best, 2 * n * 2 / t["device"] / 1e9)
            res.add("ceiling", f"copy {name}", t, bytes_moved=2 * n * 2)
        res.run("ceiling", name, one)

    def torch_copy():
        nonlocal best
        import torch
        a = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        b = torch.empty_like(a)
        for _ in range(3):
            b.copy_(a)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            b.copy_(a)
        torch.cuda.synchronize()
        t = (time.perf_counter() - start) / 10
        best = max(best, 2 * n * 2 / t / 1e9)
        res.add("ceiling", "copy torch", t, bytes_moved=2 * n * 2)
        del a, b
    res.run("ceiling", "torch", torch_copy)
    del xs
    res.ceilings["copy_GBps"] = best

    def matmul():
        keys = jax.random.split(jax.random.key(0), 4)
        ms = [jax.random.normal(k, (8192, 8192), jnp.bfloat16) for k in keys]
        t = time_fn(jax.jit(lambda a, b: a @ b), [(ms[0], ms[1]), (ms[2], ms[3])], batch=5)
        res.ceilings["matmul_TFLOPs"] = 2 * 8192**3 / t["device"] / 1e12
        res.add("ceiling", "bf16 matmul 8192^3", t, flops=2 * 8192**3)
    res.run("ceiling", "matmul", matmul)


def make_decode_batch(key, num_seqs, ctx, page_size, q_tokens_per_seq=1, heads=LLAMA_HEADS):
    """A paged cache of num_seqs sequences of ctx tokens each, pages shuffled; bf16."""
    h = heads
    pages_per_seq = ctx // page_size
    num_pages = num_seqs * pages_per_seq + 1
    kk, kv, kq, kp = jax.random.split(key, 4)
    shape = (num_pages, page_size, h["kv_heads"], h["head_dim"])
    k_pages = jax.random.normal(kk, shape, jnp.bfloat16)
    v_pages = jax.random.normal(kv, shape, jnp.bfloat16)
    perm = jax.random.permutation(kp, jnp.arange(1, num_pages, dtype=jnp.int32))
    table = perm.reshape(num_seqs, pages_per_seq)
    t = num_seqs * q_tokens_per_seq
    q = jax.random.normal(kq, (t, h["num_heads"], h["head_dim"]), jnp.bfloat16)
    kv_lens = jnp.full((num_seqs,), ctx, jnp.int32)
    cu = jnp.arange(num_seqs + 1, dtype=jnp.int32) * q_tokens_per_seq
    return q, k_pages, v_pages, kv_lens, table, cu, jnp.array([num_seqs], jnp.int32)


def bench_quantized_kv(res: Results, num_seqs=64, ctx=4096, page_size=32, heads=LLAMA_HEADS):
    """Decode attention over the same cache stored bf16, int8 and e4m3 (QuantizedPages, a scale per token and
    head; 32-token pages, what a quantized cache gets on a GPU): time, and bandwidth over the bytes each
    stores (codes + scales for the quantized ones)."""
    q, k_pages, v_pages, kv_lens, table, cu, ns = make_decode_batch(jax.random.key(1), num_seqs, ctx, page_size,
                                                                    heads=heads)
    qs = [q * (i + 1) for i in range(3)]
    scale = heads["head_dim"] ** -0.5
    fn = jax.jit(lambda *a: rpa_gpu.ragged_paged_attention(*a, sm_scale=scale, one_token_per_seq=True))
    section = f"decode {num_seqs}x{ctx // 1024}k, R={page_size}"

    def stored(pages, dtype):
        if dtype is None:
            return pages
        p, r, k, h = pages.shape
        values, scales = rpa_ref.quantize_kv(pages.reshape(p * r, k, h), dtype)  # [P*R, K, H], [P*R, K]
        return rpa_ref.QuantizedPages(values.reshape(pages.shape), scales.reshape(p, r, k).transpose(0, 2, 1))

    for name, dtype in (("bf16 KV", None), ("int8 KV", jnp.int8), ("fp8 KV", jnp.float8_e4m3fn)):
        kp, vp = stored(k_pages, dtype), stored(v_pages, dtype)
        kv_bytes = sum(leaf[1:].nbytes for leaf in jax.tree.leaves((kp, vp)))  # page 0 is never read
        sets = [(qi, kp, vp, kv_lens, table, cu, ns) for qi in qs]
        res.run(section, name, lambda sets=sets, name=name, kv_bytes=kv_bytes: res.add(
            section, f"ours {name}", time_fn(fn, sets), bytes_moved=kv_bytes))


KV_WRITE_TOKENS = (2, 64, 192, 256, 4096)


def bench_kv_write(res: Results, num_pages=25_192, page_size=16, heads=LLAMA_HEADS):
    """The engine's cache write against a plain scatter at each token count of KV_WRITE_TOKENS; distinct random
    slots, the cache donated from call to call (each call writes into the last one's result) so every write is
    in place."""
    from jaxinfer.models.common import _write_values

    shape = (num_pages, page_size, heads["kv_heads"], heads["head_dim"])  # [P, R, K, H]

    def plain(pages, x, slots):
        flat = pages.reshape(-1, *shape[2:])  # [P*R, K, H]
        return flat.at[slots].set(x).reshape(shape)

    for tokens in KV_WRITE_TOKENS:
        kx, ks = jax.random.split(jax.random.key(tokens))
        x = jax.random.normal(kx, (tokens, *shape[2:]), jnp.bfloat16)  # [T, K, H]
        slots = jax.random.choice(ks, num_pages * page_size, (tokens,), replace=False).astype(jnp.int32)
        for name, write in (("engine", _write_values), ("plain scatter", plain)):
            donated = jax.jit(write, donate_argnums=(0,))
            state = {"pages": jnp.zeros(shape, jnp.bfloat16)}

            def chained(donated=donated, state=state, x=x, slots=slots):
                state["pages"] = donated(state["pages"], x, slots)
                return state["pages"]

            res.run(f"kv write T={tokens}", name, lambda chained=chained, name=name, tokens=tokens, x=x: res.add(
                f"kv write T={tokens}", name, time_fn(chained, [()]), bytes_moved=x.nbytes))


def bench_attention(res: Results, section, num_seqs, ctx, page_size, q_tokens_per_seq,
                    heads=LLAMA_HEADS, baselines=True):
    """Our kernel on one batch shape; with `baselines`, also its tuning variants, the XLA reference
    and JAX's bundled paged attention (decode)."""
    h = heads
    batch = make_decode_batch(jax.random.key(1), num_seqs, ctx, page_size, q_tokens_per_seq, h)
    q, k_pages, v_pages, kv_lens, table, cu, ns = batch
    qs = [q * (i + 1) for i in range(3)]
    scale = h["head_dim"] ** -0.5
    kv_bytes = 2 * k_pages[1:].size * 2
    causal = q_tokens_per_seq > 1
    flops = 4 * num_seqs * h["num_heads"] * h["head_dim"] * (
        q_tokens_per_seq * ctx / 2 if causal else q_tokens_per_seq * ctx)
    sets = [(qi, k_pages, v_pages, kv_lens, table, cu, ns) for qi in qs]
    measure = dict(bytes_moved=kv_bytes, flops=flops)

    # A decode batch is timed as the engine's decode loop calls the kernel (one new token per sequence, promised).
    ours = jax.jit(lambda *a: rpa_gpu.ragged_paged_attention(*a, sm_scale=scale, one_token_per_seq=not causal))
    res.run(section, "ours", lambda: res.add(section, f"ours R={page_size}", time_fn(ours, sets),
                                             **measure))
    if not baselines:
        return
    for label, knobs in ATTENTION_VARIANTS.items():
        fn = jax.jit(lambda *a, knobs=knobs: rpa_gpu.ragged_paged_attention(
            *a, sm_scale=scale, one_token_per_seq=not causal, **knobs))
        res.run(section, label, lambda fn=fn, label=label: res.add(
            section, f"ours R={page_size} {label}", time_fn(fn, sets), **measure))
    ref = jax.jit(lambda *a: rpa_ref.ragged_paged_attention(*a, sm_scale=scale))
    res.run(section, "reference", lambda: res.add(section, f"XLA reference R={page_size}",
                                                  time_fn(ref, sets, repeats=3, batch=2), **measure))
    if not causal:
        res.run(section, "jax paged_attention",
                lambda: _bench_bundled_paged(res, section, sets, page_size, measure))
    elif num_seqs == 1:
        res.run(section, "jax attention_mgpu", lambda: _bench_bundled_flash(res, section, sets, table, measure))


def _bench_bundled_flash(res, section, sets, table, measure):
    """JAX's own Hopper flash attention (jax.experimental.pallas.ops.gpu.attention_mgpu: two compute warpgroups
    and a memory warpgroup per CTA, 128 query rows of one head) on the same prefill with K/V contiguous, as it
    needs them: what a causal 4k prefill can take on this GPU in Pallas, beside our paged kernel."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu as fa

    _, k_pages, v_pages, *_ = sets[0]
    # float16: the bundled kernel's shared-memory tiles are float16 (same bytes and tensor-core rate as bf16).
    contiguous = lambda pages: pages[table[0]].reshape(1, -1, *pages.shape[2:]).astype(jnp.float16)  # [1, ctx, K, H]
    k, v = contiguous(k_pages), contiguous(v_pages)
    for block_q, block_kv, steps in ((64, 64, 2), (64, 128, 2)):
        config = fa.TuningConfig(block_q=block_q, block_kv=block_kv, max_concurrent_steps=steps, causal=True)
        fn = jax.jit(lambda q, config=config: fa.attention(q[None], k, v, config)[0])
        label = f"jax attention_mgpu bq={block_q} bkv={block_kv}"
        res.run(section, label, lambda fn=fn, label=label: res.add(
            section, label, time_fn(fn, [(s[0].astype(jnp.float16),) for s in sets]), **measure))


def bench_head_layouts(res: Results):
    """Our kernel alone over GQA groups and head dims (HEAD_SWEEP_*), same batch shapes as the
    decode and prefill sections; the q heads grow with G, the KV bytes only with H."""
    shapes = [("decode 64x4k", g, h, (64, 4096, 16, 1)) for g, h in HEAD_SWEEP_DECODE] + [
        ("prefill 4k", g, h, (1, 4096, 64, 4096)) for g, h in HEAD_SWEEP_PREFILL]
    for label, group, head_dim, batch_shape in shapes:
        heads = dict(num_heads=group * HEAD_SWEEP_KV_HEADS, kv_heads=HEAD_SWEEP_KV_HEADS,
                     head_dim=head_dim)
        section = f"{label} G={group} H={head_dim}"
        res.run(section, "batch", lambda section=section, heads=heads, shape=batch_shape:
                bench_attention(res, section, *shape, heads, baselines=False))


def _bench_bundled_paged(res, section, sets, page_size, measure):
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

    q, k_pages, v_pages, kv_lens, table = sets[0][:5]
    k_t = jnp.transpose(k_pages, (2, 0, 1, 3))  # [K, P, R, H], the bundled kernel's layout
    v_t = jnp.transpose(v_pages, (2, 0, 1, 3))
    ppcb = max(1, 64 // page_size)
    fn = jax.jit(lambda qi: jax_paged.paged_attention(
        qi * LLAMA_HEADS["head_dim"] ** -0.5, k_t, v_t, table, kv_lens,
        pages_per_compute_block=ppcb))
    res.add(section, f"jax paged_attention R={page_size}",
            time_fn(fn, [(s[0],) for s in sets]), **measure)


def bench_matmuls(res: Results):
    ms = (1, 8, 16, 32, 64)
    for shape_name, (k, n) in LLAMA_MATMULS.items():
        keys = jax.random.split(jax.random.key(2), 3)
        ws = [jax.random.normal(key, (k, n), jnp.float32) * 0.02 for key in keys]
        for bits in (8, 4):
            wqs = [quantize_weights(w, bits=bits, group_size=128 if bits == 4 else None)
                   for w in ws]
            wbytes = wqs[0].values.size * wqs[0].values.dtype.itemsize + wqs[0].scales.size * 4
            for m in ms:
                x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
                sets = [(x, wq) for wq in wqs]
                sec = f"matmul {shape_name}"
                res.run(sec, f"int{bits} M={m}", lambda sets=sets, m=m, bits=bits, sec=sec: res.add(
                    sec, f"ours int{bits} M={m}", time_fn(jax.jit(qmm_gpu.quantized_matmul), sets),
                    bytes_moved=wbytes, flops=2 * m * k * n))
                if m in (1, 64):
                    res.run(sec, f"ref int{bits} M={m}", lambda sets=sets, m=m, bits=bits, sec=sec: res.add(
                        sec, f"XLA reference int{bits} M={m}",
                        time_fn(jax.jit(qmm_ref.quantized_matmul), sets),
                        bytes_moved=wbytes, flops=2 * m * k * n))
        wb = [w.astype(jnp.bfloat16) for w in ws]
        for m in (1, 64):
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
            res.run(f"matmul {shape_name}", f"bf16 M={m}", lambda x=x, m=m: res.add(
                f"matmul {shape_name}", f"XLA bf16 weights M={m}",
                time_fn(jax.jit(jnp.dot), [(x, w) for w in wb]),
                bytes_moved=k * n * 2, flops=2 * m * k * n))
        res.run(f"matmul {shape_name}", "jax mixed", lambda k=k, n=n, ws=ws: _bench_bundled_mixed(
            res, f"matmul {shape_name}", k, n, ws))


def _bench_bundled_mixed(res, section, k, n, ws):
    """JAX's hopper_mixed_type_matmul_mgpu: int8 LHS times bf16 RHS, run as W^T[N,K] @ x^T[K,128]."""
    from jax.experimental.pallas.ops.gpu import hopper_mixed_type_matmul_mgpu as mixed

    cfg = mixed.TuningConfig(tile_m=64, tile_n=64, tile_k=128, max_concurrent_steps=4,
                             epi_tile_n=64, epi_tile_m=64)
    wts = [jnp.clip(jnp.round(w.T / 0.0005), -127, 127).astype(jnp.int8) for w in ws]
    xt = jax.random.normal(jax.random.key(7), (k, 128), jnp.bfloat16)  # n must fill 2 tiles
    fn = jax.jit(lambda a, b: mixed.mixed_matmul_kernel(a, b, out_dtype=jnp.bfloat16, config=cfg))
    res.add(section, "jax hopper_mixed_type int8 M=128", time_fn(fn, [(w, xt) for w in wts]),
            bytes_moved=k * n, flops=2 * 128 * k * n)


def print_table(res: Results):
    print("\n=== ceilings:", json.dumps(res.ceilings))
    print(f"{'section':<28} {'name':<36} {'us':>9} {'wall us':>9} {'GB/s':>8} {'%BW':>6} {'TFLOP/s':>8} "
          f"{'%MM':>6}")
    for r in res.rows:
        f = lambda key, fmt: format(r[key], fmt) if key in r else "-"
        print(f"{r['section']:<28} {r['name']:<36} {r['us']:>9.1f} {r['wall_us']:>9.1f} {f('GB/s', '8.0f'):>8} "
              f"{f('%BW', '6.1f'):>6} {f('TFLOP/s', '8.1f'):>8} {f('%MM', '6.1f'):>6}")
    for k, v in res.errors.items():
        print(f"ERROR {k}: {v[:300]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_kernels.json")
    parser.add_argument("--sections", default="ceilings,decode,prefill,matmul",
                        help="comma-separated: ceilings, decode, prefill, matmul, heads, kv8, kv_write")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    res = Results()
    print("device:", jax.devices()[0].device_kind, flush=True)
    if "ceilings" in sections:
        measure_ceilings(res)
    if "decode" in sections:
        for page_size in (16, 64):
            bench_attention(res, "decode 64x4k", 64, 4096, page_size, 1)
    if "prefill" in sections:
        bench_attention(res, "prefill 4k", 1, 4096, 64, 4096)
        bench_attention(res, "prefill 4k", 1, 4096, 16, 4096)  # the engine's GPU page size
        bench_attention(res, "prefill 4k, Qwen3-30B-A3B heads", 1, 4096, 16, 4096, heads=QWEN3_MOE_HEADS)
    if "kv8" in sections:
        bench_quantized_kv(res)
    if "heads" in sections:
        bench_head_layouts(res)
    if "kv_write" in sections:
        bench_kv_write(res)
    if "matmul" in sections:
        bench_matmuls(res)
    with open(args.out, "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, ceilings=res.ceilings, rows=res.rows,
                       errors=res.errors), f, indent=1)
    print_table(res)


if __name__ == "__main__":
    main()
