"""Quantized weights and KV on CPU: tensor-parallel (shard_map) == unsharded, bad input refused by name before
anything loads, and the fields through the CLI and batch YAML. Real-model accuracy: test_quantization_accuracy.py;
collectives: test_collectives.py."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, quantization
from jaxinfer.checkpoint import CheckpointError
from jaxinfer.config import ConfigError
from jaxinfer.config import MeshConfig
from jaxinfer.engine.batcher import BatchShape, SeqChunk, pack
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.errors import InvalidInput
from jaxinfer.kv_cache import allocate_kv_cache, kv_storage
from jaxinfer.linear import Linear, is_quantized
from jaxinfer.models import LLAMA, with_linear
from jaxinfer.models.fused import fuse_projections, split_projections
from jaxinfer.params import init_params
from jaxinfer.quantization import QuantizationConfig, check_plan, fit_packs, logical_shards, method_plan, quantized_specs
from jaxinfer.sharding import make_mesh, tensor_parallel_rules
from pallas_kernels.quantized_matmul.reference import NATURAL_PACK
from model_helpers import tiny_config

PAGE = 4


def quantized_runner(cfg, tp: int, method: str, kv_cache_dtype: str = "auto", plan_tp: int = 2,
                     num_pages: int = 16, pack_backend: str = "cpu", linear_impl: str = "reference",
                     joined: bool = False) -> ModelRunner:
    """A reference-attention runner over random weights quantized as `method`, split over `tp` devices. The
    plan is the one for `plan_tp` devices (int4 packing chunks fit the split K), so runners of different tp
    draw the same random codes with the same meaning. `pack_backend`: the backend whose int4 order the plan
    takes ("gpu": plain order); `linear_impl`: quantized_matmul's impl ("auto": the platform's kernels); `joined`:
    q/k/v and gate/up joined as an LLM's engine holds them (models.fused)."""
    mesh, rules = make_mesh(MeshConfig(tensor=tp)), tensor_parallel_rules(cfg, tp)
    specs = LLAMA.param_specs(cfg, jnp.float32)
    plan_shards = logical_shards(tensor_parallel_rules(cfg, plan_tp), make_mesh(MeshConfig(tensor=plan_tp)))
    plan = fit_packs(specs, method_plan(specs, QuantizationConfig.parse(method)), plan_shards, backend=pack_backend)
    check_plan(specs, plan, logical_shards(rules, mesh))
    weights = init_params(quantized_specs(specs, plan), 0, mesh, rules)
    if joined:
        weights = fuse_projections(weights)
    kv_dtype, kv_quantized = kv_storage(kv_cache_dtype, jnp.float32)
    cache = allocate_kv_cache(cfg, num_pages, PAGE, kv_dtype, mesh, rules, quantized=kv_quantized)
    family = with_linear(LLAMA, Linear(mesh, rules, linear_impl))
    return ModelRunner(family, cfg, weights, cache, mesh, rules, attention_impl="reference")


def prompt_then_decode_logits(runner: ModelRunner, ids: list[int]) -> np.ndarray:
    """Logits of a 9-token prefill and then one decode step over the cache it wrote: [2, V]."""
    shape = BatchShape(tokens=16, seqs=2, pages_per_seq=4)
    first = runner.logits(pack([SeqChunk(ids[:9], 0, [1, 2, 3])], shape, PAGE))[0]
    second = runner.logits(pack([SeqChunk(ids[9:10], 9, [1, 2, 3])], shape, PAGE))[0]
    return np.stack([np.asarray(first), np.asarray(second)])


# method -> (kv_cache_dtype, tolerance): int8 in groups, int4 in groups of 32 (each of 2 devices holds K = 32
# of the attention output and 64 of the down projection), fp8 W8A8; each with a quantized KV cache, split by
# head like the values. fp8 quantizes activations per row of each device's K slice, so its sharded result
# differs by that rounding; the integer formats only by the order of the psum.
# "plain": int4 in plain order (pack 2), as a GPU stores it (the CPU runs it through the reference).
CASES = {"int8:32": ("int8", 1e-5), "int4:32": ("int8", 1e-5), "int4:32 plain": ("int8", 1e-5), "fp8": ("fp8", 0.05)}


