"""Model families, looked up by the checkpoint's architecture name."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from jaxinfer.checkpoint.assemble import CheckpointError, TensorRule
from jaxinfer.config import ModelConfig
from jaxinfer.models import gemma3, llama, mixtral, qwen3


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """Everything the loaders and the runner need to know about one architecture."""

    name: str
    param_specs: Callable[..., Any]  # (cfg, dtype) -> weights pytree of ParamSpec
    # (weights, cfg, token_ids, md, kv_cache, attn_fn) -> (hidden, kv_cache); the MoE families' forwards (qwen3,
    # dense Qwen3 included, and mixtral) also take `moe_fn=` (default jaxinfer.models.moe.moe_block) to swap the
    # expert computation, and return (hidden, kv_cache, tokens routed to each expert [E]).
    forward: Callable[..., Any]
    compute_logits: Callable[..., Any]  # (weights, cfg, hidden [S, D]) -> [S, V] float32
    checkpoint_rules: Callable[[], list[TensorRule]]
    config_from_gguf: Callable[[dict[str, Any]], ModelConfig]
    config_from_hf: Callable[[dict[str, Any]], ModelConfig]
    gguf_architectures: tuple[str, ...]
    hf_architectures: tuple[str, ...]
    # GGUF files with routed experts (`{arch}.expert_count` > 0): True = only those, False = only files
    # without, None = either. llama.cpp writes Mixtral as architecture "llama" with experts.
    gguf_experts: bool | None = None
    moe: bool = False  # routed experts: forward takes `moe_fn=` and the mesh may have an `expert` axis


LLAMA = ModelFamily(
    name="llama",
    param_specs=llama.param_specs,
    forward=llama.forward,
    compute_logits=llama.compute_logits,
    checkpoint_rules=llama.checkpoint_rules,
    config_from_gguf=llama.config_from_gguf,
    config_from_hf=llama.config_from_hf,
    gguf_architectures=("llama", "mistral"),
    hf_architectures=("LlamaForCausalLM", "MistralForCausalLM"),
    gguf_experts=False,
)

GEMMA3 = ModelFamily(
    name="gemma3",
    param_specs=gemma3.param_specs,
    forward=gemma3.forward,
    compute_logits=gemma3.compute_logits,
    checkpoint_rules=gemma3.checkpoint_rules,
    config_from_gguf=gemma3.config_from_gguf,
    config_from_hf=gemma3.config_from_hf,
    gguf_architectures=("gemma3",),
    hf_architectures=("Gemma3ForCausalLM",),
)

QWEN3 = ModelFamily(
    name="qwen3",
    param_specs=qwen3.param_specs,
    forward=qwen3.forward,
    compute_logits=qwen3.compute_logits,
    checkpoint_rules=qwen3.checkpoint_rules,
    config_from_gguf=qwen3.config_from_gguf,
    config_from_hf=qwen3.config_from_hf,
    gguf_architectures=("qwen3",),
    hf_architectures=("Qwen3ForCausalLM",),
)

QWEN3_MOE = ModelFamily(
    name="qwen3_moe",
    param_specs=qwen3.moe_param_specs,
    forward=qwen3.forward,  # the config decides which layers are sparse
    compute_logits=qwen3.compute_logits,
    checkpoint_rules=qwen3.checkpoint_rules,
    config_from_gguf=qwen3.moe_config_from_gguf,
    config_from_hf=qwen3.moe_config_from_hf,
    gguf_architectures=("qwen3moe",),
    hf_architectures=("Qwen3MoeForCausalLM",),
    moe=True,
)

MIXTRAL = ModelFamily(
    name="mixtral",
    param_specs=mixtral.param_specs,
    forward=mixtral.forward,
    compute_logits=mixtral.compute_logits,
    checkpoint_rules=mixtral.checkpoint_rules,
    config_from_gguf=mixtral.config_from_gguf,
    config_from_hf=mixtral.config_from_hf,
    gguf_architectures=("llama", "mistral"),
    hf_architectures=("MixtralForCausalLM",),
    gguf_experts=True,
    moe=True,
)

FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (LLAMA, GEMMA3, QWEN3, QWEN3_MOE, MIXTRAL)}


def with_linear(family: ModelFamily, linear: Any) -> ModelFamily:
    """The family with `linear` (jaxinfer.linear.Linear: how quantized weights run on this mesh) bound into
    its forward and compute_logits, so callers (the runner) keep calling them as before."""
    return dataclasses.replace(family, forward=functools.partial(family.forward, linear=linear),
                               compute_logits=functools.partial(family.compute_logits, linear=linear))


def _supported(attr: str) -> str:
    return ", ".join(sorted(a for f in FAMILIES.values() for a in getattr(f, attr)))


def family_for_config(cfg: ModelConfig) -> ModelFamily:
    try:
        return FAMILIES[cfg.architecture]
    except KeyError:
        raise CheckpointError(
            f"Unknown model architecture {cfg.architecture!r}; supported: {', '.join(sorted(FAMILIES))}."
        ) from None


def family_for_gguf(arch: str, metadata: dict[str, Any] | None = None) -> ModelFamily:
    """The family of a GGUF architecture; `metadata` tells a Llama file with experts (Mixtral) from one without."""
    has_experts = bool((metadata or {}).get(f"{arch}.expert_count"))
    for family in FAMILIES.values():
        if arch in family.gguf_architectures and family.gguf_experts in (None, has_experts):
            return family
    raise CheckpointError(f"Unknown GGUF architecture {arch!r}; supported: {_supported('gguf_architectures')}.")


def family_for_hf(architectures: list[str]) -> ModelFamily:
    for family in FAMILIES.values():
        if any(a in family.hf_architectures for a in architectures):
            return family
    raise CheckpointError(
        f"Unknown HF architecture {architectures}; supported: {_supported('hf_architectures')}."
    )
