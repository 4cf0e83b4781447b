"""Turn named checkpoint tensors into a weights pytree, with exhaustive checks and per-tensor placement.

Each model family declares a mapping table: for every weight, the tensor name in each checkpoint format
and the transform from the checkpoint's layout (PyTorch `Linear` is `[out, in]`) to ours. The assembler
walks the family's ParamSpecs, so every expected tensor is looked up, every shape is checked against the
spec, and whatever the checkpoint holds beyond the table is reported as left over.

Tensors are read, converted and placed one at a time: host memory holds at most one full tensor, and each
device receives only its own shard (`jax.make_array_from_callback`).

Expert weights (a ParamSpec whose leading logical axis is EXPERTS, shape [E, ...]) come either as one
tensor per expert, named with an `{e}` placeholder and stacked here (HF's published per-expert layout), or
as one tensor with the experts already stacked first (GGUF `ffn_*_exps`, transformers 5's fused
`experts.gate_up_proj`); either way a rule's transform applies to each expert's slice. A `Part` names one
equal chunk of a fused tensor (gate and up projections saved as one). A rule may list several sources for a
format; the first one the checkpoint holds completely is used, and whatever it does not use is reported
as left over, so a checkpoint mixing layouts or missing one expert still fails with the names.
Host memory for an expert weight is one layer's experts of that weight (about twice that while stacking).

Quantized weights (a `plan`, jaxinfer.quantization): a planned weight is read like any other and
quantized on the host, one tensor at a time; a format that stores the checkpoint's own blocks (GGUF)
instead hands back integer codes and scales (`TensorSource.read_quantized`), whose rows are already
the kernels' output channels, so that weight never exists in float anywhere.
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
from jaxinfer.quantization import Plan, QFormat, place_quantized, quantize_host, quantized_spec, to_values
from jaxinfer.sharding import Logical, ShardingRules


class CheckpointError(ValueError):
    """The checkpoint does not hold what the model needs (missing, extra, misshapen or unreadable)."""


class Transform(enum.Enum):
    NONE = "none"  # same layout
    LINEAR = "linear"  # [out, in] -> [in, out]
    LINEAR_TO_HEADS = "linear_to_heads"  # [heads*H, D] -> [D, heads, H]
    LINEAR_FROM_HEADS = "linear_from_heads"  # [D, heads*H] -> [heads, H, D]


@dataclasses.dataclass(frozen=True)
class Part:
    """Chunk `index` of `parts` equal chunks along `axis` of a fused checkpoint tensor.

    For expert weights `axis` counts within one expert's slice: transformers 5 saves each layer's experts'
    gate and up projections as `experts.gate_up_proj` [E, 2F, D] (gate first), so the gate is
    `Part(name, 0, 2)` and the up projection `Part(name, 1, 2)`, both along axis 0 of [2F, D].
    """

    name: str
    index: int
    parts: int
    axis: int = 0


Source = str | Part  # a tensor name template ({i} layer, {e} expert) or a chunk of one


@dataclasses.dataclass(frozen=True)
class TensorRule:
    """One weight: where it lives in each format and how to bring it to our layout."""

    path: str  # our pytree path with `{i}` for the layer index, e.g. "layers.{i}.wq"
    gguf: Source | tuple[Source, ...] | None  # e.g. "blk.{i}.attn_q.weight"; a tuple lists alternatives
    hf: Source | tuple[Source, ...] | None  # e.g. "model.layers.{i}.self_attn.q_proj.weight"
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


def _span(index: slice, size: int) -> tuple[int, int]:
    start, stop, step = index.indices(size)
    if step != 1:
        raise ValueError("shard indices are contiguous")
    return start, stop


def source_block(transform: Transform, spec_shape: tuple[int, ...],
                 index: tuple[slice, ...]) -> tuple[tuple[slice, ...], tuple[int, ...]]:
    """The checkpoint-layout block that holds our-layout block `index` (one shard of the weight), and that
    block's own spec shape, so `to_our_layout(w[block], transform, shape)` is exactly `ours[index]`.

    A head axis is only ever split at whole heads (head_dim is never sharded), so each shard maps to one
    contiguous row or column range of the checkpoint tensor."""
    spans = [_span(i, n) for i, n in zip(index, spec_shape)]
    shape = tuple(b - a for a, b in spans)
    if transform is Transform.NONE:
        return tuple(slice(a, b) for a, b in spans), shape
    if transform is Transform.LINEAR:
        return tuple(slice(a, b) for a, b in reversed(spans)), shape
    if transform is Transform.LINEAR_TO_HEADS:  # ours [D, heads, H] <- [heads*H, D]
        (d0, d1), (h0, h1), _ = spans
        h = spec_shape[2]
        return (slice(h0 * h, h1 * h), slice(d0, d1)), shape
    (h0, h1), _, (d0, d1) = spans  # ours [heads, H, D] <- [D, heads*H]
    h = spec_shape[1]
    return (slice(d0, d1), slice(h0 * h, h1 * h)), shape


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


@dataclasses.dataclass(frozen=True)
class _Planned:
    """One weight of the model resolved to the checkpoint tensor(s) that hold it."""

    path: str
    spec: ParamSpec
    rule: TensorRule
    names: tuple[str, ...]  # one tensor, or one per expert
    part: Part | None
    experts: int | None  # E when the spec's leading axis is EXPERTS (the transform then applies per expert)
    per_expert: bool  # names are one tensor per expert (else one tensor, experts stacked first if any)

    def source_shape(self) -> tuple[int, ...]:
        """The shape each named checkpoint tensor must have."""
        inner = self.spec.shape[1:] if self.experts is not None else self.spec.shape
        shape = list(expected_source_shape(self.rule.transform, inner))
        if self.part is not None:
            shape[self.part.axis] *= self.part.parts
        stacked = self.experts is not None and not self.per_expert
        return (self.experts, *shape) if stacked else tuple(shape)

    def to_our_layout(self, tensors: list[np.ndarray]) -> np.ndarray:
        """Checkpoint tensors (postprocessed) -> one array of the spec's shape."""
        if self.experts is None:
            return to_our_layout(_take_part(tensors[0], self.part), self.rule.transform, self.spec.shape)
        slices = tensors if self.per_expert else list(tensors[0])  # one [.., ..] per expert
        inner = self.spec.shape[1:]
        return np.stack([to_our_layout(_take_part(w, self.part), self.rule.transform, inner) for w in slices])


