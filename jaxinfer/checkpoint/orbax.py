"""Orbax checkpoints: `jaxinfer convert SRC DST` writes one; loading restores straight into the mesh.

Layout of DST:
  jaxinfer_model.json   model config + format version (the marker that this is ours), and for a quantized
                        model its quantization plan (weight path -> format, jaxinfer.quantization)
  params/               orbax PyTree checkpoint of the weights pytree (quantized weights are their small
                        pytrees of values / scales / zeros; restored straight into the mesh like any weight)
  tokenizer/            the tokenizer files (tokenizer.json or tokenizer.model + tokenizer_config.json), when the
                        source had a tokenizer
"""

from __future__ import annotations

import dataclasses
import json
from functools import cached_property
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
from jax.sharding import Mesh

from jaxinfer.checkpoint.assemble import CheckpointError
from jaxinfer.config import ModelConfig
from jaxinfer.models import ModelFamily, family_for_config
from jaxinfer.models.fused import split_projections
from jaxinfer.params import abstract_params
from jaxinfer.quantization import Plan, plan_from_json, plan_to_json, quantize_params, quantized_specs
from jaxinfer.sharding import ShardingRules

ORBAX_MARKER = "jaxinfer_model.json"
FORMAT_VERSION = 2  # 2: int4 codes are two's complement nibbles (version 1 stored code + 8; its float and 8-bit
                    # checkpoints still read)


def save_checkpoint(dst: str | Path, cfg: ModelConfig, weights: Any, tokenizer: Any, plan: Plan | None = None) -> Path:
    """Write weights (orbax), config, quantization plan and tokenizer to `dst`, which must not exist yet."""
    dst = Path(dst).expanduser().resolve()
    if dst.exists():
        raise CheckpointError(f"{dst}: already exists; choose a new directory for the converted checkpoint.")
    dst.mkdir(parents=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(dst / "params", split_projections(weights))  # the published layout, whatever the engine joined
    if tokenizer is not None:  # a checkpoint without one converts to one without one (token-id prompts)
        tokenizer.save(dst / "tokenizer")
    meta = {"format_version": FORMAT_VERSION, "model_config": _config_to_json(cfg)}
    if plan:
        meta["quantization_plan"] = plan_to_json(plan)
    (dst / ORBAX_MARKER).write_text(json.dumps(meta, indent=1, sort_keys=True), encoding="utf-8")
    return dst


def _config_to_json(cfg: ModelConfig) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        out[f.name] = value.value if hasattr(value, "value") else value
    return out


@dataclasses.dataclass
class OrbaxCheckpoint:
    directory: Path

    @cached_property
    def meta(self) -> dict[str, Any]:
        meta = json.loads((self.directory / ORBAX_MARKER).read_text(encoding="utf-8"))
        version = meta.get("format_version")
        int4 = any(fmt.get("bits") == 4 for fmt in meta.get("quantization_plan", {}).values())
        if version not in (1, FORMAT_VERSION) or (version == 1 and int4):
            why = "its int4 codes are stored as code + 8, " if version == 1 else ""
            raise CheckpointError(
                f"{self.directory}: checkpoint format_version {version} is not the supported "
                f"{FORMAT_VERSION} ({why}two's complement since version 2); convert it again."
            )
        return meta

    @cached_property
    def config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.meta["model_config"], section=f"{self.directory}/{ORBAX_MARKER}")

    @cached_property
    def family(self) -> ModelFamily:
        return family_for_config(self.config)

    @property
    def tokenizer_path(self) -> Path:
        return self.directory / "tokenizer"

    @cached_property
    def stored_plan(self) -> Plan:
        """The quantization plan the checkpoint was saved with ({} for float weights)."""
        return plan_from_json(self.meta.get("quantization_plan", {}))

    def load_weights(self, specs: Any, mesh: Mesh, rules: ShardingRules, plan: Plan | None = None) -> Any:
        """Restore each array directly with its target sharding (no host round trip); quantized weights
        restore quantized. A float checkpoint loaded with a quantization plan is quantized after."""
        target = abstract_params(quantized_specs(specs, self.stored_plan), mesh, rules)
        try:
            with ocp.StandardCheckpointer() as ckptr:
                weights = ckptr.restore(self.directory / "params", target)
        except (ValueError, FileNotFoundError) as e:
            raise CheckpointError(f"{self.directory}: orbax restore failed ({e}).") from None
        if plan and not self.stored_plan:
            weights = quantize_params(weights, specs, plan, mesh, rules)
        return weights
