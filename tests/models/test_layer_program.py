"""A forward traces each kind of decoder layer once (jaxinfer.models.common.layer_program), however many
layers the model has: full-size presets traced abstractly, counting the attention calls the trace makes and
the layer functions the lowered module holds."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from jaxinfer.attention import make_attention_fn
from jaxinfer.kv_cache import KVCache
from jaxinfer.models import family_for_config
from jaxinfer.models.common import AttentionMetadata
from jaxinfer.params import abstract_params
from jaxinfer.presets import load_preset


def _abstract_inputs(cfg, tokens: int = 8, seqs: int = 2, pages: int = 16, page_size: int = 16):
    family = family_for_config(cfg)
    weights = abstract_params(family.param_specs(cfg, jnp.bfloat16))
    page = jax.ShapeDtypeStruct((pages, page_size, cfg.num_kv_heads, cfg.head_size), jnp.bfloat16)
    cache = KVCache(k=(page,) * cfg.num_layers, v=(page,) * cfg.num_layers)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    md = AttentionMetadata(positions=i32(tokens), slot_mapping=i32(tokens), cu_q_lens=i32(seqs + 1),
                           kv_lens=i32(seqs), page_indices=i32(seqs, 4), num_seqs=i32(1))
    return family, weights, i32(tokens), md, cache


# preset -> kinds of layer: Gemma 3 alternates local (sliding-window) and global layers; every other
# family here has one kind (Qwen3-30B-A3B's layers are all sparse).
@pytest.mark.parametrize("name, kinds", [("llama-3-8b", 1), ("gemma3-1b", 2), ("qwen3-30b-a3b", 1),
                                         ("mixtral-8x7b", 1), ("qwen3-8b", 1)])
def test_each_kind_of_layer_traces_once(name: str, kinds: int) -> None:
    cfg = load_preset(name)
    family, weights, tokens, md, cache = _abstract_inputs(cfg)
    attention = make_attention_fn(cfg, "reference", False)
    calls = []

    def counting_attention(*args, **kwargs):
        calls.append(kwargs)
        return attention(*args, **kwargs)

    forward = jax.jit(lambda w, t, m, c: family.forward(w, cfg, t, m, c, counting_attention)[:2])
    lowered = forward.lower(weights, tokens, md, cache)
    assert cfg.num_layers > 20 and len(calls) == kinds
    # One private function per kind of layer in the module, called once per layer.
    text = lowered.as_text()
    callees = re.findall(r"call @([\w.]+)\(", text)
    layer_fns = {c for c in callees if "decoder_layer" in c}
    assert len(layer_fns) == kinds
    assert sum(callees.count(f) for f in layer_fns) == cfg.num_layers
