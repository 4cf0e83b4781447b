"""Expert weights from every layout they come in: HF per-expert and fused safetensors, GGUF stacked (and old
per-expert) tensors, orbax; missing, extra and misshapen expert tensors named in one sentence."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxinfer.checkpoint import CheckpointError, open_checkpoint
from jaxinfer.config import MeshConfig
from jaxinfer.sharding import make_mesh, tensor_parallel_rules
from test_parity_moe import greedy_through_runner, runner_for

DATA = Path(__file__).resolve().parents[1] / "data"
GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def load(path: Path):
    ckpt = open_checkpoint(path)
    cfg = ckpt.config
    mesh, rules = make_mesh(MeshConfig()), tensor_parallel_rules(cfg, 1)
    return cfg, ckpt.load_weights(ckpt.family.param_specs(cfg, jnp.float32), mesh, rules)


def f32(tensors: dict) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, np.float32) for k, v in tensors.items()}


@pytest.mark.parametrize("name, expert", [("qwen3-moe-tiny", "mlp.experts.{e}.{w}_proj.weight"),
                                          ("mixtral-tiny", "block_sparse_moe.experts.{e}.{w}.weight")])
def test_published_and_fused_layouts_stack_to_the_same_weights(name: str, expert: str) -> None:
    cfg, per_expert = load(DATA / name)
    cfg_fused, fused = load(DATA / f"{name}-fused")
    assert cfg == cfg_fused
    for a, b in zip(jax.tree.leaves(per_expert), jax.tree.leaves(fused)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    src = f32(load_file(DATA / name / "model.safetensors"))
    layer = 1
    moe = per_expert.layers[layer].moe
    gate, up, down = ("gate", "up", "down") if name.startswith("qwen") else ("w1", "w3", "w2")
    p = f"model.layers.{layer}."
    for e in (0, 5):
        np.testing.assert_array_equal(np.asarray(moe.w_gate[e]), src[p + expert.format(e=e, w=gate)].T)  # [D, F]
        np.testing.assert_array_equal(np.asarray(moe.w_up[e]), src[p + expert.format(e=e, w=up)].T)
        np.testing.assert_array_equal(np.asarray(moe.w_down[e]), src[p + expert.format(e=e, w=down)].T)  # [F, D]
    fused_src = f32(load_file(DATA / f"{name}-fused" / "model.safetensors"))
    gate_up = fused_src[p + "mlp.experts.gate_up_proj"]  # [E, 2F, D], gate rows first
    f = cfg.moe_intermediate_size
    np.testing.assert_array_equal(np.asarray(moe.w_up), gate_up[:, f:].transpose(0, 2, 1))
    assert moe.w_gate.shape == (cfg.num_experts, cfg.hidden_size, f) and moe.router.shape == (cfg.hidden_size, 8)


def _edited(tmp_path: Path, name: str, edit) -> Path:
    d = tmp_path / name
    shutil.copytree(DATA / name, d)
    tensors = load_file(d / "model.safetensors")
    edit(tensors)
    save_file(tensors, d / "model.safetensors")
    return d


def test_missing_expert_tensor_is_named(tmp_path: Path) -> None:
    d = _edited(tmp_path, "qwen3-moe-tiny", lambda t: t.pop("model.layers.5.mlp.experts.6.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) model.layers.5.mlp.experts.6.up_proj.weight\."):
        load(d)


def test_extra_expert_tensor_is_named(tmp_path: Path) -> None:
    """A ninth expert in an eight-expert model is left over, not silently ignored."""
    def add(t):
        t["model.layers.0.block_sparse_moe.experts.8.w2.weight"] = t["model.layers.0.block_sparse_moe.experts.0.w2.weight"]
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) model.layers.0.block_sparse_moe.experts.8.w2"):
        load(_edited(tmp_path, "mixtral-tiny", add))


def test_mixed_layouts_are_refused(tmp_path: Path) -> None:
    """Per-expert tensors next to a complete fused set: the fused set loads, the per-expert copies are extra."""
    src = load_file(DATA / "qwen3-moe-tiny" / "model.safetensors")
    d = _edited(tmp_path, "qwen3-moe-tiny-fused", lambda t: t.update(
        {"model.layers.1.mlp.experts.3.gate_proj.weight": src["model.layers.1.mlp.experts.3.gate_proj.weight"]}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) model.layers.1.mlp.experts.3.gate_proj.weight"):
        load(d)


def test_misshapen_fused_experts_name_the_shapes(tmp_path: Path) -> None:
    def cut(t):
        t["model.layers.1.mlp.experts.gate_up_proj"] = t["model.layers.1.mlp.experts.gate_up_proj"][:7]
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.experts.gate_up_proj' has shape \[7, 48, 64\] but "
                                              r"the model config needs \[8, 48, 64\] \(for weight layers.1.moe.w_gate\)"):
        load(_edited(tmp_path, "qwen3-moe-tiny-fused", cut))


def test_orbax_round_trip_of_a_moe_checkpoint(tmp_path: Path) -> None:
    from jaxinfer.cli import main

    dst = tmp_path / "orbax"
    assert main(["convert", str(DATA / "qwen3-moe-tiny"), str(dst), "--dtype", "float32"]) == 0
    cfg_a, a = load(DATA / "qwen3-moe-tiny")
    cfg_b, b = load(dst)
    assert cfg_a == cfg_b and cfg_b.mlp_only_layers == (3,)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert not (dst / "tokenizer").exists()  # the source had none


# ------------------------------------------------------------------------------------------------- GGUF


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row interleave for Llama-architecture files (what our loader undoes)."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _write(path: Path, arch: str, hf: dict, tensors: dict[str, np.ndarray], experts: dict | None) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(hf["num_attention_heads"])
    writer.add_head_count_kv(hf["num_key_value_heads"])
    writer.add_key_length(hf["head_dim"])
    writer.add_value_length(hf["head_dim"])
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_vocab_size(hf["vocab_size"])
    writer.add_rope_freq_base(hf["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    if experts:
        writer.add_expert_count(experts["count"])
        writer.add_expert_used_count(experts["used"])
        if "ffn" in experts:
            writer.add_expert_feed_forward_length(experts["ffn"])
    for name, value in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(value, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_attention(src: dict, hf: dict, i: int, permute: bool) -> dict[str, np.ndarray]:
    p, n, k = f"model.layers.{i}.", hf["num_attention_heads"], hf["num_key_value_heads"]
    q, kk = src[p + "self_attn.q_proj.weight"], src[p + "self_attn.k_proj.weight"]
    return {f"blk.{i}.attn_norm.weight": src[p + "input_layernorm.weight"],
            f"blk.{i}.attn_q.weight": _permute(q, n) if permute else q,
            f"blk.{i}.attn_k.weight": _permute(kk, k) if permute else kk,
            f"blk.{i}.attn_v.weight": src[p + "self_attn.v_proj.weight"],
            f"blk.{i}.attn_output.weight": src[p + "self_attn.o_proj.weight"],
            f"blk.{i}.ffn_norm.weight": src[p + "post_attention_layernorm.weight"]}


def _mixtral_gguf(tmp_path: Path, stacked: bool) -> Path:
    """mixtral-tiny as llama.cpp writes it: arch llama + expert counts, Q/K permuted, experts stacked or not."""
    hf = json.loads((DATA / "mixtral-tiny" / "config.json").read_text())
    src = f32(load_file(DATA / "mixtral-tiny" / "model.safetensors"))
    out = {"token_embd.weight": src["model.embed_tokens.weight"], "output_norm.weight": src["model.norm.weight"],
           "output.weight": src["lm_head.weight"]}
    for i in range(hf["num_hidden_layers"]):
        out.update(_gguf_attention(src, hf, i, permute=True))
        moe = f"model.layers.{i}.block_sparse_moe."
        out[f"blk.{i}.ffn_gate_inp.weight"] = src[moe + "gate.weight"]
        for ours, theirs in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
            per = [src[moe + f"experts.{e}.{theirs}.weight"] for e in range(8)]
            if stacked:
                out[f"blk.{i}.ffn_{ours}_exps.weight"] = np.stack(per)  # [E, out, in]
            else:
                out.update({f"blk.{i}.ffn_{ours}.{e}.weight": w for e, w in enumerate(per)})
    return _write(tmp_path / f"mixtral-{stacked}.gguf", "llama", hf, out, {"count": 8, "used": 2})


@pytest.mark.parametrize("stacked", [True, False], ids=["ffn_exps", "old-per-expert"])
def test_mixtral_gguf_reproduces_hf_greedy(tmp_path: Path, stacked: bool) -> None:
    path = _mixtral_gguf(tmp_path, stacked)
    assert open_checkpoint(path).family.name == "mixtral"
    golden = json.loads((GOLDEN / "mixtral-tiny.json").read_text())
    runner = runner_for(path)
    for case in golden["greedy"][1:3]:
        tokens, logprobs = greedy_through_runner(runner, case["prompt_ids"], case["max_new_tokens"])
        assert tokens == case["output_ids"]
        np.testing.assert_allclose(logprobs, case["logprobs"], rtol=0, atol=2e-3)


def test_qwen3moe_gguf_stacked_experts(tmp_path: Path) -> None:
    """llama.cpp's qwen3moe: every layer sparse, QK-norm tensors, no Q/K permute, stacked experts [E, out, in]."""
    r = np.random.default_rng(0)
    t = lambda *s: r.standard_normal(s).astype(np.float32)  # noqa: E731
    hf = {"num_hidden_layers": 1, "hidden_size": 16, "intermediate_size": 40, "num_attention_heads": 2,
          "num_key_value_heads": 1, "head_dim": 8, "max_position_embeddings": 64, "vocab_size": 32,
          "rope_parameters": {"rope_theta": 1e6}, "rms_norm_eps": 1e-6}
    tensors = {"token_embd.weight": t(32, 16), "output_norm.weight": t(16), "output.weight": t(32, 16),
               "blk.0.attn_norm.weight": t(16), "blk.0.attn_q.weight": t(16, 16), "blk.0.attn_k.weight": t(8, 16),
               "blk.0.attn_v.weight": t(8, 16), "blk.0.attn_output.weight": t(16, 16),
               "blk.0.attn_q_norm.weight": t(8), "blk.0.attn_k_norm.weight": t(8), "blk.0.ffn_norm.weight": t(16),
               "blk.0.ffn_gate_inp.weight": t(4, 16), "blk.0.ffn_gate_exps.weight": t(4, 6, 16),
               "blk.0.ffn_up_exps.weight": t(4, 6, 16), "blk.0.ffn_down_exps.weight": t(4, 16, 6)}
    cfg, w = load(_write(tmp_path / "q.gguf", "qwen3moe", hf, tensors, {"count": 4, "used": 2, "ffn": 6}))
    assert (cfg.architecture, cfg.num_experts, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (
        "qwen3_moe", 4, 6, True)
    moe = w.layers[0].moe
    np.testing.assert_array_equal(np.asarray(moe.w_gate), tensors["blk.0.ffn_gate_exps.weight"].transpose(0, 2, 1))
    np.testing.assert_array_equal(np.asarray(moe.w_down), tensors["blk.0.ffn_down_exps.weight"].transpose(0, 2, 1))
    np.testing.assert_array_equal(np.asarray(moe.router), tensors["blk.0.ffn_gate_inp.weight"].T)
    np.testing.assert_array_equal(np.asarray(w.layers[0].wq), tensors["blk.0.attn_q.weight"].reshape(2, 8, 16)
                                  .transpose(2, 0, 1))  # not un-permuted
    np.testing.assert_array_equal(np.asarray(w.layers[0].q_norm), tensors["blk.0.attn_q_norm.weight"])
    del tensors["blk.0.ffn_up_exps.weight"]
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) blk.0.ffn_up_exps.weight"):
        load(_write(tmp_path / "m.gguf", "qwen3moe", hf, tensors, {"count": 4, "used": 2, "ffn": 6}))


