"""Verification of speculative proposals inside the target's step: lossless acceptance on device.

A row that speculates ran its last token x and k proposals d_1..d_k through the model in one ragged step
(k + 1 query tokens, the same paged attention as any chunk), so position j (0..k) holds the target's logits
for the token after x, d_1, ..., d_j. Every position is processed exactly as `sampling.sample` would process
that token had it been generated alone: the row's knobs repeated per position with `step` + j (seeds,
min_tokens), the proposals shifted into the recent tokens (bad words), and the penalty counts raised by the
proposals before it (`_expand_rows`, `_expand_penalties`). Then (`verify`):

  greedy rows   accept the longest prefix where d_{j+1} == argmax of position j; the token after it is the
                argmax at the first disagreement (or after the last proposal): exactly plain greedy decoding;
  sampled rows  standard speculative sampling: accept d_{j+1} with probability min(1, p_j(d) / q_j(d)) where
                p_j is the target's final distribution (temperature, top-k/p, min-p after bias, penalties
                and masks) and q_j the proposer's (one-hot for n-gram and greedy drafts); at the first
                rejection sample from the residual max(p_j - q_j, 0) (for one-hot q: p_j without d), after
                k acceptances sample the bonus token from p_k. The output distribution is exactly p's.

Randomness follows the plain sampler so nothing depends on the batch: the residual and bonus draws use the
Gumbel noise of fold_in(key(seed), step + j) over the kept set, the very draw `sample` makes for that token
(a row with no proposals gets the plain sampler's token), and the acceptance uniforms come from a further
fold_in of that key. Padding rows and rows with no proposals are ordinary rows with k = 0.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from jaxinfer.engine.sampling import (
    GREEDY_EPS,
    NUM_CANDIDATES,
    _PRNG_IMPL,
    SamplerOutput,
    VocabShards,
    _filter_threshold,
    _gumbel_noise,
    _logprob_outputs,
    process_logits,
)
from jaxinfer.engine.sampling_rows import PenaltyState, SamplingArrays
from jaxinfer.validation import MAX_LOGPROBS

ACCEPT_STREAM = 1  # fold_in(fold_in(key, step), ACCEPT_STREAM): the acceptance uniform of one proposal


@struct.dataclass
class VerifyInputs:
    """The proposals of one verification step, rows aligned with the step's sequences (S rows, K = k max)."""

    draft_tokens: jax.Array  # [S, K] int32 proposals d_1..d_K (entries past num_draft are ignored)
    num_draft: jax.Array  # [S] int32 proposals of each row, 0..K (0: an ordinary row)
    draft_rows: jax.Array  # [S, K] int32 flat index of d_j in the step's tokens (T for none: dropped)
    logits_rows: jax.Array  # [S, K + 1] int32 flat index of position j's token (x, d_1, ..., d_K)
    draft_probs: jax.Array | None = None  # [S, K, V] f32 q_j of a sampling draft model; None: one-hot proposals


class VerifyOutput(NamedTuple):
    sampled: SamplerOutput  # [S, K + 1] the emitted tokens (accepted proposals, then one more) and logprobs
    num_emitted: jax.Array  # [S] int32 accepted proposals + 1


def verify_logits(compute_logits: Any, hidden: jax.Array, logits_rows: jax.Array) -> jax.Array:
    """Float logits [S, K + 1, V] at the verification positions of hidden [T, D]: the LM head over the T
    tokens when that is fewer rows than S * (K + 1) (small token buckets), else over the gathered rows."""
    s, k1 = logits_rows.shape
    if s * k1 >= hidden.shape[0]:
        return compute_logits(hidden)[logits_rows]  # [T, V] -> [S, K + 1, V]
    logits = compute_logits(hidden[logits_rows.reshape(-1)])  # [S * (K + 1), V]
    return logits.reshape(s, k1, -1)


