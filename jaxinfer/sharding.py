"""The one axis vocabulary: logical array axes, mesh axes, and the validated rules between them.

Models name each weight axis with a logical name (`embed`, `q_heads`, ...). `ShardingRules` maps logical
names to mesh axes (`data`, `tensor`, `expert`, `seq`), or to a tuple of them; nothing else in the code base
decides a layout. Rules are checked once: an unknown name, or two logical axes of one array landing on the
same mesh axis, is an error that names the axes.

How a replica's devices are used (`mesh_rules`):
- The dense parts (attention heads, the dense MLP, the vocabulary of the embedding and the LM head) split
  Megatron-style over every model-parallel device, i.e. over the `expert` and `tensor` axes together
  (`model_axes`): with expert parallelism, attention runs tensor-parallel on the same devices that hold the
  experts, as in vLLM's expert-parallel mode.
- Mixture-of-experts weights split their experts over `expert` and each expert's FFN width over `tensor`.
- `seq` splits the tokens of a step (sequence parallelism): weights and the cache are replicated over it.
- `data` slices are independent engine replicas (jaxinfer.engine.replicas).

`HeadLayout` says how attention heads split over those devices. Query heads always split evenly. KV heads
split when the degree divides them; when there are fewer KV heads than devices (Gemma-3-270M has 1,
Llama-3-70B has 8 on 16 chips) each KV head is replicated over the devices whose query heads read it, as
vLLM does: the weights stay whole (they are small), and the cache holds one head per device so every device
keeps exactly the one it uses.
"""

from __future__ import annotations

import dataclasses
import enum
import math
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
    EXPERT_FFN = "expert_ffn"  # the FFN width inside one expert (split over `tensor`, experts over `expert`)
    KV_CACHE_HEADS = "kv_cache_heads"  # the cache's head axis: always split over the model axes (HeadLayout)
    PAGES = "pages"
    PAGE_SLOT = "page_slot"


MESH_AXES = ("data", "tensor", "expert", "seq")
MODEL_AXES = ("expert", "tensor")  # the devices attention heads and dense layers split over, in this order

# One logical axis lands on nothing (replicated), one mesh axis, or several mesh axes (major first).
MeshAxes = str | tuple[str, ...] | None


def flat_axes(axes: MeshAxes) -> tuple[str, ...]:
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis -> mesh axis, tuple of mesh axes, or None for replicated."""

    mapping: Mapping[Logical, MeshAxes]

    def __post_init__(self) -> None:
        for logical, mesh_axes in self.mapping.items():
            if not isinstance(logical, Logical):
                raise ConfigError(f"ShardingRules: {logical!r} is not a logical axis name.")
            unknown = [a for a in flat_axes(mesh_axes) if a not in MESH_AXES]
            if unknown:
                raise ConfigError(
                    f"ShardingRules: logical axis {logical.value!r} maps to unknown mesh axis "
                    f"{unknown[0]!r}; mesh axes are {', '.join(MESH_AXES)}."
                )

    def spec(self, logical_axes: Sequence[Logical | None]) -> PartitionSpec:
        """PartitionSpec for an array whose axes carry these logical names."""
        mesh_axes = [self.mapping.get(a) if a is not None else None for a in logical_axes]
        used = [m for axes in mesh_axes for m in flat_axes(axes)]
        if len(used) != len(set(used)):
            names = [a.value if a else None for a in logical_axes]
            raise ConfigError(
                f"ShardingRules: logical axes {names} map two axes of one array to the same mesh axis "
                f"({mesh_axes})."
            )
        return PartitionSpec(*mesh_axes)

    def sharding(self, mesh: Mesh, logical_axes: Sequence[Logical | None]) -> NamedSharding:
        return NamedSharding(mesh, self.spec(logical_axes))


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """How the attention heads of one model split over `tensor` model-parallel devices (see `head_layout`)."""

    tensor: int  # devices the heads split over (tensor x expert parallel size)
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


def head_layout(cfg: ModelConfig, tp: int, what: str = "tensor_parallel_size") -> HeadLayout:
    """The head split over `tp` devices, or a ConfigError naming the numbers when no split exists."""
    n, k = cfg.num_heads, cfg.num_kv_heads
    usable = [d for d in _divisors(n) if k % d == 0 or d % k == 0]
    if n % tp:
        raise ConfigError(f"{what}={tp} does not divide the model's {n} query heads; choose one of {usable}.")
    if k % tp and tp % k:
        raise ConfigError(
            f"{what}={tp} and the model's {k} kv heads do not divide one another, so the kv heads can be "
            f"neither split nor replicated evenly; choose one of {usable}."
        )
    return HeadLayout(tensor=tp, num_heads=n, num_kv_heads=k)


def model_axes(sizes: Mapping[str, int]) -> MeshAxes:
    """The mesh axes dense layers split over, given axis sizes (a MeshConfig's or a mesh's): None, one
    axis, or ("expert", "tensor")."""
    axes = tuple(a for a in MODEL_AXES if sizes.get(a, 1) > 1)
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _split_if(size: int, degree: int, axes: MeshAxes) -> MeshAxes:
    """Split a dimension that divides evenly; replicate it otherwise (costs memory, never correctness)."""
    return axes if degree > 1 and size % degree == 0 else None


def check_expert_parallel(cfg: ModelConfig, ep: int) -> None:
    if ep == 1:
        return
    if not cfg.num_experts:
        raise ConfigError(
            f"expert_parallel_size={ep}, but this model has no experts; use tensor_parallel_size to split a "
            "dense model."
        )
    if cfg.num_experts % ep:
        raise ConfigError(
            f"expert_parallel_size={ep} does not divide the model's {cfg.num_experts} experts; choose one of "
            f"{_divisors(cfg.num_experts)}."
        )


def attention_axes(cfg: ModelConfig, sizes: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes attention heads (and the KV cache) split over: all model axes when the heads divide
    over expert x tensor, else `tensor` alone (attention then runs whole on each expert group, e.g. a small
    model with 4 heads and 8 experts at expert_parallel_size=8). Raises when not even `tensor` works."""
    tp, ep = sizes.get("tensor", 1), sizes.get("expert", 1)
    every = flat_axes(model_axes(sizes))
    if ep > 1:
        try:
            head_layout(cfg, tp * ep)
            return every
        except ConfigError:
            pass
    what = "tensor_parallel_size" if ep == 1 else f"tensor_parallel_size (with expert_parallel_size={ep})"
    head_layout(cfg, tp, what)
    return ("tensor",) if tp > 1 else ()


