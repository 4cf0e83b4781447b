"""Decode every key/value field of a GGUF file header to plain Python.

Why not `gguf.GGUFReader(...).fields`: the reader builds one NumPy view per array *item* while parsing
(tens of seconds for a 262k-token vocabulary). The header layout is simple, so it is decoded here straight
from the bytes: numeric arrays become one `np.frombuffer` each and string arrays one tight loop. A reader
that already exists is accepted too; its memory map is re-parsed the same way, never its fields.

Layout (GGUF v2/v3, all little- or all big-endian):
    magic b"GGUF" | version u32 | tensor_count u64 | kv_count u64 | kv_count x (key str, type u32, value)
    str   = length u64 + UTF-8 bytes
    array = item type u32 + count u64 + count items

Values come back as str / int / float / bool, lists of those, and `np.ndarray` for numeric arrays with at
least `NUMPY_ARRAY_MIN_LEN` items (token scores, token types) where a list of Python objects would be slow
and large. The pseudo keys `GGUF.version`, `GGUF.tensor_count` and `GGUF.kv_count` mirror GGUFReader.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

__all__ = ["GGUFMetadataError", "NUMPY_ARRAY_MIN_LEN", "TensorInfo", "read_gguf_layout", "read_gguf_metadata"]

# Numeric arrays this long or longer come back as NumPy arrays; shorter ones (rope sections, per-layer
# head counts) as lists, which is what configuration code wants to compare and serialize.
NUMPY_ARRAY_MIN_LEN = 256

_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_STRING = 8
_ARRAY = 9
_BOOL = 7
# GGUFValueType code -> NumPy dtype character (byte order added at parse time).
_NUMERIC = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 10: "u8", 11: "i8", 12: "f8"}
# The same codes as `struct` formats (standard sizes) for scalars.
_STRUCT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 10: "Q", 11: "q", 12: "d"}


class GGUFMetadataError(ValueError):
    """The file is not a GGUF file, uses an unsupported version, or ends inside its header."""


class _Truncated(Exception):
    """Internal: a read ran past the end of the buffer (turned into GGUFMetadataError with the name)."""


class _Cursor:
    """Sequential reader over the header bytes with one fixed byte order."""

    def __init__(self, buf: memoryview, order: str) -> None:
        self.buf = buf
        self.pos = 0
        self.order = order  # "<" or ">"

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if end > len(self.buf):
            raise _Truncated
        view = self.buf[self.pos : end]
        self.pos = end
        return view

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise _Truncated
        (value,) = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        # "replace": a stray invalid byte in one vocab entry must not make the whole file unreadable.
        return bytes(self.take(self.scalar("Q"))).decode("utf-8", errors="replace")


def _string_array(cur: _Cursor, count: int) -> list[str]:
    """Decode `count` length-prefixed strings; the hot loop for vocabularies, so kept flat."""
    buf, pos, end = cur.buf, cur.pos, len(cur.buf)
    unpack = struct.Struct(cur.order + "Q").unpack_from
    out = []
    for _ in range(count):
        if pos + 8 > end:
            raise _Truncated
        (n,) = unpack(buf, pos)
        pos += 8
        if pos + n > end:
            raise _Truncated
        out.append(str(buf[pos : pos + n], "utf-8", "replace"))
        pos += n
    cur.pos = pos
    return out


def _numeric_array(cur: _Cursor, item_type: int, count: int) -> np.ndarray | list[Any]:
    dtype = np.dtype(_NUMERIC[item_type]).newbyteorder(cur.order)
    raw = cur.take(count * dtype.itemsize)
    # .astype copies out of the (soon closed) memory map and normalizes to native byte order.
    values = np.frombuffer(raw, dtype=dtype).astype(dtype.newbyteorder("="))
    return values if count >= NUMPY_ARRAY_MIN_LEN else values.tolist()


def _array(cur: _Cursor) -> Any:
    item_type = cur.scalar("I")
    count = cur.scalar("Q")
    if item_type == _STRING:
        return _string_array(cur, count)
    if item_type in _NUMERIC:
        return _numeric_array(cur, item_type, count)
    if item_type == _BOOL:
        return [b != 0 for b in bytes(cur.take(count))]
    # Nested arrays (rare; e.g. per-layer lists) recurse item by item.
    if item_type == _ARRAY:
        return [_array(cur) for _ in range(count)]
    raise GGUFMetadataError(f"array item type {item_type} is not a GGUF value type")


def _value(cur: _Cursor, value_type: int) -> Any:
    if value_type == _STRING:
        return cur.string()
    if value_type == _ARRAY:
        return _array(cur)
    if value_type == _BOOL:
        return cur.scalar("B") != 0
    if value_type in _NUMERIC:
        return cur.scalar(_STRUCT[value_type])
    raise GGUFMetadataError(f"value type {value_type} is not a GGUF value type")


def _byte_order(buf: memoryview) -> str:
    """GGUF has no byte-order flag: a big-endian file shows a huge version number when read as LE."""
    (version_le,) = struct.unpack_from("<I", buf, 4)
    return "<" if version_le & 0xFFFF else ">"


def _parse(buf: memoryview) -> dict[str, Any]:
    return _parse_header(buf)[0]


def _parse_header(buf: memoryview) -> tuple[dict[str, Any], _Cursor]:
    if len(buf) < 8 or bytes(buf[:4]) != _MAGIC:
        raise GGUFMetadataError("does not start with the GGUF magic bytes")
    cur = _Cursor(buf, _byte_order(buf))
    cur.pos = 4
    version = cur.scalar("I")
    if version not in _SUPPORTED_VERSIONS:
        raise GGUFMetadataError(f"GGUF version {version} is not supported (only {_SUPPORTED_VERSIONS})")
    tensor_count, kv_count = cur.scalar("Q"), cur.scalar("Q")
    meta: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": tensor_count, "GGUF.kv_count": kv_count}
    for _ in range(kv_count):
        key = cur.string()
        meta[key] = _value(cur, cur.scalar("I"))
    return meta, cur


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are: GGML dims (innermost first), quant type code, absolute file offset."""

    name: str
    dims: tuple[int, ...]
    type_code: int
    offset: int


