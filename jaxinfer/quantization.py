"""Quantized weights: which weights are quantized and how (a plan), their ParamSpecs, host quantization.

A quantized weight is a small pytree declared through ParamSpecs like any weight (DESIGN.md): a float
weight's spec becomes a `QuantizedWeights` (pallas_kernels.quantized_matmul) or, for MoE experts, a
`QuantizedExperts` (pallas_kernels.grouped_matmul) whose array fields are ParamSpecs. So
`abstract_params`, `init_params`, `param_shardings`, `jax.eval_shape` and orbax restore work on the
quantized tree unchanged, and each array field carries logical axes, so it is sharded like its float
weight: the output channels like the float weight's output axis, K like its input axis.

The plan (`Plan`, weight path -> `QFormat`) is the one description of a quantized model:
* `method_plan`: quantization="int8" | "int4" | "fp8" over a float model's specs;
* GGUF "auto" (jaxinfer.checkpoint.gguf_repack): each tensor's nearest kernel format;
* orbax: the plan saved beside the checkpoint (`jaxinfer convert --quantization ...`).

Formats: int8 symmetric per output channel ("int8:G": groups of G); int4 asymmetric (a scale and a zero
point per group) in groups of 32 by default ("int4:G" to choose), since int4's 16 levels over +-absmax
waste about one of its four bits on every group whose values are not centred, and wider groups let one
large value coarsen 127 others. Measured on SmolLM2 (docs/QUANTIZATION.md): top-1 agreement 61-69%
symmetric or asymmetric in groups of 64/128, 98.5% asymmetric in groups of 32 (llama.cpp's Q4 blocks are
32 wide for the same reason). int4's scales and zero points are fp16 (codes are chosen against the rounded
numbers): in fp32 they were a third of the bytes of a weight in groups of 32. Groups of 128 cost less scale
traffic on GPU: "int4:128" where speed matters more. fp8: e4m3 per channel with per-row e4m3 activations (W8A8).

Which weights: every matrix of a linear layer, the embedding table and the LM head; not norms, not
the MoE router (its logits pick the experts; it is tiny). In int4 and fp8 modes the embedding and
the LM head are int8 per channel (as llama.cpp's Q4_K_M keeps the output layer at 6 bits): the
logits are where 4-bit or e4m3 rounding shows first, and they are a small share of the bytes.

Matrix view of a float weight spec (letters: docs/ARCHITECTURE.md): its `fan_in_axes` are K and come
first, the other axes are the output channels N (`wq [D, N, H]` is K = D, N = N*H; `wo [N, H, D]` is
K = N*H, N = D). Values are stored output-major `[N, K]`, so a checkpoint's `[out, in]` rows (GGUF
and HF both) are the values' rows. The embedding `[V, D]` (no fan-in: a row lookup) is K = D, N = V,
and its values `[V, D]` serve both the lookup (rows) and a tied LM head (the matmul).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels.grouped_matmul.reference import QuantizedExperts
from pallas_kernels.quantized_matmul.reference import (NATURAL_PACK, PACK_CHUNK, SMALL_GROUPS, QuantizedWeights,
                                                        check_group_size, default_pack)
from jaxinfer.params import Init, ParamSpec, is_spec
from jaxinfer.sharding import Logical

METHODS = ("auto", "none", "int8", "int4", "fp8")
DEFAULT_INT4_GROUPS = (32,)  # int4's default group (module docstring: why 32); "int4:G" chooses another
_CODE_STD = {"int8": 73.6, "int4": 4.32, "fp8": 64.0}  # spread of Init.CODES' random codes
_SCALE_DTYPES = {"float32": jnp.float32, "float16": jnp.float16}


class QuantizationError(ValueError):
    """A quantization setting the model cannot take (names the weight and the format)."""


@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    """`quantization=` as parsed: a method and, for int8/int4, an optional group size ("int4:64")."""

    method: str = "auto"
    group_size: int | None = None

    @classmethod
    def parse(cls, value: str | None) -> QuantizationConfig:
        """None / "gguf" (older spelling) -> auto; "int4:64" -> int4 in groups of 64. Raises ValueError."""
        if value is None or value == "gguf":
            return cls("auto")
        method, _, group = str(value).partition(":")
        if method not in METHODS:
            raise ValueError(f"unknown quantization method {method!r}")
        if not group:
            return cls(method)
        if method not in ("int8", "int4") or not group.isdigit():
            raise ValueError(f"a group size ({value!r}) needs int8 or int4 and a number")
        check_group_size(8 if method == "int8" else 4, int(group))
        return cls(method, int(group))

    @property
    def quantizes(self) -> bool:
        """Whether float weights are quantized at load (auto and none keep a float model float)."""
        return self.method in ("int8", "int4", "fp8")

    def __str__(self) -> str:
        return self.method if self.group_size is None else f"{self.method}:{self.group_size}"


@dataclasses.dataclass(frozen=True)
class QFormat:
    """How one weight is stored: a kernel format (pallas_kernels.quantized_matmul.reference)."""

    bits: int = 8
    group: int | None = None  # K elements per scale; None: one scale per output channel
    fp8: bool = False
    w8a8: bool = False
    zeros: bool = False  # a per-group offset (GGUF minimums, or asymmetric quantization)
    scale_dtype: str = "float32"  # "float16" where every scale is exactly one (GGUF legacy blocks)
    pack: int | None = None  # int4 packing chunk; None: reference.default_pack
    experts: bool = False  # a QuantizedExperts (MoE): 8-bit, per channel only

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> QFormat:
        return cls(**d)

    def describe(self) -> str:
        kind = "fp8 W8A8" if self.w8a8 else "fp8" if self.fp8 else f"int{self.bits}"
        scales = f"groups of {self.group}" if self.group else "per channel"
        return f"{kind} ({scales}{', zero points' if self.zeros else ''})"


Plan = dict[str, QFormat]  # weight path ("layers.3.wq") -> format; weights not listed stay float


# ----------------------------------------------------------------------------- matrix view of specs


@dataclasses.dataclass(frozen=True)
class MatrixView:
    """A float weight spec seen as the [K, N] matrix a kernel multiplies by."""

    k: int
    n: int
    in_axis: Logical | None  # the logical axis K is sharded like
    out_axis: Logical | None  # ... and N
    experts: int | None = None  # E for [E, K, N] expert weights
    embedding: bool = False


def _first(axes: tuple[Logical | None, ...]) -> Logical | None:
    return next((a for a in axes if a is not None), None)


def matrix_view(spec: ParamSpec) -> MatrixView | None:
    """The [K, N] view of a quantizable weight spec; None for what stays float (norms, the router)."""
    if spec.init is not Init.NORMAL or len(spec.shape) < 2 or None in spec.logical_axes:
        return None
    axes, shape = spec.logical_axes, spec.shape
    if axes[0] is Logical.EXPERTS:  # [E, K, N], K = fan_in axis 1
        return MatrixView(shape[1], shape[2], axes[1], axes[2], experts=shape[0])
    if not spec.fan_in_axes:  # embedding [V, D]: a row per token
        return MatrixView(shape[1], shape[0], axes[1], axes[0], embedding=True)
    k_axes = spec.fan_in_axes
    if k_axes != tuple(range(len(k_axes))):
        return None
    n_axes = tuple(range(len(k_axes), len(shape)))
    return MatrixView(math.prod(shape[a] for a in k_axes), math.prod(shape[a] for a in n_axes),
                      _first(tuple(axes[a] for a in k_axes)), _first(tuple(axes[a] for a in n_axes)))


def flatten_specs(specs: Any) -> list[tuple[str, Any]]:
    """(dotted path, leaf) for every weight: a ParamSpec, or a quantized weight's spec tree as one leaf."""
    flat, _ = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_weight_leaf)
    out = []
    for key_path, leaf in flat:
        parts = [str(getattr(k, "name", getattr(k, "idx", getattr(k, "key", k)))) for k in key_path]
        out.append((".".join(parts), leaf))
    return out


