"""HF checkpoint directories: `config.json` plus `*.safetensors` (single file or sharded with an index)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from jax.sharding import Mesh
from safetensors import SafetensorError, safe_open

from jaxinfer.checkpoint.assemble import CheckpointError, TensorSource, assemble_weights
from jaxinfer.config import ModelConfig
from jaxinfer.models import ModelFamily, family_for_hf
from jaxinfer.sharding import ShardingRules

# Buffers some exporters save that are derived, not learned.
_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found.") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON ({e.msg} at line {e.lineno}).") from None


@dataclasses.dataclass
class SafetensorsCheckpoint:
    directory: Path

    @cached_property
    def hf_config(self) -> dict[str, Any]:
        return read_json(self.directory / "config.json")

    @cached_property
    def family(self) -> ModelFamily:
        archs = self.hf_config.get("architectures") or [self.hf_config.get("model_type", "?")]
        return family_for_hf(archs)

    @cached_property
    def config(self) -> ModelConfig:
        try:
            return self.family.config_from_hf(self.hf_config)
        except KeyError as e:
            raise CheckpointError(f"{self.directory / 'config.json'}: missing field {e.args[0]!r}.") from None

    @cached_property
    def weight_map(self) -> dict[str, Path]:
        """Tensor name -> file holding it."""
        index = self.directory / "model.safetensors.index.json"
        if index.is_file():
            mapping = read_json(index).get("weight_map", {})
            return {name: self.directory / file for name, file in mapping.items()}
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.directory}: no *.safetensors files.")
        out: dict[str, Path] = {}
        for file in files:
            with self._open(file) as f:
                out.update({name: file for name in f.keys()})
        return out

    def _open(self, file: Path) -> Any:
        try:
            return safe_open(file, framework="numpy")
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file}: not a readable safetensors file, or it is truncated ({e}).") from None

    def _ignorable(self, name: str) -> bool:
        # Tied checkpoints sometimes also store the (identical) output projection.
        tied_copy = self.config.tie_word_embeddings and name == "lm_head.weight"
        return tied_copy or name.endswith(_DERIVED_SUFFIXES)

    def load_weights(self, specs: Any, mesh: Mesh, rules: ShardingRules) -> Any:
        with contextlib.ExitStack() as stack:
            handles = {file: stack.enter_context(self._open(file)) for file in set(self.weight_map.values())}

            def handle(name: str) -> Any:
                return handles[self.weight_map[name]]

            def read(name: str) -> np.ndarray:
                try:
                    return handle(name).get_tensor(name)
                except SafetensorError as e:
                    raise CheckpointError(f"{self.weight_map[name]}: cannot read tensor {name!r} ({e}).") from None

            def read_block(name: str, index: tuple[slice, ...]) -> np.ndarray:
                try:
                    return handle(name).get_slice(name)[index]  # reads only those bytes of the file
                except SafetensorError as e:
                    raise CheckpointError(f"{self.weight_map[name]}: cannot read tensor {name!r} ({e}).") from None

            source = TensorSource(
                description=str(self.directory),
                names=set(self.weight_map),
                shape_of=lambda name: tuple(handle(name).get_slice(name).get_shape()),
                read=read,
                ignorable=self._ignorable,
                read_block=read_block,
            )
            return assemble_weights(specs, self.family.checkpoint_rules(), source, "hf", mesh, rules)
