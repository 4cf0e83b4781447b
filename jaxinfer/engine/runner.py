"""The device side: one jitted step over params, the donated KV cache and a bucketed batch.

`ModelRunner` owns the weights and the cache and compiles `forward -> gather last positions -> logits`
once per bucket. It counts compilations so tests and the engine can prove steady-state runs never
recompile.

Multi-step decode (`decode_steps`): when every sequence of a step is a decode, up to `max_steps` decode
iterations run inside one device call: a `lax.scan` of exactly `max_steps` iterations with a branch-free body.
Each iteration samples, feeds the token back, advances positions / write slots / kv_lens and stops rows on
device at their token budget (max_tokens, max_model_len) or at an EOS / stop id once min_tokens are out.
Iterations past the requested number, and rows that stopped, are masked (their writes go to the trash page,
their tokens are flagged invalid) rather than skipped by a `lax.cond`: XLA's GPU runtime reads a
conditional's predicate back to the host, a sync per iteration, while a loop of known trip count runs without
one; and on every backend, a cache update under a conditional made XLA copy each cache layer per iteration
when the update became a dynamic-update-slice (the 1-row bucket). The host guarantees the pages: it asks for
no more iterations than every row's last page has room for, so the loop never needs a new page. The sampler in
the body keeps its own conds (the passes only some rows need) unless the call takes its branch-free build
(`takes_branch_free`, on GPUs, where each cond cost the device an idle wait per iteration).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxinfer.attention import make_attention_fn
from jaxinfer.expert_parallel import make_moe_fn
from jaxinfer.config import ModelConfig
from jaxinfer.engine import export_recipes
from jaxinfer.engine.aot import CompiledPrograms
from jaxinfer.engine.page_copies import PAGE_COPY_WIDTH, copy_pages, page_copy_arrays
from jaxinfer.engine.page_table import PageCopy
from jaxinfer.engine.transfer import Transfer
from jaxinfer.engine.verify import VerifyInputs, verify, verify_logits
from jaxinfer.engine.sampling import (
    PromptLogprobs,
    SamplerOutput,
    VocabShards,
    branch_free_applies,
    compute_prompt_logprobs,
    sample,
)
from jaxinfer.engine.sampling_rows import PenaltyState, SamplingArrays, set_rows, update_output_counts
from jaxinfer.engine.step_io import (
    DecodeInputs,
    MultiStepOutput,
    SampleInputs,
    StepBatch,
    StepLogits,
    StepOutput,
    VerifyStepOutput,
)
from jaxinfer.validation import MAX_LOGPROBS
from jaxinfer.kv_cache import KVCache, cache_shardings
from jaxinfer.models import ModelFamily
from jaxinfer.models.common import AttentionMetadata, gather_last_tokens
from jaxinfer.models.moe import PairKernel
from jaxinfer.sharding import Logical, ShardingRules, axis_size, replicated
from pallas_kernels.grouped_matmul import gather_matmul, grouped_matmul
from pallas_kernels.grouped_matmul import gpu as gmm_gpu
from pallas_kernels.grouped_matmul import gpu_swiglu as gmm_swiglu
from pallas_kernels.grouped_matmul import resolve_impl as resolve_experts_impl
from pallas_kernels.moe_routing import top_k_routing
from pallas_kernels.ragged_paged_attention import resolve_impl


PROMPT_LOGPROB_CHUNK = 256  # positions whose full-vocabulary logits exist at once

# XLA's GPU backend records runs of kernels as CUDA graphs ("command buffers") and, when a call's input buffers
# sit at new addresses, updates every graph node that reads them before launching. The single-step programs get
# new input buffers in every step (the batch placed from the host, the sampler's tokens), and on an H100 the
# Llama-3-8B forward then took 4.2 ms to return from its dispatch, against 1.4 ms with the same buffers, while
# the device waited for it: a pipelined step took 16.3 ms with graphs and 13.7 ms with plain kernel launches
# (scripts/pipeline_timeline.py). The multi-step loop is unchanged either way (12.1 ms per iteration).
# A GPU debug option: the other backends ignore it.
NO_COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer": ""}
# Forwards of a few tokens (the GPU's batch-1..8 single steps) let XLA merge every set of dots that share an operand
# into one GEMM: by default it merges up to 32 MB of weights, so q/k/v became one GEMM but a Llama-3-8B layer's gate
# and up projections (2 x 117 MB) stayed two. Merged, an H200 ran a 2-token step's matmuls in 3.72 instead of 3.82 ms
# and the host launched 32 kernels fewer (scripts/profile_single_step.py's dot_merge variant). At these row counts
# XLA runs the merged dot as a Triton GEMM that reads both weights in place; larger steps keep the default, where a
# library GEMM would need the two weights copied side by side.
MERGED_DOTS_MAX_TOKENS = 8
MERGED_DOTS = {"xla_gpu_dot_merger_threshold_mb": 1024}
SMALL_FORWARD_OPTIONS = {**NO_COMMAND_BUFFERS, **MERGED_DOTS}
# The multi-step loop of at most MERGED_DOTS_MAX_TOKENS rows (the GPU's 2-row bucket, batch 1 and 2) merges them
# too, keeping its CUDA graphs. On an H100, Llama-3-8B at batch 1, alternating processes with and without the
# merge (scripts/ab_xla_flags.py): one iteration 6.05 -> 5.97 ms on the device, 6.22 / 6.17 -> 6.06 / 6.05 ms a
# token end to end.


class _DecodeCarry(NamedTuple):
    kv_cache: KVCache
    rows: PenaltyState  # [S, ...] this call's penalty rows
    sampling: SamplingArrays  # [S, ...] `step` advanced every iteration
    tokens: jax.Array  # [S] int32 input token of the next iteration
    positions: jax.Array  # [S] int32 its position
    active: jax.Array  # [S] bool rows still generating
    expert_counts: jax.Array  # [E] int32 so far ([0] for dense models)


class ModelRunner(CompiledPrograms):
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
        self.platform = mesh.devices.flat[0].platform  # "cpu", "gpu" or "tpu": what compiles the programs
        # A vocabulary-parallel lm_head leaves the logits split over `tensor`; the sampler keeps them split.
        vocab_axes = rules.mapping.get(Logical.VOCAB)
        self.vocab = VocabShards(mesh, vocab_axes) if vocab_axes is not None else None
        self.attention_impl = resolve_impl(attention_impl)
        self.num_compiles = 0
        self.num_background_compiles = 0  # programs traced by `precompile_in_background`
        self._trace_lock = threading.Lock()
        self._in_background = threading.local()  # set on the thread of `precompile_in_background`
        self._deferred: set[tuple[Any, ...]] = set()  # keys of programs that thread has yet to hand over
        self.transfer = Transfer(replicated(mesh))  # each step's small host arrays in a few copies
        # Executables compiled ahead of time by `precompile`, keyed by entry point and input shapes.
        self._executables: dict[tuple[Any, ...], Any] = {}
        self.precompile_times: dict[str, Any] = {}  # the last `precompile`: trace and compile seconds
        attn_fn = make_attention_fn(cfg, attention_impl, interpret, mesh)
        # The multi-step decode loop has exactly one new token per row, which it tells the attention: the GPU kernel
        # then lays one token per tile and moves only the tile's q-head rows (gpu.tile_layout; at 192 rows an
        # H200's decode iteration took 16.9 instead of 18.9 ms, docs/PERFORMANCE.md). Other steps may prefill.
        decode_attn_fn = make_attention_fn(cfg, attention_impl, interpret, mesh, one_token_per_seq=True)
        # The experts' grouped matmul follows the attention choice: the Pallas kernel of the platform, or the
        # jnp reference (ragged_dot) wherever attention runs jnp (the reference or its xla reordering).
        experts_impl = "reference" if attention_impl == "xla" else attention_impl
        experts = functools.partial(grouped_matmul, impl=experts_impl, interpret=interpret)
        # Decode steps of a few tokens take the per-pair kernel where the GPU kernel runs (no sort; see
        # jaxinfer.models.moe). Elsewhere its reference would gather a weight copy per pair: the grouped path stays.
        pairs = gpu_pair_kernel(interpret) if resolve_experts_impl(experts_impl) == "pallas_gpu" else None
        self.moe_fn = make_moe_fn(mesh, rules, experts, pairs) if family.moe else None
        self.num_experts = cfg.num_experts if family.moe else 0
        self._logits_step = jax.jit(
            functools.partial(self._logits_step_impl, attn_fn=attn_fn),
            donate_argnums=(1,),
            out_shardings=(None, replicated(mesh)),
        )
        # A single step is two programs, the model's forward and the sampler, so the engine can launch the
        # next forward before it has read this step's tokens (pipelined single steps, pipeline.py).
        self._forward_step = jax.jit(functools.partial(self._forward_step_impl, attn_fn=attn_fn), donate_argnums=(1,),
                                     compiler_options=NO_COMMAND_BUFFERS)
        self._small_forward_step = jax.jit(functools.partial(self._forward_step_impl, attn_fn=attn_fn),
                                           donate_argnums=(1,), compiler_options=SMALL_FORWARD_OPTIONS)
        self._sample_logits = jax.jit(self._sample_logits_impl, donate_argnums=(0,), static_argnames=("branch_free",),
                                      compiler_options=NO_COMMAND_BUFFERS)
        # On GPUs the single-step sampler has a second build without `lax.cond` (sampling.sample's
        # `branch_free`), for the steps it serves: there a cond makes the host wait for the device (see
        # `sampling._when`). Elsewhere a cond costs no host round trip, and one build serves every step.
        self.branch_free_sampler = self.platform == "gpu"
        # The multi-step loop has the same second build (`branch_free`), for calls whose rows all pass
        # `branch_free_applies`: each cond in the loop body made the host wait for the device in every
        # iteration, and the host then launched the rest of the iteration (a CUDA graph) onto an idle GPU. On an
        # H100, same lease: one iteration 6.2 instead of 7.2 ms at batch 1 (Llama-3-8B) and 6.6 instead of 7.4 ms
        # (Qwen3-30B-A3B); a batch-64 step 12.4 instead of 13.6 ms end to end (docs/PERFORMANCE.md).
        def decode_loop(options: dict[str, Any] | None) -> Any:
            return jax.jit(functools.partial(self._decode_steps_impl, attn_fn=decode_attn_fn), donate_argnums=(1, 2),
                           static_argnames=("max_steps", "branch_free"), compiler_options=options)

        # Loops of a few rows also merge their dots (MERGED_DOTS, `decode_kind`).
        self._decode_steps, self._small_decode_steps = decode_loop(None), decode_loop(MERGED_DOTS)
        self._verify_step = jax.jit(
            functools.partial(self._verify_step_impl, attn_fn=attn_fn), donate_argnums=(1, 2)
        )
        # Copy-on-write page copies are a program of their own, run before a step only when its plan has some.
        # Inside every step they cost two scatters per layer whether or not a page moved (64 of a Llama-3-8B
        # single step's ~580 kernels, each launched by the host one by one), and steps almost never copy.
        self._copy_step = jax.jit(self._copy_pages_impl, donate_argnums=(1,), compiler_options=NO_COMMAND_BUFFERS)
        self.attn_fn = attn_fn  # for entry points registered from outside (a draft model's proposal loop)
        self._entry_points = {"forward": self._forward_step, "small_forward": self._small_forward_step,
                              "sample": self._sample_logits,
                              "decode": self._decode_steps, "small_decode": self._small_decode_steps,
                              "verify": self._verify_step, "copy": self._copy_step}
        # Prompt logprobs are their own program over the forward's hidden states, for the rare steps that ask:
        # as a `lax.cond` inside the forward, XLA's GPU runtime read the predicate back to the host in every
        # step, so the forward's launch returned only once it had run and the next call could not queue behind it.
        self._prompt_step = jax.jit(self._prompt_logprobs, compiler_options=NO_COMMAND_BUFFERS)
        self._entry_points["prompt"] = self._prompt_step
        # How many leading arguments of an entry point are the runner's own (weights, kv_cache): they never change
        # shape, so `_key` skips them and `precompile` supplies them.
        self._own_args = {"sample": 0, "prompt": 1}
        # What these entry points' traces are made of besides their arguments, for the export cache's recipes
        # (export_recipes: a warm start then reads each program without tracing it). Entry points registered
        # later close over other state and are traced on every start.
        self.program_identity = export_recipes.describe(
            (family, cfg, mesh.axis_names, mesh.devices.shape, [d.id for d in mesh.devices.flat], rules,
             attention_impl, self.attention_impl, bool(interpret), self.platform))
        self._recipe_kinds = frozenset(self._entry_points)
        # Where precompile keeps lowered programs (export_cache): "auto" beside the persistent compilation cache
        # (export_cache.default_directory), None nowhere, or a directory.
        self.export_directory: str | Path | None = "auto"

    def penalty_sharding(self) -> PenaltyState:
        """Where the penalty state lives: output counts [S, V] split by vocabulary like the logits they
        penalise (so the sampler never gathers them), the prompt bitmask [S, V/32] whole (it is small)."""
        counts = P(None, self.vocab.axis) if self.vocab is not None else P()
        return PenaltyState(prompt_bits=replicated(self.mesh), output_counts=NamedSharding(self.mesh, counts))

    def _pin_state(self, kv_cache: KVCache, penalties: PenaltyState) -> tuple[KVCache, PenaltyState]:
        """Give the carried state the sharding it came in with, so an executable compiled ahead of time for
        that sharding takes the next step's state as it is."""
        return self._pin_cache(kv_cache), jax.lax.with_sharding_constraint(penalties, self.penalty_sharding())

    def _pin_cache(self, kv_cache: KVCache) -> KVCache:
        return jax.lax.with_sharding_constraint(kv_cache, cache_shardings(kv_cache, self.mesh, self.rules))

    def _forward(self, weights: Any, token_ids: jax.Array, md: AttentionMetadata, kv_cache: KVCache,
                 attn_fn: Any) -> tuple[jax.Array, KVCache, jax.Array]:
        """The family's forward -> (hidden [T, D], cache, expert token counts [E], [0] without experts).

        With a `seq` axis the step's tokens are split over it (sequence parallelism): constraining the
        token ids makes every activation downstream split by token, so the matmuls run on T/seq rows."""
        seq = axis_size(self.mesh, "seq")
        if seq > 1 and token_ids.shape[0] % seq == 0:
            token_ids = jax.lax.with_sharding_constraint(token_ids, NamedSharding(self.mesh, P("seq")))
        if self.moe_fn is None:
            # Dense Qwen3 shares the MoE families' forward, which also returns (empty) expert counts.
            hidden, kv_cache = self.family.forward(weights, self.cfg, token_ids, md, kv_cache, attn_fn)[:2]
            return hidden, kv_cache, jnp.zeros((0,), jnp.int32)
        return self.family.forward(weights, self.cfg, token_ids, md, kv_cache, attn_fn, moe_fn=self.moe_fn)

    def _count_compile(self) -> None:
        with self._trace_lock:  # called only while tracing, i.e. once per new bucket shape
            if getattr(self._in_background, "on", False):
                self.num_background_compiles += 1
            else:
                self.num_compiles += 1

    def _logits_step_impl(self, weights: Any, kv_cache: KVCache, batch: StepBatch, *, attn_fn: Any) -> Any:
        self._count_compile()
        hidden, kv_cache, _ = self._forward(weights, batch.token_ids, batch.md, kv_cache, attn_fn)
        last = gather_last_tokens(hidden, batch.logits_indices)  # [S, D]
        return kv_cache, self.family.compute_logits(weights, self.cfg, last)

    def _copy_pages_impl(self, weights: Any, kv_cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
        """Page dst[i] <- page src[i] in every layer ([C] int32 each; padding copies the trash page onto itself).
        `weights` is unused (jit prunes it): it keeps the (weights, kv_cache, ...) order of the stateful kinds."""
        del weights
        self._count_compile()
        return self._pin_cache(copy_pages(kv_cache, src, dst))

    def _forward_step_impl(
        self, weights: Any, kv_cache: KVCache, batch: StepBatch, *, attn_fn: Any,
    ) -> tuple[KVCache, StepLogits]:
        """The model half of a step: forward, the last tokens' logits [S, V] (split by vocabulary under a
        vocabulary-parallel lm_head, as the sampler takes them) and the hidden states for prompt logprobs."""
        self._count_compile()
        hidden, kv_cache, counts = self._forward(weights, batch.token_ids, batch.md, kv_cache, attn_fn)
        logits = self.family.compute_logits(weights, self.cfg, gather_last_tokens(hidden, batch.logits_indices))
        logits = jax.lax.with_sharding_constraint(logits, self.logits_sharding())
        # Pinned, so the prompt-logprob program compiled ahead of time for this layout takes it as it comes.
        hidden = jax.lax.with_sharding_constraint(hidden, self.hidden_sharding(hidden.shape[0]))
        return self._pin_cache(kv_cache), StepLogits(logits, hidden, counts)

    def _sample_logits_impl(
        self, penalties: PenaltyState, logits: jax.Array, sampling: SamplingArrays, slots: jax.Array,
        sample_mask: jax.Array, *, branch_free: bool = False,
    ) -> tuple[PenaltyState, SamplerOutput]:
        """The sampler half of a step: logits [S, V] -> one token per row; the rows' output counts advance."""
        rows = jax.tree.map(lambda a: a[slots], penalties)  # [S, ...] this step's rows
        out = sample(logits, sampling, rows, vocab=self.vocab, branch_free=branch_free)
        rows = update_output_counts(rows, out.tokens, sample_mask)
        penalties = set_rows(penalties, slots, rows)
        # Replicated like the host token ids they become when the engine launches the next forward on them.
        out = out._replace(tokens=jax.lax.with_sharding_constraint(out.tokens, replicated(self.mesh)))
        return jax.lax.with_sharding_constraint(penalties, self.penalty_sharding()), out

    def hidden_sharding(self, num_tokens: int) -> NamedSharding:
        """Where the forward leaves the hidden states [T, D]: split by token under sequence parallelism (as
        `_forward` splits the step), whole otherwise."""
        seq = axis_size(self.mesh, "seq")
        return NamedSharding(self.mesh, P("seq" if seq > 1 and num_tokens % seq == 0 else None, None))

    def logits_sharding(self) -> NamedSharding:
        """Where a step's logits [S, V] live between the forward and the sampler."""
        return NamedSharding(self.mesh, P(None, self.vocab.axis) if self.vocab is not None else P())

    @functools.cached_property
    def logits_width(self) -> int:
        """V of the logits the lm_head gives (abstractly evaluated: no compile)."""
        hidden = jax.ShapeDtypeStruct((1, self.cfg.hidden_size), jnp.float32)
        return jax.eval_shape(lambda w, h: self.family.compute_logits(w, self.cfg, h), self.weights, hidden).shape[-1]

    def example_logits(self, num_rows: int) -> jax.Array:
        """Zero logits [num_rows, V] placed as the forward leaves them, to compile the sampler ahead of time."""
        return jnp.zeros((num_rows, self.logits_width), jnp.float32, device=self.logits_sharding())

    def _verify_step_impl(
        self, weights: Any, kv_cache: KVCache, penalties: PenaltyState, batch: StepBatch, inputs: SampleInputs,
        spec: VerifyInputs, *, attn_fn: Any,
    ) -> tuple[KVCache, PenaltyState, VerifyStepOutput]:
        """Speculative verification (jaxinfer.engine.verify): the proposals are put into the step's tokens
        (a draft model's arrive as device arrays), every row runs its tokens through the ragged batch as a
        chunk, and each row keeps its accepted proposals plus one token. Rows without proposals sample as in
        `step`. Rejected proposals leave KV behind their row's new length, which the host rolls back."""
        self._count_compile()
        token_ids = batch.token_ids.at[spec.draft_rows].set(spec.draft_tokens, mode="drop")  # [T]
        hidden, kv_cache, counts = self._forward(weights, token_ids, batch.md, kv_cache, attn_fn)
        logits = verify_logits(lambda h: self.family.compute_logits(weights, self.cfg, h), hidden, spec.logits_rows)
        rows = jax.tree.map(lambda a: a[inputs.slots], penalties)  # [S, ...] this step's rows
        out, rows = verify(logits, inputs.sampling, rows, spec, inputs.sample_mask, vocab=self.vocab)
        penalties = set_rows(penalties, inputs.slots, rows)
        return *self._pin_state(kv_cache, penalties), VerifyStepOutput(out.sampled, out.num_emitted, counts)

    def _prompt_logprobs(self, weights: Any, hidden: jax.Array, next_ids: jax.Array) -> PromptLogprobs:
        """Prompt logprobs of every position, PROMPT_LOGPROB_CHUNK positions at a time: the [T, V] fp32
        logits and their log-softmax/top-k temporaries at once took 11.8 GiB for T = 4096, V = 128k."""
        t = hidden.shape[0]
        c = min(t, PROMPT_LOGPROB_CHUNK)  # T is a power-of-two bucket, so c divides it
        chunks = (hidden.reshape(t // c, c, hidden.shape[-1]), next_ids.reshape(t // c, c))  # [T/C, C, D], [T/C, C]
        out = jax.lax.map(
            lambda hc: compute_prompt_logprobs(
                self.family.compute_logits(weights, self.cfg, hc[0]), hc[1], MAX_LOGPROBS, self.vocab),
            chunks,
        )
        return jax.tree.map(lambda a: a.reshape(t, *a.shape[2:]), out)  # [T/C, C, ...] -> [T, ...]

    def _decode_steps_impl(
        self, weights: Any, kv_cache: KVCache, penalties: PenaltyState, batch: StepBatch, inputs: SampleInputs,
        decode: DecodeInputs, *, attn_fn: Any, max_steps: int, branch_free: bool = False,
    ) -> tuple[KVCache, PenaltyState, MultiStepOutput]:
        self._count_compile()
        num_rows = batch.logits_indices.shape[0]
        real = jnp.arange(num_rows) < batch.md.num_seqs[0]  # [S]
        carry = _DecodeCarry(
            kv_cache, jax.tree.map(lambda a: a[inputs.slots], penalties), inputs.sampling,
            batch.token_ids, batch.md.positions, real & (decode.budget > 0) & decode.alive,
            jnp.zeros((self.num_experts,), jnp.int32),
        )

        def body(carry: _DecodeCarry, i: jax.Array) -> tuple[_DecodeCarry, tuple[SamplerOutput, jax.Array]]:
            return self._decode_iteration(weights, carry, i, batch.md, decode, attn_fn, branch_free)

        carry, (sampled, valid) = jax.lax.scan(body, carry, jnp.arange(max_steps))  # outputs [N, S, ...]
        penalties = set_rows(penalties, inputs.slots, carry.rows)
        # Replicated like the host inputs they replace, so a continuation call's executable takes them as they are.
        follow = jax.lax.with_sharding_constraint((carry.tokens, carry.active), replicated(self.mesh))
        return *self._pin_state(carry.kv_cache, penalties), MultiStepOutput(sampled, valid, *follow,
                                                                             carry.expert_counts)

    def _decode_iteration(
        self, weights: Any, c: _DecodeCarry, i: jax.Array, md0: AttentionMetadata, decode: DecodeInputs,
        attn_fn: Any, branch_free: bool = False,
    ) -> tuple[_DecodeCarry, tuple[SamplerOutput, jax.Array]]:
        """One masked iteration: rows generate only while active and i < num_steps (see the module doc);
        `branch_free`: the sampler without `lax.cond` (`sampling.sample`)."""
        live = c.active & (i < decode.num_steps)  # [S]
        md = decode_metadata(c.positions, live, md0.page_indices, md0.num_seqs, c.kv_cache.page_size)
        hidden, kv_cache, counts = self._forward(weights, c.tokens, md, c.kv_cache, attn_fn)  # [S, D]
        out = sample(self.family.compute_logits(weights, self.cfg, hidden), c.sampling, c.rows, vocab=self.vocab,
                     branch_free=branch_free)
        rows = update_output_counts(c.rows, out.tokens, live)
        # `step` counts tokens generated before this one, so this token is number step + 1.
        hit_stop = jnp.any(out.tokens[:, None] == decode.stop_ids, axis=-1)  # [S]
        may_stop = c.sampling.step + 1 >= c.sampling.min_tokens  # [S]
        stop = live & ((hit_stop & may_stop) | (i + 1 >= decode.budget))  # [S]
        nxt = _DecodeCarry(
            kv_cache, rows, c.sampling.advance(out.tokens, live),  # tokens feed multi-token bad words
            jnp.where(live, out.tokens, c.tokens), c.positions + live.astype(jnp.int32), c.active & ~stop,
            c.expert_counts + counts * jnp.any(live),
        )
        return nxt, (out, live)

    def decode_steps(
        self, penalties: PenaltyState, batch: StepBatch, inputs: SampleInputs, decode: DecodeInputs, max_steps: int,
        branch_free: bool = False, copies: Sequence[PageCopy] = (),
    ) -> tuple[PenaltyState, MultiStepOutput]:
        """Up to `max_steps` decode iterations in one call after the plan's page `copies`; `batch` holds one token
        per row (T == S). `branch_free` where `takes_branch_free` says so for the call's host sampling arrays; while
        that build is still compiling in the background (`precompile_in_background`) the call runs the branching
        one."""
        self.copy_pages(copies)
        args = (self.weights, self.kv_cache, penalties, batch, inputs, decode)
        static: dict[str, Any] = {"max_steps": max_steps}
        kind = decode_kind(batch.logits_indices.shape[0])
        # Keyed only while the background thread still holds builds back: otherwise `_dispatch` keys the call once.
        if branch_free and not (self._deferred and self._key(kind, args, {**static, "branch_free": True})
                                in self._deferred):
            static["branch_free"] = True
        self.kv_cache, penalties, out = self._dispatch(kind, args, static)
        return penalties, out

    def takes_branch_free(self, sampling: SamplingArrays) -> bool:
        """Whether a call over these host sampling arrays runs the sampler's branch-free build (single step or
        multi-step loop): on GPUs, where a `lax.cond` costs a host round trip, when no row needs a pass that
        stays behind a cond (`sampling.branch_free_applies`)."""
        return self.branch_free_sampler and branch_free_applies(sampling)

    def step(self, penalties: PenaltyState, batch: StepBatch, inputs: SampleInputs,
             copies: Sequence[PageCopy] = ()) -> tuple[PenaltyState, StepOutput]:
        """Forward + sampling (+ prompt logprobs when `inputs` asks); the cache and the penalty state are updated
        in place (donated)."""
        step = self.forward(batch, copies)
        penalties, sampled = self.sample(penalties, step.logits, inputs.sampling, inputs.slots, inputs.sample_mask)
        prompt = self.prompt_logprobs(step.hidden, inputs.prompt_next_ids) if inputs.want_prompt_logprobs else None
        return penalties, StepOutput(sampled, prompt, step.expert_counts)

    def forward(self, batch: StepBatch, copies: Sequence[PageCopy] = ()) -> StepLogits:
        """The model half of a step (`_forward_step_impl`) after the plan's page `copies`; the cache is updated in
        place (donated)."""
        self.copy_pages(copies)
        kind = forward_kind(batch.token_ids.shape[0])
        self.kv_cache, out = self._dispatch(kind, (self.weights, self.kv_cache, batch), {})
        return out

    def copy_pages(self, copies: Sequence[PageCopy]) -> None:
        """Apply copy-on-write page copies (src, dst) to the cache in place, PAGE_COPY_WIDTH per call; every
        step entry point calls it first, from the thread that makes its device call, so the order holds."""
        for start in range(0, len(copies), PAGE_COPY_WIDTH):
            self.kv_cache = self._dispatch("copy", (self.weights, self.kv_cache, *self.place(
                page_copy_arrays(copies[start : start + PAGE_COPY_WIDTH]))), {})

    def sample(self, penalties: PenaltyState, logits: jax.Array, sampling: SamplingArrays, slots: jax.Array,
               sample_mask: jax.Array, branch_free: bool = False) -> tuple[PenaltyState, SamplerOutput]:
        """The sampler half of a step over `forward`'s logits (see `_sample_logits_impl`); the penalty state is
        updated in place (donated). `branch_free` only where `branch_free_sampler` and the host arrays of
        `sampling` pass `sampling.branch_free_applies`."""
        static = {"branch_free": True} if branch_free else {}
        return self._dispatch("sample", (penalties, logits, sampling, slots, sample_mask), static)

    def prompt_logprobs(self, hidden: jax.Array, next_ids: jax.Array) -> PromptLogprobs:
        """Prompt logprobs [T] of every position of a forward's `hidden` [T, D] (`_prompt_logprobs`)."""
        return self._dispatch("prompt", (self.weights, hidden, next_ids), {})

    def verify(self, penalties: PenaltyState, batch: StepBatch, inputs: SampleInputs, spec: VerifyInputs,
               copies: Sequence[PageCopy] = ()) -> tuple[PenaltyState, VerifyStepOutput]:
        """One speculative verification step (see `_verify_step_impl`) after the plan's page `copies`; cache and
        penalties in place."""
        self.copy_pages(copies)
        self.kv_cache, penalties, out = self._dispatch(
            "verify", (self.weights, self.kv_cache, penalties, batch, inputs, spec), {}
        )
        return penalties, out

    def logits(self, batch: StepBatch) -> jax.Array:
        """Run the model on `batch`, update the cache in place, return float32 logits [S, V]."""
        self.kv_cache, logits = self._logits_step(self.weights, self.kv_cache, batch)
        return logits

    def place(self, batch: Any, background: bool = False) -> Any:
        """Host arrays -> device, replicated over the mesh (metadata is small); device arrays stay as they are.
        A tuple's elements are packed one by one (jaxinfer.engine.transfer)."""
        return self.transfer.place(batch, background)


def gpu_pair_kernel(interpret: bool = False, swiglu_tiling=None) -> PairKernel:
    """The per-pair kernels of MoE decode steps on a GPU, as the runner uses them (scripts/profile_moe_block.py
    times this too): gather_matmul, the fused SwiGLU kernel where it takes the experts (16-bit weights), and the
    routing kernel (pallas_kernels.moe_routing, Pallas Triton) fed the router's product as ROUTER_SPLITS partials.

    The routing kernel replaces XLA's top-k (a sort and a slice of its first k columns) and the sum of the split-K
    router product's partials: three kernels of a decode layer become one, and XLA adds one back (a transpose of
    the kernel's [T, k] outputs for the combine). One H200, Qwen3-30B-A3B's batch-1 decode loop, same process
    (scripts/moe_b1_variants.py, docs/benchmarks/moe_b1_fusion_h200_2026-11-28.json): 3.68 -> 3.61 ms an iteration
    with the routing kernel on whole logits; fed the split product, one more kernel a layer goes.

    The SwiGLU kernel is given the routing weights (swiglu_weighted): it scales each pair's rows and writes zeros
    for the pairs it skips, so the combine is a plain sum, and its mask fusion and that transpose go (two kernels
    a layer; 3.542 -> 3.445 and 3.520 -> 3.432 ms an iteration in two leases,
    docs/benchmarks/moe_b1_fusion_h200_2026-11-28b.json and -28c.json). Where the model hands the block its
    residual (moe.takes_logits), the kernel adds its rows into it (swiglu_accumulates): the combine's sum goes too."""
    route_impl = "pallas_gpu" if interpret else "auto"  # auto: the reference for shapes the kernel does not take
    return PairKernel(functools.partial(gather_matmul, impl="pallas_gpu", interpret=interpret),
                      takes=gmm_gpu.supported,
                      swiglu=functools.partial(gmm_swiglu.swiglu_experts, interpret=interpret, tiling=swiglu_tiling),
                      swiglu_takes=gmm_swiglu.supported, swiglu_weighted=True, swiglu_accumulates=True,
                      select_top_k=functools.partial(top_k_routing, impl=route_impl, interpret=interpret),
                      router_splits=ROUTER_SPLITS)


# The router's product reaches the routing kernel as this many partial products over slices of D (at most; fewer
# where D is small, moe_routing.router_splits): XLA's autotuner split Qwen3-30B-A3B's [2, 2048] x [2048, 128] router
# 32 ways on an H200 and then summed the partials in a kernel of its own; the routing kernel sums them instead.
ROUTER_SPLITS = 32


def forward_kind(num_tokens: int) -> str:
    """The entry point of a forward over a bucket of `num_tokens` tokens (see MERGED_DOTS_MAX_TOKENS)."""
    return "small_forward" if num_tokens <= MERGED_DOTS_MAX_TOKENS else "forward"


DECODE_KINDS = ("decode", "small_decode")


def decode_kind(num_rows: int) -> str:
    """The entry point of a multi-step decode call over a bucket of `num_rows` rows (see MERGED_DOTS)."""
    return "small_decode" if num_rows <= MERGED_DOTS_MAX_TOKENS else "decode"


def decode_metadata(
    positions: jax.Array, active: jax.Array, page_indices: jax.Array, num_seqs: jax.Array, page_size: int
) -> AttentionMetadata:
    """Attention metadata of a decode-only step with one token per row (T == S), built on device.

    Stopped rows still attend (their outputs are dropped) but write into the trash page, so a row that
    stopped never touches KV the host did not account for; padding rows have kv_len 0.
    """
    num_rows = positions.shape[0]
    rows = jnp.arange(num_rows)  # [S]
    col = jnp.minimum(positions // page_size, page_indices.shape[1] - 1)  # [S]
    page = jnp.take_along_axis(page_indices, col[:, None], axis=1)[:, 0]  # [S]
    slots = jnp.where(active, page * page_size + positions % page_size, rows % page_size)  # [S]
    real = rows < num_seqs[0]  # [S]
    cu_q_lens = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(real, dtype=jnp.int32)])  # [S+1]
    kv_lens = jnp.where(real, positions + 1, 0).astype(jnp.int32)  # [S]
    return AttentionMetadata(
        positions=positions, slot_mapping=slots.astype(jnp.int32), cu_q_lens=cu_q_lens, kv_lens=kv_lens,
        page_indices=page_indices, num_seqs=num_seqs,
    )

