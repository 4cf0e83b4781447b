"""MoE routing on the router's logits: the top-k experts of each token and their weights, in one kernel.

    weights [T, k] f32, experts [T, k] i32 = top_k_routing(logits [T, E] f32, top_k, renorm, impl="auto")

`logits` may also come as [P, T, E] partial sums (the router's product split along D), which the kernel adds up
first: XLA computes a small router product split-K anyway (an H200 split Qwen3-30B-A3B's 2048 x 128 router 32
ways) and then sums the partials in a kernel of its own; handed the split product, the routing kernel does that
sum too (`split_router_logits`).

`renorm` (Qwen3-MoE's `norm_topk_prob`, always on for Mixtral): the weights are a softmax over the k chosen
logits (they sum to 1); otherwise they are the chosen experts' probabilities in a softmax over all E. Ties go to
the lower expert id, as `jax.lax.top_k`. `reference` is the jnp form; `pallas_gpu` a Pallas Triton kernel.

Why a kernel: on a GPU XLA runs top-k over 128 experts as a sort (3.4 us for a 2-row decode bucket on an H200),
slices its first k columns in a kernel of their own, and the softmax over those k (a reduction) lands in a
fusion in front of the MoE combine, which then writes its [S, k, T, D] input out once more (it cannot fuse into
the combine's reduction). With the routing in one kernel that writes the final weights, one MoE layer took 39.5
-> 38.5 us of device time at batch 1 and ran a kernel fewer at 16 tokens (one H200,
docs/benchmarks/moe_block_routing_h200.json). The engine's GPU decode steps use it (jaxinfer.engine.runner's
gpu_pair_kernel), fed the router's split product: in the batch-1 decode loop of Qwen3-30B-A3B it takes the place of
three kernels a layer (docs/benchmarks/moe_b1_fusion_h200_2026-11-28.json). JAX 0.11.2 warns that its Pallas
Triton backend is deprecated. The kernel is one program over the whole [T, E] block (k rounds of a row max and the
lowest index that reaches it; the [P, T, E] partials are added one [T, E] slice at a time), so it is meant for
decode steps: `takes` asks for power-of-two T, E and k (Triton block shapes) and T * E up to 16k.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp

Impl = Literal["auto", "reference", "pallas_gpu"]

_MAX_BLOCK = 16 * 1024  # T * E of one program: 16 tokens x 128 experts, a decode step's pair path
NUM_WARPS = 4  # of the one program (read when the kernel is traced)


def split_router_logits(x: jax.Array, router: jax.Array, splits: int) -> jax.Array:
    """x [T, D] @ router [D, E] as `splits` float32 partial products over D's consecutive slices: [P, T, E]."""
    t, d = x.shape
    xs = x.reshape(t, splits, d // splits)  # [T, P, D/P]
    rs = router.reshape(splits, d // splits, router.shape[1])  # [P, D/P, E]
    return jnp.einsum("tpd,pde->pte", xs, rs, preferred_element_type=jnp.float32)  # [P, T, E]


def router_splits(hidden: int, most: int = 32, least_width: int = 64) -> int:
    """How many D slices `split_router_logits` takes: the largest power of two up to `most` that divides D into
    slices of at least `least_width` (a power of two because the kernel's block [P, T, E] is one)."""
    p = 1
    while p * 2 <= most and hidden % (p * 2) == 0 and hidden // (p * 2) >= least_width:
        p *= 2
    return p


def _summed(logits: jax.Array) -> jax.Array:
    """[T, E] float32 logits from [T, E] or [P, T, E] partial sums."""
    logits = logits.astype(jnp.float32)
    return logits.sum(axis=0) if logits.ndim == 3 else logits


def reference(logits: jax.Array, top_k: int, renorm: bool) -> tuple[jax.Array, jax.Array]:
    """The specification: [T, k] weights and expert ids from float32 logits [T, E] (or [P, T, E] partials)."""
    logits = _summed(logits)
    if renorm:
        # The softmax over all E is monotone and its denominator cancels in the renormalization.
        top, experts = jax.lax.top_k(logits, top_k)  # [T, k] each; ties to the lower id
        return jax.nn.softmax(top, axis=-1), experts.astype(jnp.int32)
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)  # [T, k]
    return weights, experts.astype(jnp.int32)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def takes(num_tokens: int, num_experts: int, top_k: int) -> bool:
    """Whether the kernel takes this shape: powers of two (Triton blocks), one program's worth of logits."""
    return (_pow2(num_tokens) and _pow2(num_experts) and _pow2(top_k) and top_k <= num_experts
            and num_tokens * num_experts <= _MAX_BLOCK)


def _kernel(logits_ref, weights_ref, experts_ref, *, top_k: int, renorm: bool):
    # logits_ref [P, T, E] f32 partial sums; weights_ref [T, k] f32; experts_ref [T, k] i32.
    logits = logits_ref[0]
    for p in range(1, logits_ref.shape[0]):  # P is small (<= 32) and static: unrolled loads of [T, E]
        logits = logits + logits_ref[p]
    tokens, num_experts = logits.shape
    col = jnp.broadcast_to(jnp.arange(num_experts, dtype=jnp.int32)[None, :], (tokens, num_experts))  # [T, E]
    slot = jnp.broadcast_to(jnp.arange(top_k, dtype=jnp.int32)[None, :], (tokens, top_k))  # [T, k]
    top = jnp.zeros((tokens, top_k), jnp.float32)
    ids = jnp.zeros((tokens, top_k), jnp.int32)
    rest = logits
    for j in range(top_k):
        best = jnp.max(rest, axis=1)  # [T]
        pick = jnp.min(jnp.where(rest == best[:, None], col, num_experts), axis=1)  # [T]: lowest id of the max
        top = jnp.where(slot == j, best[:, None], top)
        ids = jnp.where(slot == j, pick[:, None], ids)
        rest = jnp.where(col == pick[:, None], -jnp.inf, rest)
    high = jnp.max(top, axis=1)[:, None]  # [T, 1]: the largest logit, slot 0's
    scaled = jnp.exp(top - high)  # [T, k]
    if renorm:
        total = jnp.sum(scaled, axis=1)[:, None]
    else:
        total = jnp.sum(jnp.exp(logits - high), axis=1)[:, None]  # the full softmax's denominator
    weights_ref[...] = scaled / total
    experts_ref[...] = ids


@functools.partial(jax.jit, static_argnames=("top_k", "renorm", "interpret"))
def _pallas_gpu(logits: jax.Array, top_k: int, renorm: bool, interpret: bool = False):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as plt

    parts = logits.astype(jnp.float32).reshape(-1, *logits.shape[-2:])  # [P, T, E]
    tokens = parts.shape[1]
    out = (jax.ShapeDtypeStruct((tokens, top_k), jnp.float32), jax.ShapeDtypeStruct((tokens, top_k), jnp.int32))
    return pl.pallas_call(
        functools.partial(_kernel, top_k=top_k, renorm=renorm), out_shape=out, interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
    )(parts)


def top_k_routing(logits: jax.Array, top_k: int, renorm: bool, *, impl: Impl = "auto",
                  interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """(weights [T, k] f32, experts [T, k] i32) of logits [T, E] or partial logits [P, T, E] (module docstring).
    impl="auto": the Pallas kernel on a GPU where it `takes` the shape, the reference otherwise."""
    if impl not in ("auto", "reference", "pallas_gpu"):
        raise ValueError(f"impl must be 'auto', 'reference' or 'pallas_gpu', got {impl!r}")
    tokens, num_experts = logits.shape[-2:]
    if logits.ndim == 3 and not _pow2(logits.shape[0]):
        impl = "reference" if impl == "auto" else impl  # the kernel's [P, T, E] block needs a power-of-two P
        if impl == "pallas_gpu":
            raise ValueError(f"the routing kernel sums a power-of-two number of partials, got {logits.shape[0]}")
    if impl == "auto":
        gpu = jax.default_backend() == "gpu" and takes(tokens, num_experts, top_k)
        impl = "pallas_gpu" if gpu else "reference"
    if impl == "reference":
        return reference(logits, top_k, renorm)
    if not takes(tokens, num_experts, top_k):
        raise ValueError(f"the routing kernel takes power-of-two T, E and k with T * E <= {_MAX_BLOCK}, got "
                         f"T={tokens}, E={num_experts}, k={top_k}")
    return _pallas_gpu(logits, top_k, renorm, interpret)


__all__ = ["reference", "router_splits", "split_router_logits", "takes", "top_k_routing"]
