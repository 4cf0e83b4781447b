"""The MoE block over a mesh: experts split over `expert`, each expert's FFN over `tensor`, in shard_map.

Why shard_map: the expert computation is a grouped matmul whose groups come from routing decided on device,
and (like every Pallas kernel) it is opaque to XLA's partitioner, which would gather every expert's weights
onto every device. Inside the shard_map each device runs the grouped matmul over its own experts only.

Dispatch and combine, and why not all-to-all: after the attention block's all-reduce every device already
holds all T tokens of the step (attention is tensor-parallel over the same devices, jaxinfer.sharding).
So each device routes all tokens (the router is small and replicated, and routing is deterministic, so
every device computes the same top-k), picks the (token, expert) pairs of its local experts, runs them,
and the combine is one float32 all-reduce of [T, D] over the model axes: it sums the experts of different
devices and, with an FFN split over `tensor`, the partial down-projections. That is the same single
collective a tensor-parallel dense MLP pays. An all-to-all dispatch pays off when tokens are split across
devices (data-parallel attention), which this engine does not do: there it would add two collectives.

Per-expert token counts (load-balance statistics) are computed from the global routing on every device and
returned replicated.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import Mesh, PartitionSpec as P

from jaxinfer.models.moe import (GroupedMatmul, MoEFn, MoEWeights, PairKernel, expert_token_counts, moe_block,
                                 moe_partial, step_routing)
from jaxinfer.sharding import Logical, ShardingRules, axis_size, flat_axes, model_axes
from pallas_kernels.grouped_matmul import QuantizedExperts

EXPERT = "expert"


def _expert_spec(rules: ShardingRules, w: object, k_axis: Logical, n_axis: Logical) -> object:
    """The PartitionSpec(s) of one expert weight: [E, K, N] float, or quantized values [E, N, K] and
    per-channel scales [E, N] (jaxinfer.quantization), split like the float weight."""
    if isinstance(w, QuantizedExperts):
        return QuantizedExperts(values=rules.spec((Logical.EXPERTS, n_axis, k_axis)),
                                scales=rules.spec((Logical.EXPERTS, n_axis)))
    return rules.spec((Logical.EXPERTS, k_axis, n_axis))


def _weight_specs(rules: ShardingRules, w: MoEWeights) -> MoEWeights:
    ffn, embed = Logical.EXPERT_FFN, Logical.EMBED
    return MoEWeights(router=P(), w_gate=_expert_spec(rules, w.w_gate, embed, ffn),
                      w_up=_expert_spec(rules, w.w_up, embed, ffn), w_down=_expert_spec(rules, w.w_down, ffn, embed))


def make_moe_fn(mesh: Mesh | None, rules: ShardingRules, expert_matmul: GroupedMatmul = jax.lax.ragged_dot,
                pair_kernel: PairKernel | None = None) -> MoEFn:
    """The MoE block the model calls (same signature as jaxinfer.models.moe.moe_block) for this mesh."""
    reduce_axes = flat_axes(model_axes(mesh.shape)) if mesh is not None else ()
    if not reduce_axes:
        return functools.partial(moe_block, expert_matmul=expert_matmul, pair_kernel=pair_kernel)
    ep = axis_size(mesh, EXPERT)

    def per_device(x: jax.Array, w: MoEWeights, valid: jax.Array | None, *, top_k: int,
                   norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
        routing = step_routing(x, w.router, top_k, norm_topk_prob, pair_kernel)  # the same on every device
        offset = jax.lax.axis_index(EXPERT) * w.w_gate.shape[0] if ep > 1 else 0
        partial, _ = moe_partial(x, w, routing, valid=valid, expert_offset=offset, expert_matmul=expert_matmul,
                                 pair_kernel=pair_kernel)
        out = jax.lax.psum(partial, reduce_axes)  # [T, D] f32: other devices' experts, other FFN slices
        return out.astype(x.dtype), expert_token_counts(routing.experts, w.router.shape[1], valid)

    def moe_fn(x: jax.Array, w: MoEWeights, *, top_k: int, norm_topk_prob: bool,
               valid: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        fn = jax.shard_map(
            functools.partial(per_device, top_k=top_k, norm_topk_prob=norm_topk_prob), mesh=mesh,
            in_specs=(P(), _weight_specs(rules, w), P()), out_specs=(P(), P()), check_vma=False)
        return fn(x, w, valid)

    return moe_fn
