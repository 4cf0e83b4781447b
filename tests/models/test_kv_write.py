"""The paged cache write (`models.common.write_kv`) as the engine calls it: real tokens in distinct slots, padding
tokens sharing slots of the trash page 0. The scatter promises XLA unique, in-bounds indices; these check that
the promise holds where it matters: every real token lands in its slot and nothing outside page 0 changes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.models.common import write_kv
from pallas_kernels.ragged_paged_attention.reference import QuantizedPages, quantize_kv

NUM_PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM = 12, 4, 2, 8


def step_slots(real: int, padded: int, rng: np.random.Generator) -> np.ndarray:
    """`real` distinct slots outside the trash page, then padding slots as the batcher fills them (arange % R in
    page 0, so padding tokens repeat slots once there are more than R of them): [padded] int32."""
    real_slots = rng.choice(np.arange(PAGE_SIZE, NUM_PAGES * PAGE_SIZE), real, replace=False)
    pad_slots = np.arange(padded - real) % PAGE_SIZE
    return np.concatenate([real_slots, pad_slots]).astype(np.int32)


@pytest.mark.parametrize("real,padded", [(1, 2), (5, 16), (16, 16), (3, 32)])
def test_real_tokens_land_in_their_slots_and_only_page_0_takes_padding(real: int, padded: int) -> None:
    rng = np.random.default_rng(real * 100 + padded)
    slots = step_slots(real, padded, rng)
    k = jnp.asarray(rng.standard_normal((padded, KV_HEADS, HEAD_DIM)), jnp.bfloat16)  # [T, K, H]
    v = -k
    shape = (NUM_PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM)  # [P, R, K, H]
    before = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    k_pages, v_pages = jax.jit(write_kv)(before, before, k, v, jnp.asarray(slots))

    expected = np.asarray(before, np.float32).reshape(-1, KV_HEADS, HEAD_DIM).copy()  # [P*R, K, H]
    expected[slots[:real]] = np.asarray(k[:real], np.float32)
    got = np.asarray(k_pages, np.float32).reshape(expected.shape)
    np.testing.assert_array_equal(got[PAGE_SIZE:], expected[PAGE_SIZE:])  # page 0 holds whatever padding wrote
    expected[slots[:real]] = np.asarray(v[:real], np.float32)
    got = np.asarray(v_pages, np.float32).reshape(expected.shape)
    np.testing.assert_array_equal(got[PAGE_SIZE:], expected[PAGE_SIZE:])


def test_quantized_pages_take_codes_and_scales_at_the_same_slots() -> None:
    rng = np.random.default_rng(7)
    real, padded = 6, 24
    slots = step_slots(real, padded, rng)
    k = jnp.asarray(rng.standard_normal((padded, KV_HEADS, HEAD_DIM)), jnp.float32)  # [T, K, H]
    pages = QuantizedPages(jnp.zeros((NUM_PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM), jnp.int8),
                           jnp.zeros((NUM_PAGES, KV_HEADS, PAGE_SIZE), jnp.float32))  # values, scales [P, K, R]
    k_pages, _ = jax.jit(write_kv)(pages, pages, k, k, jnp.asarray(slots))

    codes, scales = quantize_kv(k[:real], jnp.int8)  # [real, K, H], [real, K]
    page, offset = slots[:real] // PAGE_SIZE, slots[:real] % PAGE_SIZE
    np.testing.assert_array_equal(np.asarray(k_pages.values)[page, offset], np.asarray(codes))
    np.testing.assert_array_equal(np.asarray(k_pages.scales)[page, :, offset], np.asarray(scales))
    untouched = np.ones(NUM_PAGES * PAGE_SIZE, bool)
    untouched[:PAGE_SIZE] = False
    untouched[slots[:real]] = False
    assert not np.asarray(k_pages.values).reshape(-1, KV_HEADS, HEAD_DIM)[untouched].any()
