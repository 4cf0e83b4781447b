"""Host arrays -> device in a few transfers: each argument's small arrays packed into one buffer.

Every engine step sends ~20-40 small host arrays (the batch's positions, slots and page table, the sampler's
per-row knobs). `jax.device_put` makes one host-to-device copy per array, and on a GPU each costs the host
tens of microseconds: on an H100, placing one pipelined step's arrays took 3.4 ms of the engine thread's
12 ms of host work per 13 ms step (docs/PERFORMANCE.md). Here the small arrays of one argument (a StepBatch,
a SamplingArrays, ...) are viewed as int32 words, concatenated into one buffer, sent in one copy, and cut
back into the original arrays on device by a small compiled program (one per layout, kept).

Layouts are per argument, not per call, so the same argument type and bucket gives the same program whoever
places it (the warmup's precompile places every argument type the steps place; engine_stats counts any
compiled later). A field that is a device array in some calls and a host array in others is always sent on its
own, so its argument's layout does not depend on which it is: the structured-output bitmask (the all-allowed
mask stays on device), and the token ids and alive rows that a follow-on decode call takes from the call
before it on device.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding

# Fewer small leaves than this in an argument: sent as they are (the unpack call would cost more than it saves).
MIN_PACKED_LEAVES = 3
# Leaves larger than this are sent on their own: packing would copy them once more on the host for nothing.
MAX_PACKED_BYTES = 64 * 1024
# Fields that may be a device array in one call and a host array in the next (see the module docstring).
UNPACKED_FIELDS = frozenset({"token_bitmask", "token_ids", "alive"})


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where one leaf sits in the int32 buffer and how it comes back."""

    shape: tuple[int, ...]
    dtype: np.dtype  # the leaf's dtype as device_put would give it
    offset: int  # in int32 words
    size: int  # in int32 words


Layout = tuple[_Slot, ...]


_UNSIGNED = {1: np.uint8, 2: np.uint16}


def _words(a: np.ndarray) -> np.ndarray:
    """`a` (already in its device dtype) as flat int32 words: 4-byte types bit for bit, narrower ones widened
    (bools and small ints by value, 16-bit floats by their bits)."""
    if a.dtype.itemsize == 4:
        return a.reshape(-1).view(np.int32)
    if jnp.issubdtype(a.dtype, jnp.floating):  # 16- and 8-bit floats: their bits, zero-extended
        return a.reshape(-1).view(_UNSIGNED[a.dtype.itemsize]).astype(np.int32)
    return a.reshape(-1).astype(np.int32)


def _restore(words: jax.Array, slot: _Slot) -> jax.Array:
    dtype = slot.dtype
    if dtype.itemsize == 4:
        out = words if dtype == jnp.int32 else jax.lax.bitcast_convert_type(words, dtype)
    elif jnp.issubdtype(dtype, jnp.floating):
        out = jax.lax.bitcast_convert_type(words.astype(_UNSIGNED[dtype.itemsize]), dtype)
    elif dtype == jnp.bool_:
        out = words != 0
    else:
        out = words.astype(dtype)
    return out.reshape(slot.shape)


def _unpack(buffer: jax.Array, layout: Layout) -> list[jax.Array]:
    return [_restore(buffer[s.offset : s.offset + s.size], s) for s in layout]  # [size] slices of [N]


def _canonical(a: np.ndarray) -> np.ndarray:
    """`a` in the dtype device_put gives it (64-bit types narrowed without x64)."""
    if a.dtype.itemsize < 8:
        return a
    return a.astype(jax.dtypes.canonicalize_dtype(a.dtype))


def _packable(path: Any, leaf: Any) -> bool:
    if not isinstance(leaf, np.ndarray) or leaf.nbytes > MAX_PACKED_BYTES or leaf.dtype.itemsize > 8:
        return False
    name = getattr(path[-1], "name", None) if path else None
    return name not in UNPACKED_FIELDS


