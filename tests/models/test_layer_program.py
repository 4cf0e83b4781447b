"""A forward traces each kind of decoder layer once (jaxinfer.models.common.layer_program), however many
layers the model has: full-size presets traced abstractly, counting the attention calls the trace makes and
the layer functions the lowered module holds."""

from __future__ import annotations

import re

import jax
import pytest

from jaxinfer.attention import make_attention_fn
from jaxinfer.presets import load_preset
from model_helpers import abstract_forward_inputs


# preset -> kinds of layer: Gemma 3 alternates local (sliding-window) and global layers; every other
# family here has one kind (Qwen3-30B-A3B's layers are all sparse).
@pytest.mark.parametrize("name, kinds", [("llama-3-8b", 1), ("gemma3-1b", 2), ("qwen3-30b-a3b", 1),
                                         ("mixtral-8x7b", 1), ("qwen3-8b", 1)])
def test_each_kind_of_layer_traces_once(name: str, kinds: int) -> None:
    cfg = load_preset(name)
    family, weights, tokens, md, cache = abstract_forward_inputs(cfg, tokens=8, seqs=2, pages=16, table_width=4)
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