def _expand_rows(arrays: SamplingArrays, drafts: jax.Array, k1: int) -> SamplingArrays:
    """Each row's knobs repeated for positions 0..K ([S] -> [S * (K + 1)]): `step` + j, and the recent
    tokens of position j are the row's recent tokens followed by d_1..d_j."""
    out = jax.tree.map(lambda a: jnp.repeat(a, k1, axis=0), arrays)
    step = (arrays.step[:, None] + jnp.arange(k1)[None, :]).reshape(-1)  # [S * (K + 1)]
    recent = arrays.recent_tokens  # [S, R]
    width = recent.shape[1]
    full = jnp.concatenate([recent, drafts.astype(recent.dtype)], axis=1)  # [S, R + K]
    window = jnp.arange(k1)[:, None] + jnp.arange(width)[None, :]  # [K + 1, R]
    shifted = full[:, window].reshape(-1, width)  # [S * (K + 1), R]
    return dataclasses.replace(out, step=step, recent_tokens=shifted)


def _expand_penalties(rows: PenaltyState, drafts: jax.Array, k1: int, vocab_size: int) -> PenaltyState:
    """Penalty rows for positions 0..K: position j counts d_1..d_j as generated ([S] -> [S * (K + 1)])."""
    counts = jnp.asarray(rows.output_counts)  # [S, V]
    added = jnp.cumsum(jax.nn.one_hot(drafts, vocab_size, dtype=jnp.int32), axis=1)  # [S, K, V]
    expanded = jnp.concatenate([counts[:, None], counts[:, None] + added[:, : k1 - 1]], axis=1)  # [S, K + 1, V]
    bits = jnp.repeat(jnp.asarray(rows.prompt_bits), k1, axis=0)  # [S * (K + 1), W]
    return PenaltyState(prompt_bits=bits, output_counts=expanded.reshape(-1, vocab_size))


def _uniforms(key_data: jax.Array, step: jax.Array, k: int) -> jax.Array:
    """U[0, 1) [S, K] for the acceptance test of proposal j + 1 (drawn at token number step + j)."""

    def one(data: jax.Array, n: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(data, impl=_PRNG_IMPL), n), ACCEPT_STREAM)
        return jax.random.uniform(key, (), jnp.float32)

    steps = step[:, None] + jnp.arange(k)[None, :]  # [S, K]
    return jax.vmap(jax.vmap(one, in_axes=(None, 0)))(key_data, steps)


def _leading_true(accept: jax.Array) -> jax.Array:
    """Length of the all-true prefix of each row of accept [S, K] -> [S]."""
    return jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def _greedy_accept(x: jax.Array, inputs: VerifyInputs) -> tuple[jax.Array, jax.Array]:
    """(accepted proposals m [S], the token after them [S]) for greedy rows; x [S, K + 1, V] processed."""
    best = jnp.argmax(x, axis=-1).astype(jnp.int32)  # [S, K + 1]
    k = inputs.draft_tokens.shape[1]
    ok = (best[:, :k] == inputs.draft_tokens) & (jnp.arange(k)[None, :] < inputs.num_draft[:, None])  # [S, K]
    m = _leading_true(ok)
    return m, jnp.take_along_axis(best, m[:, None], axis=1)[:, 0]


