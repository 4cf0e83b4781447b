"""Gemma 3 forward: paged/ragged path vs an independent dense float64 NumPy model, chunking, sharding, shapes.

The tiny configs use a sliding window of 4 with 11-token sequences, so local layers really drop keys, and
a window pattern of 2 so both layer kinds appear in two layers.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import ConfigError, MeshConfig, ModelConfig, RopeScaling
from jaxinfer.attention import make_attention_fn
from jaxinfer.models import GEMMA3, family_for_gguf, family_for_hf
from jaxinfer.models.gemma3 import config_from_gguf, config_from_hf, gemma3_extras
from jaxinfer.params import count_params
from jaxinfer.presets import load_preset
from jaxinfer.sharding import make_mesh, tensor_parallel_rules
from model_helpers import build_runner as shared_build_runner
from model_helpers import abstract_forward_inputs, rel_err, run_chunks


def tiny_config(**overrides) -> ModelConfig:
    """Gemma 3 270M's preset shrunk to test size, with a window short enough to matter at 11 tokens."""
    base = dict(vars(load_preset("gemma3-270m")))
    small = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, sliding_window=4, sliding_window_pattern=2, rope_local_theta=100.0,
                 query_pre_attn_scalar=16.0)
    return ModelConfig(**{**base, **small, **overrides})


def build_runner(cfg: ModelConfig, tp: int = 1, seed: int = 0, num_pages: int = 64, page_size: int = 4):
    return shared_build_runner(cfg, tp, seed, num_pages, page_size, family=GEMMA3,
                               weights_hook=lambda w: randomize_norms(w, seed))

def randomize_norms(weights, seed: int):
    """Random init leaves norms at identity (w = 0); perturb them so a wrong (1 + w) convention shows up."""
    rng = np.random.default_rng(seed + 100)

    def perturb(path, w):
        if "norm" not in jax.tree_util.keystr(path):
            return w
        new = rng.normal(0.0, 0.3, w.shape).astype(np.float32)
        return jax.device_put(new, w.sharding)

    return jax.tree_util.tree_map_with_path(perturb, weights)


def dense_reference_logits(w, cfg: ModelConfig, ids: list[int]) -> np.ndarray:
    """Gemma 3 written out in float64 NumPy over one whole sequence with dense masks: logits [T, V]."""
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    ex = gemma3_extras(cfg)
    t, h = len(ids), cfg.head_size

    def rope(x, theta, factor):  # x [T, heads, H], half-split convention
        inv_freq = 1.0 / theta ** (np.arange(0, h, 2) / h) / factor  # [H/2]
        ang = np.arange(t)[:, None] * inv_freq[None, :]  # [T, H/2]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x1, x2 = np.split(x, 2, axis=-1)
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def norm(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_norm_eps) * (1.0 + f64(g))

    def gelu_tanh(x):
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

    def attention(layer, x, i):
        is_global = (i + 1) % ex.sliding_window_pattern == 0
        theta, factor = (cfg.rope_theta, cfg.rope_scaling_factor) if is_global else (ex.rope_local_theta, 1.0)
        if is_global and cfg.rope_scaling is RopeScaling.NONE:
            factor = 1.0
        q = rope(norm(np.einsum("td,dnh->tnh", x, f64(layer.wq)), layer.q_norm), theta, factor)  # [T, N, H]
        k = rope(norm(np.einsum("td,dkh->tkh", x, f64(layer.wk)), layer.k_norm), theta, factor)  # [T, K, H]
        k = np.repeat(k, cfg.q_per_kv, axis=1)  # [T, N, H]
        v = np.repeat(np.einsum("td,dkh->tkh", x, f64(layer.wv)), cfg.q_per_kv, axis=1)  # [T, N, H]
        s = np.einsum("qnh,knh->nqk", q, k) / math.sqrt(ex.query_pre_attn_scalar)  # [N, T, T]
        if ex.attn_logit_softcap is not None:
            s = ex.attn_logit_softcap * np.tanh(s / ex.attn_logit_softcap)
        qi, ki = np.arange(t)[:, None], np.arange(t)[None, :]
        mask = (ki <= qi) & (is_global | (ki > qi - ex.sliding_window))  # [T, T]
        s = np.where(mask[None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        return np.einsum("tnh,nhd->td", np.einsum("nqk,knh->qnh", p, v), f64(layer.wo))  # [T, D]

    x = f64(w.embed)[ids] * math.sqrt(cfg.hidden_size)  # [T, D]
    for i, layer in enumerate(w.layers):
        x = x + norm(attention(layer, norm(x, layer.attn_norm), i), layer.post_attn_norm)
        hh = norm(x, layer.mlp_norm)
        mlp = (gelu_tanh(hh @ f64(layer.w_gate)) * (hh @ f64(layer.w_up))) @ f64(layer.w_down)  # [T, D]
        x = x + norm(mlp, layer.post_mlp_norm)
    logits = norm(x, w.final_norm) @ f64(w.embed).T  # [T, V]
    if ex.final_logit_softcap is not None:
        logits = ex.final_logit_softcap * np.tanh(logits / ex.final_logit_softcap)
    return logits


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(num_kv_heads=4, rope_scaling=RopeScaling.LINEAR, rope_scaling_factor=8.0),
        dict(num_kv_heads=1, query_pre_attn_scalar=10.0, attn_logit_softcap=5.0, final_logit_softcap=3.0),
    ],
    ids=["gqa", "mha-linear-rope", "mqa-scaled-softcaps"],
)
def test_paged_forward_matches_dense_reference(overrides) -> None:
    cfg = tiny_config(**overrides)
    runner = build_runner(cfg, seed=1)
    ids = list(np.random.default_rng(0).integers(0, cfg.vocab_size, 11))
    ref = dense_reference_logits(runner.weights, cfg, ids)
    ours = run_chunks(runner, ids, chunk=1, pages=[3, 7, 1, 9])  # decode one token at a time
    assert rel_err(ours, ref) < 1e-5


