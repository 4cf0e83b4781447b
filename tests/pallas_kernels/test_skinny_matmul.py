"""The skinny product kernel (Pallas Triton; interpret mode on CPU) against its jnp reference on fresh random
inputs, with and without the RMSNorm in its prologue, and the reference against a float64 oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.skinny_matmul import Tiling, normed_matmul, normed_matmul_parts, reference, takes
from pallas_kernels.skinny_matmul import gpu

EPS = 1e-6


def _inputs(rng, tokens: int, k: int, n: int, dtype=jnp.bfloat16):
    """x with rows of different scales (the norm must be per row), w, and a norm weight around 1."""
    x = rng.standard_normal((tokens, k)) * rng.uniform(0.1, 10.0, (tokens, 1))
    w = rng.standard_normal((k, n)) / np.sqrt(k)
    g = 1.0 + 0.5 * rng.standard_normal(k)
    return (jnp.asarray(x, dtype), jnp.asarray(w, dtype), jnp.asarray(g, dtype))


def _oracle(x, w, g) -> np.ndarray:
    """float64: RMSNorm (the normed rows rounded to x's dtype, as the engine does), then the product."""
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    if g is not None:
        normed = x64 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + EPS) * np.asarray(g, np.float64)
        x64 = np.asarray(jnp.asarray(normed, jnp.float32).astype(x.dtype).astype(jnp.float32), np.float64)
    return x64 @ np.asarray(w.astype(jnp.float32), np.float64)


def test_reference_matches_the_float64_oracle(rng):
    x, w, g = _inputs(rng, 3, 256, 48, jnp.float32)
    for norm in (None, g):
        np.testing.assert_allclose(np.asarray(reference.normed_matmul(x, w, norm, EPS)), _oracle(x, w, norm),
                                   rtol=2e-5, atol=2e-5)
        parts = reference.normed_matmul_parts(x, w, norm, EPS, 4)
        assert parts.shape == (4, 3, 48) and parts.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(parts.sum(0)), _oracle(x, w, norm), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("tokens, k, n, tiling", [
    (2, 256, 128, Tiling(block_n=32, block_k=32, splits=4)),
    (1, 128, 64, Tiling(block_n=64, block_k=64, splits=1, block_acc=False)),
    (8, 512, 64, Tiling(block_n=16, block_k=64, splits=2)),
    (3, 256, 32, Tiling(block_n=32, block_k=16, splits=8, block_acc=False)),
    (2, 512, 128, Tiling(block_n=32, block_k=64, splits=4, mma=True)),
])
@pytest.mark.parametrize("normed", [False, True])
def test_kernel_in_interpret_mode_matches_reference(rng, tokens, k, n, tiling, normed):
    x, w, g = _inputs(rng, tokens, k, n)
    norm = g if normed else None
    parts = normed_matmul_parts(x, w, norm, EPS, impl="pallas_gpu", tiling=tiling, interpret=True)
    want = reference.normed_matmul_parts(x, w, norm, EPS, tiling.splits)
    assert parts.shape == (tiling.splits, tokens, n) and parts.dtype == jnp.float32
    # The same bf16 operands summed in float32 in another order; a normed row may round its last bit the other way.
    np.testing.assert_allclose(np.asarray(parts), np.asarray(want), rtol=1e-2, atol=2e-2)
    out = normed_matmul(x, w, norm, EPS, impl="pallas_gpu", tiling=tiling, interpret=True)
    assert out.shape == (tokens, n) and out.dtype == x.dtype
    err = np.abs(np.asarray(out, np.float64) - _oracle(x, w, norm))
    assert err.max() <= 0.02 * np.abs(_oracle(x, w, norm)).max()


