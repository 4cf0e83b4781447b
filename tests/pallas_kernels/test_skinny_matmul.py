"""A decode step's dense products by the skinny_matmul kernel (Mosaic GPU): float32 partials over slices of K, or
added into a float32 residual, against the jnp reference and a float64 oracle on fresh random inputs (interpreted on
any backend, compiled on a GPU); and tiny bf16 Qwen3 models whose decode takes it (q/k/v and the output projection,
with a float32 residual stream) giving the logits of XLA's path within bf16's rounding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.models import QWEN3, QWEN3_MOE, common, moe, qwen3
from jaxinfer.models.fused import fuse_projections
from model_helpers import (DECODE_SHAPE, build_runner, float32_twin, rel_err, run_chunks, tiny_qwen3_dense,
                           tiny_qwen3_moe)
from pallas_kernels import skinny_matmul
from pallas_kernels.skinny_matmul import gpu as skinny


def random_case(seed: int, tokens: int, k: int, n: int):
    r = np.random.default_rng(seed)
    x = jnp.asarray(r.standard_normal((tokens, k)), jnp.bfloat16)
    w = jnp.asarray(r.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
    residual = jnp.asarray(r.standard_normal((tokens, n)), jnp.float32)
    return x, w, residual


def check_case(x, w, residual, splits: int, tiling, interpret: bool) -> None:
    """Partials as the float64 product of each K slice; residual + their sum likewise (bf16 products are exact in
    float32, so only the float32 sums round)."""
    parts = skinny.skinny_matmul(x, w, splits=splits, tiling=tiling, interpret=interpret)
    t, k = x.shape
    xs = np.asarray(x, np.float64).reshape(t, splits, k // splits).transpose(1, 0, 2)  # [S, T, K/S]
    oracle = xs @ np.asarray(w, np.float64).reshape(splits, k // splits, -1)  # [S, T, N]
    assert parts.shape == oracle.shape and parts.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(parts, np.float64), oracle, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(parts), np.asarray(skinny_matmul.reference(x, w, splits=splits)),
                               rtol=1e-5, atol=1e-5)
    out = skinny.skinny_matmul(x, w, residual, splits=splits, tiling=tiling, interpret=interpret)
    assert out.shape == residual.shape and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out, np.float64), np.asarray(residual, np.float64) + oracle.sum(axis=0),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens, k, n, splits, tile_k", [(1, 256, 128, 2, 64), (2, 512, 64, 4, 128),
                                                          (3, 128, 192, 1, 64), (8, 256, 128, 2, 128)])
def test_interpreted_kernel_matches_the_oracle(tokens, k, n, splits, tile_k) -> None:
    check_case(*random_case(tokens * k + n, tokens, k, n), splits, skinny.SkinnyTiling(tile_k=tile_k, stages=2),
               interpret=True)


def test_plan_takes_and_refuses() -> None:
    assert skinny.plan(2048, 5120, 8) == (8, skinny.SkinnyTiling(tile_k=128))  # Qwen3-30B-A3B's q/k/v
    assert skinny.plan(4096, 2048, 8) == (8, skinny.SkinnyTiling(tile_k=128))  # its output projection
    assert skinny.plan(64, 256, 8) == (1, skinny.SkinnyTiling(tile_k=64))  # one 64-wide step
    assert skinny.plan(192, 128, 8) == (1, skinny.SkinnyTiling(tile_k=64))  # 192 = 3 x 64: no even split
    assert skinny.plan(256, 96, 8) is None  # N not a multiple of 64
    x, w, _ = random_case(0, 2, 256, 128)
    assert skinny.takes(x, w, 2)
    assert not skinny.takes(x, w, 4)  # 256 into 4 slices of whole 128-wide steps: no
    assert not skinny.takes(x.astype(jnp.float32), w, 1)  # 16-bit x and w of one dtype
    assert not skinny.takes(jnp.zeros((9, 256), jnp.bfloat16), w, 1)  # past one 8-row x block
    with pytest.raises(ValueError, match="multiple of splits"):
        skinny.skinny_matmul(x, w, splits=4, interpret=True)
    with pytest.raises(ValueError, match="float32"):
        skinny.skinny_matmul(x, w, jnp.zeros((2, 128), jnp.bfloat16), splits=2, interpret=True)


def test_lowers_for_cuda_with_the_residual_aliased() -> None:
    x = jax.ShapeDtypeStruct((2, 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4096, 2048), jnp.bfloat16)
    r = jax.ShapeDtypeStruct((2, 2048), jnp.float32)
    call = lambda x, w, r: skinny.skinny_matmul(x, w, r, splits=8)  # noqa: E731
    text = jax.jit(call).trace(x, w, r).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "output_operand_aliases" in text


def decode_logits(runner, ids: list[int]) -> np.ndarray:
    """The last logits of each decode-sized chunk of 3 tokens of `ids` (one sequence, pages 1-4)."""
    return run_chunks(runner, ids, 3, [1, 2, 3, 4], DECODE_SHAPE)


def check_model(monkeypatch, family, make_cfg, mode: str) -> None:
    """A tiny bf16 model decoding with the GPU decode path's kernels (`mode`: interpreted or compiled) with and
    without skinny_matmul: the same logits within bf16's rounding, the kernel's no further from the float32 run of
    the same weights than XLA's path (it rounds the residual once a layer, not twice), and every layer's output
    projection adding into the float32 residual stream."""
    cfg = make_cfg(num_heads=4, num_kv_heads=2, head_dim=16)
    ids = list(np.random.default_rng(6).integers(0, cfg.vocab_size, 12))
    monkeypatch.setattr(common, "NORM_ROPE_WRITE", mode)
    monkeypatch.setattr(moe, "NORM_ROUTER", mode)

    def build(dtype=jnp.bfloat16, weights=None):
        hook = fuse_projections if weights is None else (lambda _: weights)
        return build_runner(cfg, seed=7, family=family, weights_hook=hook, dtype=dtype, num_pages=8)

    monkeypatch.setattr(qwen3, "SKINNY", None)
    xla = build()
    want = decode_logits(xla, ids)
    exact = decode_logits(float32_twin(build, xla), ids)
    monkeypatch.setattr(qwen3, "SKINNY", mode)
    calls = []
    kernel = skinny.skinny_matmul
    monkeypatch.setattr(skinny, "skinny_matmul",
                        lambda x, w, residual=None, **k: calls.append(residual is not None and residual.dtype)
                        or kernel(x, w, residual, **k))
    got = decode_logits(build(), ids)  # a new runner: its programs trace anew
    # One trace of each kind of layer: a q/k/v product (no residual) and an output projection into float32.
    assert False in calls and jnp.float32 in calls, calls
    assert rel_err(got, want) < 2e-2
    assert rel_err(got, exact) < 1.5 * rel_err(want, exact)


FAMILIES = pytest.mark.parametrize("family, make_cfg", [(QWEN3, tiny_qwen3_dense), (QWEN3_MOE, tiny_qwen3_moe)])


@FAMILIES
def test_model_with_the_interpreted_kernel_gives_the_same_logits(monkeypatch, family, make_cfg) -> None:
    check_model(monkeypatch, family, make_cfg, "interpret")


@pytest.mark.gpu
@FAMILIES
def test_model_with_the_gpu_kernel_gives_the_same_logits(monkeypatch, family, make_cfg) -> None:
    check_model(monkeypatch, family, make_cfg, "gpu")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2, 5, 8])
@pytest.mark.parametrize("k, n", [(2048, 5120), (4096, 2048)])  # Qwen3-30B-A3B's q/k/v and output projection
def test_gpu_kernel_matches_the_oracle(tokens, k, n) -> None:
    splits, tiling = skinny.plan(k, n, qwen3.SKINNY_SPLITS)
    check_case(*random_case(tokens + k, tokens, k, n), splits, tiling, interpret=False)