@pytest.mark.parametrize("chunk", [3, 5, 11])
def test_chunked_prefill_equals_full_prefill(chunk: int) -> None:
    """Chunks that start inside, at and past the 4-token window give the dense model's logits."""
    cfg = tiny_config()
    runner = build_runner(cfg, seed=2)
    ids = list(np.random.default_rng(1).integers(0, cfg.vocab_size, 11))
    ref = dense_reference_logits(runner.weights, cfg, ids)
    ours = run_chunks(runner, ids, chunk=chunk, pages=[5, 2, 8])
    ends = [min(s + chunk, len(ids)) - 1 for s in range(0, len(ids), chunk)]
    assert rel_err(ours, ref[ends]) < 1e-5


def test_window_changes_the_output() -> None:
    """Guard against a test that passes because the window never bites: a wide window gives other logits."""
    cfg = tiny_config()
    runner = build_runner(cfg, seed=2)
    ids = list(np.random.default_rng(1).integers(0, cfg.vocab_size, 11))
    narrow = dense_reference_logits(runner.weights, cfg, ids)[-1]
    wide = dense_reference_logits(runner.weights, cfg.replace(sliding_window=64), ids)[-1]
    assert rel_err(narrow, wide) > 1e-2


@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_equals_unsharded(tp: int) -> None:
    """tp=4 with 2 kv heads exercises kv-head replication; q heads (4) split evenly."""
    cfg = tiny_config()
    ids = list(np.random.default_rng(4).integers(0, cfg.vocab_size, 11))
    base = build_runner(cfg, tp=1, seed=5)
    sharded = build_runner(cfg, tp=tp, seed=5)
    ref = run_chunks(base, ids, chunk=4, pages=[1, 2, 3])
    ours = run_chunks(sharded, ids, chunk=4, pages=[1, 2, 3])
    assert rel_err(ours, ref) < 1e-5
    wq = sharded.weights.layers[0].wq
    assert len({s.index for s in wq.addressable_shards}) == tp  # really split, not replicated


def _abstract_forward(cfg: ModelConfig, tokens: int = 256, seqs: int = 8, pages: int = 128, page_size: int = 16):
    _, weights, token_ids, md, cache = abstract_forward_inputs(cfg, tokens, seqs, pages, page_size)
    attn = make_attention_fn(cfg, "reference", False)

    def step(w, t, m, c):
        hidden, c = GEMMA3.forward(w, cfg, t, m, c, attn)
        return GEMMA3.compute_logits(w, cfg, hidden[:seqs]), c

    return jax.eval_shape(step, weights, token_ids, md, cache)


