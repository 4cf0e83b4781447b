"""Engine defaults that fit the platform: what `LLM(model)` with no engine knobs runs with.

A GPU or TPU serves many sequences at once and is fed from a host that must stay out of the way, so it gets
a wide batch (256 sequences, a 4096-token step budget), 8 decode iterations per device call and most of the
memory the weights leave for the KV cache. A CPU (tests, laptops, notebooks) gets a small batch and half of
the memory; 4 decode iterations per call there because one token per call spends most of each step in the
host. Any of them passed explicitly wins.

`quantization` left unset is the platform's too. A GPU or TPU keeps a .gguf model's blocks quantized (its
kernels read them as they are). A CPU has no quantized matmul kernel: each step would dequantize every weight
(3.6x slower than float at batch 1 on SmolLM2-135M), so it dequantizes once at load when the float copy takes
at most 1/8 of the host's memory, and keeps larger models quantized so that they still fit.

The values chosen are printed once per process, so a user sees what ran without reading this file.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import jax


@dataclasses.dataclass(frozen=True)
class PlatformDefaults:
    max_num_seqs: int
    max_num_batched_tokens: int
    decode_steps_per_call: int
    memory_fraction: float  # of each device's memory still free after the weights, for the KV cache
    # Streamed decode batches of at most this many rows run one iteration per device call, each call launched
    # before the previous one's tokens are read (engine/pipeline.py), so tokens reach a streaming client one by
    # one (ITL p99 1.2x the median at concurrency 1 on an H100, not ~3,000x with 8-iteration calls). At 64 rows
    # pure decode was even (12.93 / 12.90 ms), but a served mix of prefills and decodes at 64 lost ~5%: 8 is
    # what was measured to win. Batches that nobody streams keep multi-step calls (`Engine.decodes_singly`):
    # since the multi-step loop lost its branches and host syncs, it runs a token faster on the device than a
    # single step's kernels launched one by one (docs/PERFORMANCE.md, twenty-first session). A CPU runs the
    # "device" work on the host's own cores, so it keeps multi-step calls.
    single_step_max_rows: int


CPU = PlatformDefaults(max_num_seqs=16, max_num_batched_tokens=512, decode_steps_per_call=4, memory_fraction=0.5,
                       single_step_max_rows=0)
ACCELERATOR = PlatformDefaults(max_num_seqs=256, max_num_batched_tokens=4096, decode_steps_per_call=8,
                               memory_fraction=0.85, single_step_max_rows=8)
FIELDS = tuple(f.name for f in dataclasses.fields(PlatformDefaults))

# Mixture-of-experts models keep multi-step calls at every batch size. Each of Qwen3-30B-A3B's 48 layers ran
# ~27 small kernels for routing, dispatch, the grouped matmuls and the combine (scripts/profile_moe_block.py;
# 13 since decode steps take the per-pair path), so a single step was ~2,000 launches: launched one by one from
# the host, the device was busy 6.3 ms of the 19.6 ms a single step took on an H200 at batch 1, while the
# multi-step loop ran 7.9 ms per iteration. With the per-pair path: 12.4 against 7.45 ms (device only).
MOE_SINGLE_STEP_MAX_ROWS = 0
# Quantized weights on a GPU keep multi-step calls too. Each quantized product is a Mosaic GPU kernel plus its
# wrapper's small kernels (activation padding, the split-K sum, scales), ~800 launches a Llama-3-8B step, and a
# single step launches them one by one from the host. H200, batch 1, traced (scripts/trace_engine.py): with int8
# weights a token took 13.6 ms in single steps, the device busy 28% of it, against 4.8 ms in the multi-step loop,
# whose CUDA graphs launch the kernels (busy 80%); int4 23.1 against 5.2 ms. fp8 (W8A8: one kernel per product
# plus the activations' quantization) was not traced; it is held to the same rule.
QUANTIZED_GPU_SINGLE_STEP_MAX_ROWS = 0

CPU_FLOAT_WEIGHTS_FRACTION = 1 / 8

_announced: set[tuple[str, tuple[tuple[str, object], ...]]] = set()


def platform_defaults(backend: str | None = None) -> PlatformDefaults:
    return CPU if (backend or jax.default_backend()) == "cpu" else ACCELERATOR


def fill_defaults(values: dict[str, object], backend: str | None = None) -> dict[str, object]:
    """The platform's default for every None among FIELDS in `values` (only those)."""
    defaults = platform_defaults(backend)
    return {name: getattr(defaults, name) for name in FIELDS if values.get(name) is None}


def fit_to_model(chosen: dict[str, object], moe: bool, quantized: bool = False,
                 backend: str | None = None) -> dict[str, object]:
    """The platform's choices in `chosen` (fill_defaults' result) adjusted to the model: a mixture-of-experts
    model gets MOE_SINGLE_STEP_MAX_ROWS, quantized weights on a GPU QUANTIZED_GPU_SINGLE_STEP_MAX_ROWS. Values the
    user passed are not in `chosen` and stay as given."""
    if "single_step_max_rows" not in chosen:
        return chosen
    if moe:
        return {**chosen, "single_step_max_rows": MOE_SINGLE_STEP_MAX_ROWS}
    if quantized and (backend or jax.default_backend()) == "gpu":
        return {**chosen, "single_step_max_rows": QUANTIZED_GPU_SINGLE_STEP_MAX_ROWS}
    return chosen


PAGE_SIZE = 16
# A quantized KV cache on a GPU: the attention kernel copies each page's scale row (R fp32 per KV head) into
# shared memory with one TMA copy, and Mosaic GPU takes copies of a multiple of 128 bytes (R >= 32).
QUANTIZED_KV_GPU_PAGE_SIZE = 32


def default_page_size(quantized_kv: bool, backend: str | None = None) -> int:
    """Tokens per KV page when `block_size` is not given: PAGE_SIZE, or QUANTIZED_KV_GPU_PAGE_SIZE for an int8 /
    fp8 cache on a GPU."""
    if quantized_kv and (backend or jax.default_backend()) == "gpu":
        return QUANTIZED_KV_GPU_PAGE_SIZE
    return PAGE_SIZE


def default_quantization(checkpoint: object, float_weight_bytes: int, backend: str | None = None) -> str | None:
    """What `quantization=None` means here: "none" (dequantize at load) for a quantized checkpoint on a CPU
    whose float weights fit in CPU_FLOAT_WEIGHTS_FRACTION of the host's memory, else None ('auto')."""
    if (backend or jax.default_backend()) != "cpu" or not callable(getattr(checkpoint, "quantization_plan", None)):
        return None
    host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return "none" if float_weight_bytes <= CPU_FLOAT_WEIGHTS_FRACTION * host_bytes else None


def announce(chosen: dict[str, object], backend: str | None = None) -> None:
    """Print the defaults chosen, once per process and set of values (after the model loaded: an error
    about the model must stay the only line a failed start prints)."""
    if not chosen:
        return
    backend = backend or jax.default_backend()
    key = (backend, tuple(sorted(chosen.items())))
    if key in _announced:
        return
    _announced.add(key)
    settings = ", ".join(f"{k}={v}" for k, v in chosen.items())
    print(f"jaxinfer: {backend} defaults {settings} (pass any of them to LLM(...) to choose otherwise)",
          file=sys.stderr)
