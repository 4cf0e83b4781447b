"""The user-facing `LLM` class: load a model from a GGUF file, HF directory, orbax directory or preset."""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import distributed
from jaxinfer.beam_search import BeamSearchOutput, BeamSearchParams, run_beam_search

from jaxinfer.chat import HFStyleTokenizer, chat_prompts
from jaxinfer.checkpoint import open_checkpoint
from jaxinfer.config import (
    CacheConfig,
    ConfigError,
    DType,
    EngineConfig,
    MeshConfig,
    ModelConfig,
    model_config_from_yaml,
)
from jaxinfer.errors import InvalidInput, Notice
from jaxinfer.kv_cache import allocate_kv_cache, bytes_per_page, kv_storage
from jaxinfer.llm_args import DTYPE_NAMES, LLMArgs, check_model_limits, resolve_llm_args, resolve_model_name
from jaxinfer.linear import Linear
from jaxinfer.models import family_for_config, with_linear
from jaxinfer.models.fused import fuse_projections
from jaxinfer.outputs import RequestOutput
from jaxinfer.params import init_params, nbytes
from jaxinfer.platform import FIELDS as PLATFORM_FIELDS, announce, default_quantization, fill_defaults, fit_to_model
from jaxinfer.quantization import QuantizationError, build_plan, check_platform, quantized_specs
from jaxinfer.presets import BUNDLED, bundled_checkpoint, is_alias, load_preset
from jaxinfer.sharding import make_mesh, mesh_rules
from jaxinfer.tokenizer import Tokenizer, load_tokenizer

JNP_DTYPES = {DType.FLOAT32: jnp.float32, DType.BFLOAT16: jnp.bfloat16, DType.FLOAT16: jnp.float16}


def resolve_source(model: str | Path | ModelConfig) -> tuple[Any | None, ModelConfig | None]:
    """(checkpoint, None) for paths and bundled aliases; (None, config) for shape-only presets and configs."""
    if isinstance(model, ModelConfig):
        return None, model
    name = str(model)
    if name in BUNDLED:
        return open_checkpoint(bundled_checkpoint(name)), None
    if name.endswith((".yaml", ".yml")):  # a model shape of one's own (random weights), like a preset
        return None, model_config_from_yaml(name)
    if Path(name).expanduser().exists() or not is_alias(name):
        return open_checkpoint(name), None
    return None, load_preset(name)


def load_model_tokenizer(checkpoint: Any, tokenizer: str | Path | None) -> Tokenizer | None:
    """The explicit tokenizer, else the checkpoint's own; None for a directory that ships no tokenizer files
    (e.g. a bare `save_pretrained` of a model): such a model takes token-id prompts only."""
    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    if hasattr(checkpoint, "metadata"):  # GGUF: reuse the metadata already read
        return Tokenizer.from_gguf_metadata(checkpoint.metadata)
    path = Path(getattr(checkpoint, "tokenizer_path", None) or getattr(checkpoint, "directory", None))
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        return None
    return load_tokenizer(path)


COMPILATION_CACHE_ENV = "JAXINFER_COMPILATION_CACHE"  # overrides the default directory of "auto"
COMPILATION_CACHE_MAX_BYTES = 8 << 30


def default_compilation_cache_dir() -> Path:
    return Path(os.environ.get(COMPILATION_CACHE_ENV) or Path.home() / ".cache" / "jaxinfer" / "xla")


def use_compilation_cache(setting: str | Path | None) -> Path | None:
    """Turn on JAX's persistent compilation cache; returns the directory in use, or None.

    "auto": on GPU and TPU, where compiling the buckets is most of warmup, the directory of
    `default_compilation_cache_dir()` (a second start with the same shapes loads the executables instead of
    compiling them); off on CPU. A path: that directory. None: leave JAX's setting alone. JAX treats the
    cache as trusted code, so it must be a directory only its user can write.
    """
    if setting is None:
        return None
    if setting == "auto":
        if jax.default_backend() == "cpu":
            return None
        setting = default_compilation_cache_dir()
    path = Path(setting).expanduser()
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    jax.config.update("jax_compilation_cache_dir", str(path))
    # Every executable, however quick to compile: a start also compiles dozens of small programs (the packed
    # transfers' unpacking, weight initialisation, cache allocation) that take 0.05-0.3 s each on a GPU and
    # load from the cache in milliseconds.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    # Least recently used entries go beyond this: shapes change between jobs, and every new one adds
    # executables of tens of megabytes.
    jax.config.update("jax_compilation_cache_max_size", COMPILATION_CACHE_MAX_BYTES)
    return path


