"""On-device sampling: per-request knobs as arrays, one jitted pass from logits to tokens.

Every per-request knob lives in `SamplingArrays` as an array row, so changing any value never recompiles
(DESIGN rule 3). The rows' state (`SamplingArrays`, the penalties' `PenaltyState`, seeds) and its host builders
are `jaxinfer.engine.sampling_rows`; this module is the device pass that reads them. Shapes are static: S is
the padded number of sequences; padding rows are greedy with every knob off, so they cost nothing and touch
nothing.

Order inside `sample` (vLLM semantics unless noted):
  logit bias -> repetition/presence/frequency penalties -> min_tokens suppression of stop ids
  -> token masks (bad_words, allowed_token_ids) -> temperature -> top-k -> top-p -> min-p
  -> Gumbel-max with the row's key.
Rows with temperature < GREEDY_EPS take the argmax of the processed logits (bias and penalties applied).
Returned logprobs are of the *raw* model distribution (log_softmax of the unmodified logits), like vLLM's
default, with the top `max_logprobs` alternatives; callers slice per request.

Filtering as thresholds. top-k, top-p and min-p each keep a set {z >= t} of the temperature-scaled logits
z, so the sampler computes one threshold per row (the max of the three) and never reorders the vocabulary:
  * min-p is elementwise: t = max(z) + log(min_p). Probability ratios do not depend on normalisation, so
    the kept set is the same before or after top-k/top-p (vLLM V1 applies it first; the result agrees).
  * top-k and top-p only need the largest few values: `lax.top_k(z, C)` over C candidates. top-k is exact
    when k <= C; top-p (renormalised over the top-k set, as in vLLM) is exact whenever the nucleus fits in
    C, which the candidate mass proves (mass of the C candidates >= top_p). When any row does not fit,
    a `lax.cond` falls back to finding the exact thresholds by bisection over the float order (32 masked
    sums over the vocabulary each for top-k and top-p): same compile, only slower that step. Ties at the
    cut value are all kept (vLLM's top-k keeps ties too).
  * top_p >= 1 and top_k <= 0 are off: no candidate work at all when no row of the batch needs it.

Vocabulary-parallel logits. Under tensor parallelism the lm_head is split by vocabulary, so the logits
arrive split over the mesh's `tensor` axis (`VocabShards`). Everything here is written so that no [S, V]
array is gathered onto one device: reductions (max, logsumexp, argmax, ranks) become all-reduces of [S]
(or [S, tp]) partials; the only top-k over the vocabulary, `_top_k`, takes each shard's top k inside a
`shard_map` and merges the tp*k candidates; the exact fallback of top-k/top-p finds its threshold by
bisection over the float order (32 masked sums, each an all-reduce of [S]) instead of sorting the vocabulary.
The penalty counts are split by vocabulary like the logits (`PenaltyState`).

Seeds. Each row carries threefry key data from its seed ([hi, lo] words of seed mod 2**64; for
0 <= seed < 2**31 that is exactly `jax.random.PRNGKey(seed)`) and a step counter n = tokens already
generated; the n-th token uses fold_in(key(seed), n) and Gumbel noise over the full vocabulary. The noise
depends on nothing but (seed, n, V), so a request samples the same tokens alone, in any batch, at any row,
and after preemption by recompute, given the same logits (batch-invariant logits are the model's job).
`sampling_rows.resolve_seed` gives unseeded requests a random seed once at admission and gives the children of an n > 1
request distinct seeds (seed + index, as vLLM does).

Inside step():  out = sample(logits, arrays, penalties)
                penalties = update_output_counts(penalties, out.tokens, active)   # active: [S] real, running
                arrays = arrays.advance()                                        # next decode iteration
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from jaxinfer.engine.sampling_rows import PenaltyState, SamplingArrays, unpack_token_bits
from jaxinfer.validation import MAX_LOGPROBS


NUM_CANDIDATES = 256  # C: candidate set for top-k/top-p before the full-sort fallback
GREEDY_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS); avoids overflow in z / T
_PRNG_IMPL = "threefry2x32"


@dataclasses.dataclass(frozen=True)
class VocabShards:
    """The vocabulary axis of the logits (and penalty counts) is split over `axis` of `mesh`."""

    mesh: Mesh
    axis: str = "tensor"


class SamplerOutput(NamedTuple):
    tokens: jax.Array  # [S] i32
    logprobs: jax.Array  # [S] f32 of the chosen token under the raw model distribution
    top_ids: jax.Array  # [S, Kmax] i32, most likely first
    top_logprobs: jax.Array  # [S, Kmax] f32
    ranks: jax.Array  # [S] i32 1-based rank of the chosen token under the raw distribution


class PromptLogprobs(NamedTuple):
    logprobs: jax.Array  # [T] f32 of each actual next prompt token
    top_ids: jax.Array  # [T, k] i32
    top_logprobs: jax.Array  # [T, k] f32
    ranks: jax.Array  # [T] i32 1-based rank of the actual next token


def process_logits(logits: jax.Array, arrays: SamplingArrays, penalties: PenaltyState | None = None,
                   branch_free: bool = False) -> jax.Array:
    """Logit bias -> penalties -> min_tokens suppression, on [S, V] f32. NaN becomes -inf so a broken row
    cannot poison the argmax. `branch_free`: see `_when`."""
    x = jnp.where(jnp.isnan(logits), -jnp.inf, logits.astype(jnp.float32))  # [S, V]
    x = _apply_logit_bias(x, arrays.bias_ids, arrays.bias_values)
    if penalties is not None:
        x = _apply_penalties_if_any(x, arrays, penalties, branch_free)
    x = _suppress_stop_ids(x, arrays)
    return apply_token_masks(x, arrays, branch_free)


def _when(pred: jax.Array, apply: Callable[[], Any], skip: Callable[[], Any], branch_free: bool) -> Any:
    """`apply()` where `pred` holds, else `skip()`, as a `lax.cond`; with `branch_free`, `apply()` always, for
    passes that leave a row they do not concern exactly as it was. XLA's GPU runtime reads a conditional's
    predicate back to the host, so the host cannot queue the next program until the device reached it: the
    pipelined single steps (pipeline.py) launch the next forward right behind the sampler only when it has none."""
    return apply() if branch_free else lax.cond(pred, apply, skip)


def apply_token_masks(x: jax.Array, arrays: SamplingArrays, branch_free: bool = False) -> jax.Array:
    """Ban tokens by request (after bias and penalties, so nothing can lift a ban): bad words whose prefix the
    row just generated lose their last token, rows with allowed_token_ids keep only those, and rows under a
    structured-output grammar keep only what its bitmask allows. Data in the arrays, so no request recompiles
    the step."""
    x = _apply_allowed_ids(_apply_bad_words(x, arrays), arrays, branch_free)
    return _apply_bitmask(x, arrays.token_bitmask, branch_free)


def _apply_bitmask(x: jax.Array, bitmask: jax.Array, branch_free: bool = False) -> jax.Array:
    """Tokens whose bit is 0 become -inf. The [S, V] unpacking runs only in steps where some row has a cleared
    bit (`lax.cond`), so batches without structured output pay one [S, V/32] comparison."""

    def restrict() -> jax.Array:
        allowed = unpack_token_bits(lax.bitcast_convert_type(bitmask, jnp.uint32), x.shape[1])  # [S, V]
        return jnp.where(allowed, x, -jnp.inf)  # [S, V]

    return _when(jnp.any(bitmask != -1), restrict, lambda: x, branch_free)


def _apply_bad_words(x: jax.Array, arrays: SamplingArrays) -> jax.Array:
    """O(S * W * R) compares and an O(S * W) scatter: cheap enough to run in every step."""
    rows = jnp.arange(x.shape[0])[:, None]  # [S, 1]
    prefix = arrays.bad_prefix  # [S, W, R]
    same = (prefix < 0) | (prefix == arrays.recent_tokens[:, None, :])  # [S, W, R] pads match anything
    ids = _row_scatter_ids(arrays.bad_last, jnp.all(same, axis=-1), x.shape[1])  # [S, W]
    return x.at[rows, ids].set(-jnp.inf, mode="drop")  # [S, V]


def _apply_allowed_ids(x: jax.Array, arrays: SamplingArrays, branch_free: bool = False) -> jax.Array:
    """The [S, V] mask is built only in steps where some row has allowed_token_ids (`lax.cond`)."""
    on = arrays.allowed_ids[:, 0] >= 0  # [S]

    def restrict() -> jax.Array:
        rows = jnp.arange(x.shape[0])[:, None]  # [S, 1]
        ids = _row_scatter_ids(arrays.allowed_ids, on[:, None], x.shape[1])  # [S, A]
        allowed = jnp.zeros(x.shape, bool).at[rows, ids].set(True, mode="drop")  # [S, V]
        return jnp.where(on[:, None] & ~allowed, -jnp.inf, x)  # [S, V]

    return _when(jnp.any(on), restrict, lambda: x, branch_free)


def _row_scatter_ids(ids: jax.Array, use: jax.Array, vocab_size: int) -> jax.Array:
    """Map unused slots to V, an out-of-range id that mode="drop" scatters discard (-1 would wrap)."""
    return jnp.where(use & (ids >= 0), ids, vocab_size)  # [S, X]


def _apply_logit_bias(x: jax.Array, bias_ids: jax.Array, bias_values: jax.Array) -> jax.Array:
    rows = jnp.arange(x.shape[0])[:, None]  # [S, 1]
    ids = _row_scatter_ids(bias_ids, jnp.asarray(True), x.shape[1])  # [S, B]
    return x.at[rows, ids].add(bias_values, mode="drop")  # [S, V]


def _apply_penalties(x: jax.Array, arrays: SamplingArrays, penalties: PenaltyState) -> jax.Array:
    """HF/vLLM repetition penalty over prompt + output (positive logits divided, others multiplied), then
    OpenAI frequency (per occurrence) and presence (once) penalties over the output only."""
    counts = penalties.output_counts  # [S, V] i32
    in_output = counts > 0  # [S, V]
    seen = unpack_token_bits(penalties.prompt_bits, x.shape[1]) | in_output  # [S, V]
    rep = jnp.where(seen, arrays.repetition_penalty[:, None], 1.0)  # [S, V]
    x = jnp.where(x > 0, x / rep, x * rep)  # [S, V]
    x = x - arrays.frequency_penalty[:, None] * counts.astype(jnp.float32)  # [S, V]
    return x - arrays.presence_penalty[:, None] * in_output.astype(jnp.float32)  # [S, V]


def _apply_penalties_if_any(x: jax.Array, arrays: SamplingArrays, penalties: PenaltyState,
                            branch_free: bool = False) -> jax.Array:
    """Skip the O(S*V) penalty pass at run time when no row of the batch uses a penalty (the common case). A
    row without penalties comes through the pass exactly: x / 1, x * 1, x - 0 * count and x - 0 * seen are x."""
    active = (arrays.repetition_penalty != 1) | (arrays.presence_penalty != 0) | (arrays.frequency_penalty != 0)
    return _when(jnp.any(active), lambda: _apply_penalties(x, arrays, penalties), lambda: x, branch_free)  # [S, V]


def _suppress_stop_ids(x: jax.Array, arrays: SamplingArrays) -> jax.Array:
    """Ban EOS/stop ids while fewer than min_tokens are generated; computed from `step` on device so it
    stays right across several decode iterations in one call."""
    rows = jnp.arange(x.shape[0])[:, None]  # [S, 1]
    suppress = (arrays.step < arrays.min_tokens)[:, None]  # [S, 1]
    ids = _row_scatter_ids(arrays.stop_ids, suppress, x.shape[1])  # [S, E]
    return x.at[rows, ids].set(-jnp.inf, mode="drop")  # [S, V]


def _safe_logsumexp(x: jax.Array) -> jax.Array:
    """Row logsumexp [S, W] -> [S]; an all -inf row gives 0 instead of -inf so later x - lse is not NaN."""
    lse = jax.nn.logsumexp(x, axis=-1)  # [S]
    return jnp.where(jnp.isfinite(lse), lse, 0.0)


def _take_rows(vals: jax.Array, idx: jax.Array) -> jax.Array:
    """vals[s, idx[s]] for [S, W] and [S] -> [S]."""
    return jnp.take_along_axis(vals, idx[:, None], axis=-1)[:, 0]


def _threshold_from_sorted(vals: jax.Array, lse: jax.Array, top_k: jax.Array, top_p: jax.Array,
                           k_on: jax.Array, p_on: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Top-k/top-p cut on the W largest scaled logits, sorted descending. Returns (threshold [S], fits [S]),
    fits saying the cut is exact with only these W values. `lse` [S] is the full-vocabulary logsumexp."""
    width = vals.shape[1]
    in_k = ~k_on[:, None] | (jnp.arange(width)[None, :] < top_k[:, None])  # [S, W]
    thresh_k = jnp.where(k_on, _take_rows(vals, jnp.clip(top_k - 1, 0, width - 1)), -jnp.inf)  # [S]
    # vLLM renormalises over the top-k set before top-p; without top-k the whole vocabulary counts.
    norm = jnp.where(k_on, _safe_logsumexp(jnp.where(in_k, vals, -jnp.inf)), lse)  # [S]
    probs = jnp.where(in_k, jnp.exp(vals - norm[:, None]), 0.0)  # [S, W]
    cum = jnp.cumsum(probs, axis=-1)  # [S, W]
    before = jnp.pad(cum[:, :-1], ((0, 0), (1, 0)))  # [S, W] mass strictly above each rank
    keep = in_k & (before < top_p[:, None])  # [S, W] a prefix; rank 0 always kept
    last = jnp.maximum(jnp.sum(keep, axis=-1) - 1, 0)  # [S]
    thresh_p = jnp.where(p_on, _take_rows(vals, last), -jnp.inf)  # [S]
    k_fits = ~k_on | (top_k <= width)
    # The nucleus ends inside the W values iff their mass already reaches top_p (or top-k bounds it). With
    # W = V, float32 rounding can leave the total a hair under a top_p near 1; then every token is kept.
    p_fits = ~p_on | (k_on & k_fits) | (cum[:, -1] >= top_p)
    return jnp.maximum(thresh_k, thresh_p), k_fits & p_fits


