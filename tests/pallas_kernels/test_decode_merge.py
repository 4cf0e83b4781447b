"""The decode step's flash-decoding merge kernel (pallas_kernels.ragged_paged_attention.decode_merge, Pallas Triton)
against the XLA merge it replaces (gpu._combine_splits then gpu._decode_rows) on fresh random inputs: interpret mode
on CPU, compiled on a GPU; and the whole decode attention with it against the float64 oracle on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_paged_batch, naive_attention, relative_error

import jax.numpy as jnp
from pallas_kernels.ragged_paged_attention import decode_merge, gpu


def _parts(rng, splits, kv_heads, tokens, rows, head_dim, empty=()):
    """o_parts [S, K, T, rows, H] bf16 and lse_parts [S, K, T, 64] f32 spread over +-40 (base 2), splits in `empty`
    holding what the kernel writes for a split that saw no keys (zeros, lse about -1e30)."""
    o = rng.standard_normal((splits, kv_heads, tokens, rows, head_dim)).astype(np.float32)
    lse = (rng.standard_normal((splits, kv_heads, tokens, 64)) * 20).astype(np.float32)
    for s in empty:
        o[s], lse[s] = 0.0, -1e30
    return jnp.asarray(o, jnp.bfloat16), jnp.asarray(lse)


def _xla_merge(o, lse, real_end, group, scale):
    """The XLA path: [T, N, H] in o's dtype."""
    tokens = o.shape[2]
    cu = jnp.asarray([0, real_end, real_end], jnp.int32)
    out = gpu._decode_rows(gpu._combine_splits(o, lse), cu, jnp.asarray([1], jnp.int32), tokens, group)
    if scale != 1.0:
        out = out.astype(jnp.float32) * scale
    return out.astype(o.dtype)


def _check(rng, splits, kv_heads, tokens, real, group, head_dim, scale=1.0, interpret=True):
    rows = -(-group // 8) * 8
    o, lse = _parts(rng, splits, kv_heads, tokens, rows, head_dim, empty=(splits - 1,))
    want = np.asarray(_xla_merge(o, lse, real, group, scale), np.float32)  # [T, N, H]
    got = decode_merge.merge_decode_splits(o, lse, jnp.asarray([real], jnp.int32), group=group, scale=scale,
                                           interpret=interpret)
    assert got.shape == (tokens, kv_heads, group, head_dim) and got.dtype == o.dtype
    got = np.asarray(got, np.float32).reshape(tokens, kv_heads * group, head_dim)
    assert np.isfinite(got).all() and not got[real:].any()  # padding tokens: zeros
    # Same float32 arithmetic in another order: at most one bf16 rounding step apart.
    np.testing.assert_allclose(got, want, rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("splits, kv_heads, tokens, real, group, head_dim, scale", [
    (32, 4, 2, 1, 8, 128, 1.0),  # Qwen3-30B-A3B's batch-1 bucket
    (16, 8, 2, 1, 4, 128, 1.0),  # Llama-3-8B's
    (4, 2, 5, 3, 12, 64, 1.0),  # 16 stored rows, 12 of them heads
    (8, 1, 3, 3, 5, 256, 0.25),  # no padding token; a value scale
    (2, 2, 4, 2, 1, 64, 1.0),
])
def test_merge_in_interpret_mode_matches_the_xla_merge(rng, splits, kv_heads, tokens, real, group, head_dim, scale):
    _check(rng, splits, kv_heads, tokens, real, group, head_dim, scale)


def test_merge_takes_power_of_two_splits_and_head_dims_that_fit():
    assert decode_merge.takes(32, 128) and decode_merge.takes(2, 64) and decode_merge.takes(64, 128)
    assert not decode_merge.takes(1, 128)  # nothing to merge
    assert not decode_merge.takes(33, 128) and not decode_merge.takes(32, 96)
    assert not decode_merge.takes(128, 128)  # a [128, 128] float32 slice would spill
    with pytest.raises(ValueError, match="power-of-two"):
        _check(np.random.default_rng(0), 3, 1, 2, 1, 4, 64)


def test_decode_steps_round_their_split_count_to_a_power_of_two():
    # Qwen3-30B-A3B's batch-1 bucket: 2 tiles x 4 kv heads, 33 splits to cover 2 x 132 SMs -> 32.
    assert gpu.default_num_splits(2, 4, 1000) == 33
    assert gpu.default_num_splits(2, 4, 1000, pow2=True) == 32
    assert gpu.default_num_splits(2, 8, 1000, pow2=True) == 16  # 17
    assert gpu.default_num_splits(2, 4, 24, pow2=True) == 16  # capped at the blocks first
    assert gpu.default_num_splits(256, 4, 1000, pow2=True) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("splits, kv_heads, tokens, real, group, head_dim, scale", [
    (32, 4, 2, 1, 8, 128, 1.0), (16, 8, 2, 1, 4, 128, 1.0), (4, 4, 16, 11, 8, 128, 1.0),
    (8, 2, 3, 2, 12, 64, 0.5), (32, 1, 2, 2, 16, 256, 1.0),
])
def test_gpu_merge_matches_the_xla_merge(rng, splits, kv_heads, tokens, real, group, head_dim, scale):
    _check(rng, splits, kv_heads, tokens, real, group, head_dim, scale, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads, kv_heads, seqs, pad_tokens", [
    (32, 4, ((1, 1030),), 1),  # Qwen3-30B-A3B, the batch-1 bucket: 32 splits
    (32, 8, ((1, 700), (1, 33)), 0),  # Llama-3-8B, two sequences: 16 splits
    (16, 4, ((1, 260), (1, 1), (1, 517)), 1),
])
def test_gpu_decode_attention_with_the_merge_kernel_matches_oracle(rng, num_heads, kv_heads, seqs, pad_tokens):
    """One-token tiles (a decode step) at the default split count, which the merge kernel takes, against the
    float64 oracle."""
    batch = make_paged_batch(rng, seqs, num_heads=num_heads, kv_heads=kv_heads, head_dim=128, page_size=16,
                             max_pages=72, dtype=jnp.bfloat16, pad_tokens=pad_tokens, pad_seqs=1)
    tokens = batch.q.shape[0]
    splits = gpu.default_num_splits(tokens, kv_heads, 72 * 16 // 64, pow2=True)
    assert decode_merge.takes(splits, 128)
    out = gpu.ragged_paged_attention(*batch.args(), sm_scale=128**-0.5, one_token_per_seq=True)
    out = np.asarray(out.astype(jnp.float32))
    real = batch.num_real_tokens
    assert np.isfinite(out).all() and not out[real:].any()
    assert relative_error(out[:real], naive_attention(batch, sm_scale=128**-0.5)) < 2e-2
