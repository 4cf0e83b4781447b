"""Orbax checkpoints: `jaxinfer convert SRC DST` writes one; loading restores straight into the mesh.

Layout of DST:
  jaxinfer_model.json   model config + format version (the marker that this is ours)
  params/               orbax PyTree checkpoint of the weights pytree
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
from jaxinfer.params import abstract_params
from jaxinfer.sharding import ShardingRules

ORBAX_MARKER = "jaxinfer_model.json"
FORMAT_VERSION = 1


def save_checkpoint(dst: str | Path, cfg: ModelConfig, weights: Any, tokenizer: Any) -> Path:
    """Write weights (orbax), config and tokenizer to `dst`, which must not exist yet."""
    dst = Path(dst).expanduser().resolve()
    if dst.exists():
        raise CheckpointError(f"{dst}: already exists; choose a new directory for the converted checkpoint.")
    dst.mkdir(parents=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(dst / "params", weights)
    if tokenizer is not None:  # a checkpoint without one converts to one without one (token-id prompts)
        tokenizer.save(dst / "tokenizer")
    meta = {"format_version": FORMAT_VERSION, "model_config": _config_to_json(cfg)}
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
        if meta.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{self.directory}: checkpoint format_version {meta.get('format_version')} is not the "
                f"supported {FORMAT_VERSION}; convert it again."
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

    def load_weights(self, specs: Any, mesh: Mesh, rules: ShardingRules) -> Any:
        """Restore each array directly with its target sharding (no host round trip)."""
        target = abstract_params(specs, mesh, rules)
        try:
            with ocp.StandardCheckpointer() as ckptr:
                return ckptr.restore(self.directory / "params", target)
        except (ValueError, FileNotFoundError) as e:
            raise CheckpointError(f"{self.directory}: orbax restore failed ({e}).") from None
