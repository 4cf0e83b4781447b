"""HF transformers baseline for the end-to-end benchmark: same workload as the engine, through torch + transformers.

Builds a Llama model with random weights from the shape in a spec file (no download: the hub is forced offline),
on the spec's device and dtype, and measures:

  copy_bw_gbs  device-to-device copy bandwidth of a large tensor (bytes read + written per second), the
               denominator of MBU, measured beside the model on the same device;
  decode       per batch size B: B random prompts of `ctx` tokens, greedy generate with the static cache
               (`cache_implementation="static"`). Per-step decode time excludes prefill:
               (generate(steps + 1 new tokens) - generate(1 new token)) / steps, medians after a warmup call.
               MBU = (weight bytes + KV bytes attended per step) / step time / copy bandwidth. On CUDA, HF
               torch.compile's the decode forward itself (mode "reduce-overhead"); `compiled` records whether it did
               and `warmup_s` the first call, compile included;
  throughput   per workload and mode, all prompts at once, exactly `output_len` greedy tokens each (EOS disabled):
               "static"          one `model.generate` over the whole batch with the static cache;
               "generate_batch"  transformers' continuous batching (`model.generate_batch`, paged KV cache).
               Each mode runs a short warmup of the same shape first (reported as `warmup_s`, not in `elapsed_s`).

A mode that fails records {"error": ...} and the run goes on. A mode whose run is estimated to exceed the spec's
`time_limit_s` records {"skipped": ...}: the estimate comes from the decode timings (both modes, before running) and,
for generate_batch, also from the token timestamps of its own warmup call (continuous batching can be several times
slower than the static path). The JSON is rewritten after every measurement.

    python3 jaxinfer/bench/hf_baseline.py --spec SPEC.json --out RESULT.json   (jaxinfer bench runs it)

Exit status: 0 when the result file was written (even with failed modes), 1 when the model could not be run at all
(the file then holds a top-level "error").
"""

from __future__ import annotations

import os

# Never touch the network: everything below is built from a config with random weights.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

PROMPT_VOCAB_CAP = 32000  # prompt token ids are drawn from [0, min(vocab, 32000))
STATIC_WARMUP_TOKENS = 8  # short output of the static-mode warmup: enough decode steps to compile and record graphs
CB_WARMUP_TOKENS = 16  # output of the generate_batch warmup, also a probe of its step time
DEFAULT_REPEATS = 3  # timed calls per decode measurement (median)

Json = dict[str, Any]


# ----------------------------------------------------------------------------------------------------------------
# Small utilities


