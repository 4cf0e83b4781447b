"""Helpers shared by the model and engine tests: tiny Llama configs, runners over random weights, chunked
feeding, and an independent dense float64 NumPy Llama to compare the paged forward against."""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import MeshConfig, ModelConfig
from jaxinfer.engine.batcher import BatchShape, SeqChunk, pack
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.kv_cache import allocate_kv_cache
from jaxinfer.models import LLAMA, ModelFamily
from jaxinfer.models.common import rope_inv_freq
from jaxinfer.params import init_params
from jaxinfer.presets import load_preset
from jaxinfer.sharding import make_mesh, tensor_parallel_rules


def xla_flags_with_devices(n: int) -> str:
    """The test environment's XLA_FLAGS (tests/conftest.py: its compile-time settings) with `n` forced CPU devices,
    for a subprocess that needs a different device count."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join([f"--xla_force_host_platform_device_count={n}", *flags])


def tiny_config(**overrides) -> ModelConfig:
    """SmolLM2-135M's preset shrunk to test size (same family switches: tied, GQA, rope theta)."""
    base = load_preset("smollm2-135m")
    small = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=16)
    return base.replace(**{**small, **overrides})


QWEN3_SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=32)  # head_dim * heads != hidden, as in Qwen3-30B-A3B
QWEN3_SMALL_MOE = dict(QWEN3_SMALL, num_layers=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       decoder_sparse_step=1, mlp_only_layers=(2,))


def tiny_qwen3_dense(**overrides) -> ModelConfig:
    return load_preset("qwen3-8b").replace(**{**QWEN3_SMALL, **overrides})


def tiny_qwen3_moe(**overrides) -> ModelConfig:
    """Qwen3-30B-A3B's layout at toy size: 8 experts, top-2, one dense layer among four."""
    return load_preset("qwen3-30b-a3b").replace(**{**QWEN3_SMALL_MOE, **overrides})


def build_runner(cfg: ModelConfig, tp: int = 1, seed: int = 0, num_pages: int = 64, page_size: int = 4,
                 family: ModelFamily = LLAMA, weights_hook: Callable[[Any], Any] | None = None,
                 attention_impl: str = "reference", dtype: Any = jnp.float32, interpret: bool = False) -> ModelRunner:
    """A runner over random weights (reference attention unless told; `interpret`: Pallas kernels run by the
    interpreter); `weights_hook` may perturb them."""
    mesh = make_mesh(MeshConfig(tensor=tp))
    rules = tensor_parallel_rules(cfg, tp)
    weights = init_params(family.param_specs(cfg, dtype), jax.random.key(seed), mesh, rules)
    if weights_hook is not None:
        weights = weights_hook(weights)
    cache = allocate_kv_cache(cfg, num_pages, page_size, dtype, mesh, rules)
    return ModelRunner(family, cfg, weights, cache, mesh, rules, attention_impl=attention_impl, interpret=interpret)


def abstract_forward_inputs(cfg: ModelConfig, tokens: int = 256, seqs: int = 8, pages: int = 128,
                            page_size: int = 16, table_width: int = 16) -> tuple[ModelFamily, Any, Any, Any, Any]:
    """(family, weights, token ids, metadata, cache) of a bf16 forward over `tokens` tokens of `seqs` sequences,
    as shapes only: tracing a full-size preset allocates nothing."""
    from jaxinfer.kv_cache import KVCache
    from jaxinfer.models import family_for_config
    from jaxinfer.models.common import AttentionMetadata
    from jaxinfer.params import abstract_params

    family = family_for_config(cfg)
    weights = abstract_params(family.param_specs(cfg, jnp.bfloat16))
    page = jax.ShapeDtypeStruct((pages, page_size, cfg.num_kv_heads, cfg.head_size), jnp.bfloat16)
    cache = KVCache(k=(page,) * cfg.num_layers, v=(page,) * cfg.num_layers)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    md = AttentionMetadata(positions=i32(tokens), slot_mapping=i32(tokens), cu_q_lens=i32(seqs + 1),
                           kv_lens=i32(seqs), page_indices=i32(seqs, table_width), num_seqs=i32(1))
    return family, weights, i32(tokens), md, cache


