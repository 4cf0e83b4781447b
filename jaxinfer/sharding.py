"""The one axis vocabulary: logical array axes, mesh axes, and the validated rules between them.

Models name each weight axis with a logical name (`embed`, `q_heads`, ...). `ShardingRules` maps logical
names to mesh axes (`data`, `tensor`, later `expert`, `seq`); nothing else in the code base decides a
layout. Rules are checked once: an unknown name, or two logical axes of one array landing on the same mesh
axis, is an error that names the axes.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfer.config import ConfigError, MeshConfig, ModelConfig


class Logical(enum.StrEnum):
    """Logical axis names used in ParamSpec.logical_axes and activation constraints."""

    EMBED = "embed"
    Q_HEADS = "q_heads"
    KV_HEADS = "kv_heads"
    HEAD_DIM = "head_dim"
    FFN = "ffn"
    VOCAB = "vocab"
    EXPERTS = "experts"
    PAGES = "pages"
    PAGE_SLOT = "page_slot"


MESH_AXES = ("data", "tensor")


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis -> mesh axis (or None for replicated)."""

    mapping: Mapping[Logical, str | None]

    def __post_init__(self) -> None:
        for logical, mesh_axis in self.mapping.items():
            if not isinstance(logical, Logical):
                raise ConfigError(f"ShardingRules: {logical!r} is not a logical axis name.")
            if mesh_axis is not None and mesh_axis not in MESH_AXES:
                raise ConfigError(
                    f"ShardingRules: logical axis {logical.value!r} maps to unknown mesh axis "
                    f"{mesh_axis!r}; mesh axes are {', '.join(MESH_AXES)}."
                )

    def spec(self, logical_axes: Sequence[Logical | None]) -> PartitionSpec:
        """PartitionSpec for an array whose axes carry these logical names."""
        mesh_axes = [self.mapping.get(a) if a is not None else None for a in logical_axes]
        used = [m for m in mesh_axes if m is not None]
        if len(used) != len(set(used)):
            names = [a.value if a else None for a in logical_axes]
            raise ConfigError(
                f"ShardingRules: logical axes {names} map two axes of one array to the same mesh axis "
                f"({mesh_axes})."
            )
        return PartitionSpec(*mesh_axes)

    def sharding(self, mesh: Mesh, logical_axes: Sequence[Logical | None]) -> NamedSharding:
        return NamedSharding(mesh, self.spec(logical_axes))


def _divides_or_replicate(size: int, tp: int) -> str | None:
    return "tensor" if size % tp == 0 else None


def tensor_parallel_rules(cfg: ModelConfig, tp: int) -> ShardingRules:
    """Megatron-style tensor parallelism for a dense decoder.

    Query heads must split evenly (each device owns whole heads). KV heads are sharded when `tp` divides
    them and replicated otherwise, so e.g. 8 kv heads on 16 devices still works (each device holds every
    kv head, which costs memory but keeps attention local). FFN and vocab fall back to replication when
    they do not divide, which costs memory, never correctness.
    """
    if cfg.num_heads % tp:
        raise ConfigError(
            f"tensor_parallel_size={tp} does not divide the model's {cfg.num_heads} query heads; "
            f"choose a divisor of {cfg.num_heads}."
        )
    return ShardingRules(
        {
            Logical.EMBED: None,
            Logical.Q_HEADS: "tensor" if tp > 1 else None,
            Logical.KV_HEADS: _divides_or_replicate(cfg.num_kv_heads, tp) if tp > 1 else None,
            Logical.HEAD_DIM: None,
            Logical.FFN: _divides_or_replicate(cfg.intermediate_size, tp) if tp > 1 else None,
            Logical.VOCAB: _divides_or_replicate(cfg.vocab_size, tp) if tp > 1 else None,
            Logical.PAGES: None,
            Logical.PAGE_SLOT: None,
        }
    )


def make_mesh(mesh_cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, tensor) mesh over the first `mesh_cfg.num_devices` devices."""
    devices = list(devices if devices is not None else jax.devices())
    need = mesh_cfg.num_devices
    if need > len(devices):
        raise ConfigError(
            f"The mesh needs {need} devices (data={mesh_cfg.data} x tensor={mesh_cfg.tensor}) but only "
            f"{len(devices)} {devices[0].platform} device(s) are visible."
        )
    grid = np.array(devices[:need]).reshape(mesh_cfg.data, mesh_cfg.tensor)
    return Mesh(grid, MESH_AXES)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
