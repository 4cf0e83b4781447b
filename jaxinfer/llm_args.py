"""The arguments of `LLM(...)` and of a batch job's `engine:` section: vLLM's names, checked in one place.

`resolve_llm_args` turns keyword arguments into an `LLMArgs`, or raises `InvalidInput` naming the argument,
the value and what it accepts (`LLM_ARG_RULES`, the table docs/RELIABILITY.md prints). One spelling per
concept, vLLM's where vLLM has one. Besides the table:
  * `ALIASES`: older documented names kept working (`page_size` is `block_size`);
  * `NO_EFFECT`: vLLM arguments that cannot change results here; a non-default value gives a one-line
    `Notice` (trust_remote_code: architectures are built in and no checkpoint code ever runs; download_dir:
    nothing is downloaded; enforce_eager: there is no eager mode, XLA programs are always compiled; ...);
  * `REFUSED`: vLLM arguments whose non-default value would change results if ignored (a hub `revision`, a
    LoRA, pipeline parallelism, ...): an error saying what to do instead;
  * anything else is an unknown argument, with the closest known names suggested.
Model-dependent limits (max_model_len against the model's max_position_embeddings) are checked by
`check_model_limits` once the checkpoint's config is known, before any weight is loaded.
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxinfer.errors import InvalidInput, InvalidInputType, Notice
from jaxinfer.spec_config import ACCEPTED as SPECULATIVE_ACCEPTED, parse_speculative
from jaxinfer.validation import FieldRule, Limits, Reject, as_int, as_opt_int, is_real

DTYPE_NAMES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16",
               "half": "float16"}
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "int8")
_KV_ALIASES = {"fp8_e4m3": "fp8", "float": "float32", "half": "float16"}
ATTENTION_IMPLS = ("auto", "reference", "xla", "pallas_tpu", "pallas_gpu")


def _opt_real(v: Any) -> float | None:
    if v is None:
        return None
    if not is_real(v):
        raise Reject
    return float(v)


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise Reject
    return v


def _opt_str(v: Any) -> str | None:
    if v is not None and not isinstance(v, str):
        raise Reject
    return v


def _opt_path(v: Any) -> str | None:
    if v is not None and not isinstance(v, str | Path):
        raise Reject
    return None if v is None else str(v)


def _dtype(v: Any) -> str:
    name = getattr(v, "value", v)  # a DType member
    if not isinstance(name, str):
        raise Reject
    return name


def _kv_dtype(v: Any) -> str:
    name = _dtype(v)
    return _KV_ALIASES.get(name, name)


def _valid_quantization(v: str | None) -> bool:
    from jaxinfer.quantization import QuantizationConfig

    try:
        QuantizationConfig.parse(v)
    except ValueError:
        return False
    return True


def _r(name: str, default: Any, accepted: str, normalize: Any, ok: Any = lambda v: True) -> FieldRule:
    return FieldRule(name, default, accepted, normalize, lambda v, values, limits: ok(v))


def _fraction(v: float | None) -> bool:
    return v is None or 0 < v <= 1


LLM_ARG_RULES: tuple[FieldRule, ...] = (
    _r("tokenizer", None, "None (the checkpoint's) or a path: .gguf, tokenizer.json, tokenizer.model or a directory",
       _opt_path),
    _r("dtype", "auto", "'auto' (bfloat16 on GPU and TPU, float32 on CPU), 'float32', 'bfloat16' or 'float16' "
       "('float' and 'half' too)", _dtype, lambda v: v == "auto" or v in DTYPE_NAMES),
    _r("seed", 0, "None or an integer: random weights, and the seeds of requests that set none", as_opt_int),
    _r("max_model_len", None, "None (max_position_embeddings, at most 4096) or an integer in "
       "[2, max_position_embeddings]", as_opt_int, lambda v: v is None or v >= 2),
    _r("gpu_memory_utilization", None, "None or a number in (0, 1]: the share of each device's memory the engine "
       "may use, the KV cache getting what the weights leave", _opt_real, _fraction),
    _r("memory_fraction", None, "None (the platform's: 0.85 on GPU/TPU, 0.5 on CPU) or a number in (0, 1]: the "
       "share of memory still free after the "
       "weights that the KV cache takes, when neither num_pages nor gpu_memory_utilization is set", _opt_real,
       _fraction),
    _r("max_num_seqs", None, "None (the platform's: 256 on GPU/TPU, 16 on CPU) or an integer >= 1", as_opt_int,
       lambda v: v is None or v >= 1),
    _r("max_num_batched_tokens", None, "None (the platform's: 4096 on GPU/TPU, 512 on CPU) or an integer >= 1",
       as_opt_int, lambda v: v is None or v >= 1),
    _r("block_size", None, "None (16; 32 for an int8 / fp8 KV cache on a GPU) or an integer >= 1: tokens per KV "
       "page", as_opt_int,
       lambda v: v is None or v >= 1),
    _r("num_pages", None, "None or an integer >= 2: KV pages, page 0 reserved", as_opt_int,
       lambda v: v is None or v >= 2),
    _r("enable_prefix_caching", True, "True or False", _bool),
    _r("tensor_parallel_size", 1, "an integer >= 1: devices one replica's heads, MLP and vocabulary split over",
       as_int, lambda v: v >= 1),
    _r("data_parallel_size", 1, "an integer >= 1: engine replicas, each over its own devices", as_int, lambda v: v >= 1),
    _r("expert_parallel_size", 1, "an integer >= 1 dividing the number of experts: devices the MoE experts split "
       "over", as_int, lambda v: v >= 1),
    _r("sequence_parallel_size", 1, "an integer >= 1: devices each step's tokens split over", as_int,
       lambda v: v >= 1),
    _r("quantization", None, "None (the platform's: 'auto', except on CPU, where a .gguf model whose float "
       "weights take at most 1/8 of the host's memory is dequantized at load), 'auto' (a .gguf model keeps its "
       "quantization, other checkpoints stay float), "
       "'none' (dequantize), 'int8', 'int4' or 'fp8' (quantize at load; 'int8:G' / 'int4:G' set the group size G: "
       "16, 32, 64 or a multiple of 128 for int8, 32, 64 or a multiple of 128 for int4), or 'gguf' ('auto' for a "
       ".gguf model)", _opt_str, lambda v: _valid_quantization(v)),
    _r("kv_cache_dtype", "auto", "'auto' (the model dtype), 'bfloat16', 'float16', 'float32', or 'fp8' ('fp8_e4m3') "
       "or 'int8' (quantized, one scale per token and KV head)", _kv_dtype, lambda v: v in KV_CACHE_DTYPES),
    _r("enforce_eager", False, "True or False (no effect: XLA programs are always compiled)", _bool),
    _r("decode_steps_per_call", None, "None (the platform's: 8 on GPU/TPU, 4 on CPU) or an integer >= 1: decode "
       "iterations per device call", as_opt_int, lambda v: v is None or v >= 1),
    _r("single_step_max_rows", None, "None (the platform's: 8 on GPU/TPU, 0 on CPU, for MoE models and for quantized "
       "weights on a GPU) or an integer >= 0: decode batches of at most this many rows, one of them streamed, run one "
       "iteration per call, pipelined, so tokens stream one by one; larger ones, and batches whose requests all "
       "return only when finished (generate, batch jobs), run decode_steps_per_call iterations per call", as_opt_int,
       lambda v: v is None or v >= 0),
    _r("long_prefill_token_threshold", 0, "an integer >= 0: a prompt's prefill runs at most this many tokens in one "
       "step (0: as many as max_num_batched_tokens leaves), so a long prompt arriving while others decode holds "
       "each of their tokens for a shorter step (vLLM's option of the same name)", as_int, lambda v: v >= 0),
    _r("mixed_prefill_token_cap", 0, "an integer >= 0: a step that also decodes 1 to 16 rows prefills at most this "
       "many prompt tokens in all (0: no cap), so streaming requests are not held by one long prefill; a step "
       "with nothing or more rows decoding is not capped", as_int, lambda v: v >= 0),
    _r("overlap_decode", True, "True or False", _bool),
    _r("compile_threads", None, "None (one per core) or an integer >= 1", as_opt_int, lambda v: v is None or v >= 1),
    _r("compilation_cache_dir", "auto", "'auto', None or a directory path", _opt_path),
    _r("attention_impl", "auto", "'auto', 'reference', 'xla', 'pallas_tpu' or 'pallas_gpu'", _opt_str,
       lambda v: v in ATTENTION_IMPLS),
    _r("interpret", False, "True or False", _bool),
    _r("random_weights", False, "True or False", _bool),
    _r("warmup", True, "True or False", _bool),
    _r("use_tqdm", True, "True or False", _bool),
    _r("speculative", None, SPECULATIVE_ACCEPTED + " (jaxinfer.spec_config)", parse_speculative),
)
ARG_NAMES = tuple(r.name for r in LLM_ARG_RULES)
ALIASES = {"page_size": "block_size", "speculative_config": "speculative"}  # older names; vLLM's spelling
NO_EFFECT: dict[str, tuple[Any, str]] = {  # name -> (vLLM's default, why it changes nothing here)
    "trust_remote_code": (False, "jaxinfer never runs code from a checkpoint; its architectures are built in"),
    "download_dir": (None, "nothing is ever downloaded; models are local files, directories or bundled aliases"),
    "tokenizer_mode": ("auto", "there is one tokenizer implementation per checkpoint format"),
    "swap_space": (4, "preempted sequences are recomputed, never swapped to host memory"),
    "disable_log_stats": (True, "engine_stats() is always available and costs nothing"),
    "max_seq_len_to_capture": (8192, "there are no CUDA graphs; every bucket is compiled by XLA"),
    "disable_custom_all_reduce": (False, "collectives are XLA's"),
    "disable_async_output_proc": (False, "overlap_decode is jaxinfer's form of it"),
}
REFUSED: dict[str, tuple[Any, str]] = {  # name -> (vLLM's default, what to do instead)
    "revision": (None, "jaxinfer loads local files only; check the revision out into a directory and pass its path"),
    "tokenizer_revision": (None, "pass the path of that tokenizer revision as tokenizer=..."),
    "code_revision": (None, "no checkpoint code ever runs"),
    "hf_token": (None, "nothing is downloaded"),
    "hf_overrides": (None, "edit the checkpoint's config.json instead"),
    "skip_tokenizer_init": (False, "a model without a tokenizer takes token-id prompts anyway"),
    "pipeline_parallel_size": (1, "use tensor_parallel_size (and data_parallel_size for more replicas)"),
    "enable_lora": (False, "LoRA adapters are not supported yet"),
    "cpu_offload_gb": (0, "weights stay on the device"),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LLMArgs:
    """The checked arguments of LLM(...), one field per row of LLM_ARG_RULES (block_size and memory_fraction
    resolved to their values when None)."""

    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int | None = 0
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    memory_fraction: float | None = None  # None: the platform's (jaxinfer.platform), filled in by LLM
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    num_pages: int | None = None
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    sequence_parallel_size: int = 1
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False
    decode_steps_per_call: int | None = None
    single_step_max_rows: int | None = None
    long_prefill_token_threshold: int = 0
    mixed_prefill_token_cap: int = 0
    overlap_decode: bool = True
    compile_threads: int | None = None
    compilation_cache_dir: str | None = "auto"
    attention_impl: str = "auto"
    interpret: bool = False
    random_weights: bool = False
    warmup: bool = True
    use_tqdm: bool = True
    speculative: Any = None  # a jaxinfer.spec_config.SpeculativeConfig once checked


def resolve_llm_args(given: Mapping[str, Any], *, where: str = "LLM argument ") -> LLMArgs:
    """Check keyword arguments (the table's names, ALIASES, NO_EFFECT and REFUSED vLLM names) -> LLMArgs.
    Arguments not given take the table's defaults. `where` prefixes error messages ("engine." in jobs)."""
    defaults = {r.name: r.default for r in LLM_ARG_RULES}
    values, explicit = dict(defaults), set()
    for key, value in given.items():
        name = _canonical(key, value, where)
        if name is None or _is_default(value, defaults[name]):
            continue  # a default (LLM passes every keyword) never conflicts with an alias
        if name in explicit and not _is_default(value, values[name]):
            raise InvalidInput(f"{where}{key} and {name} are the same setting; pass one of them.", field=key,
                               value=value)
        values[name] = value
        explicit.add(name)
    for rule in LLM_ARG_RULES:
        values[rule.name] = _checked(rule, values[rule.name], where)
    if values["num_pages"] is not None and values["gpu_memory_utilization"] is not None:
        raise InvalidInput(f"{where}num_pages and gpu_memory_utilization both size the KV cache; pass one of them.",
                           field="gpu_memory_utilization", value=values["gpu_memory_utilization"])
    if values["enforce_eager"]:
        _notice(f"{where}enforce_eager=True has no effect: XLA programs are always compiled.")
    if values["block_size"] is None:
        from jaxinfer.kv_cache import QUANTIZED_KV
        from jaxinfer.platform import default_page_size

        values["block_size"] = default_page_size(values["kv_cache_dtype"] in QUANTIZED_KV)
    return LLMArgs(**values)


def _is_default(value: Any, default: Any) -> bool:
    """Same value and type (True is not 1); safe for values such as arrays whose == is not a bool."""
    if value is default:
        return True
    try:
        return type(value) is type(default) and bool(value == default)
    except (TypeError, ValueError):
        return False


def _canonical(key: Any, value: Any, where: str) -> str | None:
    """The table name `key` stands for; None for a vLLM argument that has no effect here (noticed)."""
    if key in ARG_NAMES:
        return key
    if key in ALIASES:
        return ALIASES[key]
    if key in NO_EFFECT:
        default, why = NO_EFFECT[key]
        if not _is_default(value, default):
            _notice(f"{where}{key}={value!r} has no effect: {why}.")
        return None
    if key in REFUSED:
        default, instead = REFUSED[key]
        if _is_default(value, default):
            return None
        raise InvalidInput(f"{where}{key}={value!r} is not supported: {instead}.", field=key, value=value,
                           accepted=repr(default))
    close = difflib.get_close_matches(str(key), [*ARG_NAMES, *ALIASES], n=3)
    hint = f"; did you mean {' or '.join(close)}?" if close else f"; accepted: {', '.join(ARG_NAMES)}."
    raise InvalidInputType(f"{where}{key} is not an argument jaxinfer knows{hint}", field=str(key), value=value)


def _checked(rule: FieldRule, value: Any, where: str) -> Any:
    try:
        value = rule.normalize(value)
    except Reject:
        raise InvalidInputType.of(where, rule.name, value, rule.accepted) from None
    if not rule.check(value, {}, Limits()):
        raise InvalidInput.of(where, rule.name, value, rule.accepted)
    return value


def _notice(message: str) -> None:
    warnings.warn(message, Notice, stacklevel=4)


def check_model_limits(args: LLMArgs, max_position_embeddings: int, where: str = "LLM argument ") -> None:
    """What the model bounds: the context length."""
    if args.max_model_len is not None and args.max_model_len > max_position_embeddings:
        raise InvalidInput.of(where, "max_model_len", args.max_model_len,
                              f"at most the model's max_position_embeddings ({max_position_embeddings})")


def resolve_model_name(model: Any) -> Any:
    """A hub id of a bundled checkpoint -> its alias (with a notice saying which local file stands in)."""
    from jaxinfer.presets import BUNDLED, HUB_IDS

    if isinstance(model, str) and model in HUB_IDS and not Path(model).exists():
        alias = HUB_IDS[model]
        _notice(f"model={model!r}: using the bundled checkpoint {alias!r} (from the {BUNDLED[alias][2]!r} "
                "package, a quantized GGUF); nothing is downloaded.")
        return alias
    if not isinstance(model, str | Path) and type(model).__name__ != "ModelConfig":
        raise InvalidInputType.of("LLM argument ", "model", model, "a path, a bundled alias, a preset name or a "
                                  "ModelConfig")
    return model
