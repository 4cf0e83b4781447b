"""q/k/v and gate/up joined at load (models.fused): the same logits as apart, on one device and split over forced
CPU devices, float and quantized; only parts that agree join; splitting gives back the published layout."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxinfer.models import LLAMA, QWEN3
from jaxinfer.models.fused import FusedColumns, fuse_projections, split_projections
from model_helpers import build_runner, rel_err, run_chunks, tiny_config, tiny_qwen3_dense
from test_quantization import prompt_then_decode_logits, quantized_runner

CFG = dict(num_heads=8, num_kv_heads=4, head_dim=8)


def _leaves_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


@pytest.mark.parametrize("family, tp", [("llama", 1), ("llama", 2), ("llama", 4), ("qwen3", 2)])
def test_joined_float_projections_give_the_same_logits(family: str, tp: int) -> None:
    cfg, fam = (tiny_config(**CFG), LLAMA) if family == "llama" else (tiny_qwen3_dense(**CFG), QWEN3)
    ids = list(np.random.default_rng(4).integers(0, cfg.vocab_size, 11))
    apart = build_runner(cfg, tp=tp, seed=5, family=fam)
    joined = build_runner(cfg, tp=tp, seed=5, family=fam, weights_hook=fuse_projections)
    layer = joined.weights.layers[0]
    qkv, gate_up = layer.wq, (layer.w_gate if family == "llama" else layer.mlp.w_gate)
    assert isinstance(qkv, FusedColumns) and layer.wk is None and layer.wv is None
    # Each device's columns: its 8/tp q heads' and 4/tp kv heads' (x head_dim 8), its share of the FFN twice.
    assert (qkv.shards, qkv.widths) == (tp, (64 // tp, 32 // tp, 32 // tp))
    assert isinstance(gate_up, FusedColumns) and gate_up.widths == (cfg.intermediate_size // tp,) * 2
    assert {s.data.shape for s in qkv.w.addressable_shards} == {(cfg.hidden_size, 128 // tp)}
    want = run_chunks(apart, ids, chunk=4, pages=[1, 2, 3])
    assert rel_err(run_chunks(joined, ids, chunk=4, pages=[1, 2, 3]), want) < 1e-6
    assert _leaves_equal(split_projections(joined.weights), apart.weights)


def test_kv_heads_replicated_over_devices_stay_apart() -> None:
    """tp=8 with 4 kv heads: k and v are whole on every device while q is split, so q/k/v cannot join (the
    FFN still does); the forward is unchanged."""
    cfg = tiny_config(**CFG)
    runner = build_runner(cfg, tp=8, seed=5, weights_hook=fuse_projections)
    layer = runner.weights.layers[0]
    assert not isinstance(layer.wq, FusedColumns) and layer.wk is not None
    assert isinstance(layer.w_gate, FusedColumns) and layer.w_up is None
    ids = list(np.random.default_rng(4).integers(0, cfg.vocab_size, 11))
    want = run_chunks(build_runner(cfg, tp=1, seed=5), ids, chunk=4, pages=[1, 2, 3])
    assert rel_err(run_chunks(runner, ids, chunk=4, pages=[1, 2, 3]), want) < 1e-5


@pytest.mark.parametrize("method, tp", [("int8", 1), ("int8:32", 2), ("int4:32", 2), ("fp8", 1)])
def test_joined_quantized_projections_give_the_same_logits(method: str, tp: int) -> None:
    """One quantized product for q/k/v and one for gate/up, per device inside shard_map when split."""
    cfg = tiny_config(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16)
    ids = list(np.random.default_rng(1).integers(0, cfg.vocab_size, 10))
    apart = quantized_runner(cfg, tp, method, "int8")
    joined = quantized_runner(cfg, tp, method, "int8", joined=True)
    qkv = joined.weights.layers[0].wq
    assert isinstance(qkv, FusedColumns) and qkv.w.out_features == 128 and qkv.shards == tp
    assert {s.data.shape[0] for s in qkv.w.values.addressable_shards} == {128 // tp}
    want = prompt_then_decode_logits(apart, ids)
    got = prompt_then_decode_logits(joined, ids)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    assert _leaves_equal(split_projections(joined.weights), apart.weights)


def test_parts_in_different_formats_stay_apart() -> None:
    """A GGUF Q4_K_M stores attn_v as Q6_K beside Q4_K q and k: formats that disagree are not joined."""
    cfg = tiny_config(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16)
    weights = quantized_runner(cfg, 1, "int8").weights
    other = quantized_runner(cfg, 1, "int8:32").weights
    layer = dataclasses.replace(weights.layers[0], wv=other.layers[0].wv)
    mixed = fuse_projections(dataclasses.replace(weights, layers=(layer,)))
    assert not isinstance(mixed.layers[0].wq, FusedColumns) and mixed.layers[0].wv is not None
    assert isinstance(mixed.layers[0].w_gate, FusedColumns)


def test_routed_experts_stay_apart() -> None:
    """Qwen3-MoE: attention and the dense layer's MLP join; the experts' [E, D, F] gate and up stacks do not
    (the grouped matmul takes them as they are)."""
    from jaxinfer.models import QWEN3_MOE
    from model_helpers import tiny_qwen3_moe

    runner = build_runner(tiny_qwen3_moe(), seed=3, family=QWEN3_MOE, weights_hook=fuse_projections)
    moe_layer, dense_layer = runner.weights.layers[1], runner.weights.layers[2]
    assert isinstance(moe_layer.wq, FusedColumns) and moe_layer.mlp is None
    assert moe_layer.moe.w_up is not None and not isinstance(moe_layer.moe.w_gate, FusedColumns)
    assert isinstance(dense_layer.mlp.w_gate, FusedColumns) and dense_layer.mlp.w_up is None


def test_consume_frees_the_parts_as_each_layer_is_joined() -> None:
    """What LLM does at load: the separate arrays' device buffers are freed once joined, the forward unchanged."""
    cfg = tiny_config(**CFG)
    ids = list(np.random.default_rng(4).integers(0, cfg.vocab_size, 11))
    apart = build_runner(cfg, tp=2, seed=5)
    spent = {}

    def consume(weights):
        spent["parts"] = [weights.layers[0].wq, weights.layers[1].w_up]
        return fuse_projections(weights, consume=True)

    joined = build_runner(cfg, tp=2, seed=5, weights_hook=consume)
    assert all(a.is_deleted() for a in spent["parts"])
    want = run_chunks(apart, ids, chunk=4, pages=[1, 2, 3])
    assert rel_err(run_chunks(joined, ids, chunk=4, pages=[1, 2, 3]), want) < 1e-6
