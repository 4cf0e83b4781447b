"""The on-device sampler against a float64 NumPy reference written here.

Distribution tests draw many tokens of one request in a single call: N rows carry the same knobs and seed
with steps 0..N-1, which is exactly the stream one request would see over N steps on identical logits.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine.sampling import SamplerOutput, compute_prompt_logprobs, process_logits, sample
from jaxinfer.engine.sampling_rows import (
    PenaltyState,
    SamplingArrays,
    resolve_seed,
    seed_key_data,
    set_rows,
    update_output_counts,
    validate_sampling_params,
)
from jaxinfer.validation import MAX_LOGIT_BIAS

NUM_DRAWS = 4096  # rows per distribution call
SMALL_V = 16  # vocabulary of the distribution tests
DRAW_CANDIDATES = 4  # candidate set of the distribution tests
S, V = 8, 64  # the batch shape most tests share, so the sampler compiles once for all of them
EOS = 2
TRACES: collections.Counter = collections.Counter()  # traces of `_jit_sample` per static signature


def _traced_sample(logits: jax.Array, arrays: SamplingArrays, penalties: PenaltyState, *,
                   num_candidates: int) -> SamplerOutput:
    TRACES[(*logits.shape, num_candidates)] += 1  # Python side effect: runs only when jax traces
    return sample(logits, arrays, penalties, num_candidates=num_candidates)


_jit_sample = jax.jit(_traced_sample, static_argnames="num_candidates")
_jit_process = jax.jit(process_logits)


def run(logits: np.ndarray, arrays: SamplingArrays, penalties: PenaltyState | None = None) -> SamplerOutput:
    """Always pass a penalty state (empty when the test has none) so every call shares one pytree structure.
    C=8 candidates over V=64 puts both the candidate cut and the full-sort fallback under test."""
    if penalties is None:
        penalties = PenaltyState.from_tokens([], [], *logits.shape)
    return _jit_sample(logits, arrays, penalties, num_candidates=8)


@dataclasses.dataclass(frozen=True)
class Params:
    """Stand-in for config.SamplingParams: only the attributes the sampler reads."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1


# ---------------------------------------------------------------- NumPy reference


def ref_process(logits: np.ndarray, p: Params, prompt: Sequence[int] = (), output: Sequence[int] = (),
                eos: Sequence[int] = (), step: int = 0) -> np.ndarray:
    """bias -> repetition (prompt+output) / frequency / presence (output) -> min_tokens ban, in float64."""
    x = logits.astype(np.float64).copy()  # [V]
    for token, value in (p.logit_bias or {}).items():
        x[token] += value
    counts = np.bincount(np.asarray(output, np.int64), minlength=x.size)  # [V]
    seen = counts > 0
    seen[list(prompt)] = True
    rep = np.where(seen, p.repetition_penalty, 1.0)
    x = np.where(x > 0, x / rep, x * rep)
    x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
    if step < p.min_tokens:
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos))
        x[banned] = -np.inf
    return x


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


def ref_distribution(x: np.ndarray, p: Params) -> np.ndarray:
    """Target distribution after temperature, top-k, top-p (renormalised over top-k, vLLM) and min-p."""
    z = x / p.temperature
    order = np.argsort(-z, kind="stable")
    keep = np.ones(z.size, bool)
    if 0 < p.top_k < z.size:
        keep[order[p.top_k:]] = False
    if p.top_p < 1:
        sorted_probs = softmax(np.where(keep, z, -np.inf))[order]
        before = np.cumsum(sorted_probs) - sorted_probs  # mass strictly above each rank
        keep[order[before >= p.top_p]] = False
    if p.min_p > 0:
        probs = softmax(z)
        keep &= probs >= p.min_p * probs.max()
    return softmax(np.where(keep, z, -np.inf))