# Text-decoder parameter counts of the published checkpoints (4B/12B/27B without the vision tower).
@pytest.mark.parametrize("name, params_b", [("gemma3-270m", 0.268), ("gemma3-1b", 1.000), ("gemma3-4b", 3.880),
                                            ("gemma3-12b", 11.766), ("gemma3-27b", 27.009)])
def test_full_size_presets_trace(name: str, params_b: float) -> None:
    cfg = load_preset(name)
    assert count_params(GEMMA3.param_specs(cfg, jnp.bfloat16)) / 1e9 == pytest.approx(params_b, rel=0.005)
    logits, cache = _abstract_forward(cfg)
    assert logits.shape == (8, cfg.vocab_size) and logits.dtype == jnp.float32
    assert len(cache.k) == cfg.num_layers


def test_presets_carry_the_published_gemma_fields() -> None:
    presets = {n: load_preset(f"gemma3-{n}") for n in ("270m", "1b", "4b", "12b", "27b")}
    assert {n: c.sliding_window for n, c in presets.items()} == {
        "270m": 512, "1b": 512, "4b": 1024, "12b": 1024, "27b": 1024}
    assert {n: c.query_pre_attn_scalar for n, c in presets.items()} == {
        "270m": 256.0, "1b": 256.0, "4b": 256.0, "12b": 256.0, "27b": 168.0}
    for cfg in presets.values():
        ex = gemma3_extras(cfg)
        assert (ex.sliding_window_pattern, ex.rope_local_theta) == (6, 10000.0)
        assert ex.attn_logit_softcap is None and ex.final_logit_softcap is None


@pytest.mark.parametrize("field", ["sliding_window", "sliding_window_pattern", "rope_local_theta",
                                   "query_pre_attn_scalar"])
def test_missing_gemma_field_is_named(field: str) -> None:
    """No guessing from the model size: a Gemma config without a required field fails, naming it."""
    with pytest.raises(ConfigError, match=f"ModelConfig.{field} is not set, and Gemma 3 needs it"):
        gemma3_extras(tiny_config(**{field: None}))


@pytest.mark.parametrize("field", ["sliding_window", "sliding_window_pattern", "query_pre_attn_scalar"])
def test_nonpositive_gemma_field_is_rejected(field: str) -> None:
    with pytest.raises(ConfigError, match=f"ModelConfig.{field} must be > 0 when set, got 0"):
        tiny_config(**{field: 0})


@pytest.mark.parametrize("layers, scalar", [(62, 5376 / 32), (34, 128.0)])
def test_gguf_query_pre_attn_scalar_follows_llama_cpp(layers: int, scalar: float) -> None:
    """GGUF metadata has no query_pre_attn_scalar; like llama.cpp, 27B (62 layers) uses D/N, others head_dim."""
    meta = {"general.architecture": "gemma3", "gemma3.embedding_length": 5376, "gemma3.feed_forward_length": 64,
            "gemma3.block_count": layers, "gemma3.attention.head_count": 32, "gemma3.attention.key_length": 128,
            "gemma3.attention.sliding_window": 1024, "gemma3.vocab_size": 16}
    cfg = config_from_gguf(meta)
    assert cfg.query_pre_attn_scalar == scalar
    assert (cfg.sliding_window, cfg.sliding_window_pattern, cfg.rope_local_theta) == (1024, 6, 10000.0)