def is_weight_leaf(x: Any) -> bool:
    return is_spec(x) or isinstance(x, QuantizedWeights | QuantizedExperts)


# ----------------------------------------------------------------------------- plans


def _head_paths(specs: Any) -> set[str]:
    """The embedding and the LM head: the weights whose N is the vocabulary."""
    return {path for path, s in flatten_specs(specs) if is_spec(s) and Logical.VOCAB in s.logical_axes}


def method_plan(specs: Any, config: QuantizationConfig) -> Plan:
    """The plan of quantization="int8" | "int4" | "fp8" over a float model's specs (module docstring)."""
    if not config.quantizes:
        return {}
    heads = _head_paths(specs)
    plan = {}
    for path, spec in flatten_specs(specs):
        view = matrix_view(spec) if is_spec(spec) else None
        if view is None:
            continue
        if view.experts is not None:  # grouped_matmul's quantized experts: 8-bit per channel
            plan[path] = QFormat(8, fp8=config.method == "fp8", experts=True)
        elif path in heads and config.method != "int8":
            plan[path] = QFormat(8)
        elif config.method == "fp8":
            plan[path] = QFormat(8, fp8=True, w8a8=True)
        elif config.method == "int8":
            plan[path] = QFormat(8, config.group_size)
        else:  # asymmetric: int4's 16 levels span each group's [min, max] rather than +-absmax. Scales and
            # zero points in fp16: in fp32 they were a third of an int4 g32 weight's bytes.
            plan[path] = QFormat(4, _int4_group(path, view.k, config.group_size), zeros=True, scale_dtype="float16")
    return plan