def test_qwen3_gguf_reproduces_hf_greedy(tmp_path: Path) -> None:
    """qwen3-tiny as llama.cpp writes it (tied: no output.weight; Qwen keeps HF's Q/K row order)."""
    hf = json.loads((DATA / "qwen3-tiny" / "config.json").read_text())
    src = f32(load_file(DATA / "qwen3-tiny" / "model.safetensors"))
    out = {"token_embd.weight": src["model.embed_tokens.weight"], "output_norm.weight": src["model.norm.weight"]}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update(_gguf_attention(src, hf, i, permute=False))
        out.update({f"blk.{i}.attn_q_norm.weight": src[p + "self_attn.q_norm.weight"],
                    f"blk.{i}.attn_k_norm.weight": src[p + "self_attn.k_norm.weight"],
                    **{f"blk.{i}.ffn_{w}.weight": src[p + f"mlp.{w}_proj.weight"] for w in ("gate", "up", "down")}})
    path = _write(tmp_path / "qwen3.gguf", "qwen3", hf, out, None)
    golden = json.loads((GOLDEN / "qwen3-tiny.json").read_text())
    runner = runner_for(path)
    assert runner.cfg.tie_word_embeddings
    case = golden["greedy"][2]
    tokens, logprobs = greedy_through_runner(runner, case["prompt_ids"], case["max_new_tokens"])
    assert tokens == case["output_ids"]
    np.testing.assert_allclose(logprobs, case["logprobs"], rtol=0, atol=2e-3)