@pytest.fixture(scope="module")
def cfg():
    return tiny_config(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16)


@pytest.mark.parametrize("method", CASES)
def test_tensor_parallel_quantized_model_equals_unsharded(cfg, method: str) -> None:
    kv, tol = CASES[method]
    method, _, order = method.partition(" ")
    backend = "gpu" if order == "plain" else "cpu"
    ids = list(np.random.default_rng(1).integers(0, cfg.vocab_size, 10))
    whole = prompt_then_decode_logits(quantized_runner(cfg, 1, method, kv, pack_backend=backend), ids)
    split_runner = quantized_runner(cfg, 2, method, kv, pack_backend=backend)
    if method.startswith("int4"):
        assert (split_runner.weights.layers[0].w_down.pack == NATURAL_PACK) == (order == "plain")
    wq = split_runner.weights.layers[0].wq  # column-parallel: each device holds half the output rows
    assert {s.data.shape for s in wq.values.addressable_shards} == {(wq.values.shape[0] // 2, wq.values.shape[1])}
    split = prompt_then_decode_logits(split_runner, ids)
    assert np.linalg.norm(split - whole) / np.linalg.norm(whole) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("method, tol, zeros_inside, joined", [
    ("int8", 2e-2, False, False), ("int8:32", 2e-2, False, False), ("int4", 2e-2, False, False),
    ("int4", 2e-2, True, False), ("int4:128", 2e-2, False, False), ("fp8", 5e-2, False, False),
    ("int8", 2e-2, False, True), ("int4", 2e-2, True, True), ("fp8", 5e-2, False, True)])
def test_gpu_kernels_inside_the_model_match_the_reference(monkeypatch, method: str, tol: float,
                                                          zeros_inside: bool, joined: bool) -> None:
    """The model's forward with every quantized product on the GPU kernels (int4 in the plain order a GPU
    stores; zero points inside the kernel, gpu.ZEROS_IN_KERNEL's default, and in the wrapper) against the same weights through the
    reference: a prefill and a decode step's logits. Shapes are multiples of 64 so no product falls back.
    `joined`: q/k/v and gate/up as one product each, as an LLM's engine runs them (the reference apart)."""
    from pallas_kernels.quantized_matmul import gpu

    monkeypatch.setattr(gpu, "ZEROS_IN_KERNEL", zeros_inside)
    cfg = tiny_config(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=32)
    ids = list(np.random.default_rng(2).integers(0, cfg.vocab_size, 10))
    kernels = quantized_runner(cfg, 1, method, plan_tp=1, pack_backend="gpu", linear_impl="auto",
                               joined=joined)  # one GPU
    quantized = [w for w in jax.tree.leaves(kernels.weights, is_leaf=is_quantized) if is_quantized(w)]
    assert quantized and all(gpu.unsupported_reason(w) is None for w in quantized if not w.w8a8)
    assert {w.pack for w in quantized if w.bits == 4} <= {NATURAL_PACK}
    got = prompt_then_decode_logits(kernels, ids)
    want = prompt_then_decode_logits(quantized_runner(cfg, 1, method, plan_tp=1, pack_backend="gpu"), ids)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < tol


# ----------------------------------------------------------------------------- bad input, before loading


@pytest.fixture
def no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails the test if LLM gets as far as loading weights."""
    def refuse(*_a, **_k):
        raise AssertionError("weights were loaded before the bad setting was refused")

    monkeypatch.setattr(LLM, "_load_weights", refuse)


def test_int4_group_that_does_not_divide_k_names_the_weight_and_format(no_loading: None) -> None:
    # SmolLM2's FFN K is 1536 = 3 x 512: groups of 512 do not divide its other weights' K = 576.
    with pytest.raises(InvalidInput, match=r"quantization='int4:512'.*weight layers\.0\.\w+ \(int4 \(groups of 512(, zero points)?\), "
                                           r"K = 576\).*multiple of 512"):
        LLM("smollm2-135m-instruct", quantization="int4:512", use_tqdm=False)


def test_int4_scales_and_zero_points_are_fp16_and_codes_fit_the_stored_numbers() -> None:
    """quantization="int4" stores each group's scale and zero point in fp16 (a third of a g32 weight's bytes in
    fp32); the codes are chosen against the rounded numbers, so each weight is still within half a step."""
    fmt = QuantizationConfig.parse("int4")
    plan = method_plan(LLAMA.param_specs(tiny_config(), jnp.float32), fmt)
    int4 = [f for f in plan.values() if f.bits == 4]
    assert int4 and all(f.scale_dtype == "float16" and f.zeros for f in int4)
    w = np.random.default_rng(0).standard_normal((128, 64)).astype(np.float32) * 0.05 + 0.3  # off-centre groups
    codes, scales, zeros = quantization.quantize_matrix(w, int4[0])
    assert np.array_equal(scales, scales.astype(np.float16).astype(np.float32))
    assert np.array_equal(zeros, zeros.astype(np.float16).astype(np.float32))
    g = int4[0].group
    deq = codes.astype(np.float32).reshape(64, -1, g) * scales.T[:, :, None] + zeros.T[:, :, None]  # [N, G, g]
    err = np.abs(deq.reshape(64, 128).T - w)  # [K, N]
    assert np.all(err <= np.repeat(scales, g, axis=0) * 0.5 * 1.001)


def test_unknown_quantization_method_is_refused_by_name(no_loading: None) -> None:
    with pytest.raises(InvalidInput, match="quantization"):
        LLM("smollm2-135m-instruct", quantization="int3", use_tqdm=False)
    with pytest.raises(InvalidInput, match="kv_cache_dtype"):
        LLM("smollm2-135m-instruct", kv_cache_dtype="int4", use_tqdm=False)


def _pre_hopper_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """jaxinfer.quantization sees a compute-capability 8.0 GPU (the rest of JAX still the CPU devices)."""
    device = types.SimpleNamespace(compute_capability="8.0", device_kind="NVIDIA A100-SXM4-80GB")
    fake = types.SimpleNamespace(default_backend=lambda: "gpu", devices=lambda: [device])
    monkeypatch.setattr(quantization, "jax", fake)


@pytest.mark.parametrize("field,kwargs", [("quantization", dict(quantization="fp8")),
                                          ("kv_cache_dtype", dict(kv_cache_dtype="fp8"))])
def test_fp8_on_a_gpu_without_fp8_is_refused_naming_the_device(monkeypatch, no_loading, field, kwargs) -> None:
    _pre_hopper_gpu(monkeypatch)
    with pytest.raises(InvalidInput, match=rf"{field}='fp8' needs a GPU of compute capability 9\.0.*A100.*int8"):
        LLM("smollm2-135m-instruct", use_tqdm=False, **kwargs)


def test_gguf_tensor_of_a_type_we_cannot_read_is_named_before_loading(tmp_path: Path) -> None:
    import dataclasses

    import gguf

    from checkpoint.test_loaders import _tiny_gguf_tensors, _write_gguf
    from jaxinfer.checkpoint.gguf import GGUFCheckpoint

    ckpt = GGUFCheckpoint(_write_gguf(tmp_path / "q81.gguf", "llama", _tiny_gguf_tensors()))
    # One tensor's header says Q8_1: a type GGML knows that we neither repack nor dequantize.
    info = ckpt.tensors["blk.0.ffn_up.weight"]
    ckpt.tensors["blk.0.ffn_up.weight"] = dataclasses.replace(info, type_code=int(gguf.GGMLQuantizationType.Q8_1))
    with pytest.raises(CheckpointError, match=r"tensor 'blk\.0\.ffn_up\.weight' is stored as GGML Q8_1, which jaxinfer "
                                              r"cannot read \(it reads .*Q4_K"):
        ckpt.quantization_plan(LLAMA.param_specs(ckpt.config, jnp.float32))  # quantization="auto", before loading
    with pytest.raises(CheckpointError, match="Q8_1"):
        ckpt.load_weights(LLAMA.param_specs(ckpt.config, jnp.float32), None, None)  # checked before any tensor


# ----------------------------------------------------------------------------- the CLI and batch YAML


def test_cli_and_batch_yaml_take_the_quantization_fields() -> None:
    from jaxinfer.batch.job import job_from_dict
    from jaxinfer.cli import build_parser

    args = build_parser().parse_args(["generate", "--prompt", "x", "--quantization", "int4:64", "--kv-cache-dtype", "fp8"])
    assert (args.quantization, args.kv_cache_dtype) == ("int4:64", "fp8")
    assert build_parser().parse_args(["convert", "a.gguf", "out", "--quantization", "int8"]).quantization == "int8"
    job = {"model": "smollm2-135m-instruct", "input": {"path": "in.jsonl"}, "output": {"path": "out.jsonl"},
           "engine": {"quantization": "int4:32", "kv_cache_dtype": "int8"}}
    assert job_from_dict(job, "job.yaml").llm_kwargs["quantization"] == "int4:32"
    with pytest.raises(ConfigError, match=r"job.yaml: .*engine\.quantization"):
        job_from_dict({**job, "engine": {"quantization": "int5"}}, "job.yaml")


# ----------------------------------------------------------------------------- convert -> restore


# An int4 checkpoint keeps the packing chunks it was converted with (fit for the K of each device then): it
# restores on any mesh whose K split is a multiple of them, else the error names the weight. So int4 restores
# at tp=1 here, int8 (no packing) at tp=2.
@pytest.mark.parametrize("method,tp", [("int4", 1), ("int8", 2)])
def test_convert_writes_a_quantized_checkpoint_that_restores_quantized_with_identical_tokens(
        tmp_path: Path, smollm2_path: Path, method: str, tp: int) -> None:
    """`jaxinfer convert --quantization` on a tiny HF Llama; the orbax copy restores into the mesh quantized
    (no float copy: its plan says how) and greedy tokens equal quantizing the source at load."""
    from jaxinfer.cli import main
    from jaxinfer import SamplingParams
    from tiny_checkpoint import write_tiny_hf_checkpoint

    src = write_tiny_hf_checkpoint(tmp_path / "hf", smollm2_path)
    assert main(["convert", str(src), str(tmp_path / "q"), "--dtype", "float32", "--quantization", method]) == 0
    engine = dict(dtype="float32", max_model_len=64, num_pages=16, max_num_seqs=2, max_num_batched_tokens=32,
                  warmup=False, use_tqdm=False)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = ["The river rose through the night", "def fibonacci(n):"]
    want = [o.token_ids for o in LLM(str(src), quantization=method, **engine).generate(prompts, params)]
    restored = LLM(str(tmp_path / "q"), tensor_parallel_size=tp, **engine)
    assert restored.quant_plan and is_quantized(restored.weights.layers[0].w_down)
    assert [o.token_ids for o in restored.generate(prompts, params)] == want
    with pytest.raises(InvalidInput, match="already quantized"):
        LLM(str(tmp_path / "q"), quantization="int8", **engine)


def test_int4_order_follows_the_backend_and_a_named_chunk_stays() -> None:
    """A GPU stores int4 in plain order (its kernel's fast path), a CPU or TPU in chunk halves; a format that
    names its chunk (a GGUF repack, a saved checkpoint) keeps it everywhere."""
    specs = LLAMA.param_specs(tiny_config(), jnp.float32)
    plan = method_plan(specs, QuantizationConfig.parse("int4"))
    packs = lambda backend, p=plan: {f.pack for f in fit_packs(specs, p, backend=backend).values() if f.bits == 4}
    assert packs("gpu") == {NATURAL_PACK}
    assert NATURAL_PACK not in packs("cpu") | packs("tpu")
    named = {path: dataclasses.replace(f, pack=64) if f.bits == 4 else f for path, f in plan.items()}
    assert packs("gpu", named) == {64}


def test_plain_order_int4_gives_the_tokens_of_chunk_halves_and_survives_convert(
        tmp_path: Path, smollm2_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same codes in the two int4 orders are the same weights: greedy tokens are identical, through the
    engine on this CPU with plain order chosen as a GPU chooses it; and a checkpoint converted that way
    restores plain-order on a CPU (its plan names the chunk) with the same tokens."""
    from jaxinfer.cli import main
    from jaxinfer import SamplingParams
    from tiny_checkpoint import write_tiny_hf_checkpoint

    src = write_tiny_hf_checkpoint(tmp_path / "hf", smollm2_path)
    engine = dict(dtype="float32", max_model_len=64, num_pages=16, max_num_seqs=2, max_num_batched_tokens=32,
                  warmup=False, use_tqdm=False)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = ["The river rose through the night", "def fibonacci(n):"]
    halves = LLM(str(src), quantization="int4", **engine)
    assert NATURAL_PACK not in {f.pack for f in halves.quant_plan.values() if f.bits == 4}
    want = [o.token_ids for o in halves.generate(prompts, params)]
    monkeypatch.setattr(quantization, "NATURAL_INT4_BACKENDS", ("cpu",))
    plain = LLM(str(src), quantization="int4", **engine)
    assert {f.pack for f in plain.quant_plan.values() if f.bits == 4} == {NATURAL_PACK}
    assert [o.token_ids for o in plain.generate(prompts, params)] == want
    assert main(["convert", str(src), str(tmp_path / "q"), "--dtype", "float32", "--quantization", "int4"]) == 0
    monkeypatch.setattr(quantization, "NATURAL_INT4_BACKENDS", ())
    restored = LLM(str(tmp_path / "q"), **engine)
    assert {f.pack for f in restored.quant_plan.values() if f.bits == 4} == {NATURAL_PACK}
    assert [o.token_ids for o in restored.generate(prompts, params)] == want


# ----------------------------------------------------------------------------- the platform's default


def test_default_quantization_dequantizes_only_a_gguf_that_fits_on_a_cpu() -> None:
    import os

    from jaxinfer.platform import default_quantization

    gguf = types.SimpleNamespace(quantization_plan=lambda specs: ({}, {}))
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert default_quantization(gguf, host // 8, "cpu") == "none"
    assert default_quantization(gguf, host // 8 + 1, "cpu") is None  # kept quantized so that it still fits
    assert default_quantization(gguf, 1, "gpu") is None and default_quantization(gguf, 1, "tpu") is None
    assert default_quantization(types.SimpleNamespace(), 1, "cpu") is None  # safetensors / orbax: as stored


def test_cpu_default_dequantizes_the_bundled_gguf_and_says_so(monkeypatch, capsys) -> None:
    from jaxinfer import platform

    monkeypatch.setattr(platform, "_announced", set())  # another test in this process may have printed the same
    llm = LLM("smollm2-135m-instruct", warmup=False, num_pages=4, use_tqdm=False)
    assert llm.args.quantization == "none" and not llm.quant_plan
    wq = split_projections(llm.weights).layers[0].wq
    assert not is_quantized(wq) and wq.dtype == jnp.float32
    assert "quantization=none" in capsys.readouterr().err


def test_convert_keeps_a_gguf_quantized_unless_told_otherwise(tmp_path: Path, smollm2_path: Path) -> None:
    """The CPU's float default is for running: `jaxinfer convert` with no --quantization writes the blocks."""
    from jaxinfer.cli import main

    assert main(["convert", str(smollm2_path), str(tmp_path / "q")]) == 0
    restored = LLM(str(tmp_path / "q"), warmup=False, num_pages=4, use_tqdm=False)
    assert restored.quant_plan and is_quantized(split_projections(restored.weights).layers[0].wq)
