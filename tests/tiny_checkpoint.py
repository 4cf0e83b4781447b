"""Write small real-format checkpoints for tests: an HF safetensors directory with random Llama weights.

The tokenizer is SmolLM2's (from the bundled GGUF), saved as tokenizer.json, so text prompts work; the
weights are random, so text is gibberish but deterministic, and the model compiles in seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

TINY_HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,  # SmolLM2's tokenizer
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def hf_tensors(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under HF Llama names, in HF layouts ([out, in] linears)."""
    rng = np.random.default_rng(seed)
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    w = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)  # noqa: E731
    out = {"model.embed_tokens.weight": w(v, d), "model.norm.weight": np.ones(d, np.float32),
           "lm_head.weight": w(v, d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": np.ones(d, np.float32),
            p + "post_attention_layernorm.weight": np.ones(d, np.float32),
            p + "self_attn.q_proj.weight": w(q, d), p + "self_attn.k_proj.weight": w(kv, d),
            p + "self_attn.v_proj.weight": w(kv, d), p + "self_attn.o_proj.weight": w(d, q),
            p + "mlp.gate_proj.weight": w(f, d), p + "mlp.up_proj.weight": w(f, d), p + "mlp.down_proj.weight": w(d, f),
        })
    return out


def write_tiny_hf_checkpoint(directory: Path, tokenizer_source: Path, *, seed: int = 0, sharded: bool = False,
                             config_overrides: dict | None = None) -> Path:
    """config.json + model.safetensors (or two shards with an index) + the tokenizer files."""
    from jaxinfer.tokenizer import load_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    cfg = {**TINY_HF_CONFIG, **(config_overrides or {})}
    (directory / "config.json").write_text(json.dumps(cfg))
    tensors = hf_tensors(cfg, seed)
    if sharded:
        names = sorted(tensors)
        halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        for file, part in halves.items():
            save_file({n: tensors[n] for n in part}, directory / file)
        index = {"weight_map": {n: file for file, part in halves.items() for n in part}}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        save_file(tensors, directory / "model.safetensors")
    load_tokenizer(tokenizer_source).save(directory)
    return directory
