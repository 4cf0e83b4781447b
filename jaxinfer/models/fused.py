"""Projections that read the same input, stored side by side: q/k/v as one weight, gate/up as one.

Why. A model's q, k and v projections (and an MLP's gate and up) multiply the same activations. Kept apart
they are three (two) matmuls. For float weights XLA's GPU dot merger often joins them, but by reading the
separate weights in place from a split-K Triton GEMM (at 192 decode rows an H200 spent ~1.5 ms of a 16.9 ms
iteration on q/k/v, against ~0.45 ms of bytes), or by copying them side by side on every call. It cannot merge
the Pallas quantized matmul, which is a custom call: a quantized layer ran seven kernels and seven split-K
epilogues where a float one ran four GEMMs. So the engine joins them once, at load.

Layout under tensor parallelism. Each weight's output channels are split over the same mesh axes in
contiguous blocks (device s holds heads s*n/S .. (s+1)*n/S - 1). The joined weight keeps every device's own
columns on that device: its N axis is [S, sum of the parts' per-device widths], device-major, and split over
the same axes, so the join moves no bytes between devices and the product needs no collective. The product
[T, S * W] is then read as [T, S, W] and each part sliced out of W.

A joined weight takes the place of the first part in the layer (`wq`, `w_gate`) as a `FusedColumns`, and
the other parts become None; `head_projections` and `gated_mlp` (models.common) take either form, so the
families' code does not change. Only parts that agree join: all float of one dtype and sharding, or all
quantized in one format (bits, groups, packing, zero points, scale dtype); a GGUF Q4_K_M's Q6_K `attn_v`
stays apart from its Q4_K q and k. Saving a checkpoint splits them again (`split_projections`), so what is
written is the published layout.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels.quantized_matmul import QuantizedWeights

# Fields that join; the first holds the join.
_GROUPS = (("wq", "wk", "wv"), ("w_gate", "w_up"))


@struct.dataclass
class FusedColumns:
    """Column-parallel weights with one input, side by side along N, each device's columns together.

    w: float [K, shards * sum(widths)], or QuantizedWeights with that many output channels ([N, Kp] values).
    """

    w: Any
    widths: tuple[int, ...] = struct.field(pytree_node=False)  # output channels of each part on one device
    shards: int = struct.field(pytree_node=False)  # devices the N axis is split over
    shapes: tuple[tuple[int, ...], ...] = struct.field(pytree_node=False)  # each float part's shape (to split)


def split_outputs(y: jax.Array, fused: FusedColumns) -> list[jax.Array]:
    """The joined product y [T, shards * W] -> each part's output [T, shards * width], in the parts' order."""
    t = y.shape[0]
    y = y.reshape(t, fused.shards, sum(fused.widths))  # [T, S, W]: device s's columns in row s
    outs, start = [], 0
    for width in fused.widths:
        outs.append(y[:, :, start:start + width].reshape(t, fused.shards * width))  # [T, S * width]
        start += width
    return outs


def _shards(a: jax.Array, axis: int) -> int:
    """Devices array `a` is split over along `axis` (its NamedSharding's mesh axes there; 1 if none)."""
    sharding = getattr(a, "sharding", None)
    if not isinstance(sharding, NamedSharding) or axis >= len(sharding.spec) or sharding.spec[axis] is None:
        return 1
    entry = sharding.spec[axis]
    names = entry if isinstance(entry, tuple) else (entry,)
    return int(np.prod([sharding.mesh.shape[n] for n in names]))


def _float_matrix(w: jax.Array) -> jax.Array:
    return w.reshape(w.shape[0], -1)  # [D, N, H] -> [D, N * H]


def _joinable(parts: list[Any]) -> bool:
    first = parts[0]
    if any(p is None for p in parts):
        return False
    if isinstance(first, QuantizedWeights):
        def meta(q: Any) -> Any:
            if not isinstance(q, QuantizedWeights):
                return None
            return (q.bits, q.group_size, q.in_features, q.fp8, q.pack, q.w8a8, q.values.dtype, q.scales.dtype,
                    q.zeros is None, q.values.shape[1:], _spec(q.values), _spec(q.scales))
        return all(meta(p) == meta(first) and meta(p) is not None for p in parts)
    if not isinstance(first, jax.Array):
        return False
    return all(isinstance(p, jax.Array) and p.dtype == first.dtype and p.shape[0] == first.shape[0]
               and p.ndim == first.ndim and _spec(p) == _spec(first) for p in parts)


def _spec(a: jax.Array) -> Any:
    sharding = getattr(a, "sharding", None)
    return sharding.spec if isinstance(sharding, NamedSharding) else None


def _out_sharding(a: jax.Array, spec: P) -> Any:
    sharding = getattr(a, "sharding", None)
    return NamedSharding(sharding.mesh, spec) if isinstance(sharding, NamedSharding) else sharding


def _interleave(arrays: list[jax.Array], axis: int, shards: int) -> jax.Array:
    """Join along `axis`, each array's `shards` contiguous blocks kept together by block: [.., S * sum n_i, ..]."""
    split = [a.reshape(*a.shape[:axis], shards, a.shape[axis] // shards, *a.shape[axis + 1:]) for a in arrays]
    joined = jnp.concatenate(split, axis=axis + 1)  # [.., S, sum n_i / S, ..]
    return joined.reshape(*joined.shape[:axis], -1, *joined.shape[axis + 2:])


def _unleave(joined: jax.Array, axis: int, shards: int, widths: tuple[int, ...]) -> list[jax.Array]:
    """Inverse of `_interleave`: the parts, each [.., S * width, ..] again."""
    blocks = joined.reshape(*joined.shape[:axis], shards, sum(widths), *joined.shape[axis + 1:])
    out, start = [], 0
    for width in widths:
        part = jax.lax.slice_in_dim(blocks, start, start + width, axis=axis + 1)  # [.., S, width, ..]
        out.append(part.reshape(*part.shape[:axis], shards * width, *part.shape[axis + 2:]))
        start += width
    return out


def _join_quantized(parts: list[QuantizedWeights], shards: int) -> QuantizedWeights:
    first = parts[0]
    zeros = None if first.zeros is None else _interleave([p.zeros for p in parts], 1, shards)
    return dataclasses.replace(first, values=_interleave([p.values for p in parts], 0, shards),
                               scales=_interleave([p.scales for p in parts], 1, shards), zeros=zeros)


def _join_float(parts: list[jax.Array], shards: int) -> jax.Array:
    return _interleave([_float_matrix(p) for p in parts], 1, shards)


@functools.lru_cache(maxsize=None)
def _joiner(quantized: bool, shards: int, out: Any) -> Any:
    """One jitted join per (kind, split, output sharding): jax.jit's cache then serves every layer of a shape, where a
    fresh jit per layer traced and compiled again each time (1.5 s for a 30-layer toy model on a CPU)."""
    fn = _join_quantized if quantized else _join_float
    return jax.jit(functools.partial(fn, shards=shards), out_shardings=out)


def join(parts: list[Any], shards: int) -> FusedColumns:
    """Column-parallel weights (float [D, ...] or quantized) -> one FusedColumns on the same devices."""
    first = parts[0]
    if isinstance(first, QuantizedWeights):
        widths = tuple(p.out_features // shards for p in parts)
        # The joined arrays split like the parts (same rank, same axes): values on N (and K), scale rows on N.
        out = jax.tree.map(lambda a: a.sharding, first)
        return FusedColumns(_joiner(True, shards, out)(parts), widths, shards, tuple(() for _ in parts))
    spec = tuple(_spec(first) or ())
    shapes = tuple(tuple(p.shape) for p in parts)
    widths = tuple(_float_matrix(p).shape[1] // shards for p in parts)
    out_spec = P(*(spec + (None, None))[:2])  # [D, N*H]: D's and N's axes (H is never split: _float_heads_ok)
    return FusedColumns(_joiner(False, shards, _out_sharding(first, out_spec))(parts), widths, shards, shapes)


def split(fused: FusedColumns) -> list[Any]:
    """The parts of a FusedColumns, in the published layout (inverse of `join`)."""
    w = fused.w
    if isinstance(w, QuantizedWeights):
        values = _unleave(w.values, 0, fused.shards, fused.widths)
        scales = _unleave(w.scales, 1, fused.shards, fused.widths)
        zeros = [None] * len(values) if w.zeros is None else _unleave(w.zeros, 1, fused.shards, fused.widths)
        return [dataclasses.replace(w, values=v, scales=s, zeros=z) for v, s, z in zip(values, scales, zeros)]
    return [p.reshape(shape) for p, shape in zip(_unleave(w, 1, fused.shards, fused.widths), fused.shapes)]


def _float_heads_ok(parts: list[Any]) -> bool:
    """Float q/k/v [D, N, H] may join only where H is not split (it never is; checked, not assumed)."""
    spec = _spec(parts[0])
    return spec is None or len(spec) < 3 or spec[2] is None


def _free(parts: list[Any], joined: FusedColumns) -> None:
    """Free the parts' device buffers now that the join is done. Without this they live until the caller drops the
    whole tree: the separate and the joined copies of Llama-3-8B's projections (12 GB each) coexisted, and the
    separate ones then left holes of at most 234 MB. The first H100 run of record with joined projections failed in
    warmup (RESOURCE_EXHAUSTED: no 1 GB scratch buffer for XLA's autotuner beside a full KV cache); freed layer by
    layer, so that each hole takes the next layer's join, the same run went clean (docs/PERFORMANCE.md, issue 14)."""
    jax.block_until_ready(joined)
    for leaf in jax.tree.leaves(parts):
        if isinstance(leaf, jax.Array):
            leaf.delete()


def _fuse_node(node: Any, consume: bool) -> Any:
    """A layer (or its dense MLP) with its joinable groups joined; anything else, routed experts included
    (`moe`: their gate and up are [E, D, F] stacks, which the grouped matmul takes apart), unchanged."""
    if not dataclasses.is_dataclass(node) or isinstance(node, (QuantizedWeights, FusedColumns)):
        return node
    changes: dict[str, Any] = {}
    if dataclasses.is_dataclass(getattr(node, "mlp", None)):  # a dense MLP of its own (Qwen3); never the experts
        changes["mlp"] = _fuse_node(node.mlp, consume)
    names = {f.name for f in dataclasses.fields(node)}
    for fields in _GROUPS:
        parts = [getattr(node, f) for f in fields] if set(fields) <= names else []
        # Parts that agree in format and in how they are split (so each device's columns of every part are its own).
        if not parts or not _joinable(parts):
            continue
        if isinstance(parts[0], QuantizedWeights):
            shards, widths = _shards(parts[0].values, 0), [p.out_features for p in parts]
        elif _float_heads_ok(parts):
            shards, widths = _shards(parts[0], 1), [_float_matrix(p).shape[1] for p in parts]
        else:
            continue
        if any(w % shards for w in widths):
            continue
        changes[fields[0]] = join(parts, shards)
        changes.update({f: None for f in fields[1:]})
        if consume:
            _free(parts, changes[fields[0]])
    return dataclasses.replace(node, **changes) if changes else node


def fuse_projections(weights: Any, consume: bool = False) -> Any:
    """A model's weights with every layer's q/k/v and gate/up joined where they agree (module docstring), on the
    devices that hold them. `consume`: free each layer's separate arrays as soon as it is joined (the input tree
    is spent), so the device holds at most one layer's projections twice and no large holes are left behind
    (`_free`); an LLM loads this way."""
    layers = getattr(weights, "layers", None)
    if layers is None:
        return weights
    return dataclasses.replace(weights, layers=tuple(_fuse_node(layer, consume) for layer in layers))


def _split_node(node: Any) -> Any:
    if not dataclasses.is_dataclass(node) or isinstance(node, (QuantizedWeights, FusedColumns)):
        return node
    changes: dict[str, Any] = {}
    for field in dataclasses.fields(node):
        value = getattr(node, field.name)
        if isinstance(value, FusedColumns):
            group = next(fields for fields in _GROUPS if fields[0] == field.name)
            changes.update(dict(zip(group, split(value))))
        elif field.name == "mlp" and dataclasses.is_dataclass(value):
            changes[field.name] = _split_node(value)
    return dataclasses.replace(node, **changes) if changes else node


def split_projections(weights: Any) -> Any:
    """Inverse of `fuse_projections`: every joined weight split back into its parts."""
    layers = getattr(weights, "layers", None)
    if layers is None:
        return weights
    return dataclasses.replace(weights, layers=tuple(_split_node(layer) for layer in layers))


__all__ = ["FusedColumns", "fuse_projections", "join", "split", "split_outputs", "split_projections"]
