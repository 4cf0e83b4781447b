"""Llama forward: paged/ragged path vs an independent dense float64 NumPy model, chunking, sharding, shapes."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import ConfigError, ModelConfig, RopeScaling
from jaxinfer.engine.batcher import BatchShape, SeqChunk, pack
from jaxinfer.models import LLAMA
from jaxinfer.presets import load_preset
from jaxinfer.sharding import tensor_parallel_rules
from model_helpers import abstract_forward_inputs, build_runner, dense_reference_logits, rel_err, run_chunks, tiny_config


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(tie_word_embeddings=False, num_kv_heads=4),
        dict(num_kv_heads=1, rope_scaling=RopeScaling.LLAMA3, rope_scaling_factor=8.0,
             rope_original_max_position=8, rope_theta=500000.0),
    ],
    ids=["gqa-tied", "mha-untied", "mqa-llama3-rope"],
)
def test_paged_forward_matches_dense_reference(overrides) -> None:
    cfg = tiny_config(**overrides)
    runner = build_runner(cfg, seed=1)
    ids = list(np.random.default_rng(0).integers(0, cfg.vocab_size, 13))
    ref = dense_reference_logits(runner.weights, cfg, ids)
    ours = run_chunks(runner, ids, chunk=1, pages=[3, 7, 1, 9])  # decode one token at a time
    assert rel_err(ours, ref) < 1e-5


@pytest.mark.parametrize("chunk", [1, 5, 13])
def test_chunked_prefill_equals_full_prefill(chunk: int) -> None:
    cfg = tiny_config()
    runner = build_runner(cfg, seed=2)
    ids = list(np.random.default_rng(1).integers(0, cfg.vocab_size, 13))
    ref = dense_reference_logits(runner.weights, cfg, ids)
    ours = run_chunks(runner, ids, chunk=chunk, pages=[5, 2, 8, 4])
    ends = [min(s + chunk, len(ids)) - 1 for s in range(0, len(ids), chunk)]
    assert rel_err(ours, ref[ends]) < 1e-5


def test_mixed_ragged_batch_matches_separate_runs() -> None:
    """A prefill chunk of one sequence and a decode of another in one step give each its own logits."""
    cfg = tiny_config()
    runner = build_runner(cfg, seed=3)
    a = list(np.random.default_rng(2).integers(0, cfg.vocab_size, 9))
    b = list(np.random.default_rng(3).integers(0, cfg.vocab_size, 6))
    ref_a = dense_reference_logits(runner.weights, cfg, a)
    ref_b = dense_reference_logits(runner.weights, cfg, b)
    shape = BatchShape(tokens=32, seqs=4, pages_per_seq=16)
    pa, pb = [1, 2, 3], [4, 5]
    step1 = pack([SeqChunk(a[:8], 0, pa), SeqChunk(b[:5], 0, pb)], shape, 4)
    first = np.asarray(runner.logits(runner.place(step1)))
    step2 = pack([SeqChunk(b[5:], 5, pb), SeqChunk(a[8:], 8, pa)], shape, 4)
    second = np.asarray(runner.logits(runner.place(step2)))
    assert rel_err(first[0], ref_a[7]) < 1e-5 and rel_err(first[1], ref_b[4]) < 1e-5
    assert rel_err(second[0], ref_b[5]) < 1e-5 and rel_err(second[1], ref_a[8]) < 1e-5


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_sharded_equals_unsharded(tp: int) -> None:
    """tp=8 with 4 kv heads exercises kv-head replication; q heads (8) split evenly."""
    cfg = tiny_config(num_heads=8, num_kv_heads=4, head_dim=8)
    ids = list(np.random.default_rng(4).integers(0, cfg.vocab_size, 11))
    base = build_runner(cfg, tp=1, seed=5)
    sharded = build_runner(cfg, tp=tp, seed=5)
    ref = run_chunks(base, ids, chunk=4, pages=[1, 2, 3])
    ours = run_chunks(sharded, ids, chunk=4, pages=[1, 2, 3])
    assert rel_err(ours, ref) < 1e-5
    wq = sharded.weights.layers[0].wq
    assert len({s.index for s in wq.addressable_shards}) == tp  # really split, not replicated


def test_tensor_parallel_must_divide_query_heads() -> None:
    with pytest.raises(ConfigError, match="tensor_parallel_size=3 does not divide the model's 4 query heads"):
        tensor_parallel_rules(tiny_config(), 3)


def _abstract_forward(cfg: ModelConfig, tokens: int = 256, seqs: int = 8, pages: int = 128, page_size: int = 16):
    from jaxinfer.attention import make_attention_fn

    _, weights, token_ids, md, cache = abstract_forward_inputs(cfg, tokens, seqs, pages, page_size)
    attn = make_attention_fn(cfg, "reference", False)
    return jax.eval_shape(lambda w, t, m, c: LLAMA.forward(w, cfg, t, m, c, attn), weights, token_ids, md, cache)


@pytest.mark.parametrize("name, params_b", [("llama-3-8b", 8.03), ("llama-3-70b", 70.55), ("llama-3.1-8b", 8.03),
                                            ("mistral-7b", 7.25)])
def test_full_size_presets_trace(name: str, params_b: float) -> None:
    from jaxinfer.params import count_params

    cfg = load_preset(name)
    assert count_params(LLAMA.param_specs(cfg, jnp.bfloat16)) / 1e9 == pytest.approx(params_b, rel=0.01)
    hidden, cache = _abstract_forward(cfg)
    assert hidden.shape == (256, cfg.hidden_size) and len(cache.k) == cfg.num_layers


def test_fields_the_llama_family_would_ignore_are_refused() -> None:
    with pytest.raises(ConfigError, match="ModelConfig.sliding_window is set, but the Llama family does not implement"):
        LLAMA.param_specs(tiny_config(sliding_window=128), jnp.float32)
