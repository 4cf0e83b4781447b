"""How fast can decode attention's KV reads go, by access pattern, against the kernel itself (one GPU).

The decode kernel (pallas_kernels/ragged_paged_attention/gpu.py) reads KV at ~78% of the copy rate on an H100
(docs/KERNELS.md). Two causes are possible: the reads themselves (one CTA per sequence and kv head, each page
an `[R, H]` TMA box of R rows of H * 2 bytes, K * H * 2 bytes apart) or the work between them (one warpgroup
that waits on each block, then runs QK^T, the softmax and PV). This script separates them: copy-only Mosaic GPU
kernels that move exactly the kernel's bytes with its pipeline and nothing else, beside the kernel on the same
cache.

* `boxes`: the kernel's pattern with its math taken out (grid (sequence, kv head), 64-position blocks of
  per-page `[R, H]` boxes, `stages` deep);
* `pages`: one CTA per sequence, each page one contiguous `[R, K, H]` box (what reading all kv heads together
  would cost);
* `ours`: the kernel as the engine's decode loop calls it (`one_token_per_seq`), and with forced stages / splits /
  blocks, and with 64-row tiles (no promise);
* `copy`: a plain XLA copy of the same K and V arrays (read + write, counted as bytes read x 2).

    JAX_PLATFORMS=cuda PYTHONPATH=$PWD python3 scripts/attention_access_ceiling.py --out $OUT/attn_access.json
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention import gpu as rpa_gpu
from pallas_kernels.ragged_paged_attention import gpu_common as rpa_common
from scripts.bench_kernels import LLAMA_HEADS, make_decode_batch, time_fn

BLOCK_KV = 64  # the decode kernel's positions per step at 16-token pages


def _stream(issue, steps, stages: int, k_bar, v_bar, first_block_smem, out_ref) -> None:
    """Inside a copy-only kernel: `steps` blocks, `stages` deep (issue(step) starts block `step`'s copies into
    slot step % stages), each waited for and nothing else; then one block is written out so the reads land."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    for s in range(stages - 1):
        issue(s)

    def step_fn(step, carry):
        ahead = step + stages - 1
        pl.when(ahead < steps)(functools.partial(issue, ahead))
        plgpu.barrier_wait(k_bar.at[jax.lax.rem(step, stages)])
        plgpu.barrier_wait(v_bar.at[jax.lax.rem(step, stages)])
        return carry

    jax.lax.fori_loop(0, steps, step_fn, 0)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(first_block_smem, out_ref)
    plgpu.wait_smem_to_gmem(0)


def _boxes_copy(k_pages, v_pages, table, *, stages: int):
    """The decode kernel's reads alone: per (sequence, kv head), its 64-position blocks, `stages` deep."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    _, page_size, kv_heads, head_dim = k_pages.shape
    num_seqs, max_pages = table.shape
    pages_per_block = BLOCK_KV // page_size
    steps = max_pages // pages_per_block

    def body(table_ref, k_ref, v_ref, o_ref, k_smem, v_smem, k_bar, v_bar):
        seq, head = jax.lax.axis_index("seq"), jax.lax.axis_index("head")
        pages_of = lambda step: rpa_common._block_pages(table_ref, seq, step, pages_per_block, max_pages)

        def issue(step):
            rpa_gpu._issue_kv_block(k_ref, v_ref, k_smem, v_smem, k_bar, v_bar, jax.lax.rem(step, stages), head,
                                    pages_of(step))

        _stream(issue, steps, stages, k_bar, v_bar, k_smem.at[0], o_ref.at[seq, head])

    kvt = rpa_common._smem_transforms(k_pages.dtype, head_dim)
    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((num_seqs, kv_heads, BLOCK_KV, head_dim), k_pages.dtype),
        scratch_types=[plgpu.SMEM((stages, BLOCK_KV, head_dim), k_pages.dtype, transforms=kvt),
                       plgpu.SMEM((stages, BLOCK_KV, head_dim), v_pages.dtype, transforms=kvt),
                       plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=stages),
                       plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=stages)],
        grid=(num_seqs, kv_heads), grid_names=("seq", "head"), kernel_name="kv_boxes_copy",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )(table.reshape(-1), k_pages, v_pages)


def _pages_copy(k_pages, v_pages, table, *, stages: int):
    """Whole pages: per sequence, each page's `[R, K, H]` K and V as one contiguous box, `stages` deep."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    _, page_size, kv_heads, head_dim = k_pages.shape
    num_seqs, max_pages = table.shape

    def body(table_ref, k_ref, v_ref, o_ref, k_smem, v_smem, k_bar, v_bar):
        seq = jax.lax.axis_index("seq")

        def issue(step):
            page = table_ref[seq * max_pages + step]
            slot = jax.lax.rem(step, stages)
            plgpu.copy_gmem_to_smem(k_ref.at[page], k_smem.at[slot], k_bar.at[slot])  # [R, K, H]
            plgpu.copy_gmem_to_smem(v_ref.at[page], v_smem.at[slot], v_bar.at[slot])

        _stream(issue, max_pages, stages, k_bar, v_bar, k_smem.at[0], o_ref.at[seq])

    page = (page_size, kv_heads, head_dim)
    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((num_seqs, *page), k_pages.dtype),
        scratch_types=[plgpu.SMEM((stages, *page), k_pages.dtype), plgpu.SMEM((stages, *page), v_pages.dtype),
                       plgpu.Barrier(num_arrivals=1, num_barriers=stages),
                       plgpu.Barrier(num_arrivals=1, num_barriers=stages)],
        grid=(num_seqs,), grid_names=("seq",), kernel_name="kv_pages_copy",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )(table.reshape(-1), k_pages, v_pages)


