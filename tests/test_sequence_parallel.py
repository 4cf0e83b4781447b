"""Sequence parallelism on forced CPU devices: a 4k-token prompt, prefilled in 1024-token steps whose tokens
are split over `seq` devices, gives the same greedy continuation at sequence_parallel_size 1, 2 and 4 (and
composed with tensor parallelism); the compiled step gathers the new keys/values (activations), never a
weight or the cache."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.describe import collective_ops
from jaxinfer.params import abstract_params
from model_helpers import step_hlo, tiny_config

PROMPT_LEN, NEW = 4096, 6
# No warmup: each engine compiles only the two shapes it runs (1024-token prefill steps, one-token decodes).
ENGINE = dict(random_weights=True, seed=3, dtype="float32", max_num_seqs=2, max_num_batched_tokens=1024,
              max_model_len=PROMPT_LEN + 64, page_size=16, num_pages=300, use_tqdm=False, warmup=False)
# A width no token bucket shares, so an activation's shape is never mistaken for a weight's.
CFG = dict(hidden_size=80)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return np.random.default_rng(0).integers(1, 256, PROMPT_LEN).tolist()


def continuation(llm: LLM, prompt: list[int]) -> list[int]:
    out = llm.generate([prompt], SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))[0]
    return out.token_ids


@pytest.fixture(scope="module")
def unsharded(prompt: list[int]) -> list[int]:
    return continuation(LLM(tiny_config(**CFG), **ENGINE), prompt)


@pytest.mark.parametrize("seq, tp", [(2, 1), (4, 1), (2, 2)])
def test_long_prompt_gives_the_same_tokens_split_over_devices(prompt, unsharded, seq: int, tp: int) -> None:
    llm = LLM(tiny_config(**CFG), sequence_parallel_size=seq, tensor_parallel_size=tp, **ENGINE)
    assert llm.mesh.shape["seq"] == seq
    assert continuation(llm, prompt) == unsharded
    if seq == 4:
        _check_no_weight_gathers(llm)


def _check_no_weight_gathers(llm: LLM) -> None:
    """The prefill executable of the largest token bucket: collectives only of activation size."""
    runner = llm.engine.runner
    weights = {a.shape for a in jax.tree.leaves(abstract_params(llm.family.param_specs(llm.model_config, "float32")))
               if a.ndim > 1}
    engine = llm.engine
    ops = collective_ops(step_hlo(engine, 1024))
    assert any(op == "all-gather" for op, _ in ops)  # the new keys/values of every device's tokens
    for op, shapes in ops:
        for _, dims in shapes:
            assert dims not in weights and dims[:1] != (runner.kv_cache.num_pages,), (op, dims)