class LLM:
    """Offline generation over a jitted, paged, continuously batched engine, with vLLM's offline API.

    Arguments are vLLM's names where vLLM has the concept (see jaxinfer.llm_args for what each accepts, the
    older names kept as aliases, and the vLLM arguments that only give a notice or a clear error).
    """

    def __init__(
        self,
        model: str | Path | ModelConfig,
        *,
        tokenizer: str | Path | None = None,
        dtype: str = "auto",
        seed: int | None = 0,
        max_model_len: int | None = None,
        gpu_memory_utilization: float | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        block_size: int | None = None,
        enable_prefix_caching: bool = True,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        sequence_parallel_size: int = 1,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        enforce_eager: bool = False,
        num_pages: int | None = None,
        memory_fraction: float | None = None,
        decode_steps_per_call: int | None = None,
        single_step_max_rows: int | None = None,
        long_prefill_token_threshold: int = 0,
        mixed_prefill_token_cap: int = 0,
        overlap_decode: bool = True,
        compile_threads: int | None = None,
        compilation_cache_dir: str | Path | None = "auto",
        attention_impl: str = "auto",
        interpret: bool = False,
        random_weights: bool = False,
        warmup: bool = True,
        use_tqdm: bool = True,
        speculative: dict[str, Any] | None = None,  # vLLM's speculative_config (jaxinfer.spec_config)
        **kwargs: Any,  # page_size (= block_size), and vLLM arguments that need a notice or an error
    ) -> None:
        # Every keyword above goes through the one checked table (jaxinfer.llm_args.LLM_ARG_RULES).
        given = {k: v for k, v in locals().items() if k not in ("self", "model", "kwargs", "__class__")}
        args = resolve_llm_args({**given, **kwargs})
        # Engine knobs left unset take the platform's defaults (jaxinfer.platform), announced once loaded.
        chosen = fill_defaults({f: getattr(args, f) for f in PLATFORM_FIELDS})
        args = self.args = dataclasses.replace(args, **chosen)
        model = resolve_model_name(model)
        self.engine_config = EngineConfig(
            dtype=resolve_dtype(args.dtype),
            tensor_parallel_size=args.tensor_parallel_size,
            data_parallel_size=args.data_parallel_size,
            expert_parallel_size=args.expert_parallel_size,
            sequence_parallel_size=args.sequence_parallel_size,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            attention_impl=args.attention_impl,
            interpret=args.interpret,
        )
        self.cache_config = CacheConfig(page_size=args.block_size, num_pages=args.num_pages,
                                        memory_fraction=args.memory_fraction,
                                        gpu_memory_utilization=args.gpu_memory_utilization)
        self.decode_steps_per_call = args.decode_steps_per_call
        self.single_step_max_rows = args.single_step_max_rows
        self.overlap_decode = args.overlap_decode
        self.compile_threads = args.compile_threads
        self.compilation_cache_dir = use_compilation_cache(args.compilation_cache_dir)
        checkpoint, preset = resolve_source(model)
        if checkpoint is None and not args.random_weights:
            raise ConfigError(
                f"{model!r} is a shape-only preset or config with no checkpoint; pass random_weights=True or a "
                "checkpoint path."
            )
        self.model_config: ModelConfig = preset if checkpoint is None else checkpoint.config
        check_model_limits(args, self.model_config.max_position_embeddings)
        _check_quantization(args, checkpoint)
        self.family = family_for_config(self.model_config)
        self.draft = self._draft_model(args, MeshConfig(data=args.data_parallel_size, tensor=args.tensor_parallel_size,
                                                        expert=args.expert_parallel_size,
                                                        seq=args.sequence_parallel_size))
        # Before any device work: a layout no head split can use, or more devices than exist, is refused here.
        mesh_cfg = MeshConfig(data=args.data_parallel_size, tensor=args.tensor_parallel_size,
                              expert=args.expert_parallel_size, seq=args.sequence_parallel_size)
        self.rules = mesh_rules(self.model_config, mesh_cfg)
        self.mesh = make_mesh(mesh_cfg)
        self.replica_meshes = local_replicas(self.mesh)
        self.dtype = JNP_DTYPES[self.engine_config.dtype]
        self.kv_dtype, self.kv_quantized = kv_storage(args.kv_cache_dtype, self.dtype)
        if args.quantization is None and not args.random_weights:  # the platform's choice, announced with the rest
            float_bytes = nbytes(self.family.param_specs(self.model_config, self.dtype))
            if (quantization := default_quantization(checkpoint, float_bytes)) is not None:
                chosen["quantization"] = quantization
                args = self.args = dataclasses.replace(args, quantization=quantization)
        self.quant_plan = self._quantization_plan(checkpoint, args)
        if (fitted := fit_to_model(chosen, self.family.moe, quantized=bool(self.quant_plan))) != chosen:
            chosen = fitted
            args = self.args = dataclasses.replace(args, **chosen)
            self.single_step_max_rows = args.single_step_max_rows
        if self.draft is not None:  # its quantization checked too before any weight is loaded
            self.draft.prepare(self.replica_meshes[0], self.dtype)
        distributed.check_same_everywhere("the model and engine settings", self.model_config, args)
        # q/k/v and gate/up joined once here, for every engine (models.fused); a saved checkpoint splits them again.
        self.weights = fuse_projections(self._load_weights(checkpoint, args.random_weights, args.seed or 0),
                                        consume=True)
        if checkpoint is None and args.tokenizer is None:
            self.tokenizer = None
        else:
            self.tokenizer = load_model_tokenizer(checkpoint, args.tokenizer)
        if self.draft is not None:
            self.draft.check_tokenizer(self.tokenizer)
            self.draft_weights = [self.draft.load(m, self.dtype, args.seed or 0) for m in self.replica_meshes]
        self._build_engines(args.enable_prefix_caching, args.warmup, args.use_tqdm)
        announce(chosen)

    def _draft_model(self, args: LLMArgs, mesh_cfg: MeshConfig) -> Any:
        """The draft model of speculative={"method": "draft", ...}, checked against the target (None otherwise);
        and k checked against the token budget (a step must hold a row's k + 1 tokens)."""
        spec = args.speculative
        if spec is None:
            return None
        if spec.num_speculative_tokens + 1 > args.max_num_batched_tokens:
            raise InvalidInput.of("LLM argument ", "speculative.num_speculative_tokens", spec.num_speculative_tokens,
                                  f"at most max_num_batched_tokens - 1 ({args.max_num_batched_tokens - 1})")
        if spec.model is None:
            return None
        from jaxinfer.draft_model import DraftModel

        return DraftModel(spec, self.model_config, mesh_cfg, random_weights=args.random_weights)

    def _quantization_plan(self, checkpoint: Any, args: LLMArgs) -> Any:
        """Which weights are quantized and how (jaxinfer.quantization), checked against the model's shapes
        and this mesh before anything is loaded: a bad combination is an InvalidInput naming the weight."""
        specs = self.family.param_specs(self.model_config, self.dtype)
        try:
            check_platform(args.kv_cache_dtype, "kv_cache_dtype")
        except QuantizationError as e:
            raise InvalidInput(f"LLM argument {e}", field="kv_cache_dtype", value=args.kv_cache_dtype) from None
        try:
            plan, notes = build_plan(args.quantization, None if args.random_weights else checkpoint, specs,
                                     self.rules, self.mesh)
        except QuantizationError as e:
            message = str(e) if str(e).startswith("quantization=") else f"quantization={args.quantization!r}: {e}"
            raise InvalidInput(f"LLM argument {message}", field="quantization", value=args.quantization) from None
        for note in notes:
            warnings.warn(note, Notice, stacklevel=4)
        return plan

    def _load_weights(self, checkpoint: Any, random_weights: bool, seed: int) -> Any:
        specs = self.family.param_specs(self.model_config, self.dtype)
        if random_weights:
            return init_params(quantized_specs(specs, self.quant_plan), jax.random.key(seed), self.mesh, self.rules)
        return checkpoint.load_weights(specs, self.mesh, self.rules, plan=self.quant_plan)

    def _num_pages(self, mesh: Any) -> int:
        """The configured page count; or what gpu_memory_utilization of each device's memory leaves after the
        weights; or memory_fraction of the memory still free after them. Per device of `mesh` (a page costs
        each device its share of the heads), decided by the fullest device of any process."""
        cache = self.cache_config
        if cache.num_pages is not None:
            return cache.num_pages
        per_page = bytes_per_page(self.model_config, cache.page_size, self.kv_dtype, mesh, self.kv_quantized)
        if self.draft is not None:  # the draft's cache has as many pages
            per_page += self.draft.bytes_per_page(cache.page_size, self.dtype, mesh)
        total, used = device_memory(mesh)
        if cache.gpu_memory_utilization is not None:
            pages = pages_for_utilization(cache.gpu_memory_utilization, per_page, total, used)
        else:
            pages = max(2, int((total - used) * cache.memory_fraction) // per_page)
        return distributed.min_over_processes(pages)

    def _build_engines(self, prefix_caching: bool, warmup: bool, use_tqdm: bool) -> None:
        from jaxinfer.engine.replicas import DataParallelEngines, split_replicas

        weights = split_replicas(self.weights, self.replica_meshes) if self.mesh.shape["data"] > 1 else [self.weights]
        engines = [self._build_engine(mesh, w, prefix_caching, use_tqdm, i)
                   for i, (mesh, w) in enumerate(zip(self.replica_meshes, weights))]
        self.engine = engines[0] if len(engines) == 1 else DataParallelEngines(engines)
        if warmup:
            self.engine.warmup()

    def _build_engine(self, mesh: Any, weights: Any, prefix_caching: bool, use_tqdm: bool, replica: int = 0) -> Any:
        from jaxinfer.engine.engine import Engine
        from jaxinfer.engine.runner import ModelRunner

        num_pages = self._num_pages(mesh)
        kv_cache = allocate_kv_cache(
            self.model_config, num_pages, self.cache_config.page_size, self.kv_dtype, mesh, self.rules,
            quantized=self.kv_quantized,
        )
        family = self.family
        if self.quant_plan:  # quantized weights run through the Pallas matmul, in shard_map on this mesh
            impl, interpret = self.engine_config.attention_impl, self.engine_config.interpret
            family = with_linear(family, Linear.for_engine(mesh, self.rules, impl, interpret))
        runner = ModelRunner(
            family, self.model_config, weights, kv_cache, mesh, self.rules,
            attention_impl=self.engine_config.attention_impl, interpret=self.engine_config.interpret,
        )
        draft_runner = None
        if self.draft is not None:
            cfg = self.engine_config
            draft_runner = self.draft.runner(mesh, self.draft_weights[replica], num_pages, self.cache_config.page_size,
                                             self.dtype, cfg.attention_impl, cfg.interpret)
        engine = Engine(
            runner, self.tokenizer, self.engine_config, self.cache_config,
            enable_prefix_caching=prefix_caching, use_tqdm=use_tqdm,
            decode_steps_per_call=self.decode_steps_per_call, single_step_max_rows=self.single_step_max_rows,
            overlap_decode=self.overlap_decode, compile_threads=self.compile_threads, seed=self.args.seed,
            speculative=self.args.speculative, draft_runner=draft_runner,
            long_prefill_token_threshold=self.args.long_prefill_token_threshold,
            mixed_prefill_token_cap=self.args.mixed_prefill_token_cap,
        )
        if self.args.seed is None and distributed.is_multiprocess():  # every process must draw the same seeds
            engine.reseed(distributed.shared_seed(int(np.random.default_rng().integers(2**62))))
        return engine

    def get_tokenizer(self) -> HFStyleTokenizer:
        """The tokenizer with transformers' signatures and defaults (encode, decode, apply_chat_template,
        eos_token_id, vocab_size, ...), as vLLM's `get_tokenizer()` returns; `llm.tokenizer` is jaxinfer's own."""
        if self.tokenizer is None:
            raise InvalidInput("this model has no tokenizer (a shape-only preset); pass tokenizer=... to LLM.",
                               field="tokenizer")
        return HFStyleTokenizer(self.tokenizer)

    def generate(self, prompts: Any, sampling_params: Any = None, *, use_tqdm: bool | None = None,
                 priority: list[int] | None = None, lora_request: Any = None) -> list[RequestOutput]:
        """Generate for every prompt (a string, token ids, {"prompt": ...}, {"prompt_token_ids": ...}, or a list
        of them) with one SamplingParams or one per prompt; outputs come back complete, in input order."""
        _no_lora(lora_request)
        return self.engine.generate(prompts, sampling_params, use_tqdm=use_tqdm, priority=priority)

    def chat(
        self, messages: Any, sampling_params: Any = None, *, use_tqdm: bool | None = None, lora_request: Any = None,
        chat_template: str | None = None, chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True, continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None, documents: Any = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Render one conversation (a list of {"role", "content"} messages) or a list of them with the chat
        template, then generate; `RequestOutput.prompt` is the rendered text. vLLM's keywords and defaults;
        chat_template_content_format is accepted for compatibility (text parts are always joined)."""
        _no_lora(lora_request)
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise InvalidInput.of("", "chat_template_content_format", chat_template_content_format,
                                  "'auto', 'string' or 'openai'")
        prompts = chat_prompts(
            self.tokenizer, messages, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs, tools=tools,
            documents=documents,
        )
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(self, prompts: Any, params: BeamSearchParams, *, use_tqdm: bool = False,
                    lora_request: Any = None) -> list[BeamSearchOutput]:
        """Beam search with HF transformers' semantics (length_penalty, early_stopping), one
        BeamSearchOutput per prompt with its beams best first (jaxinfer.beam_search says how it runs)."""
        _no_lora(lora_request)
        engines = getattr(self.engine, "engines", [self.engine])
        return run_beam_search(self.engine, engines[0].gate, self.tokenizer, prompts, params,
                               max_num_seqs=self.engine_config.max_num_seqs, use_tqdm=use_tqdm)

    def stream(self, prompts: Any, sampling_params: Any = None) -> Any:
        """Iterate over incremental outputs as the engine produces them (each request's output_kind decides
        what they carry; with the default, `outputs[i].delta_text` is what is new)."""
        return self.engine.stream(prompts, sampling_params)

    # The add-request/step interface, for servers that run their own loop.
    def add_request(self, prompt: Any, sampling_params: Any = None, *, request_id: str | None = None,
                    priority: int = 0) -> str:
        """Queue one request (checked now: a bad one raises InvalidInput naming the field, nothing else changes)."""
        return self.engine.add_request(prompt, sampling_params, request_id=request_id, priority=priority)

    def step(self) -> list[RequestOutput]:
        """One engine iteration; the outputs of every request that advanced (as its output_kind asks)."""
        return self.engine.step()

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its pages; returns its partial output (None if unknown)."""
        return self.engine.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt page (as vLLM's method does): later requests recompute their prompts,
        running ones keep their pages. False when the engine was built without prefix caching."""
        return self.engine.reset_prefix_cache()

    def wait_for_background_compile(self, timeout: float | None = None) -> bool:
        """Block until the programs warmup compiles after the first token are ready (on a GPU, the decode
        loop's build without branches: until then decode runs the other one). Benchmarks of steady-state speed
        call this first. True when nothing is left compiling."""
        return self.engine.wait_for_background_compile(timeout)

    def engine_stats(self) -> dict[str, Any]:
        """The engine's statistics, plus `weight_bytes` and `kv_cache_bytes`: device bytes actually held by
        the weights and the KV cache, summed over every device of every replica."""
        engines = getattr(self.engine, "engines", [self.engine])
        return {**self.engine.stats(),
                "weight_bytes": sum(_device_bytes(e.runner.weights) for e in engines),
                "kv_cache_bytes": sum(_device_bytes(e.runner.kv_cache) for e in engines)}

    def describe(self) -> dict[str, Any]:
        """The mesh picture: axis sizes, each weight group's sharding, weight and KV bytes per device, pages,
        and the collectives one decode step runs (from the compiled executables). With several replicas it
        describes the first and lists every replica's devices. `format_description` prints it."""
        from jaxinfer.describe import describe_engine

        engines = getattr(self.engine, "engines", [self.engine])
        desc = describe_engine(engines[0])
        desc.update(data_parallel_size=self.engine_config.data_parallel_size, process_count=jax.process_count(),
                    replica_devices=[[str(d) for d in e.runner.mesh.devices.flat] for e in engines])
        return desc


def resolve_dtype(name: str) -> DType:
    """'auto': bfloat16 where it is fast (GPU, TPU), float32 on CPU; otherwise the named dtype."""
    if name == "auto":
        return DType.FLOAT32 if jax.default_backend() == "cpu" else DType.BFLOAT16
    return DType(DTYPE_NAMES[name])


def _check_quantization(args: LLMArgs, checkpoint: Any) -> None:
    """'gguf' is the older spelling of 'auto' for a .gguf model, and only for one."""
    if args.quantization == "gguf" and not hasattr(checkpoint, "metadata"):  # only GGUF checkpoints have metadata
        raise InvalidInput.of("LLM argument ", "quantization", "gguf", "None for a checkpoint that is not a .gguf file")


def _device_bytes(tree: Any) -> int:
    """Bytes of every shard of every array of `tree` on this process's devices."""
    return sum(s.data.nbytes for a in jax.tree.leaves(tree) for s in a.addressable_shards)


def _no_lora(lora_request: Any) -> None:
    if lora_request is not None:
        raise InvalidInput.of("", "lora_request", lora_request, "None (LoRA adapters are not supported yet)")


def pages_for_utilization(utilization: float, per_page: int, total: int, used: int) -> int:
    """KV pages that fit in `utilization` of a device's `total` memory after the `used` bytes already in use
    (the weights): vLLM's gpu_memory_utilization. Refused when nothing is left for the KV cache."""
    budget = int(total * utilization) - used
    if budget < 2 * per_page:
        raise InvalidInput.of(
            "LLM argument ", "gpu_memory_utilization", utilization,
            f"large enough to leave room for the KV cache: {utilization} of {total / 2**30:.1f} GiB is "
            f"{total * utilization / 2**30:.2f} GiB and {used / 2**30:.2f} GiB are already in use")
    return budget // per_page


def device_memory(mesh: Any) -> tuple[int, int]:
    """(bytes a device may use, bytes in use) of the device of `mesh` with the least room, among this
    process's devices (memory stats exist only for addressable ones); on CPU (no stats) 2 GiB, none used."""
    best = None
    for device in mesh.devices.flat:
        if device.process_index != jax.process_index():
            continue
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            pair = (stats["bytes_limit"], stats.get("bytes_in_use", 0))
            if best is None or pair[0] - pair[1] < best[0] - best[1]:
                best = pair
    return best or (2 << 30, 0)


def local_replicas(mesh: Any) -> list[Any]:
    """The replica meshes this process drives. One replica may span processes (every process runs it, the
    same program everywhere); several replicas must each sit inside one process (each process serves its
    own share of the requests), since one process cannot step a replica whose devices it cannot reach."""
    from jaxinfer.engine.replicas import replica_meshes

    replicas = replica_meshes(mesh)
    if len(replicas) == 1:
        return replicas
    me = jax.process_index()
    owners = [{d.process_index for d in m.devices.flat} for m in replicas]
    if any(len(o) > 1 for o in owners):
        raise ConfigError(
            f"data_parallel_size={len(replicas)} with replicas of {replicas[0].devices.size} devices that span "
            "processes: each replica must fit in one process's devices (or use data_parallel_size=1 and let "
            "the one replica span the processes)."
        )
    return [m for m, o in zip(replicas, owners) if o == {me}]
