"""ParamSpec: each weight declared once; shapes, shardings, random init and load targets derive from it.

A model family writes one function that returns its weights pytree with a `ParamSpec` at every leaf. From
that single declaration this module derives:
- `abstract_params`: `jax.ShapeDtypeStruct`s with shardings (for `jax.eval_shape`, orbax restore targets,
  and the loaders' shape checks);
- `init_params`: random weights created directly on the mesh (no host copy), for tests and benchmarks;
- `param_shardings`: the NamedShardings the loaders place each tensor with.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxinfer.sharding import Logical, ShardingRules


class Init(enum.Enum):
    """How a weight is drawn in random-weights mode."""

    NORMAL = "normal"  # N(0, 1/fan_in): activations keep unit scale through matmuls
    ONES = "ones"  # norm scales
    ZEROS = "zeros"  # norm offsets (Gemma's 1 + w), biases
    # Quantized weights (jaxinfer.quantization): random codes of the storage dtype (int8 in -127..127,
    # int4 nibble pairs with codes in -7..7, e4m3 ~ N(0, 64^2)) and their scales, a CONSTANT `value`
    # chosen so that codes x scale has the NORMAL weight's spread.
    CODES = "codes"
    CONSTANT = "constant"


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    dtype: Any
    logical_axes: tuple[Logical | None, ...]
    init: Init = Init.NORMAL
    fan_in_axes: tuple[int, ...] = (0,)  # which axes are contracted when the weight is applied
    value: float = 0.0  # Init.CONSTANT's value

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.logical_axes):
            raise ValueError(
                f"ParamSpec: shape {self.shape} has {len(self.shape)} axes but logical_axes "
                f"{self.logical_axes} names {len(self.logical_axes)}."
            )


def is_spec(x: Any) -> bool:
    return isinstance(x, ParamSpec)


def map_specs(fn: Callable[[ParamSpec], Any], specs: Any) -> Any:
    return jax.tree.map(fn, specs, is_leaf=is_spec)


def param_shardings(specs: Any, mesh: Mesh, rules: ShardingRules) -> Any:
    return map_specs(lambda s: rules.sharding(mesh, s.logical_axes), specs)


def abstract_params(specs: Any, mesh: Mesh | None = None, rules: ShardingRules | None = None) -> Any:
    """ShapeDtypeStructs (with shardings when a mesh is given) for every weight."""

    def one(s: ParamSpec) -> jax.ShapeDtypeStruct:
        sharding = rules.sharding(mesh, s.logical_axes) if mesh is not None and rules is not None else None
        return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)

    return map_specs(one, specs)


def _draw(spec: ParamSpec, key: jax.Array) -> jax.Array:
    if spec.init is Init.ONES:
        return jnp.ones(spec.shape, spec.dtype)
    if spec.init is Init.ZEROS:
        return jnp.zeros(spec.shape, spec.dtype)
    if spec.init is Init.CONSTANT:
        return jnp.full(spec.shape, spec.value, spec.dtype)
    if spec.init is Init.CODES:
        return _draw_codes(spec, key)
    fan_in = math.prod(spec.shape[a] for a in spec.fan_in_axes)
    scale = 1.0 / math.sqrt(max(fan_in, 1))
    return (jax.random.normal(key, spec.shape, jnp.float32) * scale).astype(spec.dtype)


def _draw_codes(spec: ParamSpec, key: jax.Array) -> jax.Array:
    """Random quantization codes in the storage dtype (see Init.CODES)."""
    dtype = jnp.dtype(spec.dtype)
    if dtype == jnp.int8:
        return jax.random.randint(key, spec.shape, -127, 128, jnp.int32).astype(jnp.int8)
    if dtype == jnp.uint8:  # two int4 codes per byte, codes in -7..7, each nibble two's complement
        nibbles = jax.random.randint(key, (2, *spec.shape), -7, 8, jnp.int32) & 0xF
        return (nibbles[0] | (nibbles[1] << 4)).astype(jnp.uint8)
    return (jax.random.normal(key, spec.shape, jnp.float32) * 64.0).astype(dtype)


def _codes_on_host(spec: ParamSpec, rng: np.random.Generator) -> np.ndarray:
    dtype = jnp.dtype(spec.dtype)
    if dtype == jnp.int8:
        return rng.integers(-127, 128, spec.shape).astype(np.int8)
    if dtype == jnp.uint8:
        nibbles = rng.integers(-7, 8, (2, *spec.shape)) & 0xF
        return (nibbles[0] | (nibbles[1] << 4)).astype(np.uint8)
    return (rng.standard_normal(spec.shape, np.float32) * 64.0).astype(dtype)


HOST_INIT_LIMIT_BYTES = 1 << 30


def init_params(specs: Any, key: jax.Array | int, mesh: Mesh, rules: ShardingRules) -> Any:
    """Random weights with the specs' shardings.

    Large models are drawn on device, shard by shard (jit with out_shardings: no host copy, no host
    bandwidth). Small ones (tests, tiny configs) are drawn with NumPy and placed, which skips compiling a
    PRNG program per shape; on two CPU cores that compile dominates a tiny model's start-up.
    """
    if nbytes(specs) <= HOST_INIT_LIMIT_BYTES:
        seed = key if isinstance(key, int) else int(jax.random.key_data(key).ravel()[-1])
        return _init_on_host(specs, seed, mesh, rules)
    key = jax.random.key(key) if isinstance(key, int) else key
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    shardings = [rules.sharding(mesh, s.logical_axes) for s in leaves]
    keys = list(jax.random.split(key, len(leaves)))

    # One small program per distinct (spec, sharding), not one program for every weight: a Llama-3-8B has
    # 291 weights but 9 distinct specs, and compiling one 291-output PRNG program took most of a minute.
    arrays = [_drawer(s, sharding)(k) for s, sharding, k in zip(leaves, shardings, keys)]
    return jax.tree.unflatten(treedef, arrays)


@functools.lru_cache(maxsize=256)
def _drawer(spec: ParamSpec, sharding: NamedSharding) -> Callable[[jax.Array], jax.Array]:
    return jax.jit(functools.partial(_draw, spec), out_shardings=sharding)


def _init_on_host(specs: Any, seed: int, mesh: Mesh, rules: ShardingRules) -> Any:
    rng = np.random.default_rng(seed)

    def one(s: ParamSpec) -> jax.Array:
        if s.init is Init.NORMAL:
            fan_in = math.prod(s.shape[a] for a in s.fan_in_axes)
            w = rng.standard_normal(s.shape, np.float32) / math.sqrt(max(fan_in, 1))
        elif s.init is Init.CODES:
            w = _codes_on_host(s, rng)
        else:
            value = {Init.ONES: 1.0, Init.ZEROS: 0.0, Init.CONSTANT: s.value}[s.init]
            w = np.full(s.shape, value, np.float32)
        w = w.astype(s.dtype)
        return jax.make_array_from_callback(s.shape, rules.sharding(mesh, s.logical_axes), lambda i: w[i])

    return map_specs(one, specs)


def count_params(specs: Any) -> int:
    return sum(math.prod(s.shape) for s in jax.tree.leaves(specs, is_leaf=is_spec))


def nbytes(specs: Any) -> int:
    return sum(
        math.prod(s.shape) * jnp.dtype(s.dtype).itemsize for s in jax.tree.leaves(specs, is_leaf=is_spec)
    )


def sharding_of(specs: Any, mesh: Mesh, rules: ShardingRules) -> list[NamedSharding]:
    return [rules.sharding(mesh, s.logical_axes) for s in jax.tree.leaves(specs, is_leaf=is_spec)]
