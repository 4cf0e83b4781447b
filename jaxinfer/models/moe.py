"""Dropless mixture-of-experts feed-forward (the reference path), shared by Qwen3-MoE and Mixtral.

One MoE layer, for the T tokens of a step (letters: docs/ARCHITECTURE.md; k = experts per token):

1. route: router logits in float32 (bf16 logits flip near-equal experts), softmax over all E experts, top-k,
   optionally renormalized so the k weights sum to 1 (`norm_topk_prob`; Mixtral always does; computed as the
   top-k logits and a softmax over those, which is the same thing);
2. dispatch: the T*k (token, expert) pairs sorted by expert, so each expert's rows are consecutive, and the
   token rows gathered in that order [T*k, D];
3. experts: SwiGLU as three grouped matmuls over those rows, `expert_matmul(lhs [M, D], rhs [E, D, F],
   group_sizes [E]) -> [M, F]`, `jax.lax.ragged_dot` by default;
4. combine: rows put back in (token, slot) order and summed with the routing weights.

Steps of at most PAIR_PATH_MAX_PAIRS pairs (decode) skip 2 and the un-permute of 4 when a `PairKernel` is
given (the GPU's `gather_matmul`): each pair reads its token's row and its expert's weights in place, so the
step runs the three expert matmuls and a few elementwise ops instead of a sort, scatters and gathers. Where
the kernel has a fused form (`PairKernel.swiglu`, the GPU's `swiglu_experts` for 16-bit weights), the three
matmuls and the SwiGLU between them are one launch that reads the routing itself and returns partial sums,
and the combine adds them up.

Dropless: every pair is computed, no capacity factor, so results never depend on what else is in the
batch. Shapes are static (T*k rows whatever the routing); only the group sizes vary, so nothing recompiles.
Padding tokens (past the step's real tokens) are sent to no expert: they sort last, past every group, and a
grouped-matmul kernel can skip those rows. Their output rows are zeroed, so a kernel may leave them
unwritten (ragged_dot writes zeros there; a kernel's garbage must never reach the trash KV page).

Injection points: `moe_block(..., expert_matmul=..., pair_kernel=...)` swaps the grouped matmul (and the
per-pair one), and the families' `forward(..., moe_fn=...)` swaps the whole block (same signature as
`moe_block`, e.g. a `shard_map` over the `expert` mesh axis). The block also returns the per-expert token
counts of the real tokens (`expert_token_counts`), which are its group sizes, for load-balance statistics.

The router's expert axis is not the EXPERTS logical axis: every device needs all E logits to pick the
top-k, and the router is small (D x E), so it stays replicated while the experts themselves shard.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.models.common import AttentionMetadata, rms_norm
from jaxinfer.params import ParamSpec
from jaxinfer.sharding import Logical as L
from pallas_kernels import moe_routing
from pallas_kernels.moe_routing import norm_router

# (lhs [M, D], rhs [E, D, F], group_sizes [E] int32) -> [M, F]: rows of expert e are consecutive, experts in
# order; rows past sum(group_sizes) are padding.
GroupedMatmul = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class PairKernel:
    """The per-pair expert matmul of decode steps (pallas_kernels.grouped_matmul.gather_matmul on a GPU)."""

    # (lhs [R, D], rhs [E, D, F], rows [P] int32, experts [P] int32) -> [P, F]: out[p] = lhs[rows[p]] @
    # rhs[experts[p]], zeros where experts[p] is outside [0, E).
    matmul: Callable[[jax.Array, Any, jax.Array, jax.Array], jax.Array]
    # (lhs, rhs) -> whether the kernel takes such operands (dtype, tile multiples); if not, the grouped path runs.
    takes: Callable[[jax.Array, Any], bool]
    # The fused form, or None: (x [T, D], w_gate, w_up, w_down, experts [T, k] global ids, valid [T] | None,
    # expert_offset) -> [S, k, T, D] float32 partial sums of each token's k whole SwiGLU experts (rows of invalid
    # tokens and of experts held elsewhere unwritten), taken where swiglu_takes(x, w_gate, w_up, w_down);
    # otherwise `matmul` runs three times.
    swiglu: Callable[..., jax.Array] | None = None
    swiglu_takes: Callable[..., bool] = lambda *operands: False
    # Whether `swiglu` also takes weights=[T, k] routing weights, then scales each pair's rows by them and writes
    # zeros for the pairs it skips: the combine is a plain sum of the parts, without masks or weights of its own.
    swiglu_weighted: bool = False
    # Whether a weighted `swiglu` also takes residual=[T, D] float32 and returns residual + the MoE output [T, D]
    # float32, adding each pair's rows into the residual's buffer itself: no parts, no combine kernel.
    swiglu_accumulates: bool = False
    # The routing of such steps, or None (the reference): (logits [T, E] f32, or [P, T, E] partial sums when
    # router_splits P > 1, top_k, renorm) -> (weights [T, k], experts [T, k]); e.g.
    # pallas_kernels.moe_routing.top_k_routing, one kernel where XLA runs a sort and two more.
    select_top_k: Callable[..., tuple[jax.Array, jax.Array]] | None = None
    # How many partial products over D's slices the router's logits reach select_top_k in (1: whole logits); the
    # routing kernel then also does the partials' sum, which XLA's split-K router product ran as a kernel of its own.
    router_splits: int = 1


# Steps of at most this many (token, slot) pairs take the per-pair path when a PairKernel takes them: a decode
# bucket of 16 tokens at top-8. With a few live tokens the sort, work-item table and un-permute of the grouped
# path cost more than the experts (scripts/profile_moe_block.py).
PAIR_PATH_MAX_PAIRS = 128


@struct.dataclass
class MoEWeights:
    router: jax.Array  # [D, E]
    w_gate: jax.Array  # [E, D, F]
    w_up: jax.Array  # [E, D, F]
    w_down: jax.Array  # [E, F, D]


def moe_specs(hidden: int, expert_ffn: int, num_experts: int, dtype: jnp.dtype) -> MoEWeights:
    d, f, e = hidden, expert_ffn, num_experts
    return MoEWeights(
        router=ParamSpec((d, e), dtype, (L.EMBED, None)),
        w_gate=ParamSpec((e, d, f), dtype, (L.EXPERTS, L.EMBED, L.EXPERT_FFN), fan_in_axes=(1,)),
        w_up=ParamSpec((e, d, f), dtype, (L.EXPERTS, L.EMBED, L.EXPERT_FFN), fan_in_axes=(1,)),
        w_down=ParamSpec((e, f, d), dtype, (L.EXPERTS, L.EXPERT_FFN, L.EMBED), fan_in_axes=(1,)),
    )


@struct.dataclass
class Routing:
    weights: jax.Array  # [T, k] float32, the weight of each chosen expert
    experts: jax.Array  # [T, k] int32, best first


def route(x: jax.Array, router: jax.Array, top_k: int, norm_topk_prob: bool,
          select_top_k: Callable[..., tuple[jax.Array, jax.Array]] | None = None, splits: int = 1,
          logits: jax.Array | None = None) -> Routing:
    """Softmax over all experts in float32, the top-k of it, renormalized to sum 1 when asked (computed as in
    pallas_kernels.moe_routing.reference, or by `select_top_k` on the logits, e.g. its kernel, which takes them as
    `splits` partial products when splits > 1). `logits` [T, E] float32, or [P, T, E] partial products: x @ router
    computed already (the norm_router kernel's), used as they are."""
    # Products of 16-bit values are exact in float32, so 16-bit operands summed in float32 give the float32
    # logits without a float32 copy of x and the router (a 4k-token prefill read twice the bytes that way).
    if logits is None and splits > 1 and select_top_k is not None:
        logits = moe_routing.split_router_logits(x, router.astype(x.dtype), splits)  # [P, T, E]
    elif logits is None:
        logits = jnp.einsum("td,de->te", x, router.astype(x.dtype), preferred_element_type=jnp.float32)  # [T, E]
    weights, experts = (select_top_k or moe_routing.reference)(logits, top_k, norm_topk_prob)  # [T, k] each
    return Routing(weights=weights, experts=experts.astype(jnp.int32))


def step_routing(x: jax.Array, router: jax.Array, top_k: int, norm_topk_prob: bool,
                 pair_kernel: PairKernel | None, logits: jax.Array | None = None) -> Routing:
    """`route` for a step of x's tokens: with the pair kernel's own top-k where the step takes the per-pair path
    (a decode step), so routing and experts come from the same set of kernels. `logits`: the router's product
    computed already ([T, E] float32 or [P, T, E] partials), or None."""
    small = x.shape[0] * top_k <= PAIR_PATH_MAX_PAIRS
    if pair_kernel is None or not small or pair_kernel.select_top_k is None:
        return route(x, router, top_k, norm_topk_prob, logits=logits)
    splits = 1 if logits is not None else moe_routing.router_splits(x.shape[1], pair_kernel.router_splits)
    return route(x, router, top_k, norm_topk_prob, pair_kernel.select_top_k, splits, logits)


def expert_token_counts(experts: jax.Array, num_experts: int, valid: jax.Array | None = None) -> jax.Array:
    """How many (token, slot) pairs each expert receives: experts [T, k], valid [T] bool -> [E] int32.

    Padding tokens (valid False) count for no expert. Summed over a step these are the load-balance
    statistics, and they are exactly the grouped matmul's group sizes.
    """
    ids = _pair_experts(experts, num_experts, valid)  # [T*k]
    return jnp.zeros((num_experts,), jnp.int32).at[ids].add(1, mode="drop")  # the sentinel E is dropped


def _pair_experts(experts: jax.Array, num_experts: int, valid: jax.Array | None) -> jax.Array:
    """Flat expert id of each pair [T*k]; padding tokens get the sentinel E (past every real expert)."""
    if valid is not None:
        experts = jnp.where(valid[:, None], experts, num_experts)
    return experts.reshape(-1)


def valid_tokens(md: AttentionMetadata, num_tokens: int) -> jax.Array:
    """[T] bool: the step's real tokens; the rest is bucket padding (cu_q_lens[-1] counts the real ones)."""
    return jnp.arange(num_tokens) < md.cu_q_lens[-1]


def swiglu_experts(xs: jax.Array, w: MoEWeights, group_sizes: jax.Array, expert_matmul: GroupedMatmul) -> jax.Array:
    """Each row through its own expert's SwiGLU: xs [M, D] sorted by expert -> [M, D]."""
    gate = expert_matmul(xs, w.w_gate, group_sizes)  # [M, F]
    up = expert_matmul(xs, w.w_up, group_sizes)  # [M, F]
    return expert_matmul(jax.nn.silu(gate) * up, w.w_down, group_sizes)  # [M, D]


def moe_partial(
    x: jax.Array, w: MoEWeights, routing: Routing, *, valid: jax.Array | None = None,
    expert_offset: jax.Array | int = 0, expert_matmul: GroupedMatmul = jax.lax.ragged_dot,
    pair_kernel: PairKernel | None = None, residual: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The contribution of the experts held in `w` (global ids expert_offset .. + E_local - 1) to every token:
    x [T, D] -> (float32 [T, D], the local group sizes [E_local] int32). Pairs routed to other experts, and
    padding tokens, sort past every local group and add nothing. With all experts local (offset 0) this is the
    whole MoE output and the group sizes are `expert_token_counts`; an expert-parallel caller sums the partials
    of all devices. `residual` [T, D] float32, only where `accumulates`: returned as residual + the contribution,
    the fused kernel adding its rows into it."""
    t, d = x.shape
    top_k = routing.experts.shape[1]
    e_local = w.w_gate.shape[0]
    if residual is not None and not accumulates(pair_kernel, x, w, t * top_k):
        raise ValueError("moe_partial takes a residual only where the fused kernel accumulates (`accumulates`)")
    local = routing.experts - expert_offset  # [T, k] local expert ids; outside [0, E_local) elsewhere
    mine = (local >= 0) & (local < e_local)  # [T, k]
    if valid is not None:
        mine &= valid[:, None]
    ids = jnp.where(mine, local, e_local).reshape(-1)  # [T*k], sentinel E_local past every group
    group_sizes = jnp.zeros((e_local,), jnp.int32).at[ids].add(1, mode="drop")  # [E_local]
    weights = jnp.where(mine, routing.weights, 0.0)  # [T, k]
    if _pair_path(pair_kernel, x, w, t * top_k):
        if pair_kernel.swiglu is not None and pair_kernel.swiglu_takes(x, w.w_gate, w.w_up, w.w_down):
            # The kernel reads the routing as it is and skips other pairs itself: no per-layer mask kernel.
            swiglu = functools.partial(pair_kernel.swiglu, x, w.w_gate, w.w_up, w.w_down, routing.experts, valid,
                                       expert_offset)
            if residual is not None:  # accumulates: the kernel adds the weighted rows of its pairs into residual
                return swiglu(weights=routing.weights, residual=residual), group_sizes  # [T, D] f32
            if pair_kernel.swiglu_weighted:
                parts = swiglu(weights=routing.weights)  # [S, k, T, D], weighted, zeros where not `mine`
                return jnp.sum(parts.reshape(-1, t, d), axis=0), group_sizes  # [S*k, T, D] -> [T, D]
            return _combine_parts(swiglu(), mine, weights), group_sizes  # parts [S, k, T, D]
        pair_experts = jnp.where(mine, local, -1).reshape(-1)  # [T*k]
        ys = swiglu_pairs(x, w, pair_experts, pair_kernel.matmul)  # [T*k, D], pair order
        return _combine(ys.reshape(t, top_k, d).swapaxes(0, 1), mine, weights), group_sizes  # [k, T, D] by slot
    order = jnp.argsort(ids, stable=True)  # [T*k] pair index of each sorted row; foreign pairs last
    xs = jnp.take(x, order // top_k, axis=0)  # [T*k, D], pair p belongs to token p // k
    ys = swiglu_experts(xs, w, group_sizes, expert_matmul)  # [T*k, D] in sorted order
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(t * top_k, dtype=order.dtype))  # [T*k]
    inverse = inverse.reshape(t, top_k)  # [T, k]: the sorted row of each (token, slot) pair
    slot_rows = [jnp.take(ys, inverse[:, slot], axis=0) for slot in range(top_k)]  # k x [T, D]
    return _combine(slot_rows, mine, weights), group_sizes


def _pair_path(kernel: PairKernel | None, x: jax.Array, w: MoEWeights, pairs: int) -> bool:
    """Whether this step's `pairs` (token, slot) pairs run the per-pair path (decided at trace time)."""
    return (kernel is not None and pairs <= PAIR_PATH_MAX_PAIRS
            and kernel.takes(x, w.w_gate) and kernel.takes(x, w.w_down))


def accumulates(kernel: PairKernel | None, x: jax.Array, w: MoEWeights, pairs: int) -> bool:
    """Whether this step's experts run the fused kernel that adds its rows into a residual (swiglu_accumulates)."""
    return (_pair_path(kernel, x, w, pairs) and kernel.swiglu is not None and kernel.swiglu_weighted
            and kernel.swiglu_accumulates and kernel.swiglu_takes(x, w.w_gate, w.w_up, w.w_down))


def swiglu_pairs(x: jax.Array, w: MoEWeights, experts: jax.Array, pair_matmul) -> jax.Array:
    """Each (token, slot) pair through its expert's SwiGLU, in pair order: x [T, D], experts [T*k] (-1: skip)
    -> [T*k, D]. Pair p is token p // k."""
    pairs = experts.shape[0]
    token_rows = jnp.arange(pairs, dtype=jnp.int32) // (pairs // x.shape[0])  # [T*k]
    gate = pair_matmul(x, w.w_gate, token_rows, experts)  # [T*k, F]
    up = pair_matmul(x, w.w_up, token_rows, experts)  # [T*k, F]
    return pair_matmul(jax.nn.silu(gate) * up, w.w_down, jnp.arange(pairs, dtype=jnp.int32), experts)  # [T*k, D]


def _combine(slot_rows, mine: jax.Array, weights: jax.Array) -> jax.Array:
    """sum_k weights[t, k] * row of slot k, over the pairs that are `mine`: float32 [T, D].

    `slot_rows` is indexable by slot, each [T, D]. XLA makes the gathers, masks and products of the sum over the
    k slots one elementwise fusion that reads each row once (38 us of a 4k-token prefill layer on an H200, about
    the time to read the rows; scripts/profile_moe_block.py)."""
    out = None
    for slot in range(mine.shape[1]):
        row = slot_rows[slot].astype(jnp.float32) * weights[:, slot, None]  # [T, D]
        # `where`, not the zero weight alone: rows a kernel may have left unwritten can hold NaN.
        row = jnp.where(mine[:, slot, None], row, 0.0)
        out = row if out is None else out + row
    return out


def _combine_parts(parts: jax.Array, mine: jax.Array, weights: jax.Array) -> jax.Array:
    """parts [S, k, T, D] float32 partial sums of each (slot, token) pair's expert output -> the sum over the S
    partials and the k slots, weighted, over the pairs that are `mine` ([T, k]): float32 [T, D]. The summed
    axes lead, so the reduction needs no transpose (with pairs token-major XLA transposed first, a kernel more);
    `where`, not the zero weight alone, because rows of other pairs are unwritten.

    XLA still forms the masked, weighted terms in a fusion of their own before the reduction (and, with the routing
    kernel, transposes the [T, k] weights and masks in a third). Written as one elementwise sum of the S * k slices,
    or as a reduction over S and then the k slots, it became one kernel, but one whose 4,096 threads each add 96
    values: 4.5-5.0 us a layer on an H200 against 4.5 us for the three (scripts/moe_b1_variants.py,
    docs/benchmarks/moe_b1_fusion_h200_2026-11-28.json), so this form stays."""
    s, k, t, d = parts.shape
    terms = jnp.where(mine.T[None, :, :, None], parts * weights.T[None, :, :, None], 0.0)  # [S, k, T, D]
    return jnp.sum(terms.reshape(s * k, t, d), axis=0)  # [T, D]


def moe_block(
    x: jax.Array,
    w: MoEWeights,
    *,
    top_k: int,
    norm_topk_prob: bool,
    valid: jax.Array | None = None,
    expert_matmul: GroupedMatmul = jax.lax.ragged_dot,
    pair_kernel: PairKernel | None = None,
    logits: jax.Array | None = None,
    residual: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """x [T, D] -> (MoE output [T, D] in x's dtype, per-expert token counts [E] int32). `logits` ([T, E] float32 or
    [P, T, E] partials): the router's product of x computed already (normed_router_input), or None. `residual`
    [T, D]: the layer's residual stream, then returned as residual + the MoE output, in residual's dtype; where the
    fused GPU kernel accumulates (`accumulates`), it adds the experts' rows into a float32 copy of the residual, so
    the layer's combine kernel goes (and the sum rounds once, where the unfused path rounds the output first)."""
    routing = step_routing(x, w.router, top_k, norm_topk_prob, pair_kernel, logits)
    partial = functools.partial(moe_partial, x, w, routing, valid=valid, expert_matmul=expert_matmul,
                                pair_kernel=pair_kernel)
    if residual is not None and accumulates(pair_kernel, x, w, x.shape[0] * top_k):
        out, counts = partial(residual=residual.astype(jnp.float32))  # [T, D] f32: residual + experts
        return out.astype(residual.dtype), counts
    out, counts = partial()  # [T, D] f32, [E]
    out = out.astype(x.dtype)
    return (out if residual is None else residual + out), counts


# (x [T, D], weights, *, top_k, norm_topk_prob, valid [T] bool) -> (out [T, D], counts [E]); `moe_block` is one.
MoEFn = Callable[..., tuple[jax.Array, jax.Array]]


def takes_logits(moe_fn: MoEFn) -> bool:
    """Whether `moe_fn` takes `logits=` (the router's product computed already) and `residual=`: `moe_block` itself or
    a partial of it (one device's whole block, as expert_parallel.make_moe_fn makes without a mesh); a sharded block
    does not."""
    func = moe_fn.func if isinstance(moe_fn, functools.partial) else moe_fn
    return func is moe_block


# Decode-sized steps on a GPU run the MLP RMSNorm and the router's product as one kernel
# (pallas_kernels.moe_routing.norm_router says why). "interpret": that kernel interpreted, on any backend (tests);
# None: never (XLA's path).
NORM_ROUTER: str | None = "gpu"


def normed_router_input(x: jax.Array, norm_weight: jax.Array, w: MoEWeights, eps: float,
                        moe_fn: MoEFn) -> tuple[jax.Array, jax.Array | None]:
    """A MoE layer's input: (RMSNorm(x) [T, D] in the norm weight's dtype, the router's logits of it as [P, T, E]
    float32 partials, or None).
    Both come from the norm_router kernel where it serves: NORM_ROUTER's backend, a `moe_fn` that takes the logits
    (one device's whole MoE block), a float router and the kernel's shapes; otherwise the norm alone, and the block
    computes the logits."""
    mode = NORM_ROUTER
    dtype = norm_weight.dtype  # the activations' (x may be a float32 residual stream)
    if mode is None or (mode == "gpu" and jax.default_backend() != "gpu") or not takes_logits(moe_fn):
        return rms_norm(x, norm_weight, eps).astype(dtype), None
    router = w.router.astype(dtype)
    if not norm_router.takes(x, norm_weight, router, norm_router.ROWS_PER_PROGRAM):
        return rms_norm(x, norm_weight, eps).astype(dtype), None
    return norm_router.norm_router(x, norm_weight, router, eps=eps, rows_per_program=norm_router.ROWS_PER_PROGRAM,
                                   num_warps=norm_router.NUM_WARPS, interpret=mode == "interpret")