def _int4_group(path: str, k: int, group: int | None) -> int:
    if group is not None:
        return group  # checked against K in check_plan
    for g in DEFAULT_INT4_GROUPS:
        if k % g == 0:
            return g
    raise QuantizationError(f"quantization='int4': weight {path} has K = {k}, which no int4 group size "
                            f"({', '.join(map(str, DEFAULT_INT4_GROUPS))}) divides.")


def plan_to_json(plan: Plan) -> dict[str, Any]:
    return {path: fmt.to_json() for path, fmt in sorted(plan.items())}


def plan_from_json(data: dict[str, Any]) -> Plan:
    return {path: QFormat.from_json(fmt) for path, fmt in data.items()}


def check_plan(specs: Any, plan: Plan, shards: dict[Logical, int] | None = None) -> None:
    """Every planned weight fits its format, whole and in each device's shard; else a
    QuantizationError naming the weight and the format. `shards`: devices each logical axis splits over."""
    shards = shards or {}
    by_path = dict(flatten_specs(specs))
    unknown = sorted(set(plan) - set(by_path))
    if unknown:
        raise QuantizationError(f"quantization plan names weight(s) the model does not have: {', '.join(unknown[:5])}")
    for path, fmt in plan.items():
        view = matrix_view(by_path[path])
        if view is None:
            raise QuantizationError(f"weight {path} cannot be quantized (it is not a matrix of a linear layer).")
        _check_one(path, fmt, view, shards.get(view.in_axis, 1))