def _take_part(w: np.ndarray, part: Part | None) -> np.ndarray:
    return w if part is None else np.split(w, part.parts, axis=part.axis)[part.index]


def _expand(source: Source, groups: dict[str, str], experts: int | None) -> tuple[tuple[str, ...], Part | None]:
    """A source's concrete tensor names (one per expert when it has `{e}`) and its chunk, if any."""
    part = source if isinstance(source, Part) else None
    template = part.name if part is not None else source
    for key, value in groups.items():
        template = template.replace("{" + key + "}", value)
    if "{e}" not in template:
        return (template,), part
    if experts is None:
        raise CheckpointError(f"Tensor name {template!r} has an {{e}} placeholder but its weight has no experts axis "
                              "(a bug in the model table).")
    return tuple(template.replace("{e}", str(e)) for e in range(experts)), part


def _plan_one(path: str, spec: ParamSpec, rule: TensorRule, groups: dict[str, str], fmt: str,
              present: set[str]) -> _Planned:
    """Resolve a weight to the first source the checkpoint holds completely (else the most complete one)."""
    sources = getattr(rule, fmt)
    if sources is None:
        raise CheckpointError(f"Weight {path!r} has no {fmt} name in the mapping table.")
    experts = spec.shape[0] if spec.logical_axes and spec.logical_axes[0] is Logical.EXPERTS else None
    options = [(src, *_expand(src, groups, experts)) for src in (sources if isinstance(sources, tuple) else (sources,))]

    def completeness(option: tuple[Source, tuple[str, ...], Part | None]) -> tuple[bool, int]:
        found = sum(n in present for n in option[1])
        return found == len(option[1]), found

    src, names, part = max(options, key=completeness)  # max keeps the first of equals: table order decides
    template = src.name if isinstance(src, Part) else src
    return _Planned(path, spec, rule, names, part, experts, per_expert="{e}" in template)


def _rule_for(path: str, rules: list[TensorRule]) -> tuple[TensorRule, dict[str, str]]:
    for rule in rules:
        pattern = "^" + re.escape(rule.path).replace(r"\{i\}", r"(?P<i>\d+)") + "$"
        m = re.match(pattern, path)
        if m:
            return rule, m.groupdict()
    raise CheckpointError(f"No checkpoint mapping declared for weight {path!r} (a bug in the model table).")


@dataclasses.dataclass
class TensorSource:
    """A checkpoint seen as named tensors: `read(name)` returns float32/bf16 numpy in checkpoint layout;
    `read_block(name, index)`, where the format can read part of a tensor, only that block."""

    description: str  # for messages, e.g. the file path
    names: set[str]
    shape_of: Callable[[str], tuple[int, ...]]
    read: Callable[[str], np.ndarray]
    ignorable: Callable[[str], bool] = lambda name: False
    read_block: Callable[[str, tuple[slice, ...]], np.ndarray] | None = None
    # (name, format) -> (codes [rows, K] int8, scales [rows, G], zeros or None) when the checkpoint stores
    # the tensor in blocks that map onto `format` exactly; None: read it as floats and quantize.
    read_quantized: Callable[[str, QFormat], tuple[np.ndarray, np.ndarray, np.ndarray | None] | None] | None = None


