"""The device side: one jitted step over params, the donated KV cache and a bucketed batch.

`ModelRunner` owns the weights and the cache and compiles `forward -> gather last positions -> logits`
once per bucket. It counts compilations so tests and the engine can prove steady-state runs never
recompile.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

from jaxinfer.config import ModelConfig
from jaxinfer.engine.sampling import (
    MAX_LOGPROBS,
    PenaltyState,
    PromptLogprobs,
    SamplerOutput,
    SamplingArrays,
    compute_prompt_logprobs,
    sample,
    set_rows,
    update_output_counts,
)
from jaxinfer.kv_cache import KVCache
from jaxinfer.models import ModelFamily
from jaxinfer.models.common import AttentionMetadata, gather_last_tokens
from jaxinfer.sharding import ShardingRules, replicated
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, resolve_impl


@struct.dataclass
class StepBatch:
    """One step's device inputs, padded to a bucket (T tokens, S sequences, M page-table width)."""

    token_ids: jax.Array  # [T] int32
    md: AttentionMetadata
    logits_indices: jax.Array  # [S] int32: row of each sequence's last token in this step


@struct.dataclass
class SampleInputs:
    """Everything besides the model batch that one engine step needs on device."""

    sampling: SamplingArrays  # [S, ...] per-row knobs
    slots: jax.Array  # [S] int32 penalty-state slot of each row (padding rows: the spare last slot)
    sample_mask: jax.Array  # [S] bool: rows whose token is kept (real rows at a sampling point)
    copy_src: jax.Array  # [C] int32 copy-on-write page copies, applied before this step's writes;
    copy_dst: jax.Array  # [C] int32 padded with 0 -> 0 (trash page onto itself)
    prompt_next_ids: jax.Array  # [T] int32 next prompt token of each position (for prompt logprobs)
    want_prompt_logprobs: jax.Array  # [] bool: compute logits for every token this step


class StepOutput(NamedTuple):
    sampled: SamplerOutput  # [S] tokens and logprobs
    prompt: PromptLogprobs  # [T] prompt logprobs (garbage unless requested)


def make_attention_fn(cfg: ModelConfig, impl: str, interpret: bool, **extra: Any) -> Any:
    """Bind the kernel choice and static attention settings; the model calls it per layer."""
    impl = resolve_impl(impl)  # resolve now: the platform is fixed for the runner's lifetime
    sm_scale = extra.pop("sm_scale", cfg.head_size**-0.5)

    def attn(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, md: AttentionMetadata, **layer: Any) -> jax.Array:
        return ragged_paged_attention(
            q, k_pages, v_pages, md.kv_lens, md.page_indices, md.cu_q_lens, md.num_seqs,
            sm_scale=sm_scale, impl=impl, interpret=interpret, **{**extra, **layer},
        )

    return attn


class ModelRunner:
    def __init__(
        self,
        family: ModelFamily,
        cfg: ModelConfig,
        weights: Any,
        kv_cache: KVCache,
        mesh: Mesh,
        rules: ShardingRules,
        attention_impl: str = "auto",
        interpret: bool = False,
    ) -> None:
        self.family, self.cfg, self.weights, self.kv_cache = family, cfg, weights, kv_cache
        self.mesh, self.rules = mesh, rules
        self.attention_impl = resolve_impl(attention_impl)
        self.num_compiles = 0
        attn_fn = make_attention_fn(cfg, attention_impl, interpret)
        self._logits_step = jax.jit(
            functools.partial(self._logits_step_impl, attn_fn=attn_fn),
            donate_argnums=(1,),
            out_shardings=(None, replicated(mesh)),
        )
        self._sample_step = jax.jit(
            functools.partial(self._sample_step_impl, attn_fn=attn_fn), donate_argnums=(1, 2)
        )

    def _logits_step_impl(self, weights: Any, kv_cache: KVCache, batch: StepBatch, *, attn_fn: Any) -> Any:
        self.num_compiles += 1  # runs only while tracing, i.e. once per new bucket shape
        hidden, kv_cache = self.family.forward(weights, self.cfg, batch.token_ids, batch.md, kv_cache, attn_fn)
        last = gather_last_tokens(hidden, batch.logits_indices)  # [S, D]
        return kv_cache, self.family.compute_logits(weights, self.cfg, last)

    def _sample_step_impl(
        self, weights: Any, kv_cache: KVCache, penalties: PenaltyState, batch: StepBatch, inputs: SampleInputs,
        *, attn_fn: Any,
    ) -> tuple[KVCache, PenaltyState, StepOutput]:
        self.num_compiles += 1
        kv_cache = copy_pages(kv_cache, inputs.copy_src, inputs.copy_dst)
        hidden, kv_cache = self.family.forward(weights, self.cfg, batch.token_ids, batch.md, kv_cache, attn_fn)
        logits = self.family.compute_logits(weights, self.cfg, gather_last_tokens(hidden, batch.logits_indices))
        rows = jax.tree.map(lambda a: a[inputs.slots], penalties)  # [S, ...] this step's rows
        out = sample(logits, inputs.sampling, rows)
        rows = update_output_counts(rows, out.tokens, inputs.sample_mask)
        penalties = set_rows(penalties, inputs.slots, rows)
        prompt = jax.lax.cond(
            inputs.want_prompt_logprobs,
            lambda: compute_prompt_logprobs(
                self.family.compute_logits(weights, self.cfg, hidden), inputs.prompt_next_ids, MAX_LOGPROBS
            ),
            lambda: _empty_prompt_logprobs(batch.token_ids.shape[0]),
        )
        return kv_cache, penalties, StepOutput(out, prompt)

    def step(self, penalties: PenaltyState, batch: StepBatch, inputs: SampleInputs) -> tuple[PenaltyState, StepOutput]:
        """Forward + sampling; the cache and the penalty state are updated in place (donated)."""
        self.kv_cache, penalties, out = self._sample_step(self.weights, self.kv_cache, penalties, batch, inputs)
        return penalties, out

    def logits(self, batch: StepBatch) -> jax.Array:
        """Run the model on `batch`, update the cache in place, return float32 logits [S, V]."""
        self.kv_cache, logits = self._logits_step(self.weights, self.kv_cache, batch)
        return logits

    def place(self, batch: StepBatch) -> StepBatch:
        """Host arrays -> device, replicated over the mesh (metadata is small)."""
        return jax.device_put(batch, replicated(self.mesh))


def copy_pages(kv_cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    """Copy-on-write: page dst <- page src in every layer (reads all happen before writes)."""
    return KVCache(
        k=tuple(k.at[dst].set(k[src]) for k in kv_cache.k),
        v=tuple(v.at[dst].set(v[src]) for v in kv_cache.v),
    )


def _empty_prompt_logprobs(num_tokens: int) -> PromptLogprobs:
    return PromptLogprobs(
        logprobs=jnp.zeros(num_tokens, jnp.float32),
        top_ids=jnp.zeros((num_tokens, MAX_LOGPROBS), jnp.int32),
        top_logprobs=jnp.zeros((num_tokens, MAX_LOGPROBS), jnp.float32),
        ranks=jnp.zeros(num_tokens, jnp.int32),
    )
