"""The fused MoE SwiGLU kernel's weighted form (gpu_swiglu.swiglu_experts(..., weights=)): each pair's rows scaled by
its routing weight, the rows of the pairs it skips (padding tokens, experts held elsewhere) written as zeros, so the
sum over the two leading axes is the MoE output with no mask; and its accumulating form (residual=), which adds those
rows into a float32 residual instead. Checked against a float64 oracle on fresh random inputs: in interpret mode on
CPU (fresh memory NaN-filled, so an unwritten row shows) and on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import gpu_swiglu


def _weights(key, groups, d, f):
    """bf16 gate, up and down weights scaled so the SwiGLU output stays O(1)."""
    kg, ku, kd = jax.random.split(key, 3)

    def draw(k, shape, fan_in):
        return (jax.random.normal(k, shape, jnp.float32) * fan_in**-0.5).astype(jnp.bfloat16)

    return draw(kg, (groups, d, f), d), draw(ku, (groups, d, f), d), draw(kd, (groups, f, d), f)


def _routing(rng, tokens, top_k, groups, offset):
    """Distinct global expert ids [T, k] over groups + 2 * offset ids (some held elsewhere when offset > 0), routing
    weights [T, k] in (0.1, 1) and valid [T] with the last quarter (at least one) of the tokens padding."""
    ids = np.argsort(rng.random((tokens, groups + 2 * offset)), axis=1)[:, :top_k].astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (tokens, top_k)).astype(np.float32)
    valid = np.arange(tokens) < max(1, tokens - max(1, tokens // 4))
    return ids, weights, valid


def _oracle(x, wg, wu, wd, experts, weights, valid, offset) -> tuple[np.ndarray, np.ndarray]:
    """float64 (MoE output [T, D], live pairs [k, T] bool): sum over live pairs of weight * SwiGLU expert."""
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    x, wg, wu, wd = map(f64, (x, wg, wu, wd))
    tokens, top_k = experts.shape
    out, live = np.zeros((tokens, x.shape[1])), np.zeros((top_k, tokens), bool)
    for t in range(tokens):
        for j in range(top_k):
            e = int(experts[t, j]) - offset
            if valid[t] and 0 <= e < wg.shape[0]:
                g, u = x[t] @ wg[e], x[t] @ wu[e]
                out[t] += weights[t, j] * ((g / (1 + np.exp(-g)) * u) @ wd[e])
                live[j, t] = True
    return out, live


def _check(parts, want, live):
    parts = np.asarray(parts)  # [S, k, T, D]
    assert np.isfinite(parts).all()  # every row written (interpret mode fills fresh memory with NaN)
    assert not parts[:, ~live].any()  # skipped pairs: zero rows
    got = parts.sum(axis=(0, 1))  # [T, D]
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < 1e-2, rel


CASES = {  # tokens, top_k, experts, expert offset, D, F, tiling or None (the default)
    "batch_1": (2, 8, 9, 0, 256, 128, None),
    "default_tiles": (11, 3, 7, 0, 256, 128, None),
    "expert_offset": (6, 2, 4, 3, 256, 256, gpu_swiglu.SwigluTiling(tile_f=128, tile_k=64, tile_d=128, stages=2)),
    "d256": (5, 2, 3, 0, 512, 64, gpu_swiglu.SwigluTiling(tile_f=64, tile_k=64, tile_d=256, stages=2)),
    "rows_down": (9, 3, 5, 2, 256, 128, gpu_swiglu.SwigluTiling(stages=2, down="rows")),
    "cols_gate_up": (11, 3, 7, 2, 256, 128, gpu_swiglu.SwigluTiling(stages=2, gate_up="cols")),
    "cols_d256": (3, 4, 6, 1, 512, 128, gpu_swiglu.SwigluTiling(stages=2, gate_up="cols", tile_d=256)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_weighted_swiglu_in_interpret_mode_matches_oracle(rng, name):
    tokens, top_k, groups, offset, d, f, tiling = CASES[name]
    experts, weights, valid = _routing(rng, tokens, top_k, groups, offset)
    x = jnp.asarray(rng.standard_normal((tokens, d)), jnp.bfloat16)
    wg, wu, wd = _weights(jax.random.key(int(rng.integers(2**31))), groups, d, f)
    parts = gpu_swiglu.swiglu_experts(x, wg, wu, wd, jnp.asarray(experts), jnp.asarray(valid), offset,
                                      jnp.asarray(weights), tiling=tiling, interpret=True)
    want, live = _oracle(x, wg, wu, wd, experts, weights, valid, offset)
    assert 0 < live.sum() < live.size
    _check(parts, want, live)


def _check_accumulated(got, residual, want):
    """got [T, D] float32 = residual + the MoE output: every token's row, skipped pairs adding nothing."""
    got = np.asarray(got, np.float64)
    assert got.shape == residual.shape and np.isfinite(got).all()
    moe = got - residual
    rel = np.linalg.norm(moe - want) / np.linalg.norm(want)
    assert rel < 1e-2, rel
    idle = ~np.asarray(want).any(axis=1)  # padding tokens: the residual comes back as it went in
    np.testing.assert_array_equal(got[idle], residual[idle])


