"""Model families, looked up by the checkpoint's architecture name."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxinfer.checkpoint.assemble import CheckpointError, TensorRule
from jaxinfer.config import ModelConfig
from jaxinfer.models import gemma3, llama


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """Everything the loaders and the runner need to know about one architecture."""

    name: str
    param_specs: Callable[..., Any]  # (cfg, dtype) -> weights pytree of ParamSpec
    forward: Callable[..., Any]  # (weights, cfg, token_ids, md, kv_cache, attn_fn) -> (hidden, kv_cache)
    compute_logits: Callable[..., Any]  # (weights, cfg, hidden [S, D]) -> [S, V] float32
    checkpoint_rules: Callable[[], list[TensorRule]]
    config_from_gguf: Callable[[dict[str, Any]], ModelConfig]
    config_from_hf: Callable[[dict[str, Any]], ModelConfig]
    gguf_architectures: tuple[str, ...]
    hf_architectures: tuple[str, ...]


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

FAMILIES: dict[str, ModelFamily] = {LLAMA.name: LLAMA, GEMMA3.name: GEMMA3}


def _supported(attr: str) -> str:
    return ", ".join(sorted(a for f in FAMILIES.values() for a in getattr(f, attr)))


def family_for_config(cfg: ModelConfig) -> ModelFamily:
    try:
        return FAMILIES[cfg.architecture]
    except KeyError:
        raise CheckpointError(
            f"Unknown model architecture {cfg.architecture!r}; supported: {', '.join(sorted(FAMILIES))}."
        ) from None


def family_for_gguf(arch: str) -> ModelFamily:
    for family in FAMILIES.values():
        if arch in family.gguf_architectures:
            return family
    raise CheckpointError(f"Unknown GGUF architecture {arch!r}; supported: {_supported('gguf_architectures')}.")


def family_for_hf(architectures: list[str]) -> ModelFamily:
    for family in FAMILIES.values():
        if any(a in family.hf_architectures for a in architectures):
            return family
    raise CheckpointError(
        f"Unknown HF architecture {architectures}; supported: {_supported('hf_architectures')}."
    )
