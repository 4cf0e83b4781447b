"""HF checkpoint directories: `config.json` plus `*.safetensors` (single file or sharded with an index)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from jax.sharding import Mesh
from safetensors import SafetensorError, safe_open

from jaxinfer.checkpoint.assemble import CheckpointError, TensorSource, assemble_weights
from jaxinfer.config import ConfigError, ModelConfig
from jaxinfer.models import ModelFamily, family_for_hf
from jaxinfer.sharding import ShardingRules
from jaxinfer.validation import is_int, is_real

# Buffers some exporters save that are derived, not learned.
_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`; any other content is a CheckpointError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found.") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}).") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON ({e.msg} at line {e.lineno}).") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object at the top level, got {type(data).__name__}.")
    return data


def _count(v: Any) -> bool:
    return is_int(v) and v >= 1


def _opt(check: Any) -> Any:
    return lambda v: v is None or check(v)


def _positive(v: Any) -> bool:
    return is_real(v) and math.isfinite(v) and v > 0


def _ids(v: Any) -> bool:
    return v is None or (is_int(v) and v >= 0) or (isinstance(v, list) and all(is_int(t) and t >= 0 for t in v))


# config.json keys the loaders read -> (check, what the key accepts); checked before any is used, so a
# wrong type is an error naming the file and the key instead of a TypeError inside the model code.
HF_CONFIG_KEYS: dict[str, tuple[Any, str]] = {
    "architectures": (lambda v: isinstance(v, list) and all(isinstance(a, str) for a in v), "a list of strings"),
    "model_type": (lambda v: isinstance(v, str), "a string"),
    "vocab_size": (_count, "an integer >= 1"),
    "hidden_size": (_count, "an integer >= 1"),
    "intermediate_size": (_count, "an integer >= 1"),
    "num_hidden_layers": (_count, "an integer >= 1"),
    "num_attention_heads": (_count, "an integer >= 1"),
    "num_key_value_heads": (_opt(_count), "null or an integer >= 1"),
    "head_dim": (_opt(_count), "null or an integer >= 1"),
    "max_position_embeddings": (_count, "an integer >= 1"),
    "rms_norm_eps": (_positive, "a number > 0"),
    "rope_theta": (_positive, "a number > 0"),
    "rope_local_base_freq": (_opt(_positive), "null or a number > 0"),
    "query_pre_attn_scalar": (_opt(_positive), "null or a number > 0"),
    "attn_logit_softcapping": (_opt(_positive), "null or a number > 0"),
    "final_logit_softcapping": (_opt(_positive), "null or a number > 0"),
    "sliding_window": (_opt(_count), "null or an integer >= 1"),
    "sliding_window_pattern": (_opt(_count), "null or an integer >= 1"),
    "use_sliding_window": (lambda v: isinstance(v, bool), "true or false"),
    "tie_word_embeddings": (lambda v: isinstance(v, bool), "true or false"),
    "bos_token_id": (_ids, "null, a token id or a list of them"),
    "eos_token_id": (_ids, "null, a token id or a list of them"),
    "rope_scaling": (_opt(lambda v: isinstance(v, dict)), "null or an object"),
    "rope_parameters": (_opt(lambda v: isinstance(v, dict)), "null or an object"),
    "layer_types": (_opt(lambda v: isinstance(v, list) and all(isinstance(t, str) for t in v)),
                    "null or a list of strings"),
}


def check_hf_config(hf: dict[str, Any], path: Path) -> None:
    for key, (ok, accepted) in HF_CONFIG_KEYS.items():
        if key in hf and not ok(hf[key]):
            raise CheckpointError(f"{path}: {key} must be {accepted}, got {hf[key]!r}.")


@dataclasses.dataclass
class SafetensorsCheckpoint:
    directory: Path

    @cached_property
    def hf_config(self) -> dict[str, Any]:
        path = self.directory / "config.json"
        config = read_json(path)
        check_hf_config(config, path)
        return config

    @cached_property
    def family(self) -> ModelFamily:
        archs = self.hf_config.get("architectures") or [self.hf_config.get("model_type", "?")]
        return family_for_hf(archs)

    @cached_property
    def config(self) -> ModelConfig:
        path = self.directory / "config.json"
        try:
            return self.family.config_from_hf(self.hf_config)
        except KeyError as e:
            raise CheckpointError(f"{path}: missing field {e.args[0]!r}.") from None
        except (ConfigError, TypeError, ValueError) as e:  # a value in range alone, but not with the others
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{path}: {e}") from None

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

    def load_weights(self, specs: Any, mesh: Mesh, rules: ShardingRules, plan: Any = None) -> Any:
        """The weights of `specs` (float specs); those named in `plan` quantized at load, one at a time."""
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
            return assemble_weights(specs, self.family.checkpoint_rules(), source, "hf", mesh, rules,
                                    quant_plan=plan)
