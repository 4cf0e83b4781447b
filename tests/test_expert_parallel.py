"""Expert parallelism on 8 forced CPU devices: the tiny HF-made Qwen3-MoE and Mixtral checkpoints give HF's
float32 greedy tokens and logprobs (|diff| < 2e-3) with experts split 2, 4 and 8 ways and at TP 2 x EP 4,
loaded exactly as saved; the compiled MoE layers gather no expert weights; bad degrees are refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.checkpoint import open_checkpoint
from jaxinfer.config import ConfigError, MeshConfig
from jaxinfer.describe import collective_ops
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.kv_cache import allocate_kv_cache
from jaxinfer.sharding import make_mesh, mesh_rules
from goldens import load_golden
from test_parity_moe import LOGPROB_TOL, PAGE_SIZE, checkpoint_dir, greedy_through_runner

LAYOUTS = {"ep2": MeshConfig(expert=2), "ep4": MeshConfig(expert=4), "ep8": MeshConfig(expert=8),
           "tp2_ep4": MeshConfig(tensor=2, expert=4)}


def sharded_runner(name: str, mesh_cfg: MeshConfig, **runner_kw) -> ModelRunner:
    ckpt = open_checkpoint(checkpoint_dir(load_golden(name), "published"))
    cfg = ckpt.config
    mesh, rules = make_mesh(mesh_cfg), mesh_rules(cfg, mesh_cfg)
    weights = ckpt.load_weights(ckpt.family.param_specs(cfg, jnp.float32), mesh, rules)
    cache = allocate_kv_cache(cfg, 32, PAGE_SIZE, jnp.float32, mesh, rules)
    return ModelRunner(ckpt.family, cfg, weights, cache, mesh, rules, **{"attention_impl": "reference", **runner_kw})


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "mixtral-tiny"])
def test_expert_parallel_reproduces_hf_greedy(name: str, layout: str) -> None:
    runner = sharded_runner(name, LAYOUTS[layout])
    moe_layer = next(layer.moe for layer in runner.weights.layers if layer.moe is not None)
    experts = LAYOUTS[layout].expert
    assert len({s.index for s in moe_layer.w_gate.addressable_shards}) == experts * LAYOUTS[layout].tensor
    for case in load_golden(name)["greedy"][:2]:
        tokens, logprobs = greedy_through_runner(runner, case["prompt_ids"], case["max_new_tokens"])
        assert tokens == case["output_ids"], (layout, case["prompt_ids"])
        np.testing.assert_allclose(logprobs, case["logprobs"], rtol=0, atol=LOGPROB_TOL)


def test_pallas_tpu_kernels_in_interpret_mode_under_expert_parallelism_reproduce_hf() -> None:
    """The TPU grouped-matmul and attention kernels (interpret mode), each device on its own experts."""
    runner = sharded_runner("mixtral-tiny", MeshConfig(expert=2), attention_impl="pallas_tpu", interpret=True)
    case = load_golden("mixtral-tiny")["greedy"][0]
    tokens, logprobs = greedy_through_runner(runner, case["prompt_ids"], 4)
    assert tokens == case["output_ids"][:4]
    np.testing.assert_allclose(logprobs, case["logprobs"][:4], rtol=0, atol=LOGPROB_TOL)


def test_expert_parallel_step_combines_with_one_all_reduce_per_moe_layer_and_gathers_no_experts() -> None:
    runner = sharded_runner("mixtral-tiny", MeshConfig(tensor=2, expert=4))
    cfg = runner.cfg
    from jaxinfer.engine.batcher import BatchShape, pack, SeqChunk

    batch = runner.place(pack([SeqChunk([1, 2, 3], 0, [1])], BatchShape(tokens=16, seqs=2, pages_per_seq=4), PAGE_SIZE))
    text = runner._logits_step.lower(runner.weights, runner.kv_cache, batch).compile().as_text()
    ops = collective_ops(text)
    expert_shapes = {a.shape for layer in runner.weights.layers for a in jax.tree.leaves(layer.moe)}
    for op, shapes in ops:
        assert op in ("all-reduce", "all-gather", "reduce-scatter"), op
        assert all(dims not in expert_shapes for _, dims in shapes), (op, shapes)
    combines = [op for op, shapes in ops if op == "all-reduce" and shapes == [("f32", (16, cfg.hidden_size))]]
    assert len(combines) >= cfg.num_layers  # the MoE combine of every layer (attention's may be f32 too)


def test_bad_expert_parallel_degrees_are_refused_before_any_device_work() -> None:
    cfg = open_checkpoint(checkpoint_dir(load_golden("mixtral-tiny"), "published")).config
    with pytest.raises(ConfigError, match="expert_parallel_size=3 does not divide the model's 8 experts"):
        mesh_rules(cfg, MeshConfig(expert=3))
    dense = open_checkpoint(checkpoint_dir(load_golden("qwen3-tiny"), "published")).config
    with pytest.raises(ConfigError, match="expert_parallel_size=2, but this model has no experts"):
        mesh_rules(dense, MeshConfig(expert=2))
    with pytest.raises(ConfigError, match="needs 16 devices .* but only 8"):
        make_mesh(MeshConfig(tensor=2, expert=8))
