"""The one axis vocabulary: logical array axes, mesh axes, and the validated rules between them.

Models name each weight axis with a logical name (`embed`, `q_heads`, ...). `ShardingRules` maps logical
names to mesh axes (`data`, `tensor`, `expert`, `seq`); nothing else in the code base decides a layout.
Rules are checked once: an unknown name, or two logical axes of one array landing on the same mesh axis, is
an error that names the axes.

`HeadLayout` says how attention heads split over the `tensor` axis. Query heads always split evenly. KV
heads split when the tensor degree divides them; when there are fewer KV heads than devices (Gemma-3-270M
has 1, Llama-3-70B has 8 on 16 chips) each KV head is replicated over the `tensor // num_kv_heads` devices
whose query heads read it, as vLLM does: the weights stay whole (they are small), and the cache holds
`tensor` heads so every device keeps exactly the one it uses.
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
    KV_CACHE_HEADS = "kv_cache_heads"  # the cache's head axis: always split over `tensor` (see HeadLayout)
    PAGES = "pages"
    PAGE_SLOT = "page_slot"


MESH_AXES = ("data", "tensor", "expert", "seq")


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


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """How the attention heads of one model split over `tensor` devices (validated by `head_layout`)."""

    tensor: int
    num_heads: int
    num_kv_heads: int

    @property
    def kv_replicas(self) -> int:
        """Devices that share one KV head (1 when the KV heads themselves are split)."""
        return self.tensor // self.num_kv_heads if self.tensor > self.num_kv_heads else 1

    @property
    def kv_sharded(self) -> bool:
        """The KV projections (and the new k/v) are split by head; otherwise every device computes all."""
        return self.tensor > 1 and self.kv_replicas == 1

    @property
    def cache_heads(self) -> int:
        """KV heads the cache holds over all devices: each device's share is cache_heads // tensor."""
        return self.num_kv_heads * self.kv_replicas


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def head_layout(cfg: ModelConfig, tp: int) -> HeadLayout:
    """The head split for `tp` devices, or a ConfigError naming the numbers when no split exists."""
    n, k = cfg.num_heads, cfg.num_kv_heads
    usable = [d for d in _divisors(n) if k % d == 0 or d % k == 0]
    if n % tp:
        raise ConfigError(
            f"tensor_parallel_size={tp} does not divide the model's {n} query heads; "
            f"choose one of {usable}."
        )
    if k % tp and tp % k:
        raise ConfigError(
            f"tensor_parallel_size={tp} and the model's {k} kv heads do not divide one another, so the kv "
            f"heads can be neither split nor replicated evenly; choose one of {usable}."
        )
    return HeadLayout(tensor=tp, num_heads=n, num_kv_heads=k)


def tensor_parallel_rules(cfg: ModelConfig, tp: int) -> ShardingRules:
    """Megatron-style tensor parallelism for a dense decoder.

    Query heads split evenly (each device owns whole heads); KV heads split or replicate (`HeadLayout`),
    and the cache always splits by head. FFN and vocab fall back to replication when they do not divide,
    which costs memory, never correctness.
    """
    layout = head_layout(cfg, tp)
    split = "tensor" if tp > 1 else None
    return ShardingRules(
        {
            Logical.EMBED: None,
            Logical.Q_HEADS: split,
            Logical.KV_HEADS: "tensor" if layout.kv_sharded else None,
            Logical.KV_CACHE_HEADS: split,
            Logical.HEAD_DIM: None,
            Logical.FFN: _divides_or_replicate(cfg.intermediate_size, tp) if tp > 1 else None,
            Logical.VOCAB: _divides_or_replicate(cfg.vocab_size, tp) if tp > 1 else None,
            Logical.PAGES: None,
            Logical.PAGE_SLOT: None,
        }
    )


# Device-grid order of the mesh axes: `tensor` varies fastest, so a tensor group is neighbouring devices
# (one NVLink island, one TPU host's chips, one process's devices in a multi-host run), where its per-layer
# all-reduces are cheapest; `data` varies slowest, so replicas split along hosts.
GRID_ORDER = ("data", "expert", "seq", "tensor")


def make_mesh(mesh_cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with every axis of MESH_AXES over the first `mesh_cfg.num_devices` devices."""
    devices = list(devices if devices is not None else jax.devices())
    need = mesh_cfg.num_devices
    if need > len(devices):
        sizes = " x ".join(f"{a}={getattr(mesh_cfg, a)}" for a in GRID_ORDER if getattr(mesh_cfg, a) > 1)
        raise ConfigError(
            f"The mesh needs {need} devices ({sizes or 'one device'}) but only "
            f"{len(devices)} {devices[0].platform} device(s) are visible."
        )
    grid = np.array(devices[:need]).reshape(tuple(getattr(mesh_cfg, a) for a in GRID_ORDER))
    return Mesh(grid, GRID_ORDER)


def axis_size(mesh: Mesh | None, axis: str) -> int:
    return 1 if mesh is None else int(mesh.shape.get(axis, 1))


def cache_heads(cfg: ModelConfig, mesh: Mesh | None) -> int:
    """KV heads the cache holds over `mesh` (more than the model's when KV heads are replicated)."""
    return head_layout(cfg, axis_size(mesh, "tensor")).cache_heads


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