def dense_reference_logits(w, cfg: ModelConfig, ids: list[int]) -> np.ndarray:
    """Plain causal transformer in float64 NumPy over one full sequence: logits [T, V]."""
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    inv_freq = f64(rope_inv_freq(cfg.head_size, cfg.rope_theta, cfg))
    t = len(ids)
    ang = np.arange(t)[:, None] * inv_freq[None, :]  # [T, H/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(x):  # [T, heads, H]
        x1, x2 = np.split(x, 2, axis=-1)
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def norm(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_norm_eps) * f64(g)

    x = f64(w.embed)[ids]
    g = cfg.q_per_kv
    mask = np.tril(np.ones((t, t), bool))
    for layer in w.layers:
        h = norm(x, layer.attn_norm)
        q = rope(np.einsum("td,dnh->tnh", h, f64(layer.wq)))
        k = np.repeat(rope(np.einsum("td,dkh->tkh", h, f64(layer.wk))), g, axis=1)  # [T, N, H]
        v = np.repeat(np.einsum("td,dkh->tkh", h, f64(layer.wv)), g, axis=1)
        s = np.einsum("qnh,knh->nqk", q, k) / math.sqrt(cfg.head_size)
        s = np.where(mask[None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + np.einsum("tnh,nhd->td", np.einsum("nqk,knh->qnh", p, v), f64(layer.wo))
        h = norm(x, layer.mlp_norm)
        gate, up = h @ f64(layer.w_gate), h @ f64(layer.w_up)
        x = x + (gate / (1 + np.exp(-gate)) * up) @ f64(layer.w_down)
    x = norm(x, w.final_norm)
    head = f64(w.embed).T if w.lm_head is None else f64(w.lm_head)
    return x @ head


def run_chunks(runner: ModelRunner, ids: list[int], chunk: int, pages: list[int],
               shape: BatchShape = BatchShape(tokens=32, seqs=4, pages_per_seq=16)) -> np.ndarray:
    """Feed `ids` in chunks of `chunk` tokens (in buckets of `shape`); logits of the last token of each chunk,
    stacked."""
    out = []
    for start in range(0, len(ids), chunk):
        batch = pack([SeqChunk(ids[start : start + chunk], start, pages)], shape, runner.kv_cache.page_size)
        out.append(np.asarray(runner.logits(runner.place(batch)))[0])
    return np.stack(out)


# A decode-sized bucket (8 tokens): the steps that take the GPU decode kernels (norm_router, skinny_matmul, ...).
DECODE_SHAPE = BatchShape(tokens=8, seqs=2, pages_per_seq=8)


def float32_twin(build: Callable[..., ModelRunner], runner: ModelRunner) -> ModelRunner:
    """A float32 runner over `runner`'s weights cast up, from the test's `build(dtype, weights)`: the run that kernel
    tests hold a bf16 path's logits against."""
    return build(jnp.float32, jax.tree.map(lambda a: a.astype(jnp.float32), runner.weights))


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def run_to_completion(engine: Any) -> dict[str, Any]:
    """Step `engine` until nothing is unfinished; the final output of each request, by request id."""
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def assert_clean(llm: Any) -> None:
    """Nothing queued or running, every page free: the state every test must leave a shared LLM in."""
    stats = llm.engine_stats()
    assert stats["num_running"] == stats["num_waiting"] == 0 and not llm.engine.requests
    assert stats["free_pages"] == stats["total_pages"] and not llm.has_unfinished()


def step_hlo(engine: Any, num_tokens: int, num_rows: int | None = None) -> str:
    """Compiled HLO text of one single step of `num_tokens` tokens over `num_rows` rows (default: as many) in
    the engine's bucket for it (`Engine.step_shape`): the forward program, then the sampler (two programs since
    pipelined single steps; a step's collectives are those of both)."""
    runner = engine.runner
    shape = engine.step_shape(num_tokens, num_rows or num_tokens)
    batch, inputs = engine._step_args(shape, [], [])
    from jaxinfer.engine.runner import forward_kind

    forward = runner._jitted(forward_kind(shape.tokens)).lower(runner.weights, runner.kv_cache, runner.place(batch))
    logits = runner.example_logits(batch.logits_indices.shape[0])
    sampler = runner._sample_logits.lower(engine.penalties, logits, *runner.place(
        (inputs.sampling, inputs.slots, inputs.sample_mask)))
    return forward.compile().as_text() + "\n" + sampler.compile().as_text()


def load_script(name: str) -> Any:
    """scripts/<name>.py as a module (the scripts directory is not a package), for tests of its functions."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
