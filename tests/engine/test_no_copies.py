"""The device-resident decode loop updates the cache in place and reads the weights where they are: in the
compiled multi-step decode call (every row bucket, the 1-row one included) and the single step, no copy of a
weight or of a cache layer, inside the loop or outside it. Two such copies made multi-step decode slower
than single steps: XLA relaid out the attention output projection every iteration (CPU), and copied every
cache layer every iteration of the 1-row bucket, whose one-token write became a dynamic-update-slice under
the loop's conditional (CPU and GPU: 41 ms instead of 7 ms per token on an H100)."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import pytest

from jaxinfer.attention import attention_apart
from jaxinfer.config import CacheConfig, EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.runner import decode_kind
from jaxinfer.models import GEMMA3, LLAMA, QWEN3
from jaxinfer.models.fused import fuse_projections
from jaxinfer.params import abstract_params
from model_helpers import build_runner, step_hlo, tiny_config, tiny_qwen3_dense
from models.test_gemma3 import tiny_config as tiny_gemma_config

# Copies and transposes that materialise an array: `%x = f32[...]{...} copy(` (also async copy-start).
_COPY = re.compile(r"= (\w+)\[([\d,]*)\]\{[^}]*\} (copy|copy-start|transpose)\(")


def _big_sizes(runner) -> set[int]:
    """Element counts of every matrix weight and of one cache layer (an activation never has these here:
    hidden 80 and ffn 112 are no bucket multiples)."""
    weights = abstract_params(runner.family.param_specs(runner.cfg, jnp.float32))
    sizes = {math.prod(a.shape) for a in jax.tree.leaves((weights, runner.weights)) if a.ndim > 1}  # joined too
    return sizes | {math.prod(runner.kv_cache.k[0].shape)}


def _copies(text: str, sizes: set[int]) -> list[str]:
    found = []
    for dtype, dims, op in _COPY.findall(text):
        numel = math.prod(int(d) for d in dims.split(",") if d)
        if numel in sizes:
            found.append(f"{op} {dtype}[{dims}]")
    return found


def _compiled(family, cfg, attention_impl: str, dtype=jnp.float32, single_step: bool = True,
              decode_rows: tuple[int, ...] = (1, 8), weights_hook=None) -> tuple[list[str], set[int]]:
    runner = build_runner(cfg, family=family, num_pages=40, page_size=4, attention_impl=attention_impl, dtype=dtype,
                          weights_hook=weights_hook)
    engine = Engine(runner, None, EngineConfig(max_num_seqs=8, max_num_batched_tokens=32),
                    CacheConfig(page_size=4, num_pages=40), use_tqdm=False, decode_steps_per_call=8)
    engine.small_step_buckets = (2,)  # decode-only single steps of 1-2 rows, on a GPU or TPU
    texts = [step_hlo(engine, 16), step_hlo(engine, 1)] if single_step else []
    for rows in decode_rows:  # the 1-row bucket's cache write is a dynamic-update-slice, the others' a scatter
        decode = (runner.weights, runner.kv_cache, engine.penalties,
                  *engine._decode_args(engine.decode_shape(rows), [], [], 0))
        for branch_free in (False, True):  # both builds of the loop (runner.takes_branch_free)
            loop = runner._jitted(decode_kind(engine.decode_shape(rows).seqs))  # the program the engine runs
            texts.append(loop.lower(*decode, max_steps=8, branch_free=branch_free).compile().as_text())
    return texts, _big_sizes(runner)


FAMILIES = {"llama": (LLAMA, tiny_config), "gemma3": (GEMMA3, tiny_gemma_config)}
# On a GPU also Qwen3 and Llama with q/k/v joined at load, as the engine loads them on one device: their decode steps
# write the cache from the norm_rope_write kernel (a custom call whose outputs alias the pages) in bfloat16.
GPU_FAMILIES = {**FAMILIES, "qwen3": (QWEN3, tiny_qwen3_dense), "llama-joined": (LLAMA, tiny_config)}
HOOKS = {"qwen3": fuse_projections, "llama-joined": fuse_projections}


def _check(name: str, attention_impl: str, dtype=jnp.float32, **programs) -> None:
    family, make = GPU_FAMILIES[name]
    texts, sizes = _compiled(family, make(hidden_size=80, intermediate_size=112), attention_impl, dtype,
                             weights_hook=HOOKS.get(name), **programs)
    for text in texts:
        assert "while" in text or "decode" not in text
        assert _copies(text, sizes) == []


# "auto" is the xla attention on a CPU (a gather of each sequence's pages per kv block, never the cache).
@pytest.mark.parametrize("attention_impl", ["reference", "auto"])
@pytest.mark.parametrize("name", FAMILIES)
def test_decode_loop_and_step_copy_no_weight_or_cache(name: str, attention_impl: str) -> None:
    _check(name, attention_impl)


# On a GPU the single step and the 8-row decode loop copy nothing, in bfloat16 (the GPU default) and float32.
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("name", GPU_FAMILIES)
def test_decode_loop_copies_no_weight_or_cache_on_gpu(name: str, dtype) -> None:
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU (jax.default_backend() != 'gpu')")
    _check(name, "reference", dtype, decode_rows=(8,))


# A lone decoding row's loop runs in a 2-row bucket on a GPU (Engine.decode_row_buckets). In a 1-row bucket
# XLA:GPU stored the q/k/v projection weights [D, N, H] transposed to [N, H, D] (a copy of each per call; seen on
# an H100 at eb00618 and since, in both dtypes); at two rows every projection is a GEMM over the weights in place
# (passed on an H200 on 2026-11-26, where the 1-row bucket still copied).
@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_FAMILIES)
def test_one_row_decode_loop_on_gpu(name: str) -> None:
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU (jax.default_backend() != 'gpu')")
    _check(name, "reference", jnp.bfloat16, single_step=False, decode_rows=(1,))


# XLA's GPU runtime reads a while loop's predicate back to the host on every iteration, so a loop in a step's
# forward (there were two: jnp.searchsorted's default "scan" in the attention kernel's wrapper) kept the host
# from queueing that step's kernels until the device reached the loop. With the platform's attention kernel the
# forward of every single-step bucket has no loop, and the decode program has one: the decode loop itself.
@pytest.mark.gpu
def test_forward_has_no_loop_and_decode_one_on_gpu() -> None:
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU (jax.default_backend() != 'gpu')")
    from jaxinfer.engine.runner import forward_kind
    from jaxinfer.presets import load_preset

    cfg = load_preset("llama-3-8b").replace(hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                                            num_kv_heads=2, head_dim=64, vocab_size=4096)
    runner = build_runner(cfg, num_pages=40, page_size=16, attention_impl="auto", dtype=jnp.bfloat16)
    engine = Engine(runner, None, EngineConfig(max_num_seqs=8, max_num_batched_tokens=32),
                    CacheConfig(page_size=16, num_pages=40), use_tqdm=False, decode_steps_per_call=8,
                    single_step_max_rows=8)
    loops = re.compile(r"\bwhile\(")
    for shape in engine.small_step_shapes() + [engine.batch_shape(t) for t in engine.token_buckets]:
        batch, inputs = engine._step_args(shape, [], [])
        forward = runner._jitted(forward_kind(shape.tokens))
        text = forward.lower(runner.weights, runner.kv_cache, runner.place(batch)).compile().as_text()
        assert "mosaic" in text.lower() and not loops.findall(text), shape
    for rows in (1, 16):
        decode = (runner.weights, runner.kv_cache, engine.penalties,
                  *engine._decode_args(engine.decode_shape(rows), [], [], 0))
        loop = runner._jitted(decode_kind(engine.decode_shape(rows).seqs))
        text = loop.lower(*decode, max_steps=8, branch_free=True).compile().as_text()
        assert len(loops.findall(text)) == 1, rows


def test_cpu_layers_call_one_attention_computation() -> None:
    """On a CPU every layer calls the attention as a computation of its own instead of inlining it (jaxinfer.attention:
    the bundled SmolLM2's programs compiled in 26-28 s instead of 34-47), and the calls survive XLA's pipeline into
    the compiled step and loop; the copy check above holds for these same programs."""
    assert attention_apart(None)
    cfg = tiny_config(hidden_size=80, intermediate_size=112)
    texts, _ = _compiled(LLAMA, cfg, "auto", decode_rows=(8,))
    for text in texts:
        assert len(re.findall(r" call\(", text)) >= cfg.num_layers
