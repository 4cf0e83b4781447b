"""Packed host-to-device transfers (jaxinfer.engine.transfer) give exactly what one device_put per array gives."""

from __future__ import annotations

import dataclasses

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxinfer.engine.transfer import MAX_PACKED_BYTES, Transfer


@struct.dataclass
class _Arg:
    a: object
    b: object
    c: object
    d: object
    token_bitmask: object


def _sharding(num_devices: int) -> NamedSharding:
    return NamedSharding(Mesh(np.array(jax.devices()[:num_devices]), ("tensor",)), P())


def _random_leaves(rng: np.random.Generator) -> list[object]:
    """Every dtype a step sends or might send, with 0-d and empty arrays among them."""
    return [
        rng.standard_normal((3, 5)).astype(np.float32),
        rng.integers(-2**31, 2**31, (7,), dtype=np.int64).astype(np.int32),
        rng.integers(0, 2**32, (4, 2), dtype=np.uint64).astype(np.uint32),
        rng.random(6) < 0.5,
        rng.integers(-128, 128, (5,), dtype=np.int8),
        rng.integers(0, 256, (2, 3), dtype=np.uint8),
        rng.standard_normal(9).astype(ml_dtypes.bfloat16),
        rng.standard_normal(4).astype(np.float16),
        rng.standard_normal(3).astype(ml_dtypes.float8_e4m3fn),
        rng.integers(-1000, 1000, (3,), dtype=np.int64),  # device_put narrows 64-bit types without x64
        rng.standard_normal(2),  # float64
        np.asarray(rng.integers(0, 100), np.int32),  # 0-d
        np.zeros((0, 4), np.int32),
        np.asarray(True),
    ]


def _check_same(placed: object, expected: object) -> None:
    for got, want in zip(jax.tree.leaves(placed), jax.tree.leaves(expected), strict=True):
        assert isinstance(got, jax.Array)
        assert got.dtype == want.dtype and got.shape == want.shape and got.sharding == want.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("num_devices", [1, 4])
def test_packed_equals_one_device_put_per_array(num_devices: int) -> None:
    sharding = _sharding(num_devices)
    transfer = Transfer(sharding)
    rng = np.random.default_rng()
    for _ in range(3):  # fresh values each time through the same program
        leaves = _random_leaves(rng)
        already = jax.device_put(rng.integers(0, 9, (3,), dtype=np.int32), sharding)
        args = (tuple(leaves), already, _Arg(leaves[0], leaves[1], leaves[3], already, leaves[2]))
        _check_same(transfer.place(args), jax.device_put(args, sharding))
    # One program per argument layout, reused: the tuple of leaves, and the _Arg's three small host leaves (its
    # bitmask is sent alone, its device leaf stays).
    assert transfer.num_compiles == 2


def test_layout_is_per_argument_and_ignores_device_or_host_bitmask() -> None:
    sharding = _sharding(1)
    transfer = Transfer(sharding)
    rng = np.random.default_rng()
    host = _Arg(*(rng.integers(0, 9, (4,), dtype=np.int32) for _ in range(5)))
    on_device = dataclasses.replace(host, token_bitmask=jax.device_put(host.token_bitmask, sharding))
    _check_same(transfer.place(host), jax.device_put(host, sharding))
    beside = np.zeros(3, np.int32)
    _check_same(transfer.place((on_device, beside)), jax.device_put((on_device, beside), sharding))
    assert transfer.num_compiles == 1  # the same _Arg layout, whatever sits beside it and wherever its bitmask is


def test_large_leaves_are_sent_alone_and_disabled_sends_everything_alone() -> None:
    sharding = _sharding(1)
    big = np.arange(MAX_PACKED_BYTES // 4 + 1, dtype=np.int32)
    small = [np.full(3, i, np.int32) for i in range(3)]
    transfer = Transfer(sharding)
    _check_same(transfer.place((big, *small)), jax.device_put((big, *small), sharding))
    assert transfer.num_compiles == 0  # every element of a tuple is its own argument: nothing to pack
    _check_same(transfer.place([big, *small]), jax.device_put([big, *small], sharding))
    assert transfer.num_compiles == 1  # the three small ones packed, the big one alone
    off = Transfer(sharding, enabled=False)
    _check_same(off.place([big, *small]), jax.device_put([big, *small], sharding))
    assert off.num_compiles == 0


def test_unpack_program_has_no_collectives_on_a_mesh() -> None:
    """Replicated in, replicated out: each device cuts its own copy of the buffer."""
    transfer = Transfer(_sharding(4))
    transfer.place([np.zeros(3, np.int32), np.ones(2, np.float32), np.ones(4, bool)])
    (program,) = transfer._programs.values()
    hlo = program.as_text()
    for op in ("all-gather", "all-reduce", "collective-permute", "all-to-all"):
        assert op not in hlo


@pytest.mark.gpu
def test_packed_equals_one_device_put_per_array_on_gpu() -> None:
    sharding = NamedSharding(Mesh(np.array(jax.devices("gpu")[:1]), ("tensor",)), P())
    transfer = Transfer(sharding)
    rng = np.random.default_rng()
    for _ in range(3):
        args = (tuple(_random_leaves(rng)), _Arg(*_random_leaves(rng)[:5]))
        _check_same(transfer.place(args), jax.device_put(args, sharding))
    assert transfer.num_compiles == 2
