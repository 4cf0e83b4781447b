"""The ragged paged attention tests' cases and builders, shared by the reference/TPU/xla module and the GPU one."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from conftest import make_paged_batch

from pallas_kernels.ragged_paged_attention import reference


@dataclasses.dataclass(frozen=True)
class Case:
    seqs: tuple  # ((q_len, kv_len), ...)
    num_heads: int = 4
    kv_heads: int = 1
    head_dim: int = 64
    page_size: int = 8
    max_pages: int = 6
    dtype: object = jnp.float32
    kv_dtype: object = None
    sliding_window: int | None = None
    soft_cap: float | None = None
    kv_scale: float | None = None
    pad_tokens: int = 0
    pad_seqs: int = 0
    block_q: int = 4
    pages_per_block: int = 2


# Each case covers several axes at once (a full cartesian product would not fit CI's budget):
# decode-only, prefill-only and mixed batches; lengths 1, exactly one/two pages (8, 16) and partial
# last pages; GQA ratios 1, 4, 8; head dims 64/128/256; window, soft-cap, int8/fp8 KV, padding.
CASES = {
    "decode_gqa4_h128": Case(((1, 1), (1, 8), (1, 17), (1, 40), (1, 16)), num_heads=8, kv_heads=2,
                             head_dim=128),
    "prefill_mha_h64": Case(((13, 13), (16, 16), (1, 1)), num_heads=2, kv_heads=2, block_q=8),
    "mixed_mqa8_h256": Case(((5, 21), (1, 8), (9, 32), (1, 33)), num_heads=8, kv_heads=1,
                            head_dim=256, pad_tokens=3, pad_seqs=2),
    "chunked_prefill_window": Case(((7, 30), (1, 9), (12, 12)), num_heads=4, kv_heads=1,
                                   sliding_window=5, block_q=8),
    "mixed_softcap_gqa4": Case(((3, 24), (1, 1), (6, 14)), num_heads=4, kv_heads=1, soft_cap=2.0),
    "window_softcap_pages16": Case(((17, 40), (1, 48)), num_heads=4, kv_heads=2, page_size=16,
                                   max_pages=3, sliding_window=20, soft_cap=30.0, pages_per_block=1),
    "int8_kv": Case(((4, 20), (1, 9), (8, 8)), num_heads=8, kv_heads=2, kv_dtype=jnp.int8,
                    kv_scale=0.01),
    "fp8_kv_bf16_q": Case(((4, 20), (1, 9), (2, 16)), num_heads=4, kv_heads=1,
                          dtype=jnp.bfloat16, kv_dtype=jnp.float8_e4m3fn, kv_scale=0.5),
    "bf16_padding": Case(((2, 5), (1, 24)), num_heads=4, kv_heads=1, dtype=jnp.bfloat16,
                         pad_tokens=5, pad_seqs=3),
}


def build(rng, case: Case):
    batch = make_paged_batch(
        rng, case.seqs, num_heads=case.num_heads, kv_heads=case.kv_heads, head_dim=case.head_dim,
        page_size=case.page_size, max_pages=case.max_pages, dtype=case.dtype,
        kv_dtype=case.kv_dtype, pad_tokens=case.pad_tokens, pad_seqs=case.pad_seqs)
    kwargs = dict(sm_scale=case.head_dim ** -0.5, sliding_window=case.sliding_window,
                  soft_cap=case.soft_cap, k_scale=case.kv_scale, v_scale=case.kv_scale)
    return batch, kwargs


def tolerance(case: Case) -> float:
    # bf16 output rounding is ~4e-3 relative; fp32 math differs from float64 only by rounding.
    return 1e-2 if case.dtype == jnp.bfloat16 else 1e-5


def quantized_batch(rng, kv_dtype, **shape):
    """A float batch whose K/V are then stored as QuantizedPages (a scale per token and head), with
    scales spread over two orders of magnitude so a kernel that drops or misplaces one shows."""
    batch = make_paged_batch(rng, ((4, 20), (1, 9), (9, 32), (1, 1)), **shape)

    def quantize(pages):
        spread = jnp.asarray(10.0 ** rng.uniform(-1, 1, pages.shape[:3] + (1,)), jnp.float32)  # [P, R, K, 1]
        values, scales = reference.quantize_kv((pages.astype(jnp.float32) * spread).reshape(
            -1, *pages.shape[2:]), kv_dtype)  # [P*R, K, H], [P*R, K]
        p, r, k, _ = pages.shape
        return reference.QuantizedPages(values.reshape(pages.shape),
                                        scales.reshape(p, r, k).transpose(0, 2, 1))  # scales [P, K, R]

    return dataclasses.replace(batch, k_pages=quantize(batch.k_pages), v_pages=quantize(batch.v_pages))


def dequantized(pages):
    return reference.dequantize_pages(pages.values, None, pages.scales)  # [P, R, K, H] f32
