"""See the mesh: what is where, how much of it each device holds, and what crosses devices per step.

`describe_engine` reads everything from live objects: the mesh, the weights' and cache's shardings and
their shards on this process's devices, and the compiled step executables (warmup compiled them already,
so describing costs no compile). `count_collectives` parses compiled HLO text; the collective-count tests
use it to keep tensor parallelism from gathering weights or the KV cache.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any

import jax

from jaxinfer.engine.runner import DECODE_KINDS

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# `%name = f32[16,64]{1,0} all-reduce(` or an async `all-reduce-start(`, tuple results included.
_OP = re.compile(r"= (\([^)]*\)|\S+) (" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_SHAPE = re.compile(r"([a-z]+\d*)\[([\d,]*)\]")
_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2,
               "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def _shapes(result: str) -> list[tuple[str, tuple[int, ...]]]:
    """`f32[16,64]{1,0}` or a tuple of them -> [(dtype, dims)]."""
    return [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in _SHAPE.findall(result)]


def collective_ops(hlo_text: str) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
    """Every collective in compiled HLO text: [(kind, result shapes)], in text order. A loop body appears
    once, so the ops of a multi-step decode call are those of one iteration (plus any outside the loop)."""
    return [(kind, _shapes(result)) for result, kind in _OP.findall(hlo_text)]


def count_collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """{kind: {"count": n, "bytes": result bytes summed}} for the collectives in the HLO."""
    counts: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    for kind, shapes in collective_ops(hlo_text):
        counts[kind] += 1
        sizes[kind] += sum(_ITEM_BYTES.get(t, 4) * math.prod(d) for t, d in shapes)
    return {k: {"count": counts[k], "bytes": sizes[k]} for k in counts}


def _group_path(path: tuple[Any, ...]) -> str:
    """A weight's tree path with layer indices folded: layers.3.wq -> layers.*.wq."""
    parts = []
    for k in path:
        name = getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))
        parts.append("*" if isinstance(name, int) else str(name))
    return ".".join(parts)


def _bytes_on_device(tree: Any, device: jax.Device) -> int:
    return sum(s.data.nbytes for a in jax.tree.leaves(tree) for s in a.addressable_shards if s.device == device)


def param_groups(weights: Any) -> dict[str, str]:
    """{weight group: its PartitionSpec} with the layers folded together."""
    flat, _ = jax.tree_util.tree_flatten_with_path(weights)
    return {_group_path(path): str(a.sharding.spec) for path, a in flat}


def per_device_bytes(tree: Any) -> int:
    """The most bytes of `tree` any of this process's devices holds."""
    devices = {s.device for a in jax.tree.leaves(tree) for s in a.addressable_shards}
    return max((_bytes_on_device(tree, d) for d in devices), default=0)


def decode_step_collectives(runner: Any) -> dict[str, dict[str, int]] | None:
    """Collectives of the smallest compiled decode executable (one multi-step iteration), else of the
    smallest single step; None before warmup."""
    if not runner._executables:
        return None
    by_kind = sorted(runner._executables.items(), key=lambda kv: (kv[0][0] not in DECODE_KINDS, str(kv[0][1])))
    return count_collectives(by_kind[0][1].as_text())


def describe_engine(engine: Any) -> dict[str, Any]:
    """The mesh and memory picture of one engine replica."""
    runner = engine.runner
    mesh = runner.mesh
    return {
        "mesh": {name: int(size) for name, size in mesh.shape.items()},
        "devices": [str(d) for d in mesh.devices.flat],
        "param_shardings": param_groups(runner.weights),
        "weight_bytes_per_device": per_device_bytes(runner.weights),
        "kv_cache_bytes_per_device": per_device_bytes(runner.kv_cache),
        "kv_cache_sharding": str(runner.kv_cache.k[0].sharding.spec),
        "num_pages": runner.kv_cache.num_pages,
        "page_size": runner.kv_cache.page_size,
        "collectives_per_decode_step": decode_step_collectives(runner),
    }


def format_description(desc: dict[str, Any]) -> str:
    """A few human lines (what the CLI prints at start)."""
    gib = 1 << 30
    mesh = " x ".join(f"{k}={v}" for k, v in desc["mesh"].items())
    lines = [
        f"mesh: {mesh} over {len(desc['devices'])} device(s); {desc.get('data_parallel_size', 1)} replica(s), "
        f"{desc.get('process_count', 1)} process(es)",
        f"per device: weights {desc['weight_bytes_per_device'] / gib:.2f} GiB, KV cache "
        f"{desc['kv_cache_bytes_per_device'] / gib:.2f} GiB ({desc['num_pages']} pages of {desc['page_size']} "
        f"tokens, sharding {desc['kv_cache_sharding']})",
    ]
    coll = desc.get("collectives_per_decode_step")
    if coll:
        lines.append("collectives per decode step: " + ", ".join(
            f"{v['count']} {k} ({v['bytes'] / 1024:.0f} KiB)" for k, v in sorted(coll.items())))
    elif coll is not None:
        lines.append("collectives per decode step: none")
    specs = Counter(desc["param_shardings"].values())
    lines.append("weight shardings: " + ", ".join(f"{n} x {spec}" for spec, n in specs.most_common()))
    return "\n".join(lines)


__all__ = ["COLLECTIVES", "collective_ops", "count_collectives", "describe_engine", "format_description",
           "param_groups", "per_device_bytes"]
