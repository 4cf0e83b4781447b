"""Batch input (grain over JSONL, sharded by process) and resumable, append-only JSONL output.

Resumability rests on two rules. Output records are appended one whole line per `write` and flushed
to disk as each request finishes, so a kill (SIGKILL included) loses at most the line being written.
On restart, a torn last line (no trailing newline) is cut off, the ids already present are skipped, and
the rest is generated; so the file ends with every id exactly once.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from jaxinfer.config import ConfigError

# A source turns the input path into a random-access sequence of records (pluggable, e.g. ArrayRecord).
RecordSource = Callable[[Path], Sequence[dict[str, Any]]]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    try:
        lines = path.read_text(encoding="utf-8").split("\n")  # not splitlines: U+2028 may sit in a JSON string
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}).") from None
    except OSError as e:
        raise ConfigError(f"input.path: cannot read {path} ({e.strerror}).") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{lineno}: invalid JSON ({e.msg}).") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{path}:{lineno}: each line must be a JSON object.")
        records.append(record)
    return records


def check_ids(records: Sequence[dict[str, Any]], id_field: str, source: str) -> None:
    """Every record has a string or integer id and no id repeats; reported before any work starts (without
    an id, a record could be neither written nor skipped on resume)."""
    seen: dict[Any, int] = {}
    for i, record in enumerate(records, 1):
        if id_field not in record:
            raise ConfigError(f"{source}: record {i} has no {id_field!r} field.")
        rid = record[id_field]
        if not isinstance(rid, str | int) or isinstance(rid, bool):
            raise ConfigError(f"{source}: record {i}: {id_field!r} must be a string or an integer, got {rid!r}.")
        if rid in seen:
            raise ConfigError(f"{source}: id {rid!r} appears twice (records {seen[rid]} and {i}).")
        seen[rid] = i


def load_records(path: Path, id_field: str, source: RecordSource = read_jsonl,
                 shard: bool = True) -> list[dict[str, Any]]:
    """The input through grain: this process's shard (records i, i + P, i + 2P, ... of P processes), or all
    of it when every process runs the same requests (`shard=False`: one replica spanning the processes)."""
    import grain
    import jax

    if not path.is_file():
        raise ConfigError(f"input.path: {path} does not exist.")
    records = source(path)
    check_ids(records, id_field, str(path))
    dataset = grain.MapDataset.source(records)
    return list(dataset[jax.process_index() :: jax.process_count()] if shard else dataset)


class ResumableWriter:
    """Append-only JSONL writer that knows which ids are already done."""

    def __init__(self, path: Path, id_field: str = "id", setting: str = "output.path") -> None:
        self.path = path
        self.id_field = id_field
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.done = self._recover()
            self._f = open(path, "a", encoding="utf-8")
        except OSError as e:  # a read-only directory, a path through a file, ...
            raise ConfigError(f"{setting}: cannot write {path} ({e.strerror or e}).") from None

    def _recover(self) -> set[Any]:
        """Ids in complete lines; a torn last line is truncated away."""
        if not self.path.exists():
            return set()
        data = self.path.read_bytes()
        keep = data.rfind(b"\n") + 1
        if keep != len(data):
            with open(self.path, "r+b") as f:
                f.truncate(keep)
        done = set()
        for lineno, line in enumerate(data[:keep].splitlines(), 1):
            if line.strip():
                try:
                    done.add(json.loads(line)[self.id_field])
                except (ValueError, KeyError, TypeError):
                    raise ConfigError(f"{self.path}:{lineno}: not a record this job wrote; move the file away "
                                      "or choose another output path.") from None
        return done

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, ensure_ascii=False) + "\n"
        self._f.write(line)
        self._f.flush()
        os.fsync(self._f.fileno())
        self.done.add(record[self.id_field])

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> ResumableWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pending(records: Iterable[dict[str, Any]], done: set[Any], id_field: str) -> list[dict[str, Any]]:
    return [r for r in records if r[id_field] not in done]
