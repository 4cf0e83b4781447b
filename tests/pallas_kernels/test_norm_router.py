"""A decode step's MLP RMSNorm and MoE router product as one kernel (norm_router) against its jnp reference and a
float64 oracle on fresh random inputs: interpreted on any backend, compiled on a GPU; and a tiny Qwen3-MoE model
giving the same logits with the kernel in its MoE layers as with XLA's path (rms_norm, then the block's router)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.models import QWEN3_MOE, moe
from jaxinfer.models.fused import fuse_projections
from model_helpers import DECODE_SHAPE, build_runner, float32_twin, rel_err, run_chunks, tiny_qwen3_moe
from pallas_kernels.moe_routing import norm_router as nr


def random_case(seed: int, tokens: int, d: int, e: int, dtype=jnp.bfloat16):
    r = np.random.default_rng(seed)
    x = jnp.asarray(r.standard_normal((tokens, d)) * 3, dtype)
    weight = jnp.asarray(r.standard_normal(d) + 1, dtype)
    router = jnp.asarray(r.standard_normal((d, e)) / np.sqrt(d), dtype)
    return x, weight, router


def check_case(x, weight, router, interpret: bool, **tuning) -> None:
    """h as the reference rounds it (at most one 16-bit ulp apart where the float32 sums' order tips a rounding),
    and the logits' partials as a float64 product of the kernel's own h."""
    h, logits = nr.norm_router(x, weight, router, eps=1e-6, interpret=interpret, **tuning)
    rows = tuning.get("rows_per_program", nr.ROWS_PER_PROGRAM)
    want_h, want_logits = nr.reference(x, weight, router, 1e-6, rows)
    assert h.dtype == router.dtype and h.shape == x.shape and logits.dtype == jnp.float32
    assert logits.shape == want_logits.shape == (x.shape[1] // rows, *x.shape[:1], router.shape[1])
    got, want = np.asarray(h, np.float64), np.asarray(want_h, np.float64)
    ulp = np.abs(want) * 2.0 ** -7 + 1e-30  # a bf16 ulp is at most |v| * 2^-7
    assert np.all(np.abs(got - want) <= ulp)
    assert np.mean(got == want) > 0.99
    p = logits.shape[0]
    hs = got.reshape(got.shape[0], p, -1).transpose(1, 0, 2)  # [P, T, D/P]
    oracle = hs @ np.asarray(router, np.float64).reshape(p, -1, router.shape[1])  # [P, T, E]
    np.testing.assert_allclose(np.asarray(logits, np.float64), oracle, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens, d, e, rows", [(1, 256, 64, 64), (2, 128, 128, 32), (5, 256, 32, 256),
                                                (16, 64, 16, 16)])
def test_interpreted_kernel_matches_the_reference(tokens: int, d: int, e: int, rows: int) -> None:
    check_case(*random_case(tokens + d + e, tokens, d, e), interpret=True, rows_per_program=rows)


def test_interpreted_kernel_takes_a_float32_residual_stream() -> None:
    """x float32 (qwen3.f32_residual's stream), the router bf16: h comes out bf16, normed from the float32 rows."""
    x, w, r = random_case(3, 2, 256, 64)
    x = x.astype(jnp.float32) + jnp.asarray(np.random.default_rng(3).standard_normal(x.shape) * 1e-3, jnp.float32)
    check_case(x, w, r, interpret=True)


def test_takes_and_refuses_what_it_cannot_run() -> None:
    x, w, r = random_case(0, 2, 256, 64)
    assert nr.takes(x, w, r)
    assert nr.takes(x.astype(jnp.float32), w, r)  # a float32 residual stream into a 16-bit router
    assert not nr.takes(x.astype(jnp.float32), w, r.astype(jnp.float32))  # a 16-bit router only
    assert not nr.takes(x, w, r.astype(jnp.float16))  # 16-bit x of the router's dtype
    x3, w3, r3 = random_case(0, 2, 96, 64)  # D not a power of two
    assert not nr.takes(x3, w3, r3)
    assert not nr.takes(*random_case(0, 2, 256, 96))  # E not a power of two
    assert not nr.takes(*random_case(0, nr.MAX_TOKENS + 1, 256, 64))  # past the decode buckets
    with pytest.raises(ValueError, match="power-of-two D"):
        nr.norm_router(x3, w3, r3, eps=1e-6, interpret=True)


def decode_logits(runner, ids: list[int]) -> np.ndarray:
    """The last logits of each decode-sized chunk of 3 tokens of `ids` (one sequence, pages 1-4)."""
    return run_chunks(runner, ids, 3, [1, 2, 3, 4], DECODE_SHAPE)


def check_model(monkeypatch, mode: str, attention_impl: str = "reference") -> None:
    """A tiny bf16 Qwen3-MoE model (three MoE layers, one dense) with the kernel in its MoE layers (`mode`:
    moe.NORM_ROUTER) and with XLA's path: the same logits within bf16's rounding. Where the kernel's float32 sum of
    squares tips a rounding of h by one ulp (its order is not XLA's), the perturbation spreads through the bf16 model
    to bf16's noise level, so "as close to the float32 run" holds to within half again, not exactly (three seeds on
    the CPU: 0.80-0.85% for the kernel against 0.69-0.91% for XLA's path)."""
    cfg = tiny_qwen3_moe()
    ids = list(np.random.default_rng(4).integers(0, cfg.vocab_size, 12))

    def build(dtype=jnp.bfloat16, weights=None):
        hook = fuse_projections if weights is None else (lambda _: weights)
        return build_runner(cfg, seed=5, family=QWEN3_MOE, weights_hook=hook, dtype=dtype, num_pages=8,
                            attention_impl=attention_impl)

    monkeypatch.setattr(moe, "NORM_ROUTER", None)
    xla = build()
    want = decode_logits(xla, ids)
    exact = decode_logits(float32_twin(build, xla), ids)
    monkeypatch.setattr(moe, "NORM_ROUTER", mode)
    calls = []
    kernel = nr.norm_router
    monkeypatch.setattr(nr, "norm_router", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    got = decode_logits(build(), ids)  # a new runner: its programs trace anew
    assert calls, "the kernel was not called"
    assert rel_err(got, want) < 2e-2
    assert rel_err(got, exact) < 1.5 * rel_err(want, exact)


def test_model_with_the_interpreted_kernel_gives_the_same_logits(monkeypatch) -> None:
    check_model(monkeypatch, "interpret")


def test_model_with_the_kernel_path_and_the_reference_gives_identical_logits(monkeypatch) -> None:
    """The plumbing exactly: the kernel's place taken by its jnp reference (rms_norm, then the router's product),
    the model's logits are bit for bit those of XLA's path (the block uses the logits it is handed as it would its
    own)."""
    cfg = tiny_qwen3_moe()
    ids = list(np.random.default_rng(4).integers(0, cfg.vocab_size, 9))

    def build():
        return build_runner(cfg, seed=5, family=QWEN3_MOE, weights_hook=fuse_projections, dtype=jnp.bfloat16,
                            num_pages=8)

    monkeypatch.setattr(moe, "NORM_ROUTER", None)
    want = decode_logits(build(), ids)
    monkeypatch.setattr(moe, "NORM_ROUTER", "interpret")
    calls = []
    monkeypatch.setattr(nr, "norm_router",
                        lambda x, w, r, *, eps, rows_per_program, **_: calls.append(1) or nr.reference(
                            x, w, r, eps, rows_per_program))
    got = decode_logits(build(), ids)
    assert calls
    np.testing.assert_array_equal(got, want)


def test_the_kernel_stays_out_of_blocks_that_do_not_take_logits(monkeypatch) -> None:
    """A MoE function other than moe_block or a partial of it (an expert-parallel block) gets the norm alone and no
    logits."""
    monkeypatch.setattr(moe, "NORM_ROUTER", "interpret")
    x, w, r = random_case(1, 2, 64, 16)
    weights = moe.MoEWeights(router=r, w_gate=None, w_up=None, w_down=None)
    h, logits = moe.normed_router_input(x, w, weights, 1e-6, lambda *a, **k: None)
    assert logits is None
    np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(nr.reference(x, w, r, 1e-6)[0], np.float32))
    h2, logits2 = moe.normed_router_input(x, w, weights, 1e-6, moe.moe_block)
    assert logits2 is not None and logits2.shape == (1, 2, 16)  # D 64: one partial of 64 rows


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2, 8, 16])
@pytest.mark.parametrize("rows, warps", [(64, 4), (32, 4), (128, 8)])
def test_gpu_kernel_matches_the_reference(tokens: int, rows: int, warps: int) -> None:
    # Qwen3-30B-A3B's MLP norm and router: D 2048, 128 experts.
    check_case(*random_case(tokens + rows, tokens, 2048, 128), interpret=False, rows_per_program=rows,
               num_warps=warps)


@pytest.mark.gpu
def test_model_with_the_gpu_kernel_gives_the_same_logits(monkeypatch) -> None:
    check_model(monkeypatch, "gpu", attention_impl="auto")
