"""The sampler's per-row state: each request's knobs as array rows (`SamplingArrays`), the tokens it has seen
for penalties (`PenaltyState`), its seed, and the admission check of its sampling fields.

The host builds these when a sequence is admitted or resumed; `jaxinfer.engine.sampling` reads them on device in
every step, and the decode loop advances them between iterations (`SamplingArrays.advance`,
`update_output_counts`). Shapes are static: S is the padded number of sequences, and padding rows are greedy with
every knob off.

Penalties need token occurrence. `PenaltyState` lives on device, one row per sequence slot aligned with the
logits rows: output token counts [S, V] int32, updated in the step with the sampled tokens
(`update_output_counts`, an O(S) scatter), and a prompt-presence bitmask [S, ceil(V/32)] uint32 written
once when the sequence is admitted or resumed (host cost O(len(tokens) + V), see `PenaltyState.from_tokens`).
Memory is S*V*4.125 bytes (64 rows x 128k vocab = 33 MiB); the per-step read is O(S*V), the same order as
the logits. An engine without penalties passes `penalties=None`, a static choice that skips the pass; with
a state, a batch where no row uses a penalty skips it at run time (`lax.cond`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.validation import (  # the request limits; the arrays below are sized from them
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_STOP_IDS,
    Limits,
    check_sampling_fields,
    normalized_sampling_fields,
)

Array = jax.Array | np.ndarray

MAX_BAD_WORD_SEQS = 2 * MAX_BAD_WORDS  # W: each bad word is banned with and without a leading space
RECENT = MAX_BAD_WORD_TOKENS - 1  # R: generated tokens a row remembers, the longest bad word's prefix
_NO_TOKEN = -2  # recent_tokens before the first generated token: equal to no id and to no prefix pad (-1)
_BITS = 32  # prompt-presence bits per uint32 word
_INT32_MAX = 2**31 - 1
_SEED_MOD = 2**64


def _get(p: Any, name: str, default: Any) -> Any:
    """Read a SamplingParams-like attribute; objects may omit knobs that are off."""
    value = getattr(p, name, default)
    return default if value is None else value


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-sequence sampling knobs as arrays. Build on the host with `from_params`; all fields are data."""

    temperature: Array  # [S] f32; < GREEDY_EPS is greedy
    top_k: Array  # [S] i32; 0 = off (host maps -1 and k >= V to 0)
    top_p: Array  # [S] f32; >= 1 = off
    min_p: Array  # [S] f32; 0 = off
    repetition_penalty: Array  # [S] f32; 1 = off
    presence_penalty: Array  # [S] f32; 0 = off
    frequency_penalty: Array  # [S] f32; 0 = off
    bias_ids: Array  # [S, B] i32, padded with -1
    bias_values: Array  # [S, B] f32, padded with 0
    key_data: Array  # [S, 2] u32 threefry key data of the row's seed
    step: Array  # [S] i32 tokens already generated: the next token uses fold_in(key, step)
    min_tokens: Array  # [S] i32; stop ids are banned while step < min_tokens
    stop_ids: Array  # [S, E] i32 EOS + stop_token_ids for min_tokens, padded with -1
    num_top_logprobs: Array  # [S] i32 top alternatives the row returns (SamplingParams.logprobs); 0 = none
    # Token masks (see `apply_token_masks`); every row is off by default.
    allowed_ids: Array  # [S, A] i32 allowed_token_ids padded with -1; a row is restricted iff its [0] >= 0
    bad_prefix: Array  # [S, W, R] i32 bad word tokens but the last, right-aligned, padded with -1 (any token)
    bad_last: Array  # [S, W] i32 the last token of each bad word, -1 for unused slots
    recent_tokens: Array  # [S, R] i32 the row's last R generated tokens, newest last, _NO_TOKEN before any
    # Structured output: [S, ceil(V/32)] i32, bit v % 32 of word v // 32 set iff token v may be sampled, filled
    # on the host by the row's grammar matcher (jaxinfer.engine.grammar); -1 (every bit set) where unconstrained.
    token_bitmask: Array

    @classmethod
    def from_params(
        cls,
        params_list: Sequence[Any],
        num_rows: int,
        vocab_size: int,
        *,
        steps: Sequence[int] | None = None,
        seeds: Sequence[int | None] | None = None,
        eos_ids: Sequence[int] = (),
        max_logit_bias: int = MAX_LOGIT_BIAS,
        max_stop_ids: int = MAX_STOP_IDS,
        rng: np.random.Generator | None = None,
        bad_words: Sequence[Sequence[Sequence[int]]] | None = None,
        recent: Sequence[Sequence[int]] | None = None,
        token_bitmask: Any = None,  # host array, or the engine's cached all-allowed device mask
    ) -> SamplingArrays:
        """Host (NumPy) arrays for `params_list` in rows 0..len-1, padded to `num_rows` harmless rows.

        steps[i]: tokens row i already generated (default 0). seeds[i]: the row's resolved seed (see
        `resolve_seed`); where missing, params.seed, else a draw from `rng`. eos_ids: the model's EOS ids,
        suppressed with stop_token_ids under min_tokens unless the request sets ignore_eos. bad_words[i]: the
        row's bad words as token sequences (they need the tokenizer, so the caller encodes them); recent[i]:
        the tokens row i generated so far (only the last R are kept). token_bitmask: [num_rows, ceil(V/32)]
        int32 allowed-token bits of constrained rows (structured output), -1 elsewhere; None: no row is.
        """
        if len(params_list) > num_rows:
            raise ValueError(f"num_rows must be >= the number of requests ({len(params_list)}), got {num_rows}.")
        rng = rng if rng is not None else np.random.default_rng()
        cols = _padding_columns(num_rows, max_logit_bias, max_stop_ids)
        cols["token_bitmask"] = unconstrained_bitmask(num_rows, vocab_size) if token_bitmask is None else token_bitmask
        for row, p in enumerate(params_list):
            step = 0 if steps is None else int(steps[row])
            seed = None if seeds is None else seeds[row]
            seed = resolve_seed(_get(p, "seed", None), 0, rng) if seed is None else seed
            _fill_row(cols, row, p, vocab_size, step, seed, eos_ids)
            if bad_words is not None and bad_words[row]:
                _fill_bad_words(cols, row, bad_words[row], () if recent is None else recent[row])
        return cls(**cols)

    def advance(self, tokens: Array | None = None, active: Array | None = None) -> SamplingArrays:
        """The arrays for the next decode iteration inside one device call: every row one token further, and
        `tokens` [S] (where `active` [S]) shifted into the rows' recent tokens for multi-token bad words."""
        recent = self.recent_tokens
        if tokens is not None:
            shifted = jnp.concatenate([recent[:, 1:], tokens[:, None].astype(recent.dtype)], axis=1)  # [S, R]
            recent = shifted if active is None else jnp.where(active[:, None], shifted, recent)
        return dataclasses.replace(self, step=self.step + 1, recent_tokens=recent)


