"""Frozen configuration dataclasses, one per concern, and strict YAML loading.

Every config is a frozen, keyword-only dataclass. YAML (or dict) input goes through `from_dict`, which
rejects unknown keys by name, so a typo in a job file fails at load time instead of being ignored.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

import yaml

from jaxinfer.errors import ConfigError, InvalidInput, InvalidInputType
from jaxinfer.llm_args import ATTENTION_IMPLS
from jaxinfer.validation import (
    RequestOutputKind,
    check_sampling_fields,
    is_int,
    is_real,
    normalized_sampling_fields,
)

__all__ = ["ConfigError", "InvalidInput", "InvalidInputType", "RequestOutputKind", "SamplingParams"]


class DType(enum.Enum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class RopeScaling(enum.Enum):
    NONE = "none"
    LLAMA3 = "llama3"
    LINEAR = "linear"


def _coerce(field_name: str, annotation: Any, value: Any) -> Any:
    """Turn a YAML scalar/list into the annotated type (enums from strings, tuples from lists); a value of
    another type is an InvalidInputType naming the field (a string where a number belongs, a list for a
    flag), so a typo in a job file fails at load time rather than inside the engine."""
    value = _convert(field_name, annotation, value)
    if not _type_ok(annotation, value):
        raise InvalidInputType(
            f"{field_name} must be {_describe(annotation)}, got {value!r}.", field=field_name, value=value,
            accepted=_describe(annotation),
        )
    return value


def _convert(field_name: str, annotation: Any, value: Any) -> Any:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if value is None:
        return None
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1:
            return _convert(field_name, non_none[0], value)
        return value
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        if isinstance(value, annotation):
            return value
        try:
            return annotation(value)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in annotation)
            raise ConfigError(f"{field_name}: {value!r} is not one of {allowed}.") from None
    if origin is tuple and isinstance(value, list | tuple):
        return tuple(value)
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _type_ok(annotation: Any, value: Any) -> bool:
    """Whether `value` has the annotated type (ints count as floats; numpy scalars as Python ones)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(a, value) for a in args)
    if annotation is type(None):
        return value is None
    simple = {bool: lambda v: isinstance(v, bool), int: is_int, float: is_real, str: lambda v: isinstance(v, str)}
    if annotation in simple:
        return simple[annotation](value)
    if origin is tuple:
        return isinstance(value, tuple) and all(_type_ok(args[0], v) for v in value)
    if origin in (dict, Mapping):
        return isinstance(value, Mapping)
    return not isinstance(annotation, type) or isinstance(value, annotation)


