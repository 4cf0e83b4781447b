"""What a workload must move and compute, and the fastest it could run on the measured ceilings.

The limit of a workload is max(bytes read / copy bandwidth, FLOPs / matmul rate), where the bytes are the
weights once per decode step plus every KV byte each generated token attends to, at the largest batch the
KV cache (and max_num_seqs) allows. A mixed-length workload needs at least as many decode steps as its
longest output. Its reciprocal throughput is the ceiling every figure is shown beside.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxinfer.bench.workloads import Workload
from jaxinfer.config import ModelConfig
from jaxinfer.models import family_for_config
from jaxinfer.params import count_params


@dataclasses.dataclass(frozen=True)
class ModelCost:
    body_params: int  # every weight a token's forward multiplies by, except the LM head and the embedding
    head_params: int  # the LM head (the embedding itself when tied): only sampled tokens use it
    weight_bytes_per_step: int  # what a decode step of one sequence reads: body + head (the embedding is a gather)
    kv_bytes_per_token: int  # K and V of one position in every layer
    attn_flops_per_pair: int  # QK^T and PV FLOPs of one query against one context position, all layers
    inactive_expert_bytes: int = 0  # MoE: experts one token does not use (a larger batch reads some of them)
    expert_fraction: float = 0.0  # MoE: experts per token / experts (k / E)

    @classmethod
    def of(cls, cfg: ModelConfig, dtype: jnp.dtype = jnp.bfloat16, kv_dtype: jnp.dtype | None = None) -> ModelCost:
        """A mixture-of-experts model counts only the experts a token uses (top-k of E): those are the
        weights a token's forward multiplies by, and at batch 1 the only expert weights a step reads."""
        specs = family_for_config(cfg).param_specs(cfg, dtype)
        inactive = inactive_expert_params(cfg)
        total = count_params(specs) - inactive
        head = cfg.vocab_size * cfg.hidden_size
        body = total - head - (0 if cfg.tie_word_embeddings else head)  # the embedding is not a matmul
        item = jnp.dtype(dtype).itemsize
        kv_item = jnp.dtype(kv_dtype or dtype).itemsize
        return cls(
            body_params=body,
            head_params=head,
            weight_bytes_per_step=(body + head) * item,
            kv_bytes_per_token=2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_size * kv_item,
            attn_flops_per_pair=4 * cfg.num_layers * cfg.num_heads * cfg.head_size,
            inactive_expert_bytes=inactive * item,
            expert_fraction=cfg.num_experts_per_tok / cfg.num_experts if cfg.num_experts else 0.0,
        )

    def weight_bytes(self, batch: float) -> float:
        """Weights one decode step of `batch` sequences reads. A dense model reads all of them whatever the
        batch; a MoE layer reads the experts any of the batch's tokens routes to: with balanced routing an
        expert is missed by all of them with probability (1 - k/E)^batch."""
        if not self.inactive_expert_bytes:
            return self.weight_bytes_per_step
        f = self.expert_fraction
        all_experts = self.inactive_expert_bytes / (1 - f)  # the active k/E of them are in weight_bytes_per_step
        missed = (1 - f) ** max(batch, 1)
        return self.weight_bytes_per_step - f * all_experts + (1 - missed) * all_experts


def inactive_expert_params(cfg: ModelConfig) -> int:
    """Expert parameters a token does not use: E - k of the experts of every MoE layer."""
    if not cfg.num_experts:
        return 0
    specs = family_for_config(cfg).param_specs(cfg, jnp.float32)
    moe = [layer.moe for layer in specs.layers if getattr(layer, "moe", None) is not None]
    per_expert = sum(count_params((m.w_gate, m.w_up, m.w_down)) for m in moe) // cfg.num_experts
    return per_expert * (cfg.num_experts - cfg.num_experts_per_tok)


def attended_context(workload: Workload) -> int:
    """Context positions all generated tokens attend to: token t of request i sees input_i + t positions."""
    return sum(o * i + o * (o - 1) // 2 for i, o in zip(workload.input_lens, workload.output_lens))


def workload_limit(
    cost: ModelCost, workload: Workload, *, kv_capacity_tokens: int, max_num_seqs: int, copy_bw: float,
    matmul_rate: float, replicas: int = 1,
) -> dict[str, float | int | str]:
    """The workload's fastest possible run (bytes/s and FLOP/s measured beside it).

    copy_bw, matmul_rate, kv_capacity_tokens and max_num_seqs are one engine replica's (a tensor-parallel
    replica of n devices reads and computes at n times one device's rates); with `replicas` > 1 each replica
    takes an equal share of the requests and all run at once."""
    mean_len = (workload.input_tokens + workload.output_tokens) / workload.num_prompts
    share = workload.num_prompts / replicas
    batch = max(1, min(share, max_num_seqs, int(kv_capacity_tokens // mean_len)))
    context = attended_context(workload) / replicas
    # Decode steps, each reading the weights once: at a full batch, but never fewer than the longest
    # request's output, whose tokens come one step after another however many requests run beside it.
    steps = max(workload.output_tokens / replicas / batch, max(workload.output_lens))
    bytes_read = steps * cost.weight_bytes(batch) + context * cost.kv_bytes_per_token
    forward_tokens = workload.input_tokens + workload.output_tokens - workload.num_prompts
    prefill_pairs = sum(i * (i + 1) // 2 for i in workload.input_lens)  # causal
    flops = (
        2 * cost.body_params * forward_tokens
        + 2 * cost.head_params * workload.output_tokens
        + cost.attn_flops_per_pair * (prefill_pairs + attended_context(workload))
    ) / replicas
    memory_s, compute_s = bytes_read / copy_bw, flops / matmul_rate
    seconds = max(memory_s, compute_s)
    return {
        "batch": batch,
        "bytes": bytes_read,
        "flops": flops,
        "memory_s": memory_s,
        "compute_s": compute_s,
        "bound": "memory" if memory_s >= compute_s else "compute",
        "output_tok_s": workload.output_tokens / seconds,
        "total_tok_s": (workload.input_tokens + workload.output_tokens) / seconds,
    }