class Transfer:
    """`place` for one mesh sharding: see the module docstring. Thread-safe."""

    def __init__(self, sharding: Sharding, enabled: bool = True) -> None:
        self.sharding = sharding
        self.enabled = enabled
        self._programs: dict[Layout, Callable[[jax.Array], list[jax.Array]]] = {}
        self._lock = threading.Lock()
        self.num_compiles = 0  # unpack programs compiled (each once per layout)
        self.num_background_compiles = 0  # those of them compiled for programs compiled in the background

    def place(self, args: Any, background: bool = False) -> Any:
        """Host arrays -> device (replicated), device arrays as they are. A tuple's elements are packed one by
        one; anything else is one argument. `background`: placed by a background precompile (which counts its
        unpack programs apart)."""
        parts = list(args) if isinstance(args, tuple) else [args]
        plans = [self._plan(part) for part in parts]
        sent = jax.device_put([h for plan in plans for h in plan.host], self.sharding)  # one call for all
        placed, k = [], 0
        for plan in plans:
            n = len(plan.host)
            placed.append(plan.finish(sent[k : k + n], functools.partial(self._program, background=background)))
            k += n
        return tuple(placed) if isinstance(args, tuple) else placed[0]

    def abstract(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """What `place(args)` returns, as shapes, dtypes and shardings only (device arrays as they are), for
        lowering ahead of time without sending anything."""
        def one(leaf: Any) -> Any:
            if isinstance(leaf, jax.Array):
                return leaf
            aval = jax.typeof(leaf)
            return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type, sharding=self.sharding)

        return tuple(jax.tree.map(one, tuple(args)))

    def _plan(self, part: Any) -> _Plan:
        flat, tree = jax.tree_util.tree_flatten_with_path(part)
        leaves = [leaf for _, leaf in flat]
        packed = [i for i, (path, leaf) in enumerate(flat) if self.enabled and _packable(path, leaf)]
        if len(packed) < MIN_PACKED_LEAVES:
            packed = []
        in_pack = set(packed)
        alone = [i for i, leaf in enumerate(leaves) if i not in in_pack and not isinstance(leaf, jax.Array)]
        host = [leaves[i] for i in alone]
        layout: Layout = ()
        if packed:
            arrays = [_canonical(leaves[i]) for i in packed]
            words = [_words(a) for a in arrays]
            slots, offset = [], 0
            for a, w in zip(arrays, words):
                slots.append(_Slot(a.shape, a.dtype, offset, w.size))
                offset += w.size
            layout = tuple(slots)
            host.append(np.concatenate(words) if words else np.zeros(0, np.int32))
        return _Plan(leaves, tree, alone, packed, layout, host)

    def _program(self, layout: Layout, background: bool = False) -> Callable[[jax.Array], list[jax.Array]]:
        program = self._programs.get(layout)
        if program is None:
            with self._lock:
                program = self._programs.get(layout)
                if program is None:
                    size = layout[-1].offset + layout[-1].size
                    words = jax.ShapeDtypeStruct((size,), jnp.int32, sharding=self.sharding)
                    fn = jax.jit(lambda buffer: _unpack(buffer, layout), out_shardings=self.sharding)
                    program = self._programs[layout] = fn.lower(words).compile()
                    if background:
                        self.num_background_compiles += 1
                    else:
                        self.num_compiles += 1
        return program


@dataclasses.dataclass
class _Plan:
    """One argument split into leaves sent alone and the packed buffer (last of `host`, when there is one)."""

    leaves: list[Any]
    tree: Any
    alone: list[int]  # leaf indices sent as they are
    packed: list[int]  # leaf indices in the buffer, in layout order
    layout: Layout
    host: list[Any]  # what device_put sends for this argument

    def finish(self, sent: Sequence[jax.Array], program: Callable[[Layout], Any]) -> Any:
        leaves = list(self.leaves)
        for i, a in zip(self.alone, sent):
            leaves[i] = a
        if self.packed:
            for i, a in zip(self.packed, program(self.layout)(sent[-1])):
                leaves[i] = a
        return jax.tree_util.tree_unflatten(self.tree, leaves)