def assert_matches_distribution(samples: np.ndarray, target: np.ndarray) -> None:
    """Nothing outside the support; chi-square over bins (tail bins pooled to >= 5 expected) within ~6 sigma."""
    counts = np.bincount(samples, minlength=target.size)
    assert counts[target == 0].sum() == 0, f"sampled outside the support: {np.nonzero(counts * (target == 0))}"
    expected = target * samples.size
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    dof = max(len(exp) - 1, 1)
    assert chi2 < dof + 6 * np.sqrt(2 * dof), f"chi2={chi2:.1f} with {dof} dof"


# ---------------------------------------------------------------- helpers


def draw(logits: np.ndarray, p: Params, *, prompt: Sequence[int] = (), output: Sequence[int] = ()) -> np.ndarray:
    """NUM_DRAWS successive tokens of one seeded request on fixed logits [V], in one call. Only
    DRAW_CANDIDATES candidates, so top-k/top-p cases run both the candidate cut and the full-sort fallback."""
    v = logits.size
    arrays = SamplingArrays.from_params([p] * NUM_DRAWS, NUM_DRAWS, v, steps=range(NUM_DRAWS))
    pen = PenaltyState.from_tokens([prompt] * NUM_DRAWS, [output] * NUM_DRAWS, NUM_DRAWS, v)
    out = _jit_sample(np.tile(logits, (NUM_DRAWS, 1)), arrays, pen, num_candidates=DRAW_CANDIDATES)
    return np.asarray(out.tokens)


@jax.jit
def _documented_noise(seed: jax.Array, steps: jax.Array) -> jax.Array:
    """The key scheme the sampler documents, built independently: fold_in(PRNGKey(seed), n), Gumbel over V."""
    key = jax.random.PRNGKey(seed)
    return jax.vmap(lambda n: jax.random.gumbel(jax.random.fold_in(key, n), (SMALL_V,)))(steps)  # [N, V]


def ref_gumbel_tokens(processed: np.ndarray, p: Params, target: np.ndarray) -> np.ndarray:
    """Tokens Gumbel-max must pick on the reference's kept set (target > 0) with the documented noise."""
    noise = np.asarray(_documented_noise(p.seed, np.arange(NUM_DRAWS)), np.float64)  # [N, V]
    scores = np.where(target > 0, processed / p.temperature, -np.inf) + noise  # [N, V]
    return np.argmax(scores, axis=-1)