def variants(page_size: int):
    """name -> (function of (q, k_pages, v_pages, kv_lens, table, cu, num_seqs), bytes-read multiplier)."""
    scale = LLAMA_HEADS["head_dim"] ** -0.5
    # As the engine's decode loop calls it: one new token per sequence, promised (one-token tiles).
    ours = lambda **knobs: (lambda q, k, v, lens, table, cu, ns: rpa_gpu.ragged_paged_attention(
        q, k, v, lens, table, cu, ns, sm_scale=scale, **{"one_token_per_seq": True, **knobs}))
    out = {
        "copy (XLA, read + write)": (lambda q, k, v, *_: (k + 0, v + 0), 2),
        "ours": (ours(), 1),
        "ours, 64-row tiles": (ours(one_token_per_seq=False), 1),
        "ours stages=2": (ours(stages=2), 1),
        "ours stages=4": (ours(stages=4), 1),
        "ours splits=2": (ours(num_splits=2), 1),
        "ours block_kv=128 stages=2": (ours(block_kv=128, stages=2), 1),
    }
    for stages in (2, 3, 4, 6):
        out[f"boxes stages={stages}"] = (
            lambda q, k, v, lens, table, *_, s=stages: _boxes_copy(k, v, table, stages=s), 1)
    for stages in (2, 3):
        out[f"pages stages={stages}"] = (
            lambda q, k, v, lens, table, *_, s=stages: _pages_copy(k, v, table, stages=s), 1)
    return out


def quantized_rows(shape: str, page_size: int = 32) -> list[dict]:
    """The kernel over an int8 and an e4m3 cache (a scale per token and head, 32-token pages: what a quantized
    cache gets on a GPU) at its default and forced depths; GB/s over the bytes stored (codes + scales)."""
    from pallas_kernels.ragged_paged_attention import reference as rpa_ref

    num_seqs, ctx = map(int, shape.split("x"))
    q, k_pages, v_pages, *rest = make_decode_batch(jax.random.key(0), num_seqs, ctx, page_size)
    scale = LLAMA_HEADS["head_dim"] ** -0.5
    rows = []
    for label, dtype in (("int8", jnp.int8), ("fp8", jnp.float8_e4m3fn)):
        def stored(pages):
            p, r, k, h = pages.shape
            values, scales = rpa_ref.quantize_kv(pages.reshape(p * r, k, h), dtype)  # [P*R, K, H], [P*R, K]
            return rpa_ref.QuantizedPages(values.reshape(pages.shape), scales.reshape(p, r, k).transpose(0, 2, 1))
        kp, vp = stored(k_pages), stored(v_pages)
        kv_bytes = sum(leaf[1:].nbytes for leaf in jax.tree.leaves((kp, vp)))
        sets = [(q * (i + 1), kp, vp, *rest) for i in range(2)]
        for knobs in ({}, dict(stages=2), dict(stages=3), dict(stages=4)):
            name = f"ours {label} KV R={page_size}" + "".join(f" {k}={v}" for k, v in knobs.items())
            fn = jax.jit(lambda *a, knobs=knobs: rpa_gpu.ragged_paged_attention(
                *a, sm_scale=scale, one_token_per_seq=True, **knobs))
            try:
                t = time_fn(fn, sets, repeats=5, batch=10)
                row = dict(shape=shape, name=name, us=t["device"] * 1e6, GBps=kv_bytes / t["device"] / 1e9)
            except Exception as e:
                row = dict(shape=shape, name=name, error=f"{type(e).__name__}: {e}"[:600])
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="64x4096,192x1536,8x1024,1x1024", help="SEQSxCONTEXT,... decode batches")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--quantized-shapes", default="64x4096", help="shapes also timed over int8 / fp8 caches")
    parser.add_argument("--out", default="attn_access.json")
    args = parser.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        num_seqs, ctx = map(int, shape.split("x"))
        batch = make_decode_batch(jax.random.key(0), num_seqs, ctx, args.page_size)
        sets = [(batch[0] * (i + 1), *batch[1:]) for i in range(2)]
        kv_bytes = 2 * batch[1][1:].nbytes  # K and V, page 0 unread
        for name, (fn, mult) in variants(args.page_size).items():
            try:
                t = time_fn(jax.jit(fn), sets, repeats=5, batch=10)
                row = dict(shape=shape, name=name, us=t["device"] * 1e6,
                           GBps=mult * kv_bytes / t["device"] / 1e9)
            except Exception as e:  # a variant that fails to lower must not stop the others
                row = dict(shape=shape, name=name, error=f"{type(e).__name__}: {e}"[:600])
            rows.append(row)
            print(json.dumps(row), flush=True)
    for shape in filter(None, args.quantized_shapes.split(",")):
        rows += quantized_rows(shape)
    with open(args.out, "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, page_size=args.page_size, rows=rows), f, indent=1)
    copy = {r["shape"]: r["GBps"] for r in rows if r["name"].startswith("copy") and "GBps" in r}
    print(f"\n{'shape':<10} {'variant':<26} {'us':>8} {'GB/s':>7} {'of copy':>8}")
    for r in rows:
        if "GBps" in r:
            print(f"{r['shape']:<10} {r['name']:<26} {r['us']:>8.1f} {r['GBps']:>7.0f} "
                  f"{r['GBps'] / copy.get(r['shape'], float('nan')):>8.1%}")
        else:
            print(f"{r['shape']:<10} {r['name']:<26} error: {r['error'][:80]}")


if __name__ == "__main__":
    main()