def unconstrained_bitmask(num_rows: int, vocab_size: int) -> np.ndarray:
    """[num_rows, ceil(V/32)] int32 with every bit set: no structured-output constraint."""
    return np.full((num_rows, _num_words(vocab_size)), -1, np.int32)


def resolve_seed(seed: int | None, sample_index: int, rng: np.random.Generator) -> int:
    """The seed one sequence samples with: seed + index for child `index` of an n > 1 request (children
    must differ, as in vLLM); a random seed for an unseeded request. Call once at admission and keep it, so
    a preempted sequence resumes the same stream."""
    if seed is None:
        return int(rng.integers(0, 2**63))
    return int(seed) + sample_index


def seed_key_data(seed: int) -> np.ndarray:
    """Threefry key data [2] u32 of `seed` mod 2**64: its [hi, lo] words. For 0 <= seed < 2**31 this equals
    jax.random.key_data(jax.random.PRNGKey(seed)); larger seeds stay distinct instead of overflowing."""
    s = int(seed) % _SEED_MOD
    return np.array([s >> 32, s & 0xFFFFFFFF], dtype=np.uint32)  # [2]


def _padding_columns(num_rows: int, b: int, e: int) -> dict[str, np.ndarray]:
    """Column arrays filled with the padding row: greedy, every knob off, no bias, no stop ids."""
    return {
        "temperature": np.zeros(num_rows, np.float32),
        "top_k": np.zeros(num_rows, np.int32),
        "top_p": np.ones(num_rows, np.float32),
        "min_p": np.zeros(num_rows, np.float32),
        "repetition_penalty": np.ones(num_rows, np.float32),
        "presence_penalty": np.zeros(num_rows, np.float32),
        "frequency_penalty": np.zeros(num_rows, np.float32),
        "bias_ids": np.full((num_rows, b), -1, np.int32),
        "bias_values": np.zeros((num_rows, b), np.float32),
        "key_data": np.zeros((num_rows, 2), np.uint32),
        "step": np.zeros(num_rows, np.int32),
        "min_tokens": np.zeros(num_rows, np.int32),
        "stop_ids": np.full((num_rows, e), -1, np.int32),
        "num_top_logprobs": np.zeros(num_rows, np.int32),
        "allowed_ids": np.full((num_rows, MAX_ALLOWED_TOKEN_IDS), -1, np.int32),
        "bad_prefix": np.full((num_rows, MAX_BAD_WORD_SEQS, RECENT), -1, np.int32),
        "bad_last": np.full((num_rows, MAX_BAD_WORD_SEQS), -1, np.int32),
        "recent_tokens": np.full((num_rows, RECENT), _NO_TOKEN, np.int32),
    }