def _top_k(x: jax.Array, k: int, vocab: VocabShards | None) -> tuple[jax.Array, jax.Array]:
    """lax.top_k over the last axis of x [S, V]: (values [S, k], ids [S, k]).

    With a split vocabulary, each device takes the top k of its shard and the tp*k candidates (with their
    global ids) are gathered and cut again: the global top k is among them, ties still go to the lower id,
    and only [S, tp*k] crosses devices. XLA's own partitioning of TopK would gather all of [S, V].
    """
    if vocab is None:
        return lax.top_k(x, k)

    def per_shard(xs: jax.Array) -> tuple[jax.Array, jax.Array]:  # [S, V/tp] -> [S, k] twice
        vals, ids = lax.top_k(xs, min(k, xs.shape[1]))  # [S, k'] of this shard
        ids = ids + lax.axis_index(vocab.axis) * xs.shape[1]  # global vocabulary ids
        vals = lax.all_gather(vals, vocab.axis, axis=1, tiled=True)  # [S, tp*k']
        ids = lax.all_gather(ids, vocab.axis, axis=1, tiled=True)
        top, pos = lax.top_k(vals, k)  # [S, k]
        return top, jnp.take_along_axis(ids, pos, axis=1)

    return jax.shard_map(per_shard, mesh=vocab.mesh, in_specs=PartitionSpec(None, vocab.axis),
                         out_specs=PartitionSpec(), check_vma=False)(x)


