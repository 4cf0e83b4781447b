"""Shared builders for the kernel tests: random ragged paged batches and a float64 attention oracle."""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest


@dataclasses.dataclass(frozen=True)
class PagedBatch:
    """Inputs of one ragged_paged_attention call plus what the oracle needs."""

    q: jax.Array  # [T, N, H]
    k_pages: jax.Array  # [P, R, K, H]
    v_pages: jax.Array  # [P, R, K, H]
    kv_lens: jax.Array  # [S]
    page_indices: jax.Array  # [S, M]
    cu_q_lens: jax.Array  # [S+1]
    num_seqs: jax.Array  # [1]
    q_lens: tuple[int, ...]

    def args(self):
        return (self.q, self.k_pages, self.v_pages, self.kv_lens, self.page_indices,
                self.cu_q_lens, self.num_seqs)

    @property
    def num_real_tokens(self) -> int:
        return int(sum(self.q_lens))


def _random_kv(rng, shape, dtype):
    """Random pages in the storage dtype; int8 uses the whole range like a real quantized cache."""
    if dtype == jnp.int8:
        return jnp.asarray(rng.integers(-127, 128, size=shape), jnp.int8)
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)


def make_paged_batch(rng, seqs, *, num_heads, kv_heads, head_dim, page_size, max_pages,
                     dtype=jnp.float32, kv_dtype=None, pad_tokens=0, pad_seqs=0) -> PagedBatch:
    """seqs: [(q_len, kv_len)] per real sequence; pages are handed out shuffled from 1..P-1."""
    kv_dtype = kv_dtype or dtype
    q_lens = [q for q, _ in seqs]
    kv_lens = [kv for _, kv in seqs]
    assert all(0 < q <= kv <= max_pages * page_size for q, kv in seqs)
    pages_needed = [-(-kv // page_size) for kv in kv_lens]
    num_pages = sum(pages_needed) + 3  # page 0 is the trash page, plus spares nobody owns
    free = rng.permutation(np.arange(1, num_pages))
    num_slots = len(seqs) + pad_seqs
    table = np.zeros((num_slots, max_pages), np.int32)
    used = 0
    for s, n in enumerate(pages_needed):
        table[s, :n] = free[used:used + n]
        used += n
    cu = np.zeros(num_slots + 1, np.int32)
    cu[1:len(seqs) + 1] = np.cumsum(q_lens)
    cu[len(seqs) + 1:] = cu[len(seqs)]
    kv = np.zeros(num_slots, np.int32)
    kv[:len(seqs)] = kv_lens
    t = sum(q_lens) + pad_tokens
    shape = (num_pages, page_size, kv_heads, head_dim)
    q = jnp.asarray(rng.standard_normal((t, num_heads, head_dim), dtype=np.float32)).astype(dtype)
    return PagedBatch(q, _random_kv(rng, shape, kv_dtype), _random_kv(rng, shape, kv_dtype),
                      jnp.asarray(kv), jnp.asarray(table), jnp.asarray(cu),
                      jnp.asarray([len(seqs)], jnp.int32), tuple(q_lens))


def naive_attention(batch: PagedBatch, *, sm_scale, sliding_window=None, soft_cap=None,
                    k_scale=None, v_scale=None) -> np.ndarray:
    """Float64 token-by-token attention straight from the ARCHITECTURE.md definition: [T_real, N, H]."""
    q = np.asarray(batch.q.astype(jnp.float32), np.float64)
    k = np.asarray(batch.k_pages.astype(jnp.float32), np.float64) * (k_scale or 1.0)
    v = np.asarray(batch.v_pages.astype(jnp.float32), np.float64) * (v_scale or 1.0)
    table, cu = np.asarray(batch.page_indices), np.asarray(batch.cu_q_lens)
    kv_lens = np.asarray(batch.kv_lens)
    page_size, kv_heads = k.shape[1], k.shape[2]
    group = q.shape[1] // kv_heads
    out = np.zeros((batch.num_real_tokens,) + q.shape[1:])
    for s, q_len in enumerate(batch.q_lens):
        for i in range(q_len):
            t = cu[s] + i
            pos = kv_lens[s] - q_len + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            kv_pos = np.arange(lo, pos + 1)
            pages = table[s, kv_pos // page_size]
            ks, vs = k[pages, kv_pos % page_size], v[pages, kv_pos % page_size]  # [L, K, H]
            for n in range(q.shape[1]):
                logits = ks[:, n // group] @ q[t, n] * sm_scale
                if soft_cap is not None:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                p = np.exp(logits - logits.max())
                out[t, n] = (p / p.sum()) @ vs[:, n // group]
    return out


def relative_error(actual, expected) -> float:
    actual = np.asarray(jnp.asarray(actual).astype(jnp.float32), np.float64)
    expected = np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30))


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test id so failures reproduce."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
