"""A quantized KV cache is stored in a rotated basis (jaxinfer.attention.kv_rotation): the rotation is
orthonormal for every supported head dim, spreads an outlier channel over the others, and makes int8 attention
with an outlier key channel far closer to float attention than quantizing the raw keys."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.attention import attention_scale, kv_rotation, make_attention_fn
from jaxinfer.models.common import AttentionMetadata, write_kv
from model_helpers import tiny_config
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.ragged_paged_attention.reference import QuantizedPages


@pytest.mark.parametrize("head_dim, block", [(64, 64), (80, 16), (96, 32), (128, 128), (256, 256)])
def test_rotation_is_orthonormal_and_spreads_a_channel(head_dim: int, block: int) -> None:
    r = kv_rotation(head_dim)
    np.testing.assert_allclose(r @ r.T, np.eye(head_dim), atol=1e-6)
    # One channel lands on a whole block, each entry 1/sqrt(block) of it.
    np.testing.assert_allclose(np.abs(r[3])[np.abs(r[3]) > 0], 1 / np.sqrt(block), rtol=1e-6)
    assert np.count_nonzero(r[3]) == block


def test_int8_attention_with_an_outlier_key_channel_is_close_to_float() -> None:
    cfg = tiny_config(num_heads=4, num_kv_heads=2, head_dim=64)
    t, page, pages = 32, 16, 4
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (t, 4, 64))  # [T, N, H]
    k = jax.random.normal(keys[1], (t, 2, 64)).at[:, :, 5].add(40.0)  # [T, K, H], channel 5 an outlier
    v = jax.random.normal(keys[2], (t, 2, 64))
    md = AttentionMetadata(positions=jnp.arange(t, dtype=jnp.int32), slot_mapping=jnp.arange(t, dtype=jnp.int32),
                           cu_q_lens=jnp.array([0, t], jnp.int32), kv_lens=jnp.array([t], jnp.int32),
                           page_indices=jnp.arange(pages, dtype=jnp.int32)[None], num_seqs=jnp.array([1], jnp.int32))
    float_pages = lambda: jnp.zeros((pages, page, 2, 64), jnp.float32)  # noqa: E731
    int8_pages = lambda: QuantizedPages(jnp.zeros((pages, page, 2, 64), jnp.int8),  # noqa: E731
                                        jnp.zeros((pages, 2, page), jnp.float32))
    attn = make_attention_fn(cfg, "reference", False)
    exact = attn(q, k, v, float_pages(), float_pages(), md)[0]
    rotated = attn(q, k, v, int8_pages(), int8_pages(), md)[0]
    # The same cache written from the raw keys and values, without the rotation.
    kq, vq = write_kv(int8_pages(), int8_pages(), k, v, md.slot_mapping)
    raw = ragged_paged_attention(q, kq, vq, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs,
                                 sm_scale=attention_scale(cfg), impl="reference")
    rotated_err = float(jnp.max(jnp.abs(rotated - exact)))
    raw_err = float(jnp.max(jnp.abs(raw - exact)))
    assert rotated_err < raw_err / 3, (rotated_err, raw_err)  # measured: 0.050 against 0.252