def _check_one(path: str, fmt: QFormat, view: MatrixView, k_shards: int) -> None:
    what = f"weight {path} ({fmt.describe()}, K = {view.k})"
    try:
        check_group_size(fmt.bits, fmt.group, fmt.fp8)
    except ValueError as e:
        raise QuantizationError(f"{what}: {e}.") from None
    if fmt.experts and (fmt.group is not None or fmt.bits != 8):
        raise QuantizationError(f"{what}: MoE experts are quantized 8-bit per channel only.")
    unit = math.lcm(32, fmt.group or 1)
    if fmt.bits == 4:
        unit = math.lcm(unit, _pack(fmt, view.k // k_shards))
    if view.k % unit:
        raise QuantizationError(f"{what}: K must be a multiple of {unit} (the group size, 32 and the int4 "
                                "packing chunk); choose a group size that divides K.")
    if k_shards > 1 and (view.k // k_shards) % unit:
        raise QuantizationError(
            f"{what}: each of the {k_shards} devices it is split over holds K = {view.k // k_shards}, not a "
            f"multiple of {unit}; choose a smaller group size or another tensor_parallel_size.")


# Backends whose int4 weights are stored in plain int4 order (reference.NATURAL_PACK) rather than in chunk halves.
# The GPU kernel reads plain order through Mosaic GPU's own int4 -> bf16 conversion, one block per pipeline step:
# H200, Llama-3-8B at batch 1, one iteration of the multi-step decode loop on the device took 4.67 ms with plain
# order against 5.76 ms with chunk halves (docs/PERFORMANCE.md, issue 15). The TPU kernel wants chunk halves.
NATURAL_INT4_BACKENDS = ("gpu",)


def fit_packs(specs: Any, plan: Plan, shards: dict[Logical, int] | None = None, backend: str | None = None) -> Plan:
    """The plan with every int4 weight's packing chunk fixed (a format that names its chunk, as a GGUF repack or
    a saved checkpoint does, keeps it). On NATURAL_INT4_BACKENDS the chunk is NATURAL_PACK, plain int4 order.
    Elsewhere a chunk packs element j and j + pack/2 into one byte, so a chunk split between two devices would
    leave each with half of every byte's pair: a weight whose K is split picks its chunk from the per-device K."""
    shards = shards or {}
    natural = (backend or jax.default_backend()) in NATURAL_INT4_BACKENDS
    by_path = dict(flatten_specs(specs))
    out = dict(plan)
    for path, fmt in plan.items():
        view = matrix_view(by_path[path]) if path in by_path else None
        if fmt.bits == 4 and fmt.pack is None and view is not None:
            pack = NATURAL_PACK if natural else default_pack(fmt.group, view.k // shards.get(view.in_axis, 1))
            out[path] = dataclasses.replace(fmt, pack=pack)
    return out


def _pack(fmt: QFormat, k: int) -> int:
    return fmt.pack or default_pack(fmt.group, k)


# ----------------------------------------------------------------------------- quantized specs


def _storage(fmt: QFormat) -> tuple[Any, str]:
    if fmt.fp8:
        return jnp.float8_e4m3fn, "fp8"
    return (jnp.int8, "int8") if fmt.bits == 8 else (jnp.uint8, "int4")


def quantized_spec(spec: ParamSpec, fmt: QFormat) -> QuantizedWeights | QuantizedExperts:
    """The quantized weight's pytree with a ParamSpec at each array field (module docstring)."""
    view = matrix_view(spec)
    dtype, kind = _storage(fmt)
    # Init.CODES draws codes of spread _CODE_STD; the scale gives codes x scale the NORMAL init's spread.
    fan_in = 1 if view.embedding else view.k
    scale_value = 1.0 / (math.sqrt(fan_in) * _CODE_STD[kind])
    scale_dtype = _SCALE_DTYPES[fmt.scale_dtype]
    if view.experts is not None:
        e = view.experts
        return QuantizedExperts(
            values=ParamSpec((e, view.n, view.k), dtype, (Logical.EXPERTS, view.out_axis, view.in_axis), Init.CODES),
            scales=ParamSpec((e, view.n), jnp.float32, (Logical.EXPERTS, view.out_axis), Init.CONSTANT,
                             value=scale_value))
    groups = 1 if fmt.group is None else view.k // fmt.group
    group_axis = view.in_axis if fmt.group is not None else None
    cols = view.k // 2 if fmt.bits == 4 else view.k
    scales = ParamSpec((groups, view.n), scale_dtype, (group_axis, view.out_axis), Init.CONSTANT, value=scale_value)
    zeros = ParamSpec((groups, view.n), scale_dtype, (group_axis, view.out_axis), Init.ZEROS) if fmt.zeros else None
    return QuantizedWeights(
        values=ParamSpec((view.n, cols), dtype, (view.out_axis, view.in_axis), Init.CODES),
        scales=scales, zeros=zeros, bits=fmt.bits, group_size=fmt.group or view.k, in_features=view.k,
        fp8=fmt.fp8, pack=_pack(fmt, view.k) if fmt.bits == 4 else PACK_CHUNK, w8a8=fmt.w8a8)


def quantized_specs(specs: Any, plan: Plan) -> Any:
    """The model's spec tree with every planned weight replaced by its quantized spec tree."""
    if not plan:
        return specs
    flat, treedef = jax.tree_util.tree_flatten(specs, is_leaf=is_spec)
    paths = [path for path, _ in flatten_specs(specs)]
    return jax.tree_util.tree_unflatten(
        treedef, [quantized_spec(s, plan[p]) if p in plan else s for p, s in zip(paths, flat)])


def quantized_nbytes(tree: Any) -> int:
    """Bytes of a (possibly quantized) spec or array tree."""
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree, is_leaf=is_spec))


# ----------------------------------------------------------------------------- host quantization


def quantize_matrix(w: np.ndarray, fmt: QFormat) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """w [K, N] float -> (codes [N, K] int8 or e4m3, scales [G, N], zeros [G, N] or None) in NumPy, the
    same arithmetic as pallas_kernels.quantized_matmul.reference.quantize_weights (absmax scales)."""
    k, n = w.shape
    group = fmt.group or k
    wt = np.ascontiguousarray(w.astype(np.float32).T).reshape(n, k // group, group)  # [N, G, g]
    amax = np.max(np.abs(wt), axis=-1)  # [N, G]
    if fmt.fp8:
        scale = _positive(amax / np.float32(448.0))
        codes = (wt / scale[:, :, None]).reshape(n, k).astype(ml_dtypes.float8_e4m3fn)
        return codes, scale.T.astype(np.float32), None
    qmax = np.float32(127.0 if fmt.bits == 8 else 7.0)
    if fmt.zeros:  # the group's [min, max] onto all 2 qmax + 2 codes: value = code * scale + zero
        lo, hi = wt.min(axis=-1), wt.max(axis=-1)  # [N, G]
        scale = _stored(_positive((hi - lo) / (2 * qmax + 1)), fmt)
        zero = _stored(lo + (qmax + 1) * scale, fmt)  # code -qmax - 1 is the group's minimum
        codes = np.clip(np.round((wt - zero[:, :, None]) / scale[:, :, None]), -qmax - 1, qmax)
        return codes.astype(np.int8).reshape(n, k), scale.T.astype(np.float32), zero.T.astype(np.float32)
    scale = _stored(_positive(amax / qmax), fmt)
    codes = np.clip(np.round(wt / scale[:, :, None]), -qmax, qmax).astype(np.int8).reshape(n, k)
    return codes, scale.T.astype(np.float32), None


def _positive(scale: np.ndarray) -> np.ndarray:
    return np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)


def _stored(x: np.ndarray, fmt: QFormat) -> np.ndarray:
    """x as the format stores it (fp32, or rounded to fp16), so codes are chosen against the stored numbers."""
    if fmt.scale_dtype == "float32":
        return x
    rounded = x.astype(np.float16)
    if not np.all(np.isfinite(rounded)):
        raise QuantizationError(f"a scale or zero point of {np.max(np.abs(x)):.3g} does not fit float16 "
                                f"({fmt.describe()}); these weights need fp32 scales (quantization='int8').")
    return rounded.astype(np.float32)


def pack_int4(codes: np.ndarray, pack: int) -> np.ndarray:
    """[N, K] int8 codes in -8..7 -> [N, K/2] uint8 (reference.pack_int4's layout, in NumPy)."""
    n, k = codes.shape
    u = (codes.astype(np.uint8) & 0xF).reshape(n, k // pack, 2, pack // 2)  # two's complement nibbles
    return (u[:, :, 0, :] | (u[:, :, 1, :] << 4)).reshape(n, k // 2)


def to_values(codes: np.ndarray, fmt: QFormat) -> np.ndarray:
    """Codes [N, K] -> the stored values ([N, K/2] packed for int4)."""
    return pack_int4(codes, _pack(fmt, codes.shape[1])) if fmt.bits == 4 else codes


def matrix_of(w: np.ndarray, spec: ParamSpec) -> np.ndarray:
    """A float weight in our layout -> its [K, N] matrix ([E, K, N] for experts)."""
    view = matrix_view(spec)
    if view.experts is not None:
        return w
    if view.embedding:
        return w.T
    return w.reshape(view.k, view.n)


def quantize_host(w: np.ndarray, spec: ParamSpec, fmt: QFormat) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A float weight in our layout -> (values, scales, zeros) of its quantized spec, in NumPy."""
    m = matrix_of(w, spec)
    if fmt.experts:  # [E, K, N] -> values [E, N, K], scales [E, N]
        parts = [quantize_matrix(m[e], fmt) for e in range(m.shape[0])]
        return np.stack([p[0] for p in parts]), np.stack([p[1][0] for p in parts]), None
    codes, scales, zeros = quantize_matrix(m, fmt)
    dtype = _SCALE_DTYPES[fmt.scale_dtype]
    return to_values(codes, fmt), scales.astype(dtype), None if zeros is None else zeros.astype(dtype)


def place_quantized(arrays: tuple[np.ndarray, ...], qspec: Any, mesh: Any, rules: Any) -> Any:
    """Host (values, scales, zeros) -> the quantized pytree on the mesh, each device only its shards."""
    values, scales, zeros = arrays
    leaves = {"values": values, "scales": scales, "zeros": zeros}

    def place(name: str, s: ParamSpec | None) -> jax.Array | None:
        if s is None:
            return None
        a = np.ascontiguousarray(leaves[name]).astype(s.dtype)
        if a.shape != s.shape:
            raise QuantizationError(f"quantized {name} has shape {a.shape}, the spec {s.shape} (a bug).")
        return jax.make_array_from_callback(s.shape, rules.sharding(mesh, s.logical_axes), lambda i: a[i])

    if isinstance(qspec, QuantizedExperts):
        return QuantizedExperts(place("values", qspec.values), place("scales", qspec.scales))
    return dataclasses.replace(qspec, values=place("values", qspec.values), scales=place("scales", qspec.scales),
                               zeros=place("zeros", qspec.zeros))


def quantize_params(weights: Any, specs: Any, plan: Plan, mesh: Any, rules: Any) -> Any:
    """Float weights (arrays, laid out as `specs`) -> the quantized tree of `plan`, one weight at a time
    through the host (tests and `jaxinfer convert` of a model already in memory)."""
    qspecs = quantized_specs(specs, plan)
    flat_w, treedef = jax.tree_util.tree_flatten(weights)
    flat_s = [s for _, s in flatten_specs(specs)]
    flat_q = [q for _, q in flatten_specs(qspecs)]
    paths = [p for p, _ in flatten_specs(specs)]
    out = []
    for path, w, s, q in zip(paths, flat_w, flat_s, flat_q):
        if path in plan:
            out.append(place_quantized(quantize_host(np.asarray(jax.device_get(w), np.float32), s, plan[path]),
                                       q, mesh, rules))
        else:
            out.append(w)
    return jax.tree_util.tree_unflatten(treedef, out)


# ----------------------------------------------------------------------------- choosing the plan


def resolve_plan(config: QuantizationConfig, checkpoint: Any, specs: Any) -> tuple[Plan, list[str]]:
    """The plan of `config` for this checkpoint (None: random weights) and float `specs`, plus notices to
    show (what a GGUF file's tensors became where not exactly). Raises QuantizationError."""
    stored = getattr(checkpoint, "quantization_plan", None)
    if config.method == "none":
        if checkpoint is not None and getattr(checkpoint, "stored_plan", None):
            raise QuantizationError("quantization='none': this orbax checkpoint was saved quantized; convert the "
                                    "original checkpoint again without --quantization to get float weights.")
        return {}, []
    if checkpoint is not None and getattr(checkpoint, "stored_plan", None):  # orbax, saved quantized
        if config.method != "auto":
            raise QuantizationError(
                f"quantization={str(config)!r}: this orbax checkpoint is already quantized; load it with "
                "quantization='auto' (or convert the original checkpoint with the method you want).")
        return dict(checkpoint.stored_plan), []
    if config.method == "auto":
        if stored is None or not callable(stored):
            return {}, []
        plan, inexact = stored(specs)
        notes = [f"quantization='auto': the {qtype} tensors ({len(paths)}, e.g. {paths[0]}) have no exact kernel "
                 f"format; they were dequantized and stored as {plan[paths[0]].describe()}."
                 for qtype, paths in sorted(inexact.items())]
        return plan, notes
    return method_plan(specs, config), []


def logical_shards(rules: Any, mesh: Any) -> dict[Logical, int]:
    """Devices each logical axis is split over on `mesh` (1 when replicated)."""
    from jaxinfer.sharding import flat_axes

    shape = dict(mesh.shape)
    return {axis: math.prod(shape.get(a, 1) for a in flat_axes(mesh_axes)) for axis, mesh_axes in rules.mapping.items()}


def build_plan(quantization: str | None, checkpoint: Any, specs: Any, rules: Any, mesh: Any) -> tuple[Plan, list[str]]:
    """The checked plan for `quantization` (as LLM(...) takes it) of a model on `mesh`: which weights are
    quantized and how, fitted to the shards each device holds; `checkpoint` None means random weights. Raises
    QuantizationError (or ValueError for a bad spelling) before anything is loaded; also returns notices."""
    config = QuantizationConfig.parse(quantization)
    check_platform(config.method)
    plan, notes = resolve_plan(config, checkpoint, specs)
    shards = logical_shards(rules, mesh)
    plan = fit_packs(specs, plan, shards)
    check_plan(specs, plan, shards)
    return plan, notes


def check_platform(method: str, what: str = "quantization") -> None:
    """fp8 needs Hopper-class GPUs (fp8 wgmma; e4m3 conversions); elsewhere every method runs (CPU and TPU
    through the reference / the TPU kernels). Raises QuantizationError naming the device."""
    if method != "fp8" or jax.default_backend() != "gpu":
        return
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if capability is not None and float(capability) < 9.0:
        raise QuantizationError(f"{what}='fp8' needs a GPU of compute capability 9.0 or newer (Hopper); "
                                f"{device.device_kind} has {capability}. Use int8 instead.")


__all__ = ["build_plan", "check_platform", "fit_packs", "logical_shards", "resolve_plan", "DEFAULT_INT4_GROUPS", "METHODS", "MatrixView", "Plan", "QFormat", "QuantizationConfig",
           "QuantizationError", "SMALL_GROUPS", "check_plan", "flatten_specs", "is_weight_leaf", "matrix_of",
           "matrix_view", "method_plan", "pack_int4", "plan_from_json", "place_quantized", "plan_to_json", "quantize_host",
           "quantize_matrix", "quantize_params",
           "quantized_nbytes", "quantized_spec", "quantized_specs", "to_values"]