def _order_key(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (-inf lowest), so a threshold can be bisected exactly."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _key_value(key: jax.Array) -> jax.Array:
    bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _bisect(lo: jax.Array, hi: jax.Array, pred: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """The smallest key k in (lo, hi] with pred(value(k)) true, given pred false at lo, true at hi and
    monotone between (all [S] uint32). 32 halvings pin it to one representable float."""

    def body(_: jax.Array, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        mid = lo + (hi - lo) // 2  # [S]; hi >= lo, so no overflow
        ok = pred(_key_value(mid))
        return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

    return lax.fori_loop(0, 32, body, (lo, hi))[1]


def _bisected_threshold(z: jax.Array, top_k: jax.Array, top_p: jax.Array, k_on: jax.Array,
                        p_on: jax.Array) -> jax.Array:
    """The exact top-k/top-p threshold [S] of z [S, V] without sorting.

    top-k: the k-th largest value is the largest t with count(z >= t) >= k. top-p (over the top-k set,
    renormalised, as in vLLM): the sorted cut keeps every rank whose mass strictly above it is below
    top_p and the ties of the last one, i.e. the threshold is the smallest value v with mass(z > v) <
    top_p. Both predicates are monotone in t, so bisection over the float order finds those values exactly.
    """
    floor = jnp.full(z.shape[:1], _order_key(jnp.float32(-jnp.inf)))  # [S]
    top = _order_key(jnp.max(z, axis=-1))  # [S]
    # count(z >= t) < k, monotone false -> true; the answer is one key below the first true one.
    fewer = lambda t: jnp.sum(z >= t[:, None], axis=-1) < top_k  # noqa: E731
    thresh_k = jnp.where(k_on, _key_value(_bisect(floor, top + 1, fewer) - 1), -jnp.inf)  # [S]
    in_k = z >= thresh_k[:, None]  # [S, V]
    norm = _safe_logsumexp(jnp.where(in_k, z, -jnp.inf))  # [S]
    probs = jnp.where(in_k, jnp.exp(z - norm[:, None]), 0.0)  # [S, V]
    below = lambda t: jnp.sum(jnp.where(z > t[:, None], probs, 0.0), axis=-1) < top_p  # noqa: E731
    thresh_p = jnp.where(p_on, _key_value(_bisect(floor, top, below)), -jnp.inf)  # [S]
    return jnp.maximum(thresh_k, thresh_p)


def _top_k_top_p_threshold(z: jax.Array, top_k: jax.Array, top_p: jax.Array, k_on: jax.Array,
                           p_on: jax.Array, num_candidates: int, vocab: VocabShards | None) -> jax.Array:
    """Threshold [S] from C candidates; the exact bisection only when some row's cut lies past C."""
    width = min(num_candidates, z.shape[1])
    lse = _safe_logsumexp(z)  # [S]
    candidates = _top_k(z, width, vocab)[0]  # [S, C] descending
    thresh, fits = _threshold_from_sorted(candidates, lse, top_k, top_p, k_on, p_on)
    if width == z.shape[1]:
        return thresh
    return lax.cond(jnp.all(fits), lambda: thresh, lambda: _bisected_threshold(z, top_k, top_p, k_on, p_on))


def _filter_threshold(z: jax.Array, arrays: SamplingArrays, greedy: jax.Array, num_candidates: int,
                      vocab: VocabShards | None, top_k_top_p: bool = True) -> jax.Array:
    """One threshold [S] on z combining top-k, top-p and min-p; tokens with z >= threshold stay. Without
    `top_k_top_p` (no row of the batch uses them: `branch_free_applies`) only min-p is computed."""
    # min-p keeps p >= min_p * p_max, i.e. z >= z_max + log(min_p); log(0) = -inf switches it off.
    thresh_min_p = jnp.max(z, axis=-1) + jnp.log(arrays.min_p)  # [S]
    if not top_k_top_p:
        return thresh_min_p
    k_on = (arrays.top_k > 0) & ~greedy  # [S] greedy rows never need the candidate work
    p_on = (arrays.top_p < 1.0) & ~greedy  # [S]
    thresh_kp = lax.cond(
        jnp.any(k_on | p_on),
        lambda: _top_k_top_p_threshold(z, arrays.top_k, arrays.top_p, k_on, p_on, num_candidates, vocab),
        lambda: jnp.full(z.shape[:1], -jnp.inf, z.dtype),
    )
    return jnp.maximum(thresh_min_p, thresh_kp)  # [S]


def _gumbel_noise(key_data: jax.Array, step: jax.Array, vocab_size: int) -> jax.Array:
    """Gumbel noise [S, V] from fold_in(key(seed), step): a function of (seed, step, V) only, so the row's
    position and the rest of the batch cannot change it."""

    def row_noise(data: jax.Array, n: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.wrap_key_data(data, impl=_PRNG_IMPL), n)
        return jax.random.gumbel(key, (vocab_size,), jnp.float32)  # [V]

    return jax.vmap(row_noise)(key_data, step)  # [S, V]


def _sample_random(x: jax.Array, arrays: SamplingArrays, greedy: jax.Array, num_candidates: int,
                   vocab: VocabShards | None, top_k_top_p: bool = True) -> jax.Array:
    """Temperature, filtering and Gumbel-max on processed logits x [S, V]; greedy rows take argmax(x)."""
    temperature = jnp.where(greedy, 1.0, arrays.temperature)  # [S] greedy rows: no division by ~0
    z = x / temperature[:, None]  # [S, V]
    keep = z >= _filter_threshold(z, arrays, greedy, num_candidates, vocab, top_k_top_p)[:, None]  # [S, V]
    noisy = jnp.where(keep, z + _gumbel_noise(arrays.key_data, arrays.step, x.shape[1]), -jnp.inf)  # [S, V]
    # An all -inf row (everything banned) has argmax 0: still a valid token id.
    return jnp.where(greedy, jnp.argmax(x, axis=-1), jnp.argmax(noisy, axis=-1)).astype(jnp.int32)  # [S]


def _logprob_outputs(logits: jax.Array, ids: jax.Array, k: int, want_top: jax.Array | bool = True,
                     vocab: VocabShards | None = None) -> tuple[jax.Array, ...]:
    """Raw log_softmax: logprob [S] and 1-based rank [S] of `ids`, plus the top-k alternatives [S, k].

    The top-k runs only when `want_top`: XLA lowers it to a segmented radix sort of the whole vocabulary,
    which an H100 profile of batch-64 Llama-3-8B decode put at 0.94 ms of a 13.2 ms step; without it the
    alternatives come back as zeros (no request asked for them)."""
    raw = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [S, V]
    chosen = _take_rows(raw, jnp.clip(ids, 0, raw.shape[1] - 1))  # [S]
    ranks = 1 + jnp.sum(raw > chosen[:, None], axis=-1, dtype=jnp.int32)  # [S]
    k = min(k, raw.shape[1])
    if want_top is False:  # known when traced: no row asks for alternatives
        return chosen, jnp.zeros((raw.shape[0], k), jnp.int32), jnp.zeros((raw.shape[0], k), raw.dtype), ranks
    top_logprobs, top_ids = lax.cond(
        want_top,
        lambda: tuple(_top_k(raw, k, vocab)),
        lambda: (jnp.zeros((raw.shape[0], k), raw.dtype), jnp.zeros((raw.shape[0], k), jnp.int32)),
    )  # [S, k]
    return chosen, top_ids.astype(jnp.int32), top_logprobs, ranks


def sample(logits: jax.Array, arrays: SamplingArrays, penalties: PenaltyState | None = None, *,
           max_logprobs: int = MAX_LOGPROBS, num_candidates: int = NUM_CANDIDATES,
           vocab: VocabShards | None = None, branch_free: bool = False) -> SamplerOutput:
    """Sample one token per row of logits [S, V]. Jittable; `max_logprobs`, `num_candidates` and `vocab`
    (how the logits' vocabulary is split over devices, if at all) are static, every knob in `arrays` is
    data. `penalties=None` statically skips the penalty pass.

    `branch_free` (static): the same tokens and logprobs with no `lax.cond` in the program, for batches where
    `branch_free_applies` (no top-k, top-p or top logprobs in any row): the passes a cond would skip run on
    every row, which they leave as they were, and the Gumbel noise is drawn even for an all-greedy batch."""
    x = process_logits(logits, arrays, penalties, branch_free)  # [S, V]
    greedy = arrays.temperature < GREEDY_EPS  # [S]
    if branch_free:
        tokens = _sample_random(x, arrays, greedy, num_candidates, vocab, top_k_top_p=False)  # [S]
        want_top: jax.Array | bool = False
    else:
        tokens = lax.cond(
            jnp.all(greedy),  # an all-greedy batch skips the RNG and filtering entirely
            lambda: jnp.argmax(x, axis=-1).astype(jnp.int32),
            lambda: _sample_random(x, arrays, greedy, num_candidates, vocab),
        )  # [S]
        want_top = jnp.any(arrays.num_top_logprobs > 0)
    logprobs, top_ids, top_logprobs, ranks = _logprob_outputs(logits, tokens, max_logprobs, want_top, vocab)
    return SamplerOutput(tokens, logprobs, top_ids, top_logprobs, ranks)


def branch_free_applies(arrays: SamplingArrays) -> bool:
    """Whether `sample(..., branch_free=True)` serves these host arrays: no sampled row uses top-k or top-p
    and no row asks for top logprobs (the passes that stay behind a cond: candidate top-k, bisection, the
    logprob top-k, each too dear to run in every step)."""
    greedy = np.asarray(arrays.temperature) < GREEDY_EPS
    filtered = ((np.asarray(arrays.top_k) > 0) | (np.asarray(arrays.top_p) < 1.0)) & ~greedy
    return not filtered.any() and not (np.asarray(arrays.num_top_logprobs) > 0).any()


def compute_prompt_logprobs(logits: jax.Array, next_ids: jax.Array, k: int,
                            vocab: VocabShards | None = None) -> PromptLogprobs:
    """Logprob of each actual next prompt token next_ids [T] under logits [T, V], with the top-k [T, k].
    `k` is static; padded positions (any id) give values the caller drops."""
    return PromptLogprobs(*_logprob_outputs(logits, next_ids, k, vocab=vocab))