def log(msg: str) -> None:
    print(f"[bench_hf] {msg}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds taken by fn() with the device drained before and after, and fn's result."""
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def error_record(exc: BaseException) -> Json:
    tail = traceback.format_exception(type(exc), exc, exc.__traceback__)[-3:]
    return {"error": f"{type(exc).__name__}: {exc}", "traceback_tail": "".join(tail)[-2000:]}


def guarded(label: str, fn: Callable[[], Json]) -> Json:
    """Run one measurement; a failure becomes {"error": ...} instead of ending the run."""
    try:
        return fn()
    except Exception as exc:  # one failing mode must not take the others down
        record = error_record(exc)
        log(f"{label}: FAILED {record['error']}")
        return record


def write_json(path: Path, result: Json) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def dynamo_graph_count() -> int | None:
    """Graphs compiled by torch.compile so far in this process (to spot recompiles inside a timed region)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:
        return None


def make_prompts(rng: np.random.Generator, count: int, length: int, vocab_size: int) -> np.ndarray:
    return rng.integers(0, min(vocab_size, PROMPT_VOCAB_CAP), size=(count, length), dtype=np.int64)


# ----------------------------------------------------------------------------------------------------------------
# Device ceiling


def copy_bandwidth(device: torch.device, dtype: torch.dtype, repeats: int = 10) -> float:
    """Bytes per second (read + written) of a plain device-to-device copy: 2 GiB on CUDA, 64 MiB on CPU."""
    nbytes = (2 << 30) if device.type == "cuda" else (64 << 20)
    itemsize = torch.empty((), dtype=dtype).element_size()
    src = torch.ones(nbytes // itemsize, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = [timed(device, lambda: dst.copy_(src))[0] for _ in range(repeats)]
    return 2 * src.numel() * itemsize / statistics.median(times)  # src and dst are freed on return


# ----------------------------------------------------------------------------------------------------------------
# Model


def build_model(spec: Json, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """LlamaForCausalLM with random weights, initialised directly on the device, with EOS/BOS/PAD unset."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    # No special tokens: generation can never stop early on EOS, every request makes exactly max_new_tokens.
    shape = {**spec["model"], "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    config = LlamaConfig(**shape)
    torch.manual_seed(int(spec.get("seed", 0)))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    gen = model.generation_config
    gen.bos_token_id = gen.eos_token_id = gen.pad_token_id = None
    return model


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Parameter bytes a decode step reads: everything but the input embedding (a gather) when it is untied."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights are counted once
    if not model.config.tie_word_embeddings:
        emb = model.get_input_embeddings().weight
        total -= emb.numel() * emb.element_size()
    return total


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """K and V bytes of one cached token over all layers."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * itemsize


def kv_bytes_per_step(model: torch.nn.Module, batch: int, ctx: int, steps: int) -> float:
    """K and V bytes attended per decode step, at the mean context over the timed steps."""
    return batch * (ctx + steps / 2) * kv_bytes_per_token(model)


def step_scale(model: torch.nn.Module, batch_from: int, kv_len_from: float, batch_to: int, kv_len_to: float) -> float:
    """Ratio of the bytes one decode step reads (weights + KV) between two (batch, attended length) points: how a
    step time measured at one point is carried over to another."""
    weights = weight_bytes_per_step(model)
    per_token = kv_bytes_per_token(model)
    return (weights + batch_to * kv_len_to * per_token) / (weights + batch_from * kv_len_from * per_token)


def reset_static_generate_state(model: torch.nn.Module, device: torch.device) -> None:
    """Drop what HF's static-cache generate keeps between calls (compiled forward + CUDA graph pools, cache size),
    so every measurement compiles for its own shapes and its memory is returned."""
    for attr in ("_compiled_call", "_last_compile_config", "_previous_max_cache_length"):
        if hasattr(model, attr):
            delattr(model, attr)
    try:
        torch._dynamo.reset()
    except Exception as exc:
        log(f"torch._dynamo.reset() failed: {exc}")
    try:
        from torch._inductor import cudagraph_trees

        cudagraph_trees.reset_cudagraph_trees()  # CUDA graph memory pools of "reduce-overhead"
    except Exception as exc:
        log(f"reset_cudagraph_trees() failed: {exc}")
    free_memory(device)


def compile_info(model: torch.nn.Module) -> Json:
    """Whether HF's generate compiled the forward (it caches the compiled callable on the model), and how."""
    compiled = hasattr(model, "_compiled_call")
    info: Json = {"compiled": compiled}
    cfg = getattr(model, "_last_compile_config", None)
    if compiled and cfg is not None:
        try:
            info["compile_config"] = cfg.to_dict()
        except Exception:
            info["compile_config"] = str(cfg)
    return info


def static_generate(model: torch.nn.Module, prompts: np.ndarray, new_tokens: int, cache_len: int) -> torch.Tensor:
    """Greedy generate with HF's static cache sized to exactly `cache_len` positions."""
    input_ids = torch.from_numpy(prompts).to(model.device)
    # HF sizes a new static cache to max(this call, the largest previous call): pin it so that every call of a
    # measurement uses the same cache length (same compiled graph) and a smaller later one is not penalised.
    model._previous_max_cache_length = cache_len
    return model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        cache_implementation="static",
        max_cache_len=cache_len,
    )


def check_new_tokens(out: torch.Tensor, prompt_len: int, expected: int) -> int:
    made = int(out.shape[1]) - prompt_len
    if made != expected:
        raise RuntimeError(f"generate made {made} new tokens per prompt, expected {expected}")
    return made


# ----------------------------------------------------------------------------------------------------------------
# Decode


def measure_decode(model: torch.nn.Module, device: torch.device, batch: int, ctx: int, steps: int, repeats: int,
                   rng: np.random.Generator, copy_bw: float) -> Json:
    prompts = make_prompts(rng, batch, ctx, model.config.vocab_size)
    cache_len = ctx + steps + 1
    reset_static_generate_state(model, device)

    warmup_s, out = timed(device, lambda: static_generate(model, prompts, steps + 1, cache_len))
    check_new_tokens(out, ctx, steps + 1)
    info = compile_info(model)
    graphs_before = dynamo_graph_count()
    prefill_times, full_times = [], []
    for _ in range(repeats):
        prefill_times.append(timed(device, lambda: static_generate(model, prompts, 1, cache_len))[0])
        full_times.append(timed(device, lambda: static_generate(model, prompts, steps + 1, cache_len))[0])
    graphs_after = dynamo_graph_count()
    del out
    reset_static_generate_state(model, device)

    prefill_s = statistics.median(prefill_times)
    step_s = (statistics.median(full_times) - prefill_s) / steps
    if step_s <= 0:
        raise RuntimeError(f"non-positive step time {step_s * 1e3:.3f} ms (prefill {prefill_times}, full {full_times})")
    weights = weight_bytes_per_step(model)
    kv = kv_bytes_per_step(model, batch, ctx, steps)
    record: Json = {
        "batch": batch, "ctx": ctx, "steps": steps, "repeats": repeats,
        "step_ms": step_s * 1e3,
        "tok_s": batch / step_s,
        "mbu": (weights + kv) / step_s / copy_bw,
        "prefill_s": prefill_s,
        "weight_bytes_per_step": weights,
        "kv_bytes_per_step": kv,
        "static_cache_len": cache_len,
        "warmup_s": warmup_s,
        **info,
        "prefill_times_s": prefill_times,
        "full_times_s": full_times,
    }
    if graphs_before is not None and graphs_after is not None:
        record["graphs_compiled_while_timing"] = graphs_after - graphs_before
    return record


# ----------------------------------------------------------------------------------------------------------------
# Throughput


def estimate_workload_s(model: torch.nn.Module, decode: Json, num_prompts: int, input_len: int,
                        output_len: int) -> float | None:
    """Rough time of a static-cache throughput run from the decode measurements: prefill at the measured per-token
    rate, plus output_len steps at the step time interpolated in batch to num_prompts (clamped to the measured range)
    and carried over to the workload's batch and cache length by the bytes a step reads (HF's static cache attends
    over its whole length). None without any decode measurement."""
    points = sorted((r["batch"], r["step_ms"] / 1e3, r["prefill_s"] / (r["batch"] * r["ctx"]), r["static_cache_len"])
                    for r in decode.values() if "step_ms" in r)
    if not points:
        return None
    batches = [p[0] for p in points]
    ref_batch = min(max(num_prompts, batches[0]), batches[-1])
    ref_step = float(np.interp(ref_batch, batches, [p[1] for p in points]))
    ref_cache_len = points[-1][3]
    step_s = ref_step * step_scale(model, ref_batch, ref_cache_len, num_prompts, input_len + output_len)
    prefill_per_token = points[-1][2]
    return prefill_per_token * num_prompts * input_len + output_len * step_s


def estimate_from_cb_probe(model: torch.nn.Module, outputs: dict[str, Any], probe_tokens: int, input_len: int,
                           output_len: int) -> float | None:
    """Rough time of a generate_batch run from its warmup call (same prompt count and length, `probe_tokens` out,
    per-token timestamps): from the first request's creation (after the manager is set up) until the last request
    got its first token, plus output_len - 1 steps at that request's median token interval (by then the batch is
    decoding), carried over to the longer context by the bytes a step reads."""
    runs = [(o.created_time, list(o.timestamps)) for o in outputs.values() if getattr(o, "timestamps", None)]
    runs = [(created, stamps) for created, stamps in runs if len(stamps) >= 3]
    if not runs:
        return None
    first_created = min(created for created, _ in runs)
    last = max((stamps for _, stamps in runs), key=lambda stamps: stamps[0])
    step_s = float(np.median(np.diff(last)))
    batch = len(outputs)
    scale = step_scale(model, batch, input_len + probe_tokens / 2, batch, input_len + output_len / 2)
    return (last[0] - first_created) + (output_len - 1) * step_s * scale


def run_static(model: torch.nn.Module, device: torch.device, prompts: np.ndarray, warm_prompts: np.ndarray,
               output_len: int, time_limit_s: float | None = None) -> Json:
    """One `model.generate` over all prompts with the static cache, after a warmup of the same batch and cache length
    with a short output (compile and CUDA graph capture happen there). time_limit_s is checked by the caller."""
    num_prompts, input_len = prompts.shape
    cache_len = input_len + output_len
    reset_static_generate_state(model, device)
    warm_tokens = min(STATIC_WARMUP_TOKENS, output_len)
    warmup_s, out = timed(device, lambda: static_generate(model, warm_prompts, warm_tokens, cache_len))
    del out
    info = compile_info(model)
    graphs_before = dynamo_graph_count()
    elapsed, out = timed(device, lambda: static_generate(model, prompts, output_len, cache_len))
    graphs_after = dynamo_graph_count()
    made = check_new_tokens(out, input_len, output_len)
    del out
    reset_static_generate_state(model, device)
    record = throughput_record(elapsed, num_prompts * made, num_prompts * input_len, warmup_s)
    record.update(info)
    record["static_cache_len"] = cache_len
    if graphs_before is not None and graphs_after is not None:
        record["graphs_compiled_while_timing"] = graphs_after - graphs_before
    return record


def page_size_field(cb_config: Any) -> tuple[str, int]:
    """The KV page size of a ContinuousBatchingConfig: `page_size` in 5.23, `block_size` in 5.17."""
    for name in ("page_size", "block_size"):
        value = getattr(cb_config, name, None)
        if isinstance(value, int) and value > 0:
            return name, value
    return "page_size", 256


def cb_config_summary(manager: Any) -> Json:
    """The resolved continuous-batching settings that matter for reading the numbers."""
    cfg = getattr(manager, "continuous_batching_config", None)
    if cfg is None:
        return {}
    keys = ("page_size", "block_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch",
            "max_blocks_per_request", "use_cuda_graph", "use_async_batching", "max_memory_percent",
            "varlen_compile_config", "decode_compile_config", "default_compile_level")
    out: Json = {}
    for key in keys:
        value = getattr(cfg, key, None)
        if value is not None:
            out[key] = value if isinstance(value, (int, float, bool, str)) else str(value)
    return out


def cb_generate(model: torch.nn.Module, prompts: np.ndarray, new_tokens: int, gen_config: Any, cb_config: Any,
                keep_manager: bool, timestamps: bool = False) -> dict[str, Any]:
    """One `generate_batch` call; raises if any request failed (a failed request returns no tokens)."""
    outputs = model.generate_batch(inputs=prompts.tolist(), generation_config=gen_config,
                                   continuous_batching_config=cb_config, persistent_manager=keep_manager,
                                   record_timestamps=timestamps, max_new_tokens=new_tokens)
    errors = [str(o.error) for o in outputs.values() if getattr(o, "error", None) is not None]
    if errors:
        raise RuntimeError(f"{len(errors)}/{len(prompts)} generate_batch requests failed, first: {errors[0]}")
    return outputs


def run_generate_batch(model: torch.nn.Module, device: torch.device, prompts: np.ndarray, warm_prompts: np.ndarray,
                       output_len: int, time_limit_s: float | None = None) -> Json:
    """Continuous batching over all prompts. The warmup call (other prompts, short output) creates the manager
    (paged cache, CUDA graph capture) and keeps it, so the timed call runs on a warm manager; both are sized for the
    timed workload (max_requests_per_batch and max_blocks_per_request set as generate_batch's own hints would).
    The warmup's token timestamps give an estimate of the timed call; over time_limit_s it is skipped."""
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    if not hasattr(model, "generate_batch"):
        raise RuntimeError(f"transformers {transformers.__version__} has no model.generate_batch")
    num_prompts, input_len = prompts.shape
    cb_config = ContinuousBatchingConfig()
    page_name, page = page_size_field(cb_config)
    blocks = math.ceil((input_len + output_len) / page) + 1
    cb_config.max_blocks_per_request = blocks + blocks % 2
    cb_config.max_requests_per_batch = num_prompts
    # eos_token_id None: continuous batching turns it into -1 (never fires).
    gen_config = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=None, pad_token_id=None)
    attn_before = model.config._attn_implementation
    warm_tokens = min(CB_WARMUP_TOKENS, output_len)
    record: Json = {}
    # The manager allocates its cache on this thread and updates it from its generation thread, which runs under
    # no_grad only: tensors created under inference_mode could not be written there, so leave inference_mode here.
    with torch.inference_mode(False):
        try:
            warmup_s, warm_out = timed(device, lambda: cb_generate(model, warm_prompts, warm_tokens, gen_config,
                                                                   cb_config, keep_manager=True, timestamps=True))
            estimate = estimate_from_cb_probe(model, warm_out, warm_tokens, input_len, output_len)
            record["warmup_s"] = warmup_s
            record["estimated_s"] = estimate
            record["cb_config"] = {**cb_config_summary(getattr(model, "_cached_continuous_batching_manager", None)),
                                   page_name: page}
            record["attn_implementation"] = attn_before
            record["flash_attn_available"] = flash_attention_available()
            if time_limit_s is not None and estimate is not None and estimate > time_limit_s:
                return {"skipped": f"estimated {estimate:.1f} s from the warmup probe > time_limit_s "
                                   f"{time_limit_s:g} s", **record}
            elapsed, outputs = timed(device, lambda: cb_generate(model, prompts, output_len, gen_config, cb_config,
                                                                 keep_manager=False))
        finally:
            if hasattr(model, "destroy_cached_continuous_batching_manager"):
                model.destroy_cached_continuous_batching_manager()
            free_memory(device)

    counts = [len(o.generated_tokens) for o in outputs.values()]
    produced = sum(counts)
    if produced == 0:
        raise RuntimeError(f"generate_batch returned {len(counts)} requests and no tokens")
    record = {**throughput_record(elapsed, produced, num_prompts * input_len, warmup_s), **record}
    record["requests_returned"] = len(counts)
    if len(counts) != num_prompts or any(c != output_len for c in counts):
        record["incomplete"] = (f"{len(counts)}/{num_prompts} requests returned, {produced} tokens made, expected "
                                f"{num_prompts * output_len}; fewest in one request {min(counts)}")
        log(f"generate_batch: {record['incomplete']}")
    return record