def _tensor_infos(meta: dict[str, Any], cur: _Cursor) -> list[TensorInfo]:
    """The tensor-info table that follows the key/values; offsets made absolute (aligned data start)."""
    raw = []
    for _ in range(meta["GGUF.tensor_count"]):
        name = cur.string()
        dims = tuple(cur.scalar("Q") for _ in range(cur.scalar("I")))
        raw.append((name, dims, cur.scalar("I"), cur.scalar("Q")))
    alignment = int(meta.get("general.alignment", 32))
    data_start = -(-cur.pos // alignment) * alignment
    return [TensorInfo(name, dims, code, data_start + off) for name, dims, code, off in raw]


def read_gguf_layout(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[TensorInfo]]:
    """Metadata plus the tensor table, without `GGUFReader` (whose construction takes seconds per file)."""
    name = os.fspath(path)
    with _mapped(path) as buf:
        try:
            meta, cur = _parse_header(buf)
            if cur.order != "<":
                raise GGUFMetadataError("big-endian tensor data is not supported")
            return meta, _tensor_infos(meta, cur)
        except _Truncated:
            raise GGUFMetadataError(f"{name} is truncated: it ends inside its header or tensor table.") from None
        except GGUFMetadataError as e:
            raise GGUFMetadataError(f"{name} is not a readable GGUF file: {e}.") from None


@contextmanager
def _mapped(path: str | os.PathLike[str]) -> Iterator[memoryview]:
    """Memory-map the file read-only: only the header pages are ever touched."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            yield memoryview(b"")
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                yield view
            finally:
                view.release()


def _parse_named(buf: memoryview, name: str) -> dict[str, Any]:
    try:
        return _parse(buf)
    except _Truncated:
        raise GGUFMetadataError(f"{name} is truncated: its GGUF header ends before all fields are read.") from None
    except GGUFMetadataError as e:
        raise GGUFMetadataError(f"{name} is not a readable GGUF file: {e}.") from None


def read_gguf_metadata(path_or_reader: Any) -> dict[str, Any]:
    """Every key/value field of a GGUF file as plain Python (see the module docstring for the types).

    `path_or_reader` is a path, a `gguf.GGUFReader` (its memory map is re-parsed, which is fast), or a
    bytes-like object holding at least the whole header.
    """
    reader_data = getattr(path_or_reader, "data", None)
    if isinstance(reader_data, np.ndarray):
        name = str(getattr(path_or_reader, "path", None) or "GGUF reader data")
        return _parse_named(memoryview(np.ascontiguousarray(reader_data, dtype=np.uint8)), name)
    if isinstance(path_or_reader, (bytes, bytearray, memoryview)):
        return _parse_named(memoryview(path_or_reader), "GGUF buffer")
    with _mapped(path_or_reader) as buf:
        return _parse_named(buf, os.fspath(path_or_reader))
