"""Turn named checkpoint tensors into a weights pytree, with exhaustive checks and per-tensor placement.

Each model family declares a mapping table: for every weight, the tensor name in each checkpoint format
and the transform from the checkpoint's layout (PyTorch `Linear` is `[out, in]`) to ours. The assembler
walks the family's ParamSpecs, so every expected tensor is looked up, every shape is checked against the
spec, and whatever the checkpoint holds beyond the table is reported as left over.

Tensors are read, converted and placed one at a time: host memory holds at most one full tensor, and each
device receives only its own shard (`jax.make_array_from_callback`).
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxinfer.params import ParamSpec, is_spec
from jaxinfer.sharding import ShardingRules


class CheckpointError(ValueError):
    """The checkpoint does not hold what the model needs (missing, extra, misshapen or unreadable)."""


class Transform(enum.Enum):
    NONE = "none"  # same layout
    LINEAR = "linear"  # [out, in] -> [in, out]
    LINEAR_TO_HEADS = "linear_to_heads"  # [heads*H, D] -> [D, heads, H]
    LINEAR_FROM_HEADS = "linear_from_heads"  # [D, heads*H] -> [heads, H, D]


@dataclasses.dataclass(frozen=True)
class TensorRule:
    """One weight: where it lives in each format and how to bring it to our layout."""

    path: str  # our pytree path with `{i}` for the layer index, e.g. "layers.{i}.wq"
    gguf: str | None  # e.g. "blk.{i}.attn_q.weight"
    hf: str | None  # e.g. "model.layers.{i}.self_attn.q_proj.weight"
    transform: Transform = Transform.NONE
    gguf_unpermute: str | None = None  # "q" or "k": undo llama.cpp's rotary row interleave
    # Added to the tensor when it comes from a GGUF file. llama.cpp's Gemma converter stores norm multipliers
    # as 1 + w where HF stores w, so Gemma's norm rules set -1.0 and weights stay in HF's convention.
    gguf_add: float = 0.0


def to_our_layout(w: np.ndarray, transform: Transform, spec_shape: tuple[int, ...]) -> np.ndarray:
    """Apply a layout transform; shapes come from the spec so a wrong checkpoint shape fails loudly."""
    if transform is Transform.NONE:
        return w
    if transform is Transform.LINEAR:
        return w.T
    if transform is Transform.LINEAR_TO_HEADS:
        d, heads, h = spec_shape
        return w.reshape(heads, h, d).transpose(2, 0, 1)  # [heads*H, D] -> [D, heads, H]
    heads, h, d = spec_shape
    return w.reshape(d, heads, h).transpose(1, 2, 0)  # [D, heads*H] -> [heads, H, D]


def expected_source_shape(transform: Transform, spec_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The checkpoint-side shape a tensor must have to become `spec_shape`."""
    if transform is Transform.NONE:
        return spec_shape
    if transform is Transform.LINEAR:
        return spec_shape[::-1]
    if transform is Transform.LINEAR_TO_HEADS:
        d, heads, h = spec_shape
        return (heads * h, d)
    heads, h, d = spec_shape
    return (d, heads * h)


def _flatten_with_paths(specs: Any) -> list[tuple[str, ParamSpec]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
    out = []
    for key_path, spec in flat:
        parts = []
        for k in key_path:
            parts.append(str(getattr(k, "name", getattr(k, "idx", getattr(k, "key", k)))))
        out.append((".".join(parts), spec))
    return out


def _rule_for(path: str, rules: list[TensorRule]) -> tuple[TensorRule, dict[str, str]]:
    for rule in rules:
        pattern = "^" + re.escape(rule.path).replace(r"\{i\}", r"(?P<i>\d+)") + "$"
        m = re.match(pattern, path)
        if m:
            return rule, m.groupdict()
    raise CheckpointError(f"No checkpoint mapping declared for weight {path!r} (a bug in the model table).")


@dataclasses.dataclass
class TensorSource:
    """A checkpoint seen as named tensors: `read(name)` returns float32/bf16 numpy in checkpoint layout."""

    description: str  # for messages, e.g. the file path
    names: set[str]
    shape_of: Callable[[str], tuple[int, ...]]
    read: Callable[[str], np.ndarray]
    ignorable: Callable[[str], bool] = lambda name: False


def assemble_weights(
    specs: Any,
    rules: list[TensorRule],
    source: TensorSource,
    fmt: str,
    mesh: Mesh,
    sharding_rules: ShardingRules,
    postprocess: Callable[[str, TensorRule, np.ndarray], np.ndarray] | None = None,
) -> Any:
    """Build the weights pytree from `source` (fmt: "gguf" or "hf"), checking names and shapes exhaustively."""
    leaves = _flatten_with_paths(specs)
    plan = []
    for path, spec in leaves:
        rule, groups = _rule_for(path, rules)
        template = getattr(rule, fmt)
        if template is None:
            raise CheckpointError(f"Weight {path!r} has no {fmt} name in the mapping table.")
        plan.append((path, spec, rule, template.format(**groups)))
    _check_names_and_shapes(plan, source)
    arrays = []
    for path, spec, rule, name in plan:
        w = source.read(name)
        if postprocess is not None:
            w = postprocess(path, rule, w)
        w = np.ascontiguousarray(to_our_layout(w, rule.transform, spec.shape)).astype(spec.dtype)
        arrays.append(_place(w, sharding_rules.sharding(mesh, spec.logical_axes)))
    _, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    return jax.tree.unflatten(treedef, arrays)


def _check_names_and_shapes(plan: list[tuple[str, ParamSpec, TensorRule, str]], source: TensorSource) -> None:
    missing = [name for _, _, _, name in plan if name not in source.names]
    if missing:
        shown = ", ".join(missing[:5]) + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
        raise CheckpointError(f"{source.description}: missing tensor(s) {shown}.")
    for path, spec, rule, name in plan:
        want = expected_source_shape(rule.transform, spec.shape)
        got = tuple(source.shape_of(name))
        if got != want:
            raise CheckpointError(
                f"{source.description}: tensor {name!r} has shape {list(got)} but the model config needs "
                f"{list(want)} (for weight {path})."
            )
    used = {name for *_, name in plan}
    extra = sorted(n for n in source.names - used if not source.ignorable(n))
    if extra:
        shown = ", ".join(extra[:5]) + (f" (and {len(extra) - 5} more)" if len(extra) > 5 else "")
        raise CheckpointError(f"{source.description}: unexpected tensor(s) {shown} that the model does not use.")


def _place(w: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """Each device gets only its own slice of the host tensor."""
    return jax.make_array_from_callback(w.shape, sharding, lambda index: w[index])