def _describe(annotation: Any) -> str:
    """Human name of a type annotation, for error messages."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in annotation)
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if annotation in names:
        return names[annotation]
    if origin is tuple:
        return f"a list of {_describe(args[0])}s"
    if origin in (dict, Mapping):
        return "a mapping"
    return getattr(annotation, "__name__", str(annotation))


def _check_field_types(obj: Any) -> None:
    """Every field of a config dataclass built directly (not through from_dict) has its annotated type."""
    cls = type(obj)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if not _type_ok(hints[f.name], value):
            name = f"{cls.__name__}.{f.name}"
            raise InvalidInputType(f"{name} must be {_describe(hints[f.name])}, got {value!r}.", field=f.name,
                                   value=value, accepted=_describe(hints[f.name]))


class FromDict:
    """Mixin: strict construction from a mapping (YAML section)."""

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, section: str | None = None) -> Self:
        name = section or cls.__name__
        if not isinstance(data, dict):
            raise InvalidInputType(f"{name}: expected a mapping, got {type(data).__name__}.", field=name, value=data,
                                   accepted="a mapping")
        hints = typing.get_type_hints(cls)
        known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - known, key=str)  # YAML keys may be numbers too
        if unknown:
            raise ConfigError(
                f"{name}: unknown key(s) {', '.join(map(repr, unknown))}; "
                f"allowed keys are {', '.join(sorted(known))}."
            )
        kwargs = {k: _coerce(f"{name}.{k}", hints[k], v) for k, v in data.items()}
        return cls(**kwargs)

    def replace(self, **changes: Any) -> Self:
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig(FromDict):
    """Architecture of one decoder-only transformer: Llama family fields, then fields only some families use.

    The family-specific fields live here rather than in per-family subclasses so YAML presets can set them
    and every checkpoint format (GGUF, HF, orbax) round-trips one config type.
    """

    architecture: str = "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None  # defaults to hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling.NONE
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # Gemma 3 (see jaxinfer.models.gemma3); None = the family does not use it.
    sliding_window: int | None = None  # local layers see the last W positions, their own included
    sliding_window_pattern: int | None = None  # every P-th layer (0-based P-1, 2P-1, ...) is global, others local
    rope_local_theta: float | None = None  # RoPE base of local layers (never rope-scaled)
    query_pre_attn_scalar: float | None = None  # attention scale is 1/sqrt(this) instead of 1/sqrt(head_dim)
    attn_logit_softcap: float | None = None  # attention logits become cap * tanh(logits / cap)
    final_logit_softcap: float | None = None  # output logits become cap * tanh(logits / cap)
    # Mixture of experts (jaxinfer.models.moe; Qwen3-MoE, Mixtral); None = a dense model.
    num_experts: int | None = None  # routed experts per MoE layer (E)
    num_experts_per_tok: int | None = None  # experts each token is routed to (top-k)
    moe_intermediate_size: int | None = None  # ffn width of one expert (intermediate_size is the dense layers')
    norm_topk_prob: bool | None = None  # renormalize the top-k routing weights to sum to 1
    decoder_sparse_step: int | None = None  # Qwen3-MoE: layer i is MoE when (i + 1) % step == 0 (None: 1)
    mlp_only_layers: tuple[int, ...] | None = None  # Qwen3-MoE: layers that stay dense whatever the step

    def __post_init__(self) -> None:
        _check_field_types(self)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}.")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})."
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ConfigError(
                f"ModelConfig.hidden_size ({self.hidden_size}) is not divisible by num_heads "
                f"({self.num_heads}); set head_dim explicitly."
            )
        self._check_optional_positive()
        self._check_experts()

    def _check_optional_positive(self) -> None:
        """Family-specific fields are optional, but a set one must be usable (a zero window masks everything)."""
        for name in ("sliding_window", "sliding_window_pattern", "rope_local_theta", "query_pre_attn_scalar",
                     "attn_logit_softcap", "final_logit_softcap", "num_experts", "num_experts_per_tok",
                     "moe_intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"ModelConfig.{name} must be > 0 when set, got {value}.")

    def _check_experts(self) -> None:
        """The MoE fields come together (routing needs both counts) and stay inside the model."""
        if self.mlp_only_layers is not None and not isinstance(self.mlp_only_layers, tuple):
            object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))  # hashable, like YAML's
        if (self.num_experts is None) != (self.num_experts_per_tok is None):
            raise ConfigError(
                "ModelConfig.num_experts and num_experts_per_tok must be set together "
                f"(got num_experts={self.num_experts}, num_experts_per_tok={self.num_experts_per_tok})."
            )
        if self.num_experts is not None and self.num_experts_per_tok > self.num_experts:
            raise ConfigError(
                f"ModelConfig.num_experts_per_tok ({self.num_experts_per_tok}) must be <= num_experts "
                f"({self.num_experts})."
            )
        for layer in self.mlp_only_layers or ():
            if not 0 <= layer < self.num_layers:
                raise ConfigError(
                    f"ModelConfig.mlp_only_layers holds {layer}, outside the model's layers 0..{self.num_layers - 1}."
                )

    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig(FromDict):
    """Device mesh shape of one engine replica (jaxinfer.sharding.MESH_AXES). Axis sizes multiply to the
    number of devices it uses; `data` > 1 makes a mesh whose `data` slices are independent replicas."""

    data: int = 1
    tensor: int = 1
    expert: int = 1
    seq: int = 1

    def __post_init__(self) -> None:
        for name in ("data", "tensor", "expert", "seq"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"MeshConfig.{name} must be an integer >= 1, got {value!r}.")

    @property
    def num_devices(self) -> int:
        return self.data * self.tensor * self.expert * self.seq


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheConfig(FromDict):
    """Paged KV cache sizing (see docs/ARCHITECTURE.md for the layout)."""

    page_size: int = 16
    num_pages: int | None = None  # None: derived from gpu_memory_utilization, else memory_fraction
    # vLLM's meaning: the share of each device's total memory the engine may use; the KV cache gets what is
    # left of it after the weights. None: use memory_fraction instead.
    gpu_memory_utilization: float | None = None
    memory_fraction: float = 0.5  # the older setting: this share of the memory still free after the weights
    dtype: DType | None = None  # None: same as the model dtype

    def __post_init__(self) -> None:
        _check_field_types(self)
        if self.page_size < 1:
            raise ConfigError(f"CacheConfig.page_size must be >= 1, got {self.page_size}.")
        if self.num_pages is not None and self.num_pages < 2:
            raise ConfigError(
                f"CacheConfig.num_pages must be >= 2 (page 0 is reserved), got {self.num_pages}."
            )
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ConfigError(f"CacheConfig.memory_fraction must be in (0, 1], got {self.memory_fraction}.")
        util = self.gpu_memory_utilization
        if util is not None and not 0.0 < util <= 1.0:
            raise ConfigError(f"CacheConfig.gpu_memory_utilization must be in (0, 1], got {util}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig(FromDict):
    """How the engine batches and where it runs."""

    dtype: DType = DType.FLOAT32
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1  # engine replicas, each over tensor x expert x sequence parallel devices
    expert_parallel_size: int = 1  # MoE experts split over this many devices (attention: TP over them too)
    sequence_parallel_size: int = 1  # each step's tokens split over this many devices (long prefills)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    attention_impl: str = "auto"
    interpret: bool = False

    def __post_init__(self) -> None:
        _check_field_types(self)
        for name in ("tensor_parallel_size", "data_parallel_size", "expert_parallel_size", "sequence_parallel_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}.")
        if self.max_num_seqs < 1:
            raise ConfigError(f"EngineConfig.max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.max_model_len is not None and self.max_model_len < 2:  # 0 used to mean "the default" silently
            raise ConfigError(f"EngineConfig.max_model_len must be None or >= 2, got {self.max_model_len}.")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"EngineConfig.max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}."
            )
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ConfigError(
                f"EngineConfig.attention_impl: {self.attention_impl!r} is not one of {', '.join(ATTENTION_IMPLS)}."
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams(FromDict):
    """Per-request generation settings, named and defaulted as in vLLM. All of them are data on device:
    changing them never recompiles.

    Lists may be given as lists, tuples or 1-D arrays and are stored as tuples; `None` for a list field means
    empty; `stop` and `bad_words` may be one string. Every field's accepted range is in
    `jaxinfer.validation.SAMPLING_RULES` (and docs/RELIABILITY.md); a bad value raises `InvalidInput` (a
    `ConfigError`/`ValueError`, or also a `TypeError` for a wrong type) naming the field. Checks that need
    the model (vocabulary, max_model_len, EOS ids, the tokenizer) run again when a request is added.
    Frozen, unlike vLLM's: use `clone()` or `replace(...)` for a changed copy, so a validated object stays valid.
    """

    n: int = 1
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0  # EOS, stop ids and stop strings are ignored until this many tokens are out
    temperature: float = 1.0
    top_k: int = -1  # -1 or 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False  # keep the matched stop string (or stop token's text) in the text
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives per generated token (the sampled token is always included)
    prompt_logprobs: int | None = None
    detokenize: bool = True  # False: token ids only, no text (and no stop strings)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # as with HF fast tokenizers, no effect (see RELIABILITY.md)
    truncate_prompt_tokens: int | None = None  # keep only the last N prompt tokens; -1: max_model_len - 1
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled
    bad_words: tuple[str, ...] = ()  # never generated, as token sequences (with and without a leading space)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Output constrained to a JSON schema, regex, choice or grammar (jaxinfer.structured.StructuredOutputs).
    structured: Any = None
    extra_args: dict[str, Any] | None = None  # carried along untouched, for the caller's own use
    speculative: bool = True  # False: never speculate for this request (LLM(speculative=...) opt-out)

    def __post_init__(self) -> None:
        values = normalized_sampling_fields(self)
        for name, value in values.items():
            object.__setattr__(self, name, value)
        check_sampling_fields(values)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, section: str | None = None) -> Self:
        """Strict construction from a mapping (a YAML section or a JSON record's overrides); errors name the
        section and the field."""
        name = section or cls.__name__
        if not isinstance(data, Mapping):
            raise InvalidInputType(f"{name}: expected a mapping of SamplingParams fields, got "
                                   f"{type(data).__name__}.", field=name, value=data, accepted="a mapping")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known, key=str)
        if unknown:
            raise InvalidInput(f"{name}: unknown key(s) {', '.join(map(repr, unknown))}; allowed keys are "
                               f"{', '.join(sorted(known))}.", field=str(unknown[0]), value=data[unknown[0]])
        try:
            return cls(**data)
        except InvalidInput as e:
            if section is None:
                raise
            raise type(e)(f"{section}: {e}", field=e.field, value=e.value, accepted=e.accepted) from None

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's name); the dict fields are not shared with the original."""
        return copy.deepcopy(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping; an unreadable, non-UTF-8 or malformed file, or one that is not a mapping, is an
    error naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the file ({e}).") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML ({' '.join(str(e).split())}).") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a YAML mapping at the top level, got {type(data).__name__}.")
    return data


def model_config_from_yaml(path: str | Path) -> ModelConfig:
    return ModelConfig.from_dict(load_yaml(path), section=f"{Path(path).name}")
