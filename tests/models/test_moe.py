"""The dropless MoE block: routing, sort/group/un-permute against a per-token loop, counts, padding, injection."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.models import moe
from jaxinfer.models.moe import (PAIR_PATH_MAX_PAIRS, MoEWeights, PairKernel, expert_token_counts, moe_block, moe_partial,
                                 route)
from moe_reference import reference_moe, reference_routing

T, D, F, E = 13, 16, 8, 8


def random_moe(seed: int, router_scale: float = 3.0) -> tuple[np.ndarray, MoEWeights]:
    r = np.random.default_rng(seed)
    n = lambda *s: r.standard_normal(s).astype(np.float32)  # noqa: E731
    w = MoEWeights(router=n(D, E) * router_scale / np.sqrt(D), w_gate=n(E, D, F) / np.sqrt(D),
                   w_up=n(E, D, F) / np.sqrt(D), w_down=n(E, F, D) / np.sqrt(F))
    return n(T, D), jax.tree.map(jnp.asarray, w)


@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("top_k", [2, 5])
def test_routing_matches_softmax_top_k(renorm: bool, top_k: int) -> None:
    """Softmax over all experts, top-k, renormalized (HF's order; with renorm the block takes the top-k logits
    and a softmax over those, which must agree)."""
    x, w = random_moe(0)
    got = route(jnp.asarray(x), w.router, top_k, renorm)
    want_w, want_e = reference_routing(x, w.router, top_k, renorm)
    np.testing.assert_array_equal(np.asarray(got.experts), want_e)
    np.testing.assert_allclose(np.asarray(got.weights), want_w, rtol=1e-5)
    assert got.weights.dtype == jnp.float32
    if renorm:
        np.testing.assert_allclose(np.asarray(got.weights).sum(-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("top_k, renorm", [(1, False), (2, True), (3, False), (8, True)])
def test_block_equals_per_token_loop(top_k: int, renorm: bool) -> None:
    x, w = random_moe(1)
    out, counts = moe_block(jnp.asarray(x), w, top_k=top_k, norm_topk_prob=renorm)
    np.testing.assert_allclose(np.asarray(out), reference_moe(x, w, top_k, renorm), rtol=1e-5, atol=1e-6)
    assert int(counts.sum()) == T * top_k


def test_dropless_when_every_token_picks_the_same_expert() -> None:
    """A router that sends all 13 tokens to expert 5 (far over any capacity of T*k/E): nothing is dropped."""
    x, w = random_moe(2)
    router = np.asarray(w.router).copy()
    x = np.abs(x)
    router[:, 5] = 50.0  # x >= 0, so expert 5 wins for every token
    w = w.replace(router=jnp.asarray(router))
    out, counts = moe_block(jnp.asarray(x), w, top_k=2, norm_topk_prob=True)
    assert int(counts[5]) == T
    np.testing.assert_allclose(np.asarray(out), reference_moe(x, w, 2, True), rtol=1e-5, atol=1e-6)


def test_padding_tokens_go_to_no_expert() -> None:
    x, w = random_moe(3)
    valid = np.arange(T) < 9
    out, counts = moe_block(jnp.asarray(x), w, top_k=2, norm_topk_prob=True, valid=jnp.asarray(valid))
    np.testing.assert_allclose(np.asarray(out)[:9], reference_moe(x[:9], w, 2, True), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(out)[9:], 0.0)
    _, experts = reference_routing(x[:9], w.router, 2, True)
    np.testing.assert_array_equal(np.asarray(counts), np.bincount(experts.ravel(), minlength=E))


def test_expert_token_counts() -> None:
    experts = jnp.asarray([[0, 3], [3, 1], [7, 3], [2, 0]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(expert_token_counts(experts, 8)), [2, 1, 1, 3, 0, 0, 0, 1])
    valid = jnp.asarray([True, True, False, True])
    np.testing.assert_array_equal(np.asarray(expert_token_counts(experts, 8, valid)), [2, 1, 1, 2, 0, 0, 0, 0])


def test_expert_matmul_is_injectable() -> None:
    """A stand-in grouped matmul (dense per-row expert lookup) gets the sorted rows and gives the same result."""
    x, w = random_moe(4)
    calls = []

    def gathered_matmul(lhs, rhs, group_sizes):  # lhs [M, D], rhs [E, D, F], group_sizes [E]
        calls.append((lhs.shape, rhs.shape))
        ends = jnp.cumsum(group_sizes)  # row r belongs to the first group whose end is past r
        expert = jnp.searchsorted(ends, jnp.arange(lhs.shape[0]), side="right")  # [M]; past the end: E
        per_row = jnp.take(rhs, jnp.minimum(expert, rhs.shape[0] - 1), axis=0)  # [M, D, F]
        out = jnp.einsum("md,mdf->mf", lhs, per_row)  # [M, F]
        return jnp.where((expert < rhs.shape[0])[:, None], out, 0.0)

    ours, _ = moe_block(jnp.asarray(x), w, top_k=2, norm_topk_prob=False, expert_matmul=gathered_matmul)
    ref, _ = moe_block(jnp.asarray(x), w, top_k=2, norm_topk_prob=False)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-5, atol=1e-6)
    assert [c[0] for c in calls] == [(T * 2, D), (T * 2, D), (T * 2, F)]  # gate, up, down over T*k rows


def test_unwritten_padding_rows_never_reach_the_output() -> None:
    """A kernel may leave rows past the groups unwritten (garbage, even NaN): padding outputs stay 0."""
    x, w = random_moe(5)
    nan_tail = lambda lhs, rhs, gs: jnp.where(  # noqa: E731
        (jnp.arange(lhs.shape[0]) < gs.sum())[:, None], jax.lax.ragged_dot(lhs, rhs, gs), jnp.nan)
    valid = jnp.arange(T) < 7
    out, _ = moe_block(jnp.asarray(x), w, top_k=2, norm_topk_prob=True, valid=valid, expert_matmul=nan_tail)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out)[:7], reference_moe(x[:7], w, 2, True), rtol=1e-5, atol=1e-6)


def test_one_compile_for_any_routing() -> None:
    """Static shapes: new routings (other group sizes) reuse the compiled program."""
    block = jax.jit(lambda x, w: moe_block(x, w, top_k=2, norm_topk_prob=True))
    for seed in range(3):
        x, w = random_moe(10 + seed)
        block(jnp.asarray(x), w)
    assert block._cache_size() == 1


def test_bfloat16_activations_route_in_float32() -> None:
    x, w = random_moe(6)
    wb = jax.tree.map(lambda a: a.astype(jnp.bfloat16), w)
    out, _ = moe_block(jnp.asarray(x, jnp.bfloat16), wb, top_k=2, norm_topk_prob=True)
    assert out.dtype == jnp.bfloat16
    ref = reference_moe(np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32), jax.tree.map(
        lambda a: np.asarray(a, np.float32), wb), 2, True)
    assert np.linalg.norm(np.asarray(out, np.float32) - ref) / np.linalg.norm(ref) < 2e-2


def _pair_kernel(takes=lambda lhs, rhs: True, calls=None, fused=False):
    """The reference per-pair matmul as a PairKernel (records its calls' pair counts); fused: with the
    reference fused SwiGLU too, its calls recorded as ("swiglu", pairs)."""
    from pallas_kernels.grouped_matmul import gather_matmul, swiglu_experts
    from pallas_kernels.moe_routing import top_k_routing

    def matmul(lhs, rhs, rows, experts):
        if calls is not None:
            calls.append(rows.shape[0])
        return gather_matmul(lhs, rhs, rows, experts, impl="reference")

    def swiglu(x, w_gate, w_up, w_down, experts, valid, expert_offset):
        if calls is not None:
            calls.append(("swiglu", experts.shape))
        parts = swiglu_experts(x, w_gate, w_up, w_down, experts, valid, expert_offset, impl="reference")
        # Two partial sums with garbage in the rows of skipped pairs, as the GPU kernel leaves them.
        local = experts.T - expert_offset  # [k, T]
        skipped = (local < 0) | (local >= w_gate.shape[0])
        if valid is not None:
            skipped |= ~valid[None, :]
        halves = jnp.concatenate([parts / 2, parts / 2])  # [2, k, T, D]
        return jnp.where(skipped[None, :, :, None], jnp.nan, halves)
    def select_top_k(logits, top_k, renorm):
        if calls is not None:
            calls.append(("top_k", logits.shape))
        return top_k_routing(logits, top_k, renorm, impl="reference")
    return PairKernel(matmul, takes, swiglu=swiglu if fused else None, swiglu_takes=lambda *a: fused,
                      select_top_k=select_top_k if fused else None)


@pytest.mark.parametrize("top_k, renorm", [(2, True), (3, False)])
def test_pair_path_equals_the_grouped_path(top_k: int, renorm: bool) -> None:
    """Decode-sized steps take the per-pair path: same output and counts as the grouped one, padding tokens
    sent nowhere, and no sort (the pair kernel sees every pair in (token, slot) order)."""
    x, w = random_moe(7)
    valid = jnp.arange(T) < 10
    calls = []
    ours, counts = moe_block(jnp.asarray(x), w, top_k=top_k, norm_topk_prob=renorm, valid=valid,
                             pair_kernel=_pair_kernel(calls=calls))
    ref, ref_counts = moe_block(jnp.asarray(x), w, top_k=top_k, norm_topk_prob=renorm, valid=valid)
    assert calls == [T * top_k] * 3  # gate, up, down
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(ours)[10:], 0.0)
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(ref_counts))


@pytest.mark.parametrize("top_k, renorm", [(2, True), (3, False)])
def test_fused_pair_path_equals_the_grouped_path(top_k: int, renorm: bool) -> None:
    """With a fused SwiGLU form the pair path makes one call of it instead of three matmuls, sums its
    partials and never lets the unwritten rows of skipped pairs (padding tokens) through."""
    x, w = random_moe(7)
    valid = jnp.arange(T) < 10
    calls = []
    ours, counts = moe_block(jnp.asarray(x), w, top_k=top_k, norm_topk_prob=renorm, valid=valid,
                             pair_kernel=_pair_kernel(calls=calls, fused=True))
    ref, ref_counts = moe_block(jnp.asarray(x), w, top_k=top_k, norm_topk_prob=renorm, valid=valid)
    assert calls == [("top_k", (T, E)), ("swiglu", (T, top_k))]  # the step's routing by the kernel's top-k too
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(ours)[10:], 0.0)
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(ref_counts))


def test_fused_pair_path_with_an_expert_offset_equals_the_grouped_path() -> None:
    """Expert parallelism's partial: the upper half of the experts on this device, the fused form told the
    offset, equals the grouped path's partial of the same half."""
    x, w = random_moe(11)
    half = jax.tree.map(lambda a: a[E // 2:], w)
    half = MoEWeights(router=w.router, w_gate=half.w_gate, w_up=half.w_up, w_down=half.w_down)
    routing = route(jnp.asarray(x), w.router, 2, True)
    valid = jnp.arange(T) < 9
    calls = []
    ours, counts = moe_partial(jnp.asarray(x), half, routing, valid=valid, expert_offset=E // 2,
                               pair_kernel=_pair_kernel(calls=calls, fused=True))
    ref, ref_counts = moe_partial(jnp.asarray(x), half, routing, valid=valid, expert_offset=E // 2)
    assert calls == [("swiglu", (T, 2))]
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(ref_counts))


def test_pair_path_only_for_small_steps_and_operands_it_takes() -> None:
    """Over PAIR_PATH_MAX_PAIRS pairs, or operands the kernel does not take, the grouped path runs."""
    x, w = random_moe(8)
    big = jnp.tile(jnp.asarray(x), (PAIR_PATH_MAX_PAIRS // T + 1, 1))  # T * k > the limit at k = 2
    calls = []
    moe_block(big, w, top_k=2, norm_topk_prob=True, pair_kernel=_pair_kernel(calls=calls))
    moe_block(jnp.asarray(x), w, top_k=2, norm_topk_prob=True,
              pair_kernel=_pair_kernel(takes=lambda lhs, rhs: False, calls=calls))
    assert calls == []


def test_pair_path_with_the_gpu_kernel_in_interpret_mode() -> None:
    """The engine's GPU pair kernel (Mosaic GPU interpreter on CPU) at a bf16 decode step: 16 token rows of
    which 3 are real, top-4 of 8 experts, D and F on the kernel's 64 grid; the three-launch form and the fused
    SwiGLU kernel as the runner builds them on a GPU (routing kernel fed the router's split product), and that with
    the routing kernel on whole logits."""
    _check_gpu_pair_kernel(interpret=True, d=128, f=64, e=8, t=16, top_k=4)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [2, 16])
def test_pair_path_with_the_gpu_kernels(t: int) -> None:
    """The same on a GPU at Qwen3-30B-A3B's expert shapes (D 2048, F 768, top-8 of 128): the batch-1 bucket (2 rows)
    and the 16-row one, with the routing kernel summing the router's 32 partial products."""
    _check_gpu_pair_kernel(interpret=False, d=2048, f=768, e=128, t=t, top_k=8)


def _check_gpu_pair_kernel(interpret: bool, d: int, f: int, e: int, t: int, top_k: int) -> None:
    from jaxinfer.engine.runner import gpu_pair_kernel
    from pallas_kernels.moe_routing import top_k_routing

    r = np.random.default_rng(9)
    n = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)  # noqa: E731
    w = MoEWeights(router=n(d, e) * 3 / np.sqrt(d), w_gate=n(e, d, f) / np.sqrt(d), w_up=n(e, d, f) / np.sqrt(d),
                   w_down=n(e, f, d) / np.sqrt(f))
    w = jax.tree.map(lambda a: a.astype(jnp.bfloat16), w)
    x = n(t, d).astype(jnp.bfloat16)
    real = min(t - 1, 3)
    valid = jnp.arange(t) < real
    ref, _ = moe_block(x, w, top_k=top_k, norm_topk_prob=True, valid=valid)
    ref = np.asarray(ref, np.float32)
    fused = gpu_pair_kernel(interpret=interpret)  # as the runner builds it on a GPU
    assert fused.select_top_k is not None and fused.router_splits > 1
    assert fused.swiglu_weighted  # the kernel weights the pairs and zeros the skipped ones; the combine only sums
    three = dataclasses.replace(fused, swiglu=None)
    masked = dataclasses.replace(fused, swiglu_weighted=False)  # unweighted parts, masked and weighted by the combine
    whole = dataclasses.replace(fused, router_splits=1,
                                select_top_k=lambda *a: top_k_routing(*a, impl="pallas_gpu", interpret=interpret))
    for kernel in (three, fused, masked, whole):
        ours, _ = moe_block(x, w, top_k=top_k, norm_topk_prob=True, valid=valid, pair_kernel=kernel)
        ours = np.asarray(ours, np.float32)
        assert np.isfinite(ours).all() and not ours[real:].any()
        assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) < 1e-2
    # Handed the layer's residual, the block returns residual + output; the fused kernel adds its rows into it.
    residual = (n(t, d) * 0.5).astype(jnp.bfloat16)
    want = residual.astype(jnp.float32) + ref
    assert moe.accumulates(fused, x, w, t * top_k) and not moe.accumulates(masked, x, w, t * top_k)
    for kernel in (fused, dataclasses.replace(fused, swiglu_accumulates=False), None):
        ours, _ = moe_block(x, w, top_k=top_k, norm_topk_prob=True, valid=valid, pair_kernel=kernel,
                            residual=residual)
        assert ours.dtype == residual.dtype
        ours = np.asarray(ours, np.float32)
        np.testing.assert_array_equal(ours[real:], np.asarray(residual, np.float32)[real:])  # padding: nothing added
        assert np.linalg.norm(ours - want) / np.linalg.norm(want) < 1e-2
