"""Checkpoint loaders: layouts, sharded placement, orbax round trip, and one-sentence errors for bad files."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxinfer.checkpoint import CheckpointError, open_checkpoint
from jaxinfer.checkpoint.gguf import unpermute_rotary_rows
from jaxinfer.checkpoint.orbax import save_checkpoint
from jaxinfer.config import MeshConfig
from jaxinfer.sharding import make_mesh, tensor_parallel_rules
from tiny_checkpoint import TINY_HF_CONFIG, write_tiny_hf_checkpoint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_path) -> Path:
    return write_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny"), smollm2_path, seed=7)


def load(path: Path, tp: int = 1):
    ckpt = open_checkpoint(path)
    cfg = ckpt.config
    mesh, rules = make_mesh(MeshConfig(tensor=tp)), tensor_parallel_rules(cfg, tp)
    return cfg, ckpt.load_weights(ckpt.family.param_specs(cfg, jnp.float32), mesh, rules)


def test_safetensors_layouts_map_to_ours(tiny_dir: Path) -> None:
    cfg, w = load(tiny_dir)
    src = load_file(tiny_dir / "model.safetensors")
    h, n, k = cfg.head_size, cfg.num_heads, cfg.num_kv_heads
    q = src["model.layers.1.self_attn.q_proj.weight"]  # [N*H, D]
    np.testing.assert_array_equal(np.asarray(w.layers[1].wq), q.reshape(n, h, -1).transpose(2, 0, 1))
    o = src["model.layers.0.self_attn.o_proj.weight"]  # [D, N*H]
    np.testing.assert_array_equal(np.asarray(w.layers[0].wo), o.reshape(-1, n, h).transpose(1, 2, 0))
    kk = src["model.layers.0.self_attn.k_proj.weight"]
    assert w.layers[0].wk.shape == (cfg.hidden_size, k, h) and np.allclose(w.layers[0].wk[:, 1, 3], kk[h + 3])
    np.testing.assert_array_equal(np.asarray(w.layers[0].w_down), src["model.layers.0.mlp.down_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(w.lm_head), src["lm_head.weight"].T)


def test_sharded_index_and_tensor_parallel_placement(tmp_path: Path, smollm2_path: Path, tiny_dir: Path) -> None:
    sharded = write_tiny_hf_checkpoint(tmp_path / "sharded", smollm2_path, seed=7, sharded=True)
    _, single = load(tiny_dir)
    _, split = load(sharded, tp=2)
    for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(split)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    shards = split.layers[0].wq.addressable_shards
    assert {s.data.shape for s in shards} == {(64, 2, 16)}  # each device holds only its two q heads


def test_a_model_spanning_processes_reads_only_each_devices_block(tiny_dir: Path, monkeypatch) -> None:
    """Multi-host: a process reads only its devices' blocks of a split weight, never the whole tensor. One
    process cannot span processes, so the check that picks the block path is told every weight does."""
    from jaxinfer.checkpoint import assemble

    _, whole = load(tiny_dir, tp=4)
    reads: list[tuple[str, tuple[slice, ...]]] = []
    original = assemble._place_blocks

    def spy(p, source, sharding):
        if not hasattr(source, "spied"):
            read_block, source.spied = source.read_block, True
            source.read_block = lambda name, index: reads.append((name, index)) or read_block(name, index)
        return original(p, source, sharding)

    monkeypatch.setattr(assemble, "_reads_blocks", lambda p, source, sharding, post: source.read_block is not None)
    monkeypatch.setattr(assemble, "_place_blocks", spy)
    _, blocks = load(tiny_dir, tp=4)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(blocks)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    q_reads = [index for name, index in reads if name == "model.layers.0.self_attn.q_proj.weight"]
    assert len(q_reads) == 4 and {(ix[0].stop - ix[0].start) for ix in q_reads} == {64 // 4}  # a quarter of the rows


def test_orbax_convert_round_trip(tmp_path: Path, tiny_dir: Path) -> None:
    from jaxinfer.cli import main

    dst = tmp_path / "orbax"
    assert main(["convert", str(tiny_dir), str(dst), "--dtype", "float32"]) == 0
    cfg_a, a = load(tiny_dir)
    cfg_b, b = load(dst, tp=2)  # restored straight into a 2-way tensor-parallel layout
    assert cfg_a == cfg_b
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert len({s.index for s in b.layers[0].w_up.addressable_shards}) == 2
    assert (dst / "tokenizer" / "tokenizer.json").is_file()
    with pytest.raises(CheckpointError, match="already exists"):
        save_checkpoint(dst, cfg_a, a, tokenizer=None)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    heads, h, d = 3, 8, 5
    w = np.random.default_rng(0).standard_normal((heads * h, d))
    # llama.cpp's converter: within each head, interleave the two rotary halves row by row.
    permuted = w.reshape(heads, 2, h // 2, d).swapaxes(1, 2).reshape(heads * h, d)
    np.testing.assert_array_equal(unpermute_rotary_rows(permuted, heads), w)


# ---------------------------------------------------------------------------------------- bad files


def _copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_truncated_safetensors(tmp_path: Path, tiny_dir: Path) -> None:
    d = _copy_dir(tiny_dir, tmp_path / "t")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors: not a readable safetensors file, or it is truncated"):
        load(d)


def test_wrong_shape_names_tensor_and_shapes(tmp_path: Path, tiny_dir: Path) -> None:
    d = _copy_dir(tiny_dir, tmp_path / "s")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:100]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.up_proj.weight' has shape \[100, 64\] but the "
                                              r"model config needs \[128, 64\]"):
        load(d)


def test_missing_tensor_is_named(tmp_path: Path, tiny_dir: Path) -> None:
    d = _copy_dir(tiny_dir, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.0.self_attn.v_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) model.layers.0.self_attn.v_proj.weight"):
        load(d)


def test_unknown_hf_architecture(tmp_path: Path, tiny_dir: Path) -> None:
    d = _copy_dir(tiny_dir, tmp_path / "a")
    (d / "config.json").write_text(json.dumps({**TINY_HF_CONFIG, "architectures": ["FalconForCausalLM"]}))
    with pytest.raises(CheckpointError, match=r"Unknown HF architecture \['FalconForCausalLM'\]; supported: "):
        load(d)


def test_truncated_gguf(tmp_path: Path, smollm2_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as f:
        path.write_bytes(f.read(50_000_000))
    with pytest.raises(CheckpointError, match=r"cut.gguf: truncated: tensor '[\w.]+' needs bytes up to \d+ but the "
                                              r"file has 50000000"):
        load(path)
    with open(smollm2_path, "rb") as f:
        path.write_bytes(f.read(100_000))  # ends inside the vocabulary in the header
    with pytest.raises(CheckpointError, match="cut.gguf is truncated: it ends inside its header"):
        load(path)


def _write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray],
                extra_metadata: Callable[[gguf.GGUFWriter], None] | None = None) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_context_length(64)
    writer.add_vocab_size(32)
    if extra_metadata is not None:
        extra_metadata(writer)
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tiny_gguf_tensors() -> dict[str, np.ndarray]:
    r = np.random.default_rng(0)
    t = lambda *s: r.standard_normal(s).astype(np.float32)  # noqa: E731  numpy (torch) layout: [out, in]
    return {"token_embd.weight": t(32, 8), "output_norm.weight": t(8), "blk.0.attn_norm.weight": t(8),
            "blk.0.attn_q.weight": t(8, 8), "blk.0.attn_k.weight": t(4, 8), "blk.0.attn_v.weight": t(4, 8),
            "blk.0.attn_output.weight": t(8, 8), "blk.0.ffn_norm.weight": t(8), "blk.0.ffn_gate.weight": t(16, 8),
            "blk.0.ffn_up.weight": t(16, 8), "blk.0.ffn_down.weight": t(8, 16)}


def test_gguf_writer_round_trip_loads(tmp_path: Path) -> None:
    tensors = _tiny_gguf_tensors()
    cfg, w = load(_write_gguf(tmp_path / "ok.gguf", "llama", tensors))
    assert cfg.tie_word_embeddings and cfg.num_kv_heads == 1
    np.testing.assert_array_equal(np.asarray(w.layers[0].w_up), tensors["blk.0.ffn_up.weight"].T)


def _gemma3_metadata(writer: gguf.GGUFWriter) -> None:
    writer.add_key_length(4)  # head_dim: 2 heads x 4 = the 8-wide model
    writer.add_value_length(4)
    writer.add_sliding_window(4)


def test_gemma3_gguf_norms_load_in_hf_convention(tmp_path: Path) -> None:
    """llama.cpp stores Gemma norm multipliers as 1 + w; the loader's gguf_add=-1 gives back HF's w."""
    r = np.random.default_rng(1)
    t = lambda *s: r.standard_normal(s).astype(np.float32)  # noqa: E731  [out, in]
    hf_norms = {"output_norm.weight": t(8), "blk.0.attn_norm.weight": t(8), "blk.0.attn_q_norm.weight": t(4),
                "blk.0.attn_k_norm.weight": t(4), "blk.0.post_attention_norm.weight": t(8),
                "blk.0.ffn_norm.weight": t(8), "blk.0.post_ffw_norm.weight": t(8)}
    tensors = {**_tiny_gguf_tensors(), **{n: 1.0 + w for n, w in hf_norms.items()}}
    cfg, w = load(_write_gguf(tmp_path / "g.gguf", "gemma3", tensors, _gemma3_metadata))
    assert cfg.architecture == "gemma3" and cfg.head_size == 4 and cfg.sliding_window == 4
    loaded = {"output_norm.weight": w.final_norm, "blk.0.attn_norm.weight": w.layers[0].attn_norm,
              "blk.0.attn_q_norm.weight": w.layers[0].q_norm, "blk.0.attn_k_norm.weight": w.layers[0].k_norm,
              "blk.0.post_attention_norm.weight": w.layers[0].post_attn_norm,
              "blk.0.ffn_norm.weight": w.layers[0].mlp_norm, "blk.0.post_ffw_norm.weight": w.layers[0].post_mlp_norm}
    for name, want in hf_norms.items():
        np.testing.assert_allclose(np.asarray(loaded[name]), want, rtol=0, atol=1e-6, err_msg=name)
    # Only norms shift: the other tensors come through unchanged (and Gemma's Q/K rows are not un-permuted).
    np.testing.assert_array_equal(np.asarray(w.layers[0].w_up), tensors["blk.0.ffn_up.weight"].T)
    np.testing.assert_array_equal(np.asarray(w.layers[0].wq), tensors["blk.0.attn_q.weight"].reshape(2, 4, 8)
                                  .transpose(2, 0, 1))


def test_llama_gguf_norms_are_not_shifted(tmp_path: Path) -> None:
    tensors = _tiny_gguf_tensors()
    _, w = load(_write_gguf(tmp_path / "l.gguf", "llama", tensors))
    np.testing.assert_array_equal(np.asarray(w.final_norm), tensors["output_norm.weight"])


def test_unknown_gguf_architecture(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="Unknown GGUF architecture 'rwkv9'; supported: "):
        load(_write_gguf(tmp_path / "x.gguf", "rwkv9", _tiny_gguf_tensors()))


def test_gguf_missing_and_extra_tensors(tmp_path: Path) -> None:
    tensors = _tiny_gguf_tensors()
    del tensors["blk.0.ffn_gate.weight"]
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) blk.0.ffn_gate.weight"):
        load(_write_gguf(tmp_path / "m.gguf", "llama", tensors))
    extra = {**_tiny_gguf_tensors(), "blk.0.mystery.weight": np.zeros(8, np.float32)}
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) blk.0.mystery.weight"):
        load(_write_gguf(tmp_path / "e.gguf", "llama", extra))


def test_gguf_wrong_shape(tmp_path: Path) -> None:
    tensors = {**_tiny_gguf_tensors(), "blk.0.attn_k.weight": np.zeros((6, 8), np.float32)}
    with pytest.raises(CheckpointError, match=r"'blk.0.attn_k.weight' has shape \[6, 8\] but the model config needs \[4, 8\]"):
        load(_write_gguf(tmp_path / "w.gguf", "llama", tensors))


@pytest.mark.parametrize("plan, ok", [({}, True), ({"layers.mlp.up": {"bits": 8}}, True),
                                      ({"layers.mlp.up": {"bits": 4}}, False)])
def test_orbax_format_1_reads_unless_it_holds_int4(tmp_path: Path, plan: dict, ok: bool) -> None:
    """Format 2 stores int4 codes as two's complement nibbles; a format-1 checkpoint with int4 weights (codes
    stored + 8) would decode wrong, so it is refused with what to do, and any other format-1 one still reads."""
    from jaxinfer.checkpoint.orbax import ORBAX_MARKER, OrbaxCheckpoint

    (tmp_path / ORBAX_MARKER).write_text(json.dumps({"format_version": 1, "quantization_plan": plan}))
    if ok:
        assert OrbaxCheckpoint(tmp_path).meta["format_version"] == 1
    else:
        with pytest.raises(CheckpointError, match=r"code \+ 8.*convert it again"):
            OrbaxCheckpoint(tmp_path).meta