def _as_axes(axes: tuple[str, ...]) -> MeshAxes:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def mesh_rules(cfg: ModelConfig, mesh_cfg: MeshConfig) -> ShardingRules:
    """The layout of one model on one replica's mesh (see the module docstring); validated, with errors
    naming the numbers, before anything touches a device."""
    sizes = {"tensor": mesh_cfg.tensor, "expert": mesh_cfg.expert}
    check_expert_parallel(cfg, mesh_cfg.expert)
    attn = attention_axes(cfg, sizes)
    layout = head_layout(cfg, math.prod(sizes[a] for a in attn))
    degree = mesh_cfg.tensor * mesh_cfg.expert
    axes = model_axes(sizes)
    expert_ffn = cfg.moe_intermediate_size or cfg.intermediate_size
    return ShardingRules(
        {
            Logical.EMBED: None,
            Logical.Q_HEADS: _as_axes(attn),
            Logical.KV_HEADS: _as_axes(attn) if layout.kv_sharded else None,
            Logical.KV_CACHE_HEADS: _as_axes(attn),
            Logical.HEAD_DIM: None,
            Logical.FFN: _split_if(cfg.intermediate_size, degree, axes),
            Logical.VOCAB: _split_if(cfg.vocab_size, degree, axes),
            Logical.EXPERTS: "expert" if mesh_cfg.expert > 1 else None,
            Logical.EXPERT_FFN: _split_if(expert_ffn, mesh_cfg.tensor, "tensor"),
            Logical.PAGES: None,
            Logical.PAGE_SLOT: None,
        }
    )


def tensor_parallel_rules(cfg: ModelConfig, tp: int) -> ShardingRules:
    """Megatron-style tensor parallelism of a model over `tp` devices (mesh_rules with only a tensor axis)."""
    return mesh_rules(cfg, MeshConfig(tensor=tp))


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


def attention_parallel_size(cfg: ModelConfig, mesh: Mesh | None) -> int:
    """Devices the attention heads (and the cache) split over on `mesh` (see `attention_axes`)."""
    sizes = {} if mesh is None else dict(mesh.shape)
    return math.prod(sizes[a] for a in attention_axes(cfg, sizes))


def cache_heads(cfg: ModelConfig, mesh: Mesh | None) -> int:
    """KV heads the cache holds over `mesh` (more than the model's when KV heads are replicated)."""
    return head_layout(cfg, attention_parallel_size(cfg, mesh)).cache_heads


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