def flash_attention_available() -> bool:
    try:
        from transformers.utils import is_flash_attn_2_available

        return bool(is_flash_attn_2_available())
    except Exception:
        return False


def throughput_record(elapsed: float, output_tokens: int, input_tokens: int, warmup_s: float) -> Json:
    return {
        "elapsed_s": elapsed,
        "output_tokens": output_tokens,
        "input_tokens": input_tokens,
        "output_tok_s": output_tokens / elapsed,
        "total_tok_s": (input_tokens + output_tokens) / elapsed,
        "warmup_s": warmup_s,
    }


MODE_RUNNERS: dict[str, Callable[..., Json]] = {
    "static": run_static,
    "generate_batch": run_generate_batch,
}


def measure_workload(model: torch.nn.Module, device: torch.device, workload: Json, modes: list[str], seed: int,
                     decode: Json, time_limit_s: float | None) -> Json:
    """All modes on one workload (same prompts for every mode), skipping those estimated over time_limit_s."""
    name = workload["name"]
    num_prompts, input_len, output_len = (int(workload[k]) for k in ("num_prompts", "input_len", "output_len"))
    vocab = model.config.vocab_size
    prompts = make_prompts(np.random.default_rng(seed), num_prompts, input_len, vocab)
    warm_prompts = make_prompts(np.random.default_rng(seed + 1), num_prompts, input_len, vocab)
    estimate = estimate_workload_s(model, decode, num_prompts, input_len, output_len)
    entry: Json = {"input_len": input_len, "output_len": output_len, "num_prompts": num_prompts,
                   "estimated_s": estimate, "modes": {}}
    for mode in modes:
        label = f"throughput {name} {mode}"
        if mode not in MODE_RUNNERS:
            entry["modes"][mode] = {"error": f"unknown mode {mode!r} (known: {sorted(MODE_RUNNERS)})"}
            continue
        if time_limit_s is not None and estimate is not None and estimate > time_limit_s:
            reason = f"estimated {estimate:.1f} s from the decode timings > time_limit_s {time_limit_s:g} s"
            entry["modes"][mode] = {"skipped": reason}
            log(f"{label}: skipped, {reason}")
            continue
        runner = MODE_RUNNERS[mode]
        record = guarded(label, partial(runner, model, device, prompts, warm_prompts, output_len, time_limit_s))
        free_memory(device)
        entry["modes"][mode] = record
        if "skipped" in record:
            log(f"{label}: skipped, {record['skipped']}")
        if "output_tok_s" in record:
            log(f"{label}: {record['output_tok_s']:.1f} out tok/s, {record['total_tok_s']:.1f} total tok/s, "
                f"{record['elapsed_s']:.2f} s (warmup {record['warmup_s']:.1f} s)")
    ok = {m: r["output_tok_s"] for m, r in entry["modes"].items() if "output_tok_s" in r}
    entry["best_mode"] = max(ok, key=ok.get) if ok else None
    entry["best_output_tok_s"] = ok[entry["best_mode"]] if ok else None
    return entry


