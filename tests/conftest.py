"""Test-wide setup: 8 forced CPU devices (for sharding tests) and shared real-model fixtures.

The device count must be fixed before JAX initializes its backend, hence the environment variable here at
import time rather than in a fixture.
"""

from __future__ import annotations

import os
from pathlib import Path

# Compiling is most of the suite's time on 2 cores, and most of XLA:CPU's compiling is LLVM's. Its costliest passes
# off: an engine over the real SmolLM2 compiled in 37 s instead of 49 s and decoded no slower (its matmuls are
# library calls), and the HF parity goldens (exact tokens, logits within 1e-4) pass unchanged. LLVM's optimization
# level 0 on top, each alone from an empty compilation cache: a speculative chi-square test on a tiny model (four
# engines' warmups) 83.7 -> 66.6 s, ten interpreted attention-kernel tests 61.6 -> 54.2 s, test_parity.py on the real
# model 249.4 -> 249.9 s (what it saves in compiling its slower code gives back); docs/PERFORMANCE.md, "CPU".
# Users' programs keep XLA's defaults; subprocesses that force another device count keep the rest
# (model_helpers.xla_flags_with_devices).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_llvm_disable_expensive_passes=true "
                                   "--xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Many tests build engines whose compiled programs are identical (same shapes, new jit closures); a
# persistent cache shared by the xdist workers, and by the subprocesses and notebook kernels that inherit
# this environment, turns those repeats into cache hits.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".pytest_cache" / "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1.0")

import pytest  # noqa: E402

from goldens import load_golden  # noqa: E402  (tests import it from there too)


# The slowest modules, slowest first (per-module wall totals on the 2-core machine from an empty compilation cache,
# 2026-11-28). CI runs the suite with `-n 2 --dist loadfile`: xdist hands whole modules to its two workers in
# collection order (pyproject's --no-loadscope-reorder keeps it from reordering them by test count), so starting
# these first lets the many short modules fill in behind instead of one worker running a long module alone at the
# end. Only the order changes; every module runs.
SLOWEST_MODULES = (
    "test_bench_scaling.py", "test_parity_spec.py", "engine/test_speculative.py", "test_parity.py",
    "pallas_kernels/test_ragged_paged_attention_gpu.py", "serve/test_structured.py", "test_beam_search.py",
    "test_parity_gemma3.py", "test_bench.py", "pallas_kernels/test_quantized_matmul.py",
    "test_quantization_accuracy.py", "distributed/test_multihost.py", "pallas_kernels/test_grouped_matmul.py",
    "engine/test_no_copies.py", "test_quantization.py", "test_vllm_examples.py", "serve/test_engine_process.py",
    "engine/test_overlap.py", "serve/test_server_smollm2.py", "engine/test_pipeline.py",
    "pallas_kernels/test_ragged_paged_attention.py",
)


def _slow_rank(item) -> int:
    try:
        path = item.path.resolve().relative_to(Path(__file__).resolve().parent).as_posix()
    except ValueError:  # collected from outside tests/
        return len(SLOWEST_MODULES)
    return SLOWEST_MODULES.index(path) if path in SLOWEST_MODULES else len(SLOWEST_MODULES)


def pytest_collection_modifyitems(config, items):
    """The slowest modules first (SLOWEST_MODULES; a stable sort, so tests keep their order inside a module), and
    `gpu`-marked tests skipped when JAX sees no GPU, wherever they live (a GPU test left to run on the CPU
    backend can take minutes: a 2-layer Qwen3-30B-A3B shape took 4 in CI)."""
    import jax

    items.sort(key=_slow_rank)
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU (jax.default_backend() != 'gpu')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from jaxinfer.presets import bundled_checkpoint

    return bundled_checkpoint("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    from jaxinfer.presets import bundled_checkpoint

    return bundled_checkpoint("gemma3-270m")


@pytest.fixture(scope="session")
def smollm2_golden() -> dict:
    return load_golden("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gemma3_golden() -> dict:
    return load_golden("gemma3-270m")


@pytest.fixture(scope="session")
def smollm2(smollm2_path: Path):
    """SmolLM2's tokenizer, built from its GGUF once per session (tokenizer and detokenizer tests share it)."""
    from jaxinfer.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="session")
def gemma3(gemma3_path: Path):
    """Gemma 3's SentencePiece tokenizer, built from its GGUF once per session."""
    from jaxinfer.tokenizer import load_tokenizer

    return load_tokenizer(gemma3_path)


TEXT_LLM_KW = dict(random_weights=True, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, block_size=16,
                   num_pages=40, attention_impl="reference", use_tqdm=False, decode_steps_per_call=4)


@pytest.fixture(scope="session")
def text_llm(smollm2_path: Path):
    """A tiny random Llama behind the public `LLM`, with SmolLM2's real tokenizer (vocabulary, special tokens,
    chat template): real text, compiled in seconds, multi-step decode with overlap on. Shared by the modules
    that test the front door; every test must leave it clean (nothing queued, every page free)."""
    from jaxinfer import LLM
    from jaxinfer.presets import load_preset

    cfg = load_preset("smollm2-135m").replace(hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                                               num_kv_heads=2, head_dim=16, tie_word_embeddings=False)
    return LLM(cfg, tokenizer=smollm2_path, **TEXT_LLM_KW)



@pytest.fixture(autouse=True, scope="module")
def _release_memory_after_each_module():
    """Hand a module's memory back to the system when it ends.

    A worker runs dozens of modules, each building its own engines. Without this, dropped engines' compiled
    programs stay in JAX's caches and glibc keeps the freed heap, so a worker grew to ~10 GB by the end of the
    suite and the two of them, with the servers and multi-host processes the last modules start, ran a 24 GB CI
    machine out of memory (a worker killed, the run hung). Measured on the engine and parity modules: a worker
    ended at 4.6 GB without this and 1.8 GB with it."""
    yield
    import ctypes
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass
