"""What the runner's step programs take and return: the bucketed batch, the sampler's inputs, and each
program's outputs (single step, multi-step decode loop, speculative verify). The engine, the batcher, the
pipeline and the decode loop build and read these; `jaxinfer.engine.runner` compiles the programs over them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
from flax import struct

from jaxinfer.engine.sampling import PromptLogprobs, SamplerOutput
from jaxinfer.engine.sampling_rows import SamplingArrays
from jaxinfer.models.common import AttentionMetadata


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
    prompt_next_ids: jax.Array  # [T] int32 next prompt token of each position (for prompt logprobs)
    want_prompt_logprobs: jax.Array  # [] bool: compute logits for every token this step


class StepLogits(NamedTuple):
    """What the forward half of a step leaves on device for the sampler (and the prompt-logprob program)."""

    logits: jax.Array  # [S, V] float32
    hidden: jax.Array  # [T, D] the final hidden state of every position, for steps that ask for prompt logprobs
    expert_counts: jax.Array  # [E] int32 ([0] for dense models)


class StepOutput(NamedTuple):
    sampled: SamplerOutput  # [S] tokens and logprobs
    prompt: PromptLogprobs | None  # [T] prompt logprobs; on the host only in steps that asked for them
    expert_counts: jax.Array | None = None  # [E] int32 (token, expert) pairs per expert over the MoE layers


@struct.dataclass
class DecodeInputs:
    """What the multi-step loop needs beyond the first iteration's batch (whose T equals S: one token a row)."""

    budget: jax.Array  # [S] int32 tokens each row may still generate (max_tokens, max_model_len); 0: padding
    stop_ids: jax.Array  # [S, E] int32 ids that end a row once min_tokens are out, padded with -1
    num_steps: jax.Array  # [] int32 iterations to run, <= max_steps (bounded by the rows' page room)
    # [S] bool: the rows the previous call left generating, when this call continues it before the host has
    # seen that call's tokens (Engine's overlapped decode); all True for a call planned from host state.
    alive: jax.Array


class MultiStepOutput(NamedTuple):
    sampled: SamplerOutput  # [N, S] per iteration
    valid: jax.Array  # [N, S] bool: the row sampled a real token in this iteration
    next_tokens: jax.Array  # [S] int32 each row's input token for a call that continues this one
    alive: jax.Array  # [S] bool rows still generating after this call (not stopped, budget left)
    expert_counts: jax.Array | None = None  # [E] int32 summed over the call's iterations ([0] for dense models)


class VerifyStepOutput(NamedTuple):
    sampled: SamplerOutput  # [S, K + 1] emitted tokens (accepted proposals, then one more) and their logprobs
    num_emitted: jax.Array  # [S] int32 accepted proposals + 1
    expert_counts: jax.Array | None = None  # [E] int32 ([0] for dense models)
