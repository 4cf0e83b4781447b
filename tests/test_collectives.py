"""The guard that keeps tensor parallelism fast without a GPU in CI: collectives in the compiled HLO.

With 4 and 8 forced CPU devices, the jitted prefill step and the multi-step decode call are lowered and
compiled, and their collectives counted (a loop body appears once in the HLO, so the decode call shows one
iteration). Megatron-style TP needs exactly one all-reduce of the [T, D] activations after each row-parallel
matmul (attention output and MLP down projection: two per layer) plus one for the vocabulary-parallel
embedding lookup; XLA may instead split one into a reduce-scatter + all-gather pair. Nothing of a weight's
size or the KV cache's may be gathered, and the sampler may gather only its per-shard candidates, never the
[S, V] logits. Before the attention kernels ran inside shard_map, XLA gathered the whole cache and all
queries around each opaque kernel call.

On CPU the jnp reference attention is not opaque: XLA could partition it even without the shard_map, so
the test would pass either way. The steps here therefore run with an opaque stand-in for the kernel (a host
callback, which XLA can only run on whole operands, exactly like a Pallas custom call); only the compiled
programs are inspected, nothing runs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import attention, linear
from jaxinfer.config import CacheConfig, EngineConfig
from jaxinfer.describe import collective_ops
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.sampling import NUM_CANDIDATES
from jaxinfer.models import GEMMA3, LLAMA
from jaxinfer.params import abstract_params

from model_helpers import build_runner, step_hlo, tiny_config
from test_quantization import quantized_runner
from models.test_gemma3 import tiny_config as tiny_gemma_config

TOKENS, ROWS = 64, 8


def _opaque_kernel(q, k_pages, v_pages, *metadata, **settings):
    """Same shapes as the kernel, but a call XLA cannot look into (see the module docstring)."""
    out = jax.ShapeDtypeStruct(q.shape, q.dtype)
    return jax.pure_callback(lambda *a: np.zeros(q.shape, q.dtype), out, q, k_pages, v_pages, *metadata)


@pytest.fixture(autouse=True)
def opaque_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "ragged_paged_attention", _opaque_kernel)


def _engine(cfg, tp: int, family, quantization: str | None = None) -> Engine:
    if quantization is None:
        runner = build_runner(cfg, tp=tp, family=family, num_pages=64, page_size=4)
    else:
        runner = quantized_runner(cfg, tp, quantization, "int8", plan_tp=tp, num_pages=64)
    engine_cfg = EngineConfig(max_num_seqs=ROWS, max_num_batched_tokens=TOKENS)
    return Engine(runner, None, engine_cfg, CacheConfig(page_size=4, num_pages=64), use_tqdm=False,
                  decode_steps_per_call=4)


def _compiled_texts(engine: Engine) -> dict[str, tuple[str, int]]:
    """{kind: (compiled HLO text, rows of the activations)} for a prefill step, a decode-only single step in the
    2-token bucket (Engine.small_step_buckets, on a GPU or TPU) and a decode call."""
    r = engine.runner
    engine.small_step_buckets = (2,)
    decode = engine.decode_shape(ROWS)
    decode_args = (r.weights, r.kv_cache, engine.penalties, *engine._decode_args(decode, [], [], 0))
    return {
        "prefill": (step_hlo(engine, TOKENS), TOKENS),
        "small_step": (step_hlo(engine, 2), 2),
        "decode": (r._decode_steps.lower(*decode_args, max_steps=4).compile().as_text(), decode.seqs),
    }


def _big_shapes(cfg, family, tp: int, weights=None) -> set[tuple[int, ...]]:
    """Shapes no collective may produce: every matrix weight (float, or quantized values) and the cache.
    (1-D norm weights are left out: their size is the model width, which [T] or [S] reductions may share;
    likewise quantized scales, [K / group, N], which can have an activation's shape.)"""
    shapes = {a.shape for a in jax.tree.leaves(abstract_params(family.param_specs(cfg, jnp.float32))) if a.ndim > 1}
    shapes |= {w.values.shape for w in jax.tree.leaves(weights, is_leaf=linear.is_quantized) if linear.is_quantized(w)}
    shapes |= {(64, 4, cfg.num_kv_heads, cfg.head_size), (64, 4, max(cfg.num_kv_heads, tp), cfg.head_size)}
    return shapes


CASES = {
    "llama_kv_split_tp4": (LLAMA, dict(num_heads=8, num_kv_heads=4), 4, None),
    "llama_kv_replicated_tp8": (LLAMA, dict(num_heads=8, num_kv_heads=4), 8, None),
    "gemma3_mqa_tp4": (GEMMA3, dict(num_heads=4, num_kv_heads=1), 4, None),
    # Quantized weights (each matmul an opaque kernel in shard_map) and an int8 KV cache with its scales.
    # head_dim 32 and F = 256: no values array has an activation's [T, D] shape.
    "llama_int4_int8kv_tp4": (LLAMA, dict(num_heads=8, num_kv_heads=4, head_dim=32, intermediate_size=256), 4,
                              "int4:32"),
}


def _opaque_matmul(x, w, **settings):
    """The quantized matmul as a call XLA cannot look into (module docstring): [T, N] from whole operands."""
    out = jax.ShapeDtypeStruct((x.shape[0], w.values.shape[0]), x.dtype)
    return jax.pure_callback(lambda *a: np.zeros(out.shape, out.dtype), out, x, w.values, w.scales)


@pytest.mark.parametrize("name", CASES)
def test_tensor_parallel_steps_all_reduce_twice_per_layer_and_gather_no_weights_or_cache(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    family, heads, tp, quantization = CASES[name]
    monkeypatch.setattr(linear, "quantized_matmul", _opaque_matmul)
    make = tiny_config if family is LLAMA else tiny_gemma_config
    # A vocabulary well above tp x the sampler's 256 candidates, so gathering candidates is not gathering logits.
    cfg = make(**{"vocab_size": 8192, "intermediate_size": 128, **heads})
    engine = _engine(cfg, tp, family, quantization)
    big = _big_shapes(cfg, family, tp, engine.runner.weights if quantization else None)
    for kind, (text, rows) in _compiled_texts(engine).items():
        ops = collective_ops(text)
        assert ops, f"{kind}: no collectives at tp={tp}; is the model sharded at all?"
        activation = [k for k, shapes in ops if shapes == [("f32", (rows, cfg.hidden_size))] and k == "all-reduce"]
        scattered = [k for k, _ in ops if k == "reduce-scatter"]
        assert len(activation) + len(scattered) == 2 * cfg.num_layers + 1, (kind, ops)
        for op, shapes in ops:
            assert op in ("all-reduce", "all-gather", "reduce-scatter"), (kind, op, shapes)
            for _, dims in shapes:
                assert dims not in big, f"{kind}: {op} of {dims}, the size of a weight or the cache"
                if op == "all-gather":  # at most every shard's sampling candidates, far below [rows, V]
                    assert math.prod(dims) <= rows * tp * NUM_CANDIDATES < rows * cfg.vocab_size, (kind, dims)


def test_unsharded_steps_have_no_collectives() -> None:
    engine = _engine(tiny_config(), 1, LLAMA)
    for kind, (text, _) in _compiled_texts(engine).items():
        assert collective_ops(text) == [], kind