def assemble_weights(
    specs: Any,
    rules: list[TensorRule],
    source: TensorSource,
    fmt: str,
    mesh: Mesh,
    sharding_rules: ShardingRules,
    postprocess: Callable[[str, TensorRule, np.ndarray], np.ndarray] | None = None,
    quant_plan: Plan | None = None,
) -> Any:
    """Build the weights pytree from `source` (fmt: "gguf" or "hf"), checking names and shapes exhaustively.

    `specs` are the float specs; weights named in `quant_plan` come out quantized (module docstring), and
    `postprocess` then also reorders the rows of codes and scales (GGUF's rotary un-permute)."""
    quant_plan = quant_plan or {}
    plan = plan_sources(specs, rules, source.names, fmt)
    _check_names_and_shapes(plan, source)
    arrays = []
    for p in plan:
        if p.path in quant_plan:
            arrays.append(_quantized(p, quant_plan[p.path], source, postprocess, mesh, sharding_rules))
            continue
        sharding = sharding_rules.sharding(mesh, p.spec.logical_axes)
        if _reads_blocks(p, source, sharding, postprocess):
            arrays.append(_place_blocks(p, source, sharding))
            continue
        w = _read_ours(p, source, postprocess).astype(p.spec.dtype)
        arrays.append(_place(w, sharding))
    _, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    return jax.tree.unflatten(treedef, arrays)


def plan_sources(specs: Any, rules: list[TensorRule], names: set[str], fmt: str) -> list[_Planned]:
    """Every weight resolved to the checkpoint tensor(s) that hold it (not yet checked)."""
    plan = []
    for path, spec in _flatten_with_paths(specs):
        rule, groups = _rule_for(path, rules)
        plan.append(_plan_one(path, spec, rule, groups, fmt, names))
    return plan


def _read_ours(p: _Planned, source: TensorSource, postprocess: Any) -> np.ndarray:
    """One weight as floats in our layout (host memory: its checkpoint tensors, then the result)."""
    tensors = [source.read(name) for name in p.names]
    if postprocess is not None:
        tensors = [postprocess(p.path, p.rule, w) for w in tensors]
    return np.ascontiguousarray(p.to_our_layout(tensors))


def _quantized(p: _Planned, qfmt: QFormat, source: TensorSource, postprocess: Any, mesh: Mesh,
               sharding_rules: ShardingRules) -> Any:
    """One planned weight, quantized: the checkpoint's own blocks when they map exactly, else its floats."""
    qspec = quantized_spec(p.spec, qfmt)
    decoded = None
    if source.read_quantized is not None and p.experts is None and p.part is None:
        decoded = source.read_quantized(p.names[0], qfmt)
    if decoded is None:
        arrays = quantize_host(_read_ours(p, source, postprocess).astype(np.float32), p.spec, qfmt)
    else:
        codes, scales, zeros = decoded
        if postprocess is not None:  # row reorders (GGUF's rotary un-permute) apply to codes and scales alike
            codes, scales = postprocess(p.path, p.rule, codes), postprocess(p.path, p.rule, scales)
            zeros = None if zeros is None else postprocess(p.path, p.rule, zeros)
        arrays = (to_values(codes, qfmt), scales.T, None if zeros is None else zeros.T)
    return place_quantized(arrays, qspec, mesh, sharding_rules)


def _check_names_and_shapes(plan: list[_Planned], source: TensorSource) -> None:
    missing = list(dict.fromkeys(name for p in plan for name in p.names if name not in source.names))
    if missing:
        shown = ", ".join(missing[:5]) + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
        raise CheckpointError(f"{source.description}: missing tensor(s) {shown}.")
    for p in plan:
        want = p.source_shape()
        for name in p.names:
            got = tuple(source.shape_of(name))
            if got != want:
                raise CheckpointError(
                    f"{source.description}: tensor {name!r} has shape {list(got)} but the model config needs "
                    f"{list(want)} (for weight {p.path})."
                )
    used = {name for p in plan for name in p.names}
    extra = sorted(n for n in source.names - used if not source.ignorable(n))
    if extra:
        shown = ", ".join(extra[:5]) + (f" (and {len(extra) - 5} more)" if len(extra) > 5 else "")
        raise CheckpointError(f"{source.description}: unexpected tensor(s) {shown} that the model does not use.")


def _place(w: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """Each device gets only its own slice of the host tensor."""
    return jax.make_array_from_callback(w.shape, sharding, lambda index: w[index])


def _reads_blocks(p: _Planned, source: TensorSource, sharding: jax.sharding.Sharding, postprocess: Any) -> bool:
    """Read only this process's shards when the weight spans processes (a multi-host model: no host should
    read every byte of the checkpoint) and the format can read a block of a plain, whole tensor."""
    simple = p.experts is None and p.part is None and postprocess is None and source.read_block is not None
    return simple and not sharding.is_fully_addressable


def _place_blocks(p: _Planned, source: TensorSource, sharding: jax.sharding.Sharding) -> jax.Array:
    """Each addressable device's shard read straight from the checkpoint block that holds it."""
    name, shape, transform = p.names[0], p.spec.shape, p.rule.transform

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        block, block_shape = source_block(transform, shape, index)
        w = to_our_layout(source.read_block(name, block), transform, block_shape)
        return np.ascontiguousarray(w).astype(p.spec.dtype)

    return jax.make_array_from_callback(shape, sharding, shard)