def random_logits(seed: int, shape: tuple[int, ...], scale: float = 2.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


# ---------------------------------------------------------------- host builders


def test_from_params_encodes_and_pads_rows():
    params = [Params(top_k=-1, seed=7), Params(top_k=50, temperature=0.0, seed=3), Params(top_k=3, seed=1,
              logit_bias={4: 1.5, 9: -2.0}, min_tokens=2, stop_token_ids=(5, EOS))]
    a = SamplingArrays.from_params(params, 5, 40, steps=[0, 4, 2], eos_ids=[EOS])
    assert a.temperature.shape == (5,) and a.bias_ids.shape == (5, MAX_LOGIT_BIAS)
    np.testing.assert_array_equal(a.top_k, [0, 0, 3, 0, 0])  # -1 and k >= V are both "off"
    np.testing.assert_array_equal(a.step, [0, 4, 2, 0, 0])
    np.testing.assert_array_equal(a.bias_ids[2, :3], [4, 9, -1])
    np.testing.assert_array_equal(a.stop_ids[2, :3], [EOS, 5, -1])  # deduplicated, EOS first
    np.testing.assert_array_equal(a.stop_ids[0], -1)  # no min_tokens: nothing to ban
    np.testing.assert_array_equal(a.key_data[0], jax.random.key_data(jax.random.PRNGKey(7)))
    assert (a.temperature[3:] == 0).all() and (a.top_p[3:] == 1).all() and (a.min_tokens[3:] == 0).all()


def test_ignore_eos_keeps_only_stop_token_ids_under_min_tokens():
    a = SamplingArrays.from_params([Params(min_tokens=3, ignore_eos=True, stop_token_ids=(6,))], 1, 10,
                                   eos_ids=[EOS])
    np.testing.assert_array_equal(a.stop_ids[0, :2], [6, -1])


def test_resolve_seed_children_differ_and_unseeded_draws():
    rng = np.random.default_rng(0)
    assert [resolve_seed(10, i, rng) for i in range(3)] == [10, 11, 12]
    assert resolve_seed(None, 0, rng) != resolve_seed(None, 0, rng)
    np.testing.assert_array_equal(seed_key_data(2**40 + 5), [2**8, 5])


def test_penalty_state_update_matches_rebuild_and_set_rows():
    v = 70  # not a multiple of 32: the last bitmask word is partial
    state = PenaltyState.from_tokens([[1, 69, 33], [0]], [[5, 5], []], 3, v)
    bits = state.prompt_bits  # [S, 3]: token 1 -> word 0 bit 1, 33 -> word 1 bit 1, 69 -> word 2 bit 5
    assert bits[0, 0] == 1 << 1 and bits[0, 1] == 1 << 1 and bits[0, 2] == 1 << 5
    updated = update_output_counts(state, jnp.array([5, 7, 9]), jnp.array([True, True, False]))
    rebuilt = PenaltyState.from_tokens([[1, 69, 33], [0]], [[5, 5, 5], [7]], 3, v)
    np.testing.assert_array_equal(updated.output_counts, rebuilt.output_counts)
    moved = set_rows(state, jnp.array([2]),
                     PenaltyState.from_tokens([[1, 69, 33]], [[5, 5]], 1, v))
    np.testing.assert_array_equal(moved.output_counts[2], state.output_counts[0])
    np.testing.assert_array_equal(moved.prompt_bits[2], state.prompt_bits[0])


# ---------------------------------------------------------------- logit processing


def test_bias_penalties_and_min_tokens_match_formulas():
    logits = random_logits(1, (S, V))  # both signs, so division and multiplication both occur
    params = [Params(repetition_penalty=1.7, presence_penalty=0.5, frequency_penalty=0.3),
              Params(repetition_penalty=0.6, frequency_penalty=-1.2, logit_bias={3: 5.0, 40: -7.5}),
              Params(presence_penalty=-2.0, min_tokens=4, stop_token_ids=(11,), logit_bias={EOS: 3.0}),
              Params(min_tokens=1, ignore_eos=True)]
    prompts = [[1, 2, 3, 3, 20], [3, 4, 30], [EOS], [0]]
    outputs = [[4, 4, 4, 9, 20], [5, 5, 30, 31], [7, 7, 11], [1]]
    steps = [5, 4, 3, 1]
    arrays = SamplingArrays.from_params(params, S, V, steps=steps, eos_ids=[EOS])
    got = np.asarray(_jit_process(logits, arrays, PenaltyState.from_tokens(prompts, outputs, S, V)))
    for row, p in enumerate(params):
        want = ref_process(logits[row], p, prompts[row], outputs[row], [EOS], steps[row])
        np.testing.assert_allclose(got[row], want, rtol=1e-6, atol=1e-6)
    assert np.isneginf(got[2, [EOS, 11]]).all() and np.isfinite(got[3]).all()
    np.testing.assert_array_equal(got[4:], logits[4:])  # padding rows pass through untouched


def test_no_penalty_state_equals_an_empty_one():
    """penalties=None (the static no-penalty build) samples what a state with nothing seen samples."""
    logits = random_logits(14, (S, V))
    params = [Params(seed=i, top_p=0.9, logit_bias={i: 2.0}, repetition_penalty=1.5, presence_penalty=1.0)
              for i in range(S)]
    arrays = SamplingArrays.from_params(params, S, V)
    without = jax.jit(sample, static_argnames="num_candidates")(logits, arrays, num_candidates=8)
    np.testing.assert_array_equal(without.tokens, run(logits, arrays).tokens)


def test_greedy_is_argmax_of_processed_logits():
    logits = random_logits(2, (S, V))
    params = [Params(temperature=0.0, repetition_penalty=1.3 + 0.2 * i, presence_penalty=0.4 * i,
                     logit_bias={i: 0.5 * i}, top_p=0.3, top_k=5) for i in range(S)]
    prompts, outputs = [[int(np.argmax(logits[i]))] for i in range(S)], [[i, i + 1] for i in range(S)]
    out = run(logits, SamplingArrays.from_params(params, S, V), PenaltyState.from_tokens(prompts, outputs, S, V))
    want = [np.argmax(ref_process(logits[i], params[i], prompts[i], outputs[i])) for i in range(S)]
    np.testing.assert_array_equal(out.tokens, want)


def test_top_k_one_equals_greedy_at_any_temperature():
    logits = random_logits(3, (S, V))
    params = [Params(top_k=1, temperature=t, seed=i) for i, t in enumerate([0.1, 0.5, 1, 2, 5, 10, 50, 1e3])]
    out = run(logits, SamplingArrays.from_params(params, S, V))
    np.testing.assert_array_equal(out.tokens, np.argmax(logits, axis=-1))


def test_temperature_to_zero_converges_to_argmax():
    logits = np.linspace(-3, 3, SMALL_V).astype(np.float32)[np.random.default_rng(4).permutation(SMALL_V)]
    tokens = draw(logits, Params(temperature=1e-3, seed=5))  # gap 0.4 / T = 400 nats: flips impossible
    assert (tokens == np.argmax(logits)).all()
    tokens = draw(logits, Params(temperature=1e-6, seed=5))  # below GREEDY_EPS: the greedy path
    assert (tokens == np.argmax(logits)).all()


# ---------------------------------------------------------------- distributions


DISTRIBUTION_CASES = {
    "temperature_0.7": Params(temperature=0.7, seed=11),
    "temperature_1.6": Params(temperature=1.6, seed=12),
    "top_k": Params(top_k=4, temperature=1.2, seed=13),
    "top_k_past_candidates": Params(top_k=7, temperature=1.2, seed=18),
    "top_p": Params(top_p=0.6, seed=14),
    "min_p": Params(min_p=0.15, temperature=0.9, seed=15),
    "top_k_then_top_p": Params(top_k=6, top_p=0.7, temperature=1.3, seed=16),
    "combined": Params(temperature=0.9, top_k=10, top_p=0.9, min_p=0.05, repetition_penalty=1.4,
                       presence_penalty=0.3, frequency_penalty=0.2, logit_bias={1: 1.0, 9: -1.5}, seed=17),
}


@pytest.mark.parametrize("name", sorted(DISTRIBUTION_CASES))
def test_sampling_matches_target_distribution(name):
    """Chi-square against the exact target, and every draw equal to Gumbel-max over the reference's kept
    set with the documented noise: the kept set is exact, not just the frequencies close."""
    p = DISTRIBUTION_CASES[name]
    logits = random_logits(20, (SMALL_V,), scale=1.5)
    prompt, output = [0, 3, 9], [3, 3, 5]
    tokens = draw(logits, p, prompt=prompt, output=output)
    target = ref_distribution(ref_process(logits, p, prompt, output), p)
    assert_matches_distribution(tokens, target)
    np.testing.assert_array_equal(tokens, ref_gumbel_tokens(ref_process(logits, p, prompt, output), p, target))


@pytest.mark.parametrize(("case", "scale", "p"), [
    ("nucleus_fits_in_candidates", 4.0, Params(top_p=0.8, seed=21)),
    ("nucleus_exceeds_candidates", 0.2, Params(top_p=0.5, seed=22)),
    ("top_k_exceeds_candidates", 0.5, Params(top_k=7, top_p=0.9, seed=23)),
])
def test_top_p_support_is_exact_with_and_without_fallback(case, scale, p):
    """C=4 candidates: the candidate cut and the full-sort fallback both keep exactly the nucleus."""
    logits = random_logits(30, (SMALL_V,), scale)
    target = ref_distribution(logits.astype(np.float64), p)
    assert ((target > 0).sum() <= DRAW_CANDIDATES) == (case == "nucleus_fits_in_candidates")
    tokens = draw(logits, p)
    np.testing.assert_array_equal(np.unique(tokens), np.nonzero(target)[0])  # support == nucleus
    np.testing.assert_array_equal(tokens, ref_gumbel_tokens(logits.astype(np.float64), p, target))


# ---------------------------------------------------------------- bias, min_tokens


def test_logit_bias_forces_and_bans_tokens():
    logits = random_logits(5, (S, V))
    params = [Params(temperature=0.0, logit_bias={7: 100.0}), Params(temperature=1.0, seed=1, logit_bias={7: 100.0}),
              Params(temperature=0.0, logit_bias={int(np.argmax(logits[2])): -100.0})]
    out = run(logits, SamplingArrays.from_params(params, S, V))
    assert out.tokens[0] == 7 and out.tokens[1] == 7
    assert out.tokens[2] == np.argsort(-logits[2])[1]


def _eos_heavy_logits() -> np.ndarray:
    logits = np.zeros((S, V), np.float32)
    logits[:, [EOS, 5]] = [30.0, 29.0]  # EOS, then stop id 5, dominate every row
    return logits


def test_min_tokens_suppresses_eos_and_stop_ids_until_reached():
    p = Params(temperature=1.0, seed=3, min_tokens=3, stop_token_ids=(5,))
    params = [p] * 4 + [dataclasses.replace(p, ignore_eos=True)]
    arrays = SamplingArrays.from_params(params, S, V, steps=[0, 1, 2, 3, 0], eos_ids=[EOS])
    tokens = np.asarray(run(_eos_heavy_logits(), arrays).tokens)
    assert not np.isin(tokens[:3], [EOS, 5]).any() and tokens[3] == EOS
    assert tokens[4] == EOS  # ignore_eos: only stop_token_ids are banned


def test_advance_moves_min_tokens_window_and_the_key_stream():
    arrays = SamplingArrays.from_params([Params(seed=9, min_tokens=2)], S, V, eos_ids=[EOS])
    tokens = []
    for _ in range(3):
        tokens.append(int(run(_eos_heavy_logits(), arrays).tokens[0]))
        arrays = arrays.advance()
    assert tokens[0] != EOS and tokens[1] != EOS and tokens[2] == EOS


# ---------------------------------------------------------------- seeds


def _run_steps(rows: list[Params], row_logits: np.ndarray, target_row: int, steps: int) -> list[int]:
    arrays = SamplingArrays.from_params(rows, row_logits.shape[0], row_logits.shape[1])
    out = []
    for _ in range(steps):
        out.append(int(run(row_logits, arrays).tokens[target_row]))
        arrays = arrays.advance()
    return out


def test_same_seed_same_tokens_alone_in_any_batch_and_after_preemption():
    mine = Params(temperature=1.0, top_p=0.95, seed=1234)
    my_logits = random_logits(6, (V,), scale=0.5)
    alone = _run_steps([mine], my_logits[None], 0, 6)
    others = [Params(temperature=0.8, seed=i, top_k=5) for i in range(7)]
    batch_logits = random_logits(7, (S, V))
    batch_logits[5] = my_logits
    assert _run_steps(others[:5] + [mine] + others[5:7], batch_logits, 5, 6) == alone
    batch_logits = np.roll(batch_logits, -5, axis=0)
    shuffled = [mine] + [Params(temperature=0.0)] * 3 + [Params(temperature=2.0, seed=None)] * 4
    assert _run_steps(shuffled, batch_logits, 0, 6) == alone
    # Preempted after 3 tokens and resumed by recompute: step 3 picks up the same stream.
    resumed = SamplingArrays.from_params([mine], 1, V, steps=[3])
    assert int(run(my_logits[None], resumed).tokens[0]) == alone[3]


def test_different_seeds_give_different_streams():
    logits = np.zeros((S, V), np.float32)  # uniform: two 16-token streams collide with probability 64**-16
    streams = {tuple(_run_steps([Params(seed=s) for s in range(S)], logits, row, 16)) for row in range(S)}
    assert len(streams) == S


# ---------------------------------------------------------------- compile, padding, NaN, logprobs


def _random_params(rng: np.random.Generator, trial: int) -> Params:
    return Params(temperature=float(rng.choice([0.0, 0.5, 1.3])), top_k=int(rng.choice([-1, 3, 300])),
                  top_p=float(rng.choice([1.0, 0.2, 0.9])), min_p=float(rng.choice([0.0, 0.3])),
                  repetition_penalty=float(rng.uniform(0.5, 2)), presence_penalty=float(rng.uniform(-2, 2)),
                  frequency_penalty=float(rng.uniform(-2, 2)), logit_bias={int(rng.integers(V)): 3.0},
                  seed=int(rng.integers(1 << 30)) if trial % 2 else None, min_tokens=int(rng.integers(3)),
                  stop_token_ids=(1, 4))


def test_changing_every_knob_never_retraces():
    """Random values for every knob, both filtering paths (C=8 candidates, top_k=300 forces the fallback),
    penalties, seeds, min_tokens and batch fill: one trace of the shared jitted sampler."""
    rng = np.random.default_rng(8)
    for trial in range(6):
        params = [_random_params(rng, trial) for _ in range(int(rng.integers(1, S + 1)))]
        arrays = SamplingArrays.from_params(params, S, V, steps=[trial] * len(params), eos_ids=[EOS])
        pen = PenaltyState.from_tokens([[1, trial]] * len(params), [[trial]] * len(params), S, V)
        tokens = np.asarray(run(random_logits(trial, (S, V)), arrays, pen).tokens)
        assert ((0 <= tokens) & (tokens < V)).all()
    assert TRACES[(S, V, 8)] == 1


def test_padding_rows_do_not_change_real_rows():
    params = [Params(seed=1, top_k=7), Params(seed=2, top_p=0.5, repetition_penalty=1.5), Params(temperature=0.0)]
    logits = random_logits(9, (S, V))
    pen = PenaltyState.from_tokens([[1, 2]] * 3, [[3]] * 3, S, V)
    padded = run(logits, SamplingArrays.from_params(params, S, V), pen)
    for row, p in enumerate(params):
        alone = run(logits[row:row + 1], SamplingArrays.from_params([p], 1, V), jax.tree.map(lambda x: x[:1], pen))
        assert padded.tokens[row] == alone.tokens[0]
        np.testing.assert_allclose(padded.logprobs[row], alone.logprobs[0], rtol=1e-6)
    assert ((0 <= padded.tokens) & (padded.tokens < V)).all() and np.isfinite(padded.logprobs).all()


def test_rows_with_nothing_left_still_return_valid_tokens():
    logits = random_logits(10, (S, V))
    logits[0] = -np.inf  # every token impossible
    logits[1, 3] = np.nan  # a broken logit
    logits[2:4] = -np.inf
    logits[2:4, [EOS, 5, 6]] = 1.0  # only three tokens possible...
    params = [Params(seed=1), Params(seed=2, top_p=1e-6, min_p=1.0),
              Params(seed=3, min_tokens=5, stop_token_ids=(5, 6)),  # ...and min_tokens bans two of them
              Params(seed=4, top_k=2, min_tokens=5, stop_token_ids=(EOS, 5, 6))]  # ...or all three
    tokens = np.asarray(run(logits, SamplingArrays.from_params(params, S, V)).tokens)
    assert ((0 <= tokens) & (tokens < V)).all()
    assert tokens[1] == np.nanargmax(logits[1]) and tokens[2] == EOS


def test_top_alternatives_are_skipped_when_no_row_asks_for_them():
    logits = random_logits(12, (S, V))
    out = run(logits, SamplingArrays.from_params([Params(seed=i) for i in range(S)], S, V))
    raw = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    tokens = np.asarray(out.tokens)
    np.testing.assert_allclose(out.logprobs, raw[np.arange(S), tokens], rtol=1e-5)  # still exact
    np.testing.assert_array_equal(out.ranks, 1 + (raw > raw[np.arange(S), tokens][:, None]).sum(-1))
    assert not np.asarray(out.top_ids).any() and not np.asarray(out.top_logprobs).any()


def test_logprobs_are_raw_model_logprobs_with_top_alternatives():
    logits = random_logits(11, (S, V))
    # One row asking for alternatives is enough for the whole batch to compute them.
    params = [Params(seed=i, temperature=0.3 + i, logit_bias={i: 20.0}, repetition_penalty=2.0,
                     logprobs=5 if i == 0 else None) for i in range(S)]
    out = run(logits, SamplingArrays.from_params(params, S, V), PenaltyState.from_tokens([[0, 1]] * S, [[2]] * S, S, V))
    raw = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    tokens, k = np.asarray(out.tokens), out.top_ids.shape[1]
    np.testing.assert_allclose(out.logprobs, raw[np.arange(S), tokens], rtol=1e-5)
    np.testing.assert_array_equal(out.top_ids, np.argsort(-raw, axis=-1)[:, :k])
    np.testing.assert_allclose(out.top_logprobs, np.sort(raw, axis=-1)[:, ::-1][:, :k], rtol=1e-5)
    np.testing.assert_array_equal(out.ranks, 1 + (raw > raw[np.arange(S), tokens][:, None]).sum(-1))


def test_compute_prompt_logprobs():
    t, k = 7, 4
    logits = random_logits(12, (t, V))
    next_ids = np.random.default_rng(13).integers(0, V, t)
    out = jax.jit(compute_prompt_logprobs, static_argnames="k")(logits, next_ids, k=k)
    raw = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(out.logprobs, raw[np.arange(t), next_ids], rtol=1e-5)
    np.testing.assert_array_equal(out.top_ids, np.argsort(-raw, axis=-1)[:, :k])
    np.testing.assert_allclose(out.top_logprobs, np.sort(raw, axis=-1)[:, ::-1][:, :k], rtol=1e-5)
    np.testing.assert_array_equal(out.ranks, 1 + (raw > raw[np.arange(t), next_ids][:, None]).sum(-1))


# ---------------------------------------------------------------- validation


BAD_PARAMS = [
    ("temperature", {"temperature": -0.1}), ("temperature", {"temperature": float("nan")}),
    ("top_p", {"top_p": 0.0}), ("top_p", {"top_p": 1.5}), ("top_p", {"top_p": float("nan")}),
    ("top_k", {"top_k": -2}),
    ("min_p", {"min_p": -0.1}), ("min_p", {"min_p": 1.1}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("presence_penalty", {"presence_penalty": 2.5}), ("frequency_penalty", {"frequency_penalty": -3.0}),
    ("n", {"n": 0}), ("n", {"n": 9}), ("max_tokens", {"max_tokens": 0}),
    ("min_tokens", {"min_tokens": -1}), ("min_tokens", {"min_tokens": 17}),
    ("logprobs", {"logprobs": 21}), ("prompt_logprobs", {"prompt_logprobs": 21}),
    ("logit_bias", {"logit_bias": {100: 1.0}}), ("logit_bias", {"logit_bias": {-1: 1.0}}),
    ("logit_bias", {"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}),
    ("logit_bias", {"logit_bias": {3: 101.0}}),
    ("stop_token_ids", {"stop_token_ids": (100,)}),
    ("stop_token_ids", {"stop_token_ids": tuple(range(10)), "min_tokens": 1}),
    ("seed", {"seed": 1.5}),
]


@pytest.mark.parametrize(("field", "kwargs"), BAD_PARAMS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_PARAMS)])
def test_validation_names_the_field(field, kwargs):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be"):
        validate_sampling_params(Params(**kwargs), vocab_size=100, max_logprobs=20, max_n=8, eos_ids=[EOS])


def test_validation_accepts_limits():
    for kwargs in [{}, {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 1.0, "n": 8, "min_tokens": 16,
                        "logprobs": 20, "presence_penalty": -2.0, "logit_bias": {99: -100.0}, "seed": 0},
                   {"stop_token_ids": tuple(range(10)), "top_k": 1000}, {"top_k": 0}]:  # 0: off, as in vLLM
        validate_sampling_params(Params(**kwargs), vocab_size=100, max_logprobs=20, max_n=8, eos_ids=[EOS])


def test_from_params_rejects_overflowing_rows():
    with pytest.raises(ValueError, match="num_rows"):
        SamplingArrays.from_params([Params()] * 3, 2, 10)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingArrays.from_params([Params(logit_bias={i: 1.0 for i in range(3)})], 1, 10, max_logit_bias=2)


# ---------------------------------------------------------------- the branch-free build (GPU single steps)


def test_branch_free_sampler_equals_the_branching_one_and_has_no_conditional():
    """`branch_free=True` (no lax.cond: on a GPU each one makes the host wait for the device) gives the same
    tokens, logprobs and ranks for every batch `branch_free_applies` to: greedy and tempered rows, min-p, bias,
    penalties, min_tokens, a grammar bitmask and allowed ids, padding rows; and for an all-greedy batch."""
    from jaxinfer.engine.sampling import branch_free_applies

    rng = np.random.default_rng(21)
    params = [Params(temperature=0.0, top_k=5, top_p=0.5),  # greedy: its top-k/top-p are never used
              Params(temperature=0.8, seed=1), Params(temperature=1.3, seed=2, min_p=0.05),
              Params(temperature=0.7, seed=3, repetition_penalty=1.4, frequency_penalty=0.3, logit_bias={4: 3.0}),
              Params(temperature=0.0, presence_penalty=0.8, min_tokens=3, stop_token_ids=(9,)),
              Params(temperature=0.9, seed=5)]
    prompts, outputs = [[1, 2], [3], [], [4, 4, 5], [6], [7]], [[8], [], [9, 9], [10], [2], []]
    pen = PenaltyState.from_tokens(prompts, outputs, S, V)
    bitmask = np.full((S, V // 32), -1, np.int32)
    bitmask[1] = rng.integers(-2**31, 2**31, V // 32).astype(np.int32) | 1  # a grammar row (token 0 allowed)
    bitmask[4, 0] = 0b1011
    allowed = np.full((S, 3), -1, np.int32)
    allowed[5] = [3, 17, 40]
    sample_fn = jax.jit(sample, static_argnames=("num_candidates", "branch_free"))
    for case in (params, [dataclasses.replace(p, temperature=0.0) for p in params]):
        arrays = SamplingArrays.from_params(case, S, V, steps=[0, 1, 2, 3, 1, 0], eos_ids=[EOS])
        arrays = dataclasses.replace(arrays, token_bitmask=bitmask, allowed_ids=allowed)
        assert branch_free_applies(arrays)
        for seed in range(3):
            logits = random_logits(100 + seed, (S, V))
            want = sample_fn(logits, arrays, pen, num_candidates=8)
            got = sample_fn(logits, arrays, pen, num_candidates=8, branch_free=True)
            for name, a, b in zip(SamplerOutput._fields, got, want):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    hlo = sample_fn.lower(logits, arrays, pen, num_candidates=8, branch_free=True).compile().as_text()
    assert " conditional(" not in hlo
    assert " conditional(" in sample_fn.lower(logits, arrays, pen, num_candidates=8).compile().as_text()


def test_branch_free_applies_only_without_top_k_top_p_or_top_logprobs():
    from jaxinfer.engine.sampling import branch_free_applies

    def applies(p: Params) -> bool:
        return branch_free_applies(SamplingArrays.from_params([Params(), p], S, V))

    assert applies(Params(temperature=0.0, top_k=3, top_p=0.2)) and applies(Params(min_p=0.1, logprobs=0))
    assert not applies(Params(top_k=3)) and not applies(Params(top_p=0.9)) and not applies(Params(logprobs=1))