ACCUMULATE_CASES = [name for name, case in CASES.items() if case[-1] is None or case[-1].down == "cols"]


@pytest.mark.parametrize("name", ACCUMULATE_CASES)
def test_accumulating_swiglu_in_interpret_mode_matches_oracle(rng, name):
    """residual + the MoE output, [T, D] float32, with no parts array: the kernel adds each live pair's weighted
    rows into the residual's buffer."""
    tokens, top_k, groups, offset, d, f, tiling = CASES[name]
    experts, weights, valid = _routing(rng, tokens, top_k, groups, offset)
    x = jnp.asarray(rng.standard_normal((tokens, d)), jnp.bfloat16)
    wg, wu, wd = _weights(jax.random.key(int(rng.integers(2**31))), groups, d, f)
    residual = rng.standard_normal((tokens, d)).astype(np.float32)
    got = gpu_swiglu.swiglu_experts(x, wg, wu, wd, jnp.asarray(experts), jnp.asarray(valid), offset,
                                    jnp.asarray(weights), jnp.asarray(residual), tiling=tiling, interpret=True)
    want, live = _oracle(x, wg, wu, wd, experts, weights, valid, offset)
    assert 0 < live.sum() < live.size
    _check_accumulated(got, residual, want)


def test_accumulating_swiglu_checks_its_operands():
    x = jnp.zeros((2, 256), jnp.bfloat16)
    wg, wd = jnp.zeros((4, 256, 128), jnp.bfloat16), jnp.zeros((4, 128, 256), jnp.bfloat16)
    experts, weights = jnp.zeros((2, 2), jnp.int32), jnp.ones((2, 2), jnp.float32)
    residual = jnp.zeros((2, 256), jnp.float32)
    with pytest.raises(ValueError, match="routing weights"):  # no weights to scale the rows by
        gpu_swiglu.swiglu_experts(x, wg, wg, wd, experts, None, 0, None, residual, interpret=True)
    with pytest.raises(ValueError, match=r"float32 residual \[2, 256\]"):
        gpu_swiglu.swiglu_experts(x, wg, wg, wd, experts, None, 0, weights, residual[:1], interpret=True)
    with pytest.raises(ValueError, match="'cols' down"):
        gpu_swiglu.swiglu_experts(x, wg, wg, wd, experts, None, 0, weights, residual, interpret=True,
                                  tiling=gpu_swiglu.SwigluTiling(stages=2, down="rows"))


def test_weighted_swiglu_lowers_for_cuda():
    x = jax.ShapeDtypeStruct((2, 2048), jnp.bfloat16)
    wg, wd = jax.ShapeDtypeStruct((8, 2048, 768), jnp.bfloat16), jax.ShapeDtypeStruct((8, 768, 2048), jnp.bfloat16)
    experts, valid = jax.ShapeDtypeStruct((2, 8), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.bool_)
    weights = jax.ShapeDtypeStruct((2, 8), jnp.float32)
    call = lambda *a: gpu_swiglu.swiglu_experts(*a[:6], 0, a[6])  # noqa: E731
    lowered = jax.jit(call).trace(x, wg, wg, wd, experts, valid, weights).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("tiling", [None, gpu_swiglu.SwigluTiling(tile_f=128, tile_k=64, tile_d=128, stages=3),
                                    gpu_swiglu.SwigluTiling(down="rows"), gpu_swiglu.SwigluTiling(gate_up="cols"),
                                    gpu_swiglu.SwigluTiling(gate_up="cols", stages=5),
                                    gpu_swiglu.SwigluTiling(gate_up="cols", stages=4)], ids=str)