def test_config_from_hf_old_and_new_rope_fields() -> None:
    common = dict(architectures=["Gemma3ForCausalLM"], vocab_size=262208, hidden_size=2560, intermediate_size=10240,
                  num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                  sliding_window=1024, query_pre_attn_scalar=256)
    old = config_from_hf({**common, "rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window_pattern": 6,
                          "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    new = config_from_hf({**common, "layer_types": layer_types * 2, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    assert old == new
    assert (new.rope_scaling, new.rope_scaling_factor, new.rope_local_theta) == (RopeScaling.LINEAR, 8.0, 1e4)
    assert family_for_hf(["Gemma3ForCausalLM"]) is GEMMA3 and family_for_gguf("gemma3") is GEMMA3


def test_irregular_layer_types_are_rejected() -> None:
    from jaxinfer.checkpoint.assemble import CheckpointError

    hf = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=3, num_attention_heads=1,
              layer_types=["full_attention", "sliding_attention", "sliding_attention"])
    with pytest.raises(CheckpointError, match="layer_types"):
        config_from_hf(hf)


def hf_layout(w: np.ndarray, transform) -> np.ndarray:
    """Our layout -> PyTorch's, the inverse of checkpoint.assemble.to_our_layout."""
    from jaxinfer.checkpoint.assemble import Transform

    if transform is Transform.LINEAR:
        return w.T
    if transform is Transform.LINEAR_TO_HEADS:
        return w.transpose(1, 2, 0).reshape(-1, w.shape[0])  # [D, heads, H] -> [heads*H, D]
    if transform is Transform.LINEAR_FROM_HEADS:
        return w.transpose(2, 0, 1).reshape(w.shape[2], -1)  # [heads, H, D] -> [D, heads*H]
    return w


def hf_config_json(cfg: ModelConfig) -> dict:
    """An HF Gemma3ForCausalLM config.json (transformers >= 5 style) describing `cfg`."""
    pattern = cfg.sliding_window_pattern
    layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(cfg.num_layers)]
    return dict(architectures=["Gemma3ForCausalLM"], vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                rms_norm_eps=cfg.rms_norm_eps, sliding_window=cfg.sliding_window,
                query_pre_attn_scalar=cfg.query_pre_attn_scalar, attn_logit_softcapping=cfg.attn_logit_softcap,
                final_logit_softcapping=cfg.final_logit_softcap, max_position_embeddings=cfg.max_position_embeddings,
                tie_word_embeddings=True, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                layer_types=layer_types,
                rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta}})


def write_hf_gemma_dir(directory, cfg: ModelConfig, weights):
    """Our weights under HF Gemma3ForCausalLM names and layouts, plus config.json; returns the directory."""
    import json
    import re

    from safetensors.numpy import save_file

    rules = {r.path: r for r in GEMMA3.checkpoint_rules()}
    tensors = {}
    for path, w in jax.tree_util.tree_flatten_with_path(weights)[0]:
        ours = jax.tree_util.keystr(path, simple=True, separator=".")
        rule = rules[re.sub(r"^layers\.\d+\.", "layers.{i}.", ours)]
        layer = re.match(r"^layers\.(\d+)\.", ours)
        name = rule.hf.format(i=layer.group(1) if layer else "")
        tensors[name] = np.ascontiguousarray(hf_layout(np.asarray(w), rule.transform))
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(hf_config_json(cfg)))
    return directory


def load_checkpoint(path, tp: int = 1):
    from jaxinfer.checkpoint import open_checkpoint

    ckpt = open_checkpoint(path)
    cfg = ckpt.config
    mesh = make_mesh(MeshConfig(tensor=tp))
    return cfg, ckpt.load_weights(GEMMA3.param_specs(cfg, jnp.float32), mesh, tensor_parallel_rules(cfg, tp))


def assert_same_weights(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_hf_safetensors_directory_loads(tmp_path) -> None:
    """Writes a random model under HF Gemma3ForCausalLM names (new-style config.json) and loads it back."""
    cfg = tiny_config()
    runner = build_runner(cfg, seed=7)
    cfg_loaded, loaded = load_checkpoint(write_hf_gemma_dir(tmp_path, cfg, runner.weights))
    assert cfg_loaded == cfg
    assert_same_weights(loaded, runner.weights)


def test_convert_round_trips_through_orbax(tmp_path, gemma3_path) -> None:
    """`jaxinfer convert` of a Gemma checkpoint keeps every Gemma field and the weights (norms unshifted)."""
    from jaxinfer.cli import main
    from jaxinfer.tokenizer import load_tokenizer

    cfg = tiny_config(attn_logit_softcap=5.0, final_logit_softcap=3.0)  # every Gemma field set
    runner = build_runner(cfg, seed=8)
    src = write_hf_gemma_dir(tmp_path / "hf", cfg, runner.weights)
    load_tokenizer(gemma3_path).save(src)
    dst = tmp_path / "orbax"
    assert main(["convert", str(src), str(dst), "--dtype", "float32"]) == 0
    cfg_converted, converted = load_checkpoint(dst, tp=2)  # restored straight into a 2-way layout
    assert cfg_converted == cfg
    assert_same_weights(converted, runner.weights)
    assert (dst / "tokenizer" / "tokenizer.model").is_file()
