"""Frozen configuration dataclasses, one per concern, and strict YAML loading.

Every config is a frozen, keyword-only dataclass. YAML (or dict) input goes through `from_dict`, which
rejects unknown keys by name, so a typo in a job file fails at load time instead of being ignored.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from pathlib import Path
from typing import Any, Self

import yaml


class DType(enum.Enum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class RopeScaling(enum.Enum):
    NONE = "none"
    LLAMA3 = "llama3"
    LINEAR = "linear"


class ConfigError(ValueError):
    """A config field holds a value outside what the field accepts."""


def _coerce(field_name: str, annotation: Any, value: Any) -> Any:
    """Turn a YAML scalar/list into the annotated type (enums from strings, tuples from lists)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if value is None:
        return None
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1:
            return _coerce(field_name, non_none[0], value)
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


class _FromDict:
    """Mixin: strict construction from a mapping (YAML section)."""

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, section: str | None = None) -> Self:
        name = section or cls.__name__
        if not isinstance(data, dict):
            raise ConfigError(f"{name}: expected a mapping, got {type(data).__name__}.")
        hints = typing.get_type_hints(cls)
        known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - known)
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
class ModelConfig(_FromDict):
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
class MeshConfig(_FromDict):
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
class CacheConfig(_FromDict):
    """Paged KV cache sizing (see docs/ARCHITECTURE.md for the layout)."""

    page_size: int = 16
    num_pages: int | None = None  # None: derived from memory_fraction of free device memory
    memory_fraction: float = 0.5
    dtype: DType | None = None  # None: same as the model dtype

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ConfigError(f"CacheConfig.page_size must be >= 1, got {self.page_size}.")
        if self.num_pages is not None and self.num_pages < 2:
            raise ConfigError(
                f"CacheConfig.num_pages must be >= 2 (page 0 is reserved), got {self.num_pages}."
            )
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ConfigError(f"CacheConfig.memory_fraction must be in (0, 1], got {self.memory_fraction}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig(_FromDict):
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
        for name in ("tensor_parallel_size", "data_parallel_size", "expert_parallel_size", "sequence_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"EngineConfig.{name} must be an integer >= 1, got {value!r}.")
        if self.max_num_seqs < 1:
            raise ConfigError(f"EngineConfig.max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"EngineConfig.max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}."
            )
        allowed = ("auto", "reference", "pallas_tpu", "pallas_gpu")
        if self.attention_impl not in allowed:
            raise ConfigError(
                f"EngineConfig.attention_impl: {self.attention_impl!r} is not one of {', '.join(allowed)}."
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams(_FromDict):
    """Per-request generation settings. All of them are data on device: changing them never recompiles."""

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Scalar checks that need no model knowledge; vocab-dependent checks happen at admission.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if self.max_tokens < 1:
            raise ConfigError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}.")
        from jaxinfer.engine.sampling import check_knobs  # the one definition of the knobs' ranges

        try:
            check_knobs(self)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.n < 1:
            raise ConfigError(f"SamplingParams.n must be >= 1, got {self.n}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping; a file that is not a mapping is an error naming the file."""
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a YAML mapping at the top level, got {type(data).__name__}.")
    return data


def model_config_from_yaml(path: str | Path) -> ModelConfig:
    return ModelConfig.from_dict(load_yaml(path), section=f"{Path(path).name}")