def _fill_row(cols: dict[str, np.ndarray], row: int, p: Any, vocab_size: int, step: int, seed: int,
              eos_ids: Sequence[int]) -> None:
    """Write one request's knobs into row `row` of the host columns."""
    top_k = int(_get(p, "top_k", -1))
    cols["num_top_logprobs"][row] = _get(p, "logprobs", None) or 0
    cols["temperature"][row] = _get(p, "temperature", 1.0)
    cols["top_k"][row] = top_k if 0 < top_k < vocab_size else 0
    cols["top_p"][row] = _get(p, "top_p", 1.0)
    cols["min_p"][row] = _get(p, "min_p", 0.0)
    cols["repetition_penalty"][row] = _get(p, "repetition_penalty", 1.0)
    cols["presence_penalty"][row] = _get(p, "presence_penalty", 0.0)
    cols["frequency_penalty"][row] = _get(p, "frequency_penalty", 0.0)
    cols["key_data"][row] = seed_key_data(seed)
    cols["step"][row] = step
    _fill_bias(cols, row, _get(p, "logit_bias", {}), vocab_size)
    min_tokens = int(_get(p, "min_tokens", 0))
    cols["min_tokens"][row] = min(min_tokens, _INT32_MAX)  # vLLM sets no upper bound
    if min_tokens > 0:
        _fill_stop_ids(cols, row, _stop_ids(p, eos_ids))
    allowed = _get(p, "allowed_token_ids", None)
    if allowed is not None:
        _fill_allowed(cols, row, allowed, vocab_size)


def _fill_allowed(cols: dict[str, np.ndarray], row: int, allowed: Sequence[int], vocab_size: int) -> None:
    width = cols["allowed_ids"].shape[1]
    ids = list(dict.fromkeys(int(t) for t in allowed))
    if not 0 < len(ids) <= width or not all(0 <= t < vocab_size for t in ids):
        raise ValueError(f"allowed_token_ids must be 1 to {width} ids in [0, {vocab_size}), got {len(ids)} ids.")
    cols["allowed_ids"][row, : len(ids)] = ids


def _fill_bad_words(cols: dict[str, np.ndarray], row: int, words: Sequence[Sequence[int]],
                    recent: Sequence[int]) -> None:
    """Right-align each word's prefix so position R - 1 faces the newest generated token."""
    width, r = cols["bad_last"].shape[1], cols["recent_tokens"].shape[1]
    if len(words) > width or any(not 0 < len(w) <= r + 1 for w in words):
        raise ValueError(f"bad_words must be at most {width} sequences of 1 to {r + 1} tokens.")
    for j, word in enumerate(words):
        cols["bad_last"][row, j] = word[-1]
        if len(word) > 1:
            cols["bad_prefix"][row, j, r - len(word) + 1 :] = word[:-1]
    tail = list(recent)[-r:] if r else []
    if tail:
        cols["recent_tokens"][row, r - len(tail) :] = tail


def _fill_bias(cols: dict[str, np.ndarray], row: int, bias: dict[int, float], vocab_size: int) -> None:
    width = cols["bias_ids"].shape[1]
    if len(bias) > width:
        raise ValueError(f"logit_bias may hold at most {width} entries, got {len(bias)}.")
    for j, (token, value) in enumerate(bias.items()):
        if not 0 <= int(token) < vocab_size:
            raise ValueError(f"logit_bias token ids must be in [0, {vocab_size}), got {token}.")
        cols["bias_ids"][row, j] = int(token)
        cols["bias_values"][row, j] = float(value)


def _stop_ids(p: Any, eos_ids: Sequence[int]) -> list[int]:
    """Ids banned under min_tokens: EOS (unless ignore_eos) and stop_token_ids, deduplicated in order."""
    eos = () if _get(p, "ignore_eos", False) else tuple(eos_ids)
    return list(dict.fromkeys(int(t) for t in (*eos, *_get(p, "stop_token_ids", ()))))


