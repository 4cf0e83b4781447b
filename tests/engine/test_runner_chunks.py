"""The runner's prompt logprobs, computed PROMPT_LOGPROB_CHUNK positions at a time, equal the one-shot
computation over all positions."""

import jax
import numpy as np

from jaxinfer.engine.runner import MAX_LOGPROBS, PROMPT_LOGPROB_CHUNK
from jaxinfer.engine.sampling import compute_prompt_logprobs
from tests.model_helpers import build_runner, tiny_config


def test_chunked_prompt_logprobs_equal_one_shot():
    cfg = tiny_config()
    runner = build_runner(cfg)
    t = 2 * PROMPT_LOGPROB_CHUNK  # two chunks
    hidden = jax.random.normal(jax.random.key(3), (t, cfg.hidden_size))  # [T, D]
    next_ids = jax.random.randint(jax.random.key(4), (t,), 0, cfg.vocab_size)  # [T]
    chunked = jax.jit(runner._prompt_logprobs)(runner.weights, hidden, next_ids)
    whole = compute_prompt_logprobs(runner.family.compute_logits(runner.weights, cfg, hidden), next_ids, MAX_LOGPROBS)
    for a, b in zip(chunked, whole):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
