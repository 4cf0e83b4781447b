"""The KV write kernel (pallas_kernels.ragged_paged_attention.kv_write, Pallas Triton; a variant of
scripts/moe_b1_variants.py, not in the engine's path): both caches updated in place at each token's slot, against
jaxinfer.models.common.write_kv (two scatters) on fresh random pages; interpret mode on CPU, compiled on a GPU (there
also inside a jitted step that donates the pages, the way the decode loop would run it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.models.common import write_kv
from pallas_kernels.ragged_paged_attention import kv_write


def _step(rng, num_pages, page_size, kv_heads, head_dim, real, padded, dtype=jnp.bfloat16):
    """Random pages [P, R, K, H] x 2, new rows [T, K, H] x 2 and slots: `real` distinct slots outside the trash
    page 0, then padding tokens' slots in page 0 (repeating once there are more than R of them)."""
    shape = (num_pages, page_size, kv_heads, head_dim)
    draw = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    slots = np.concatenate([rng.choice(np.arange(page_size, num_pages * page_size), real, replace=False),
                            np.arange(padded - real) % page_size]).astype(np.int32)
    return draw(*shape), draw(*shape), draw(padded, kv_heads, head_dim), draw(padded, kv_heads, head_dim), slots


def _check(k_pages, v_pages, k, v, slots, got, page_size):
    want = write_kv(k_pages, v_pages, k, v, jnp.asarray(slots))
    for g, w in zip(got, want):
        # Page 0 holds whichever padding row landed last; every other page exactly as the scatters leave it.
        np.testing.assert_array_equal(np.asarray(g[1:], np.float32), np.asarray(w[1:], np.float32))


@pytest.mark.parametrize("num_pages, page_size, kv_heads, head_dim, real, padded", [
    (9, 16, 4, 128, 1, 2),  # Qwen3-30B-A3B's batch-1 bucket
    (12, 4, 2, 64, 5, 16),
    (6, 8, 1, 256, 3, 3),
])
def test_kernel_in_interpret_mode_matches_write_kv(rng, num_pages, page_size, kv_heads, head_dim, real, padded):
    step = _step(rng, num_pages, page_size, kv_heads, head_dim, real, padded)
    got = kv_write.write_kv_pages(*step[:4], jnp.asarray(step[4]), interpret=True)
    _check(*step, got, page_size)


def test_kernel_takes_16_bit_power_of_two_rows_only():
    pages = jax.ShapeDtypeStruct((10, 16, 4, 128), jnp.bfloat16)
    assert kv_write.takes(pages, jax.ShapeDtypeStruct((2, 4, 128), jnp.bfloat16))
    assert not kv_write.takes(pages, jax.ShapeDtypeStruct((2, 4, 128), jnp.float32))  # another dtype
    assert not kv_write.takes(jax.ShapeDtypeStruct((10, 16, 4, 96), jnp.bfloat16),
                              jax.ShapeDtypeStruct((2, 4, 96), jnp.bfloat16))
    assert not kv_write.takes(jax.ShapeDtypeStruct((10, 16, 4, 128), jnp.float32),
                              jax.ShapeDtypeStruct((2, 4, 128), jnp.float32))
    assert not kv_write.takes(pages, jax.ShapeDtypeStruct((kv_write.MAX_TOKENS + 1, 4, 128), jnp.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("num_pages, page_size, kv_heads, head_dim, real, padded", [
    (300, 16, 4, 128, 1, 2), (300, 16, 8, 128, 16, 16), (40, 16, 2, 64, 5, 32), (50, 32, 1, 256, 3, 3),
])
def test_gpu_kernel_matches_write_kv_in_place(rng, num_pages, page_size, kv_heads, head_dim, real, padded):
    step = _step(rng, num_pages, page_size, kv_heads, head_dim, real, padded)
    got = kv_write.write_kv_pages(*step[:4], jnp.asarray(step[4]))
    _check(*step, got, page_size)
    # In a jitted step that donates the pages, as the decode loop does: updated in place, no copy of the cache.
    step_fn = jax.jit(lambda kp, vp, k, v, s: kv_write.write_kv_pages(kp, vp, k, v, s), donate_argnums=(0, 1))
    kp, vp = jnp.array(step[0], copy=True), jnp.array(step[1], copy=True)
    text = step_fn.lower(kp, vp, *step[2:4], jnp.asarray(step[4])).compile().as_text()
    assert " copy(" not in text and "copy-start" not in text
    got = step_fn(kp, vp, *step[2:4], jnp.asarray(step[4]))
    _check(*step, got, page_size)