def _fill_stop_ids(cols: dict[str, np.ndarray], row: int, ids: list[int]) -> None:
    width = cols["stop_ids"].shape[1]
    if len(ids) > width:
        raise ValueError(f"EOS + stop_token_ids may hold at most {width} ids with min_tokens, got {len(ids)}.")
    cols["stop_ids"][row, : len(ids)] = ids


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PenaltyState:
    """Device-resident token occurrence per sequence slot, rows aligned with the logits rows."""

    prompt_bits: Array  # [S, W] u32, W = ceil(V / 32): bit v % 32 of word v // 32 is set iff v is in the prompt
    output_counts: Array  # [S, V] i32 occurrences of each token in the output so far

    @classmethod
    def from_tokens(cls, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], num_rows: int,
                    vocab_size: int) -> PenaltyState:
        """Host builder for admission or resume after preemption; rows past len(prompts) are empty."""
        if len(prompts) != len(outputs) or len(prompts) > num_rows:
            raise ValueError(f"prompts and outputs must have equal length <= num_rows ({num_rows}).")
        bits = np.zeros((num_rows, _num_words(vocab_size)), np.uint32)  # [S, W]
        counts = np.zeros((num_rows, vocab_size), np.int32)  # [S, V]
        for row, (prompt, output) in enumerate(zip(prompts, outputs)):
            bits[row] = pack_token_bits(prompt, vocab_size)
            counts[row] = np.bincount(_checked_ids(output, vocab_size), minlength=vocab_size)
        return cls(prompt_bits=bits, output_counts=counts)


def _num_words(vocab_size: int) -> int:
    return -(-vocab_size // _BITS)


def _checked_ids(tokens: Sequence[int], vocab_size: int) -> np.ndarray:
    ids = np.asarray(tokens, np.int64).reshape(-1)  # [L]
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}).")
    return ids


def pack_token_bits(tokens: Sequence[int], vocab_size: int) -> np.ndarray:
    """Presence bitmask [ceil(V/32)] u32 of `tokens`, little-endian bit order within each word."""
    present = np.zeros(_num_words(vocab_size) * _BITS, bool)  # [W * 32]
    present[_checked_ids(tokens, vocab_size)] = True
    return np.packbits(present, bitorder="little").view("<u4").astype(np.uint32)  # [W]


def unpack_token_bits(bits: jax.Array, vocab_size: int) -> jax.Array:
    """pack_token_bits undone on device, row by row: [S, W] u32 -> [S, V] bool; elementwise shifts, no gather."""
    shifts = jnp.arange(_BITS, dtype=jnp.uint32)  # [32]
    flags = (bits[:, :, None] >> shifts) & 1  # [S, W, 32]
    return flags.reshape(bits.shape[0], -1)[:, :vocab_size].astype(bool)  # [S, V]


def update_output_counts(state: PenaltyState, tokens: jax.Array, active: jax.Array) -> PenaltyState:
    """Count the tokens just sampled (rows where `active`) inside the step: an O(S) scatter."""
    rows = jnp.arange(tokens.shape[0])  # [S]
    counts = jnp.asarray(state.output_counts).at[rows, tokens].add(active.astype(jnp.int32))  # [S, V]
    return dataclasses.replace(state, output_counts=counts)


def set_rows(state: PenaltyState, rows: jax.Array, new: PenaltyState) -> PenaltyState:
    """Overwrite slots `rows` [R] with the R rows of `new` (admission, resume, or slot reassignment)."""
    return jax.tree.map(lambda old, fresh: jnp.asarray(old).at[rows].set(fresh), state, new)


def validate_sampling_params(p: Any, vocab_size: int, max_logprobs: int, max_n: int, *,
                             eos_ids: Sequence[int] = (), max_logit_bias: int = MAX_LOGIT_BIAS,
                             max_stop_ids: int = MAX_STOP_IDS) -> None:
    """Refuse a request the sampler cannot serve exactly: InvalidInput with one sentence naming the field and
    the limit (the table in jaxinfer.validation). Call at admission so the bad request is refused and the
    rest keep running."""
    limits = Limits(vocab_size=vocab_size, eos_ids=tuple(eos_ids), max_n=max_n, max_logprobs=max_logprobs,
                    max_logit_bias=max_logit_bias, max_stop_ids=max_stop_ids)
    check_sampling_fields(normalized_sampling_fields(p), limits)