def _sampled_accept(x: jax.Array, arrays: SamplingArrays, inputs: VerifyInputs, greedy: jax.Array,
                    num_candidates: int, vocab: VocabShards | None) -> tuple[jax.Array, jax.Array]:
    """Rejection sampling for every row (greedy rows take the greedy rule); see the module doc."""
    s, k1, v = x.shape
    k = k1 - 1
    flat_greedy = jnp.repeat(greedy, k1)  # [S * (K + 1)]
    temperature = jnp.where(flat_greedy, 1.0, arrays.temperature)  # [S * (K + 1)]
    z = x.reshape(s * k1, v) / temperature[:, None]  # [S * (K + 1), V]
    keep = z >= _filter_threshold(z, arrays, flat_greedy, num_candidates, vocab)[:, None]  # [S * (K + 1), V]
    zk = jnp.where(keep, z, -jnp.inf)
    p = jnp.exp(zk - jax.nn.logsumexp(zk, axis=-1, keepdims=True)).reshape(s, k1, v)  # [S, K + 1, V]
    d = inputs.draft_tokens  # [S, K]
    p_d = jnp.take_along_axis(p[:, :k], d[..., None], axis=-1)[..., 0]  # [S, K]
    q = inputs.draft_probs
    q_d = 1.0 if q is None else jnp.take_along_axis(q, d[..., None], axis=-1)[..., 0]  # [S, K]
    u = _uniforms(arrays.key_data.reshape(s, k1, 2)[:, 0], arrays.step.reshape(s, k1)[:, 0], k)  # [S, K]
    ok = (u * q_d < p_d) & (jnp.arange(k)[None, :] < inputs.num_draft[:, None])  # [S, K]
    m_sampled = _leading_true(ok)
    m_greedy, token_greedy = _greedy_accept(x, inputs)
    m = jnp.where(greedy, m_greedy, m_sampled)  # [S]
    # The draw at position m only: the residual after a rejection, or the bonus after k acceptances.
    at = jnp.arange(s) * k1 + m  # [S] flat row of position m
    z_m, keep_m = z[at], keep[at]  # [S, V]
    noise = _gumbel_noise(arrays.key_data[at], arrays.step[at], v)  # [S, V] the plain sampler's draw
    rejected = m < inputs.num_draft  # [S]
    d_m = jnp.take_along_axis(d, jnp.minimum(m, k - 1)[:, None], axis=1)[:, 0] if k else jnp.zeros(s, jnp.int32)
    ids = jnp.arange(v)[None, :]
    if q is None:  # residual of a one-hot proposal: p without the rejected token
        allowed = keep_m & ~(rejected[:, None] & (ids == d_m[:, None]))
        scores = jnp.where(allowed, z_m + noise, -jnp.inf)
    else:
        q_m = q[jnp.arange(s), jnp.minimum(m, k - 1)]  # [S, V]
        resid = jnp.maximum(p[jnp.arange(s), m] - jnp.where(rejected[:, None], q_m, 0.0), 0.0)  # [S, V]
        bonus = jnp.where(keep_m, z_m + noise, -jnp.inf)
        scores = jnp.where(rejected[:, None], jnp.where(resid > 0, jnp.log(resid) + noise, -jnp.inf), bonus)
    token = jnp.argmax(scores, axis=-1).astype(jnp.int32)
    return m, jnp.where(greedy, token_greedy, token)


def verify(logits: jax.Array, arrays: SamplingArrays, rows: PenaltyState | None, inputs: VerifyInputs,
           sample_mask: jax.Array, *, max_logprobs: int = MAX_LOGPROBS, num_candidates: int = NUM_CANDIDATES,
           vocab: VocabShards | None = None) -> tuple[VerifyOutput, PenaltyState | None]:
    """Accept proposals of logits [S, K + 1, V]; returns the emitted tokens with their raw logprobs and the
    penalty rows with the emitted tokens counted (rows where `sample_mask`)."""
    s, k1, v = logits.shape
    flat = logits.reshape(s * k1, v)
    expanded = _expand_rows(arrays, inputs.draft_tokens, k1)
    if rows is None:
        x = process_logits(flat, expanded, None)
    else:
        uses = (arrays.repetition_penalty != 1) | (arrays.presence_penalty != 0) | (arrays.frequency_penalty != 0)
        x = lax.cond(jnp.any(uses),
                     lambda: process_logits(flat, expanded, _expand_penalties(rows, inputs.draft_tokens, k1, v)),
                     lambda: process_logits(flat, expanded, None))  # [S * (K + 1), V]
    x = x.reshape(s, k1, v)
    greedy = arrays.temperature < GREEDY_EPS  # [S]
    m, last = lax.cond(jnp.all(greedy), lambda: _greedy_accept(x, inputs),
                       lambda: _sampled_accept(x, expanded, inputs, greedy, num_candidates, vocab))
    pos = jnp.arange(k1)[None, :]  # [1, K + 1]
    drafts = jnp.pad(inputs.draft_tokens, ((0, 0), (0, 1)))  # [S, K + 1]
    tokens = jnp.where(pos < m[:, None], drafts, jnp.where(pos == m[:, None], last[:, None], 0))  # [S, K + 1]
    want_top = jnp.any(arrays.num_top_logprobs > 0)
    outs = _logprob_outputs(flat, tokens.reshape(-1), max_logprobs, want_top, vocab)
    sampled = SamplerOutput(tokens, *(a.reshape(s, k1, *a.shape[1:]) for a in outs))
    if rows is not None:
        emitted = (pos <= m[:, None]) & sample_mask[:, None]  # [S, K + 1]
        counts = jnp.asarray(rows.output_counts).at[jnp.arange(s)[:, None], tokens].add(emitted.astype(jnp.int32))
        rows = dataclasses.replace(rows, output_counts=counts)
    return VerifyOutput(sampled, m + 1), rows
