"""A draft model's side of speculative decoding: its own weights and KV cache, k proposals in one device call.

The draft cache has as many pages as the target's and uses the target's page tables: the scheduler owns one
set of page ids, and each model keeps its own KV under them (vLLM does the same). So prefix-cache hits,
copy-on-write copies and rollback apply to both at once, with no second allocator. The draft runs every
token the target runs, in step with it (`DraftRunner.propose` before each target step, over the same
sequences): each row first runs the tokens the draft has not seen (its new tokens, plus the one proposal the
draft never ran when the target accepted all k), which gives the first proposal, then k - 1 single-token
iterations give the rest. The iterations are a `lax.scan` with a branch-free body (like the decode loop):
rows that propose fewer than k tokens stop writing (trash page) instead of branching.

Proposals are greedy, or sampled at the request's temperature with their distribution q returned for the
target's rejection sampling (`draft_sampling`). Either way the target's verification makes the output exact;
the draft only decides how much is accepted, so stale draft KV (a lag the budget could not cover) costs
acceptance, never correctness.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.engine.page_table import PageCopy
from jaxinfer.engine.runner import ModelRunner, decode_metadata
from jaxinfer.engine.step_io import StepBatch
from jaxinfer.engine.sampling import GREEDY_EPS, _PRNG_IMPL
from jaxinfer.kv_cache import KVCache
from jaxinfer.models.common import gather_last_tokens

DRAFT_STREAM = 2  # fold_in(fold_in(key, step + j), DRAFT_STREAM): the draft's draw for proposal j + 1


@struct.dataclass
class DraftInputs:
    """Per-row settings of one proposal call (S rows, aligned with the target step's rows)."""

    num_draft: jax.Array  # [S] int32 proposals wanted (0: the row only runs its tokens through the draft)
    temperature: jax.Array  # [S] f32 the request's temperature (< GREEDY_EPS: greedy proposals)
    key_data: jax.Array  # [S, 2] u32 the row's seed
    step: jax.Array  # [S] int32 tokens the row generated before this step


class DraftRunner:
    """Proposals from a draft model; `runner` holds its weights, its cache and its mesh."""

    def __init__(self, runner: ModelRunner, k: int, sampling: bool) -> None:
        self.runner, self.k, self.sampling = runner, k, sampling
        jitted = jax.jit(functools.partial(self._propose_impl, attn_fn=runner.attn_fn), donate_argnums=(1,))
        runner.register_entry_point("draft", jitted)

    @property
    def vocab_size(self) -> int:
        return self.runner.cfg.vocab_size

    def propose(self, batch: StepBatch, inputs: DraftInputs, copies: Sequence[PageCopy] = ()
                ) -> tuple[jax.Array, jax.Array | None]:
        """Proposals [S, k] int32 and their distributions [S, k, V] (None when greedy), on the draft's devices,
        after the step's copy-on-write page `copies` (the draft's cache shares the target's page table)."""
        r = self.runner
        r.copy_pages(copies)
        r.kv_cache, drafts, probs = r._dispatch("draft", (r.weights, r.kv_cache, batch, inputs), {})
        return drafts, probs

    def _sample(self, logits: jax.Array, inputs: DraftInputs, j: jax.Array | int) -> tuple[jax.Array, Any]:
        """Proposal j + 1 of every row from logits [S, V], and q [S, V] when sampling (else None)."""
        logits = logits.astype(jnp.float32)
        best = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [S]
        if not self.sampling:
            return best, None
        greedy = inputs.temperature < GREEDY_EPS
        z = logits / jnp.where(greedy, 1.0, inputs.temperature)[:, None]  # [S, V]

        def noise(data: jax.Array, n: jax.Array) -> jax.Array:
            key = jax.random.fold_in(jax.random.wrap_key_data(data, impl=_PRNG_IMPL), n)
            return jax.random.gumbel(jax.random.fold_in(key, DRAFT_STREAM), (logits.shape[1],), jnp.float32)

        g = jax.vmap(noise)(inputs.key_data, inputs.step + j)  # [S, V]
        token = jnp.where(greedy, best, jnp.argmax(z + g, axis=-1).astype(jnp.int32))
        return token, jax.nn.softmax(z, axis=-1)

    def _propose_impl(self, weights: Any, kv_cache: KVCache, batch: StepBatch, inputs: DraftInputs, *,
                      attn_fn: Any) -> tuple[KVCache, jax.Array, jax.Array | None]:
        r = self.runner
        r._count_compile()
        hidden, kv_cache, _ = r._forward(weights, batch.token_ids, batch.md, kv_cache, attn_fn)
        logits = r.family.compute_logits(weights, r.cfg, gather_last_tokens(hidden, batch.logits_indices))  # [S, V]
        first, q0 = self._sample(logits, inputs, 0)

        def body(carry: tuple[KVCache, jax.Array, jax.Array], j: jax.Array) -> tuple[Any, Any]:
            cache, tokens, positions = carry
            live = j < inputs.num_draft  # [S] rows that want proposal j + 1 write the KV of proposal j
            md = decode_metadata(positions, live, batch.md.page_indices, batch.md.num_seqs, cache.page_size)
            out, cache, _ = r._forward(weights, tokens, md, cache, attn_fn)  # [S, D]
            nxt, q = self._sample(r.family.compute_logits(weights, r.cfg, out), inputs, j)
            return (cache, nxt, positions + 1), (nxt, q)

        # Proposal j (1-based) sits at position kv_len + j - 1, right after the row's last token.
        carry = (kv_cache, first, batch.md.kv_lens)
        (kv_cache, _, _), (rest, qs) = jax.lax.scan(body, carry, jnp.arange(1, self.k))  # [k - 1, S, ...]
        drafts = jnp.concatenate([first[:, None], rest.T], axis=1)  # [S, k]
        probs = None if q0 is None else jnp.concatenate([q0[:, None], jnp.swapaxes(qs, 0, 1)], axis=1)  # [S, k, V]
        return kv_cache, drafts, probs
