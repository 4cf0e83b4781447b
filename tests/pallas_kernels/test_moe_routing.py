"""The MoE routing kernel (Pallas Triton; interpret mode on CPU) against its jnp reference, and the reference
against a float64 oracle of HF's order of operations (softmax over all experts, top-k, renormalize)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe_routing import reference, router_splits, split_router_logits, takes, top_k_routing


def _oracle(logits: np.ndarray, top_k: int, renorm: bool) -> tuple[np.ndarray, np.ndarray]:
    z = logits.astype(np.float64)
    probs = np.exp(z - z.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    experts = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]  # ties: the lower id first
    weights = np.take_along_axis(probs, experts, 1)
    if renorm:
        weights /= weights.sum(1, keepdims=True)
    return weights, experts


@pytest.mark.parametrize("renorm", [True, False])
def test_reference_matches_softmax_top_k_renormalize(rng, renorm):
    logits = rng.standard_normal((6, 16)).astype(np.float32) * 3
    weights, experts = reference(jnp.asarray(logits), 4, renorm)
    want_w, want_e = _oracle(logits, 4, renorm)
    np.testing.assert_array_equal(np.asarray(experts), want_e)
    np.testing.assert_allclose(np.asarray(weights), want_w, rtol=1e-5)


@pytest.mark.parametrize("tokens, experts, top_k", [(2, 128, 8), (16, 128, 8), (4, 8, 2), (8, 64, 1)])
@pytest.mark.parametrize("renorm", [True, False])
def test_kernel_in_interpret_mode_matches_reference(rng, tokens, experts, top_k, renorm):
    """Fresh random logits with ties planted (equal values must go to the lower id, as jax.lax.top_k)."""
    logits = rng.standard_normal((tokens, experts)).astype(np.float32)
    logits[:, experts // 2] = logits[:, 1]  # a tie in every row, often inside the top-k
    logits[0, :] = 0.5  # a row of all ties
    logits = jnp.asarray(logits)
    weights, ids = top_k_routing(logits, top_k, renorm, impl="pallas_gpu", interpret=True)
    want_w, want_e = reference(logits, top_k, renorm)
    assert weights.shape == (tokens, top_k) and weights.dtype == jnp.float32 and ids.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_e))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want_w), rtol=1e-6, atol=1e-7)


def test_takes_powers_of_two_within_one_program():
    assert takes(2, 128, 8) and takes(16, 128, 8) and takes(64, 8, 2)
    assert not takes(3, 128, 8) and not takes(2, 60, 8) and not takes(2, 128, 6) and not takes(256, 128, 8)
    assert not takes(2, 4, 8)  # k > E
    with pytest.raises(ValueError, match="power-of-two T, E and k"):
        top_k_routing(jnp.zeros((3, 128)), 8, True, impl="pallas_gpu", interpret=True)
    with pytest.raises(ValueError, match="impl must be"):
        top_k_routing(jnp.zeros((2, 128)), 8, True, impl="triton")


def test_auto_agrees_with_the_reference(rng):
    """auto: the reference off a GPU, the kernel on one (shapes it takes) or the reference (shapes it does not)."""
    logits = jnp.asarray(rng.standard_normal((2, 128)), jnp.float32)
    for got, want in zip(top_k_routing(logits, 8, True), reference(logits, 8, True)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
    odd = jnp.asarray(rng.standard_normal((3, 96)), jnp.float32)
    for got, want in zip(top_k_routing(odd, 6, False), reference(odd, 6, False)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, experts, top_k", [(2, 128, 8), (16, 128, 8), (8, 8, 2)])
@pytest.mark.parametrize("renorm", [True, False])
def test_gpu_kernel_matches_reference(rng, tokens, experts, top_k, renorm):
    logits = rng.standard_normal((tokens, experts)).astype(np.float32)
    logits[:, experts // 2] = logits[:, 1]
    logits = jnp.asarray(logits)
    weights, ids = top_k_routing(logits, top_k, renorm, impl="pallas_gpu")
    want_w, want_e = reference(logits, top_k, renorm)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_e))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want_w), rtol=1e-5, atol=1e-7)


def _partials(rng, splits: int, tokens: int, experts: int):
    """[P, T, E] random partial logits whose sum has a planted tie (equal sums must go to the lower id)."""
    parts = rng.standard_normal((splits, tokens, experts)).astype(np.float32)
    parts[:, :, experts // 2] = parts[:, :, 1]  # equal partials, so the sums tie exactly in any order
    return jnp.asarray(parts)


@pytest.mark.parametrize("splits", [1, 4, 32])
def test_kernel_sums_partial_logits_in_interpret_mode(rng, splits):
    """[P, T, E] partial products (the split router product) give the routing of their sum."""
    parts = _partials(rng, splits, 2, 128)
    weights, ids = top_k_routing(parts, 8, True, impl="pallas_gpu", interpret=True)
    want_w, want_e = reference(parts.sum(axis=0), 8, True)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_e))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want_w), rtol=1e-5, atol=1e-7)


def test_split_router_logits_sum_to_the_router_product(rng):
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
    router = jnp.asarray(rng.standard_normal((256, 16)), jnp.bfloat16)
    assert router_splits(256) == 4 and router_splits(2048) == 32 and router_splits(64) == 1 and router_splits(192) == 2
    parts = split_router_logits(x, router, 4)  # [4, 3, 16]
    whole = jnp.einsum("td,de->te", x, router, preferred_element_type=jnp.float32)
    assert parts.shape == (4, 3, 16)
    np.testing.assert_allclose(np.asarray(parts.sum(axis=0)), np.asarray(whole), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("splits, tokens", [(32, 2), (32, 16), (2, 8)])
def test_gpu_kernel_sums_partial_logits(rng, splits, tokens):
    parts = _partials(rng, splits, tokens, 128)
    weights, ids = top_k_routing(parts, 8, True, impl="pallas_gpu")
    want_w, want_e = reference(parts.sum(axis=0), 8, True)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_e))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want_w), rtol=1e-5, atol=1e-7)