# ----------------------------------------------------------------------------------------------------------------
# Driver


def resolve_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("spec asks for device 'cuda' but torch sees no CUDA device")
    return device


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def setup(spec: Json, result: Json) -> tuple[torch.device, torch.nn.Module]:
    """Device, copy bandwidth and model; fills the matching fields of `result`."""
    if spec.get("architecture", "llama") != "llama":
        raise ValueError(f"architecture {spec['architecture']!r} is not supported by the HF baseline (only 'llama')")
    device = resolve_device(spec.get("device", "cuda"))
    dtype = getattr(torch, spec.get("dtype", "bfloat16"))
    result["device"] = device_name(device)
    result["copy_bw_gbs"] = copy_bandwidth(device, dtype) / 1e9
    free_memory(device)
    log(f"device {result['device']}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"copy bandwidth {result['copy_bw_gbs']:.1f} GB/s")
    build_s, model = timed(device, lambda: build_model(spec, device, dtype))
    result["model_info"] = {
        "build_s": build_s,
        "params": sum(p.numel() for p in model.parameters()),
        "weight_bytes_per_step": weight_bytes_per_step(model),
        "attn_implementation": model.config._attn_implementation,
    }
    log(f"model built in {build_s:.1f} s: {result['model_info']['params'] / 1e9:.2f} B params")
    return device, model


def run_decode(model: torch.nn.Module, device: torch.device, spec: Json, result: Json, out_path: Path) -> None:
    decode_spec = spec.get("decode") or {}
    rng = np.random.default_rng(int(spec.get("seed", 0)))
    result["decode"] = {}
    for batch in decode_spec.get("batches", []):
        record = guarded(f"decode B={batch}", partial(
            measure_decode, model, device, int(batch), int(decode_spec["ctx"]), int(decode_spec["steps"]),
            int(decode_spec.get("repeats", DEFAULT_REPEATS)), rng, result["copy_bw_gbs"] * 1e9))
        result["decode"][str(batch)] = record
        if "step_ms" in record:
            log(f"decode B={batch}: {record['step_ms']:.2f} ms/step, {record['tok_s']:.1f} tok/s, "
                f"MBU {record['mbu']:.3f} (compiled={record['compiled']}, warmup {record['warmup_s']:.1f} s)")
        free_memory(device)
        write_json(out_path, result)
    compiled = [r["compiled"] for r in result["decode"].values() if "compiled" in r]
    result["static_compiled"] = any(compiled) if compiled else None


def run_throughput(model: torch.nn.Module, device: torch.device, spec: Json, result: Json, out_path: Path) -> None:
    modes = list(spec.get("modes", MODE_RUNNERS))
    result["throughput"] = {}
    for i, workload in enumerate(spec.get("throughput", [])):
        name = str(workload.get("name", f"workload{i}"))
        result["throughput"][name] = guarded(f"throughput {name}", partial(
            measure_workload, model, device, {**workload, "name": name}, modes, int(spec.get("seed", 0)),
            result["decode"], spec.get("time_limit_s")))
        write_json(out_path, result)
    result["best_output_tok_s"] = {n: e.get("best_output_tok_s") for n, e in result["throughput"].items()}
    result["best_mode"] = {n: e.get("best_mode") for n, e in result["throughput"].items()}


def run(spec: Json, out_path: Path) -> int:
    result: Json = {
        "tool": "hf_transformers",
        "command": shlex.join([sys.executable, *sys.argv]),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "spec": spec,
    }
    write_json(out_path, result)
    try:
        device, model = setup(spec, result)
    except Exception as exc:  # nothing can be measured: say why in the result file
        result.update(error_record(exc))
        log(f"FATAL {result['error']}")
        write_json(out_path, result)
        return 1
    write_json(out_path, result)

    with torch.inference_mode():
        run_decode(model, device, spec, result, out_path)
        run_throughput(model, device, spec, result, out_path)

    reset_static_generate_state(model, device)
    model = None  # drop the last reference, then return the memory
    free_memory(device)
    write_json(out_path, result)
    print(json.dumps(result, indent=1, default=str), flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", type=Path, required=True, help="workload spec (JSON)")
    parser.add_argument("--out", type=Path, required=True, help="where to write the result (JSON)")
    args = parser.parse_args()
    spec = json.loads(args.spec.read_text())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    return run(spec, args.out)


if __name__ == "__main__":
    sys.exit(main())