@pytest.mark.parametrize("tokens, offset", [(2, 0), (16, 0), (16, 32)])
def test_gpu_weighted_swiglu_at_qwen3_decode(rng, tokens, offset, tiling):
    """Qwen3-30B-A3B's expert shapes (D 2048, F 768, top-8 of 128; with an offset, 128 of 192 ids held here). The
    output's memory is poisoned first: a NaN buffer of its size freed just before the call, which the allocator
    hands out again."""
    d, f, groups = 2048, 768, 128
    experts, weights, valid = _routing(rng, tokens, 8, groups, offset)
    x = jax.random.normal(jax.random.key(int(rng.integers(2**31))), (tokens, d), jnp.bfloat16)
    wg, wu, wd = _weights(jax.random.key(int(rng.integers(2**31))), groups, d, f)
    slices = f // (tiling or gpu_swiglu.default_tiling(tokens * 8, f, d)).tile_f
    poison = jnp.full((slices, 8, tokens, d), jnp.nan, jnp.float32).block_until_ready()
    poison.delete()
    parts = gpu_swiglu.swiglu_experts(x, wg, wu, wd, jnp.asarray(experts), jnp.asarray(valid), offset,
                                      jnp.asarray(weights), tiling=tiling)
    want, live = _oracle(x, wg, wu, wd, experts, weights, valid, offset)
    _check(parts, want, live)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2, 3, 10])
def test_gpu_weighted_swiglu_unpadded_rows(rng, tokens):
    """The default pad_rows: x [T, D] of fewer than 8 rows goes as it is, the x tile's TMA filling the rows past T
    with zeros; 10 rows are padded to 16 (Mosaic's tiling takes a row count under 8 or a multiple of it)."""
    d, f, groups = 2048, 768, 128
    experts, weights, valid = _routing(rng, tokens, 8, groups, 0)
    x = jax.random.normal(jax.random.key(int(rng.integers(2**31))), (tokens, d), jnp.bfloat16)
    wg, wu, wd = _weights(jax.random.key(int(rng.integers(2**31))), groups, d, f)
    parts = gpu_swiglu.swiglu_experts(x, wg, wu, wd, jnp.asarray(experts), jnp.asarray(valid), 0,
                                      jnp.asarray(weights))
    want, live = _oracle(x, wg, wu, wd, experts, weights, valid, 0)
    _check(parts, want, live)


@pytest.mark.gpu
@pytest.mark.parametrize("tiling", [None, gpu_swiglu.SwigluTiling(tile_f=128, tile_k=64, tile_d=128, stages=3),
                                    gpu_swiglu.SwigluTiling(gate_up="cols", stages=5),
                                    gpu_swiglu.SwigluTiling(gate_up="cols", stages=4)], ids=str)
@pytest.mark.parametrize("tokens, offset", [(1, 0), (2, 0), (10, 0), (16, 32)])
def test_gpu_accumulating_swiglu_at_qwen3_decode(rng, tokens, offset, tiling):
    """The TMA reduce-add stores at Qwen3-30B-A3B's expert shapes: residual + every live pair's weighted rows, from
    all 12 (or 6) slices of F and 8 slots, against the float64 oracle; the residual's buffer is not the caller's."""
    d, f, groups = 2048, 768, 128
    experts, weights, valid = _routing(rng, tokens, 8, groups, offset)
    x = jax.random.normal(jax.random.key(int(rng.integers(2**31))), (tokens, d), jnp.bfloat16)
    wg, wu, wd = _weights(jax.random.key(int(rng.integers(2**31))), groups, d, f)
    residual = rng.standard_normal((tokens, d)).astype(np.float32)
    residual_dev = jnp.asarray(residual)
    got = gpu_swiglu.swiglu_experts(x, wg, wu, wd, jnp.asarray(experts), jnp.asarray(valid), offset,
                                    jnp.asarray(weights), residual_dev, tiling=tiling)
    want, _ = _oracle(x, wg, wu, wd, experts, weights, valid, offset)
    _check_accumulated(got, residual, want)
    np.testing.assert_array_equal(np.asarray(residual_dev), residual)  # the caller's array is unchanged