def test_write_normed_stores_the_normed_rows(rng):
    """write_normed: column block 0's programs store their K slice of the normed rows, all of them together."""
    x, w, g = _inputs(rng, 2, 256, 64)
    tiling = Tiling(block_n=32, block_k=32, splits=4)
    parts, normed = gpu.normed_matmul_parts(x, w, g, eps=EPS, tiling=tiling, write_normed=True, interpret=True)
    want = reference.rms_normed(x, g, EPS)
    assert normed.dtype == x.dtype
    diff = np.abs(np.asarray(normed, np.float32) - np.asarray(want, np.float32))
    assert diff.max() <= 2 ** -7 * np.abs(np.asarray(want, np.float32)).max()  # at most a last-bit rounding
    np.testing.assert_allclose(np.asarray(parts), np.asarray(reference.normed_matmul_parts(x, w, g, EPS, 4)),
                               rtol=1e-2, atol=2e-2)
    with pytest.raises(ValueError, match="write_normed needs a norm"):
        gpu.normed_matmul_parts(x, w, None, tiling=tiling, write_normed=True, interpret=True)


def test_takes_and_errors():
    t = Tiling(block_n=64, block_k=64, splits=4)
    assert takes(2, 2048, 5120, t) and takes(16, 4096, 2048, t)
    assert not takes(17, 2048, 5120, t) and not takes(2, 2048, 5100, t) and not takes(2, 2000, 5120, t)
    assert not takes(2, 2048, 5120, Tiling(block_n=48))
    x, w, g = _inputs(np.random.default_rng(0), 2, 96, 64)
    with pytest.raises(ValueError, match="takes 1-16 rows"):
        normed_matmul_parts(x, w, g, impl="pallas_gpu", tiling=t, interpret=True)
    with pytest.raises(ValueError, match="impl must be"):
        normed_matmul(x, w, g, impl="triton")
    with pytest.raises(ValueError, match="skinny product"):
        gpu.normed_matmul_parts(x, w[:64], g, interpret=True)


def test_auto_is_the_kernel_on_a_gpu_and_the_reference_elsewhere(rng):
    x, w, g = _inputs(rng, 2, 256, 64)
    got, want = np.asarray(normed_matmul(x, w, g), np.float32), np.asarray(reference.normed_matmul(x, w, g), np.float32)
    if jax.default_backend() == "gpu":  # the kernel's float32 sums in another order
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    else:
        np.testing.assert_array_equal(got, want)


# Qwen3-30B-A3B's decode products (q/k/v with the attention norm, the output projection, the router with the
# MoE norm) and a Llama-sized one, at the decode bucket's 2 rows, 1 row and 8 rows.
GPU_CASES = [(2, 2048, 5120, True), (2, 4096, 2048, False), (2, 2048, 128, True), (1, 2048, 5120, True),
             (8, 2048, 5120, True), (2, 4096, 6144, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, k, n, normed", GPU_CASES)
@pytest.mark.parametrize("tiling", [Tiling(), Tiling(block_n=32, block_k=128, splits=8, block_acc=False),
                                    Tiling(block_n=64, block_k=128, splits=4, mma=True)])
def test_gpu_kernel_matches_reference(rng, tokens, k, n, normed, tiling):
    if not takes(tokens, k, n, tiling):
        tiling = Tiling(block_n=32, block_k=64, splits=4)  # the router's 128 columns
    x, w, g = _inputs(rng, tokens, k, n)
    norm = g if normed else None
    out = normed_matmul(x, w, norm, EPS, impl="pallas_gpu", tiling=tiling)
    want = _oracle(x, w, norm)
    err = np.abs(np.asarray(out, np.float64) - want)
    assert err.max() <= 2 ** -7 * np.abs(want).max() + 1e-3, err.max()  # bf16 output rounding
    parts, normed_rows = gpu.normed_matmul_parts(x, w, g, eps=EPS, tiling=tiling, write_normed=True)
    diff = np.abs(np.asarray(normed_rows, np.float32) - np.asarray(reference.rms_normed(x, g, EPS), np.float32))
    assert diff.max() <= 2 ** -7 * float(jnp.abs(reference.rms_normed(x, g, EPS).astype(jnp.float32)).max())
