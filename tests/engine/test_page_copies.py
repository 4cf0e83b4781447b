"""Copy-on-write page copies run as a program of their own (`ModelRunner.copy_pages`), before the step whose plan
has them: no step program holds a copy (inside every step they were two scatters per layer, launched whether or
not a page moved), and any number of copies is applied, PAGE_COPY_WIDTH per call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import CacheConfig, EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.page_table import PageCopy
from jaxinfer.engine.page_copies import PAGE_COPY_WIDTH
from model_helpers import build_runner, step_hlo, tiny_config

NUM_PAGES = 48


def _runner_with_random_cache():
    runner = build_runner(tiny_config(), num_pages=NUM_PAGES, page_size=4)
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(runner.kv_cache))))
    runner.kv_cache = jax.tree.map(  # every page different, so a copy from the wrong page shows
        lambda a: jax.device_put(jax.random.normal(next(keys), a.shape, a.dtype), a.sharding), runner.kv_cache)
    return runner


def test_copies_past_one_call_all_land_and_nothing_else_moves() -> None:
    runner = _runner_with_random_cache()
    before = [np.asarray(a) for a in jax.tree.leaves(runner.kv_cache)]
    n = PAGE_COPY_WIDTH + 5  # two calls of the copy program
    src, dst = np.arange(1, n + 1), np.arange(NUM_PAGES - n, NUM_PAGES)  # disjoint: no copy reads a written page
    runner.copy_pages([PageCopy(int(s), int(d)) for s, d in zip(src, dst)])
    for old, new in zip(before, map(np.asarray, jax.tree.leaves(runner.kv_cache))):  # [P, page, K, H] a layer
        want = old.copy()
        want[dst] = old[src]
        np.testing.assert_array_equal(new, want)
    assert runner.num_compiles == 1  # one program serves both calls


def test_no_step_program_copies_pages() -> None:
    runner = build_runner(tiny_config(), num_pages=40, page_size=4)
    engine = Engine(runner, None, EngineConfig(max_num_seqs=8, max_num_batched_tokens=32),
                    CacheConfig(page_size=4, num_pages=40), use_tqdm=False, decode_steps_per_call=8)
    decode = (runner.weights, runner.kv_cache, engine.penalties,
              *engine._decode_args(engine.decode_shape(8), [], [], 0))
    texts = [step_hlo(engine, 16), runner._decode_steps.lower(*decode, max_steps=8).compile().as_text()]
    assert all("copy_leaf_pages" not in text for text in texts)
    src = dst = jnp.zeros(PAGE_COPY_WIDTH, jnp.int32)
    assert "copy_leaf_pages" in runner._copy_step.lower(runner.weights, runner.kv_cache, src, dst).as_text()
