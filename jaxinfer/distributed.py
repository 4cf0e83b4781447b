"""Multi-process (multi-host) runs: joining one, and the few facts every process must agree on.

A multi-host run is the same program on every host after `jax.distributed.initialize()`. When an engine's
mesh spans processes, every process runs the same scheduler over the same requests in the same order, so
each makes the same device calls with the same host arrays (JAX requires that) and reads back the same
replicated tokens. What could make two processes diverge is checked or fixed here:
- the model and engine settings (`check_same_everywhere`: a fingerprint gathered from every process);
- the KV page count, which depends on each host's free memory (`min_over_processes`);
- random seeds of unseeded requests (`shared_seed`: process 0's draw, broadcast).
Only process 0 writes shared outputs (`is_writer`).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import jax
import numpy as np

from jaxinfer.config import ConfigError

ENV_ADDRESS = "JAX_COORDINATOR_ADDRESS"  # also read by jax.distributed itself
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer.") from None


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, **kwargs: Any) -> None:
    """Join a multi-process run: arguments, else JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
    JAX_PROCESS_ID, else JAX's own cluster detection (TPU pods, SLURM, Open MPI need no arguments).
    Call before anything touches a device. Idempotent."""
    if jax.distributed.is_initialized():
        return
    coordinator_address = coordinator_address or os.environ.get(ENV_ADDRESS) or None
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise ConfigError(f"process_id={process_id} must be in [0, num_processes={num_processes}).")
    jax.distributed.initialize(coordinator_address, num_processes, process_id, **kwargs)


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def is_writer() -> bool:
    """Whether this process writes shared outputs (files, printed results): process 0."""
    return jax.process_index() == 0


def _gather(value: int) -> list[int]:
    """A non-negative int < 2**63 from this process -> the values of all processes, in process order.

    Sent as two 32-bit words: JAX without x64 would truncate an int64 array to int32."""
    from jax.experimental import multihost_utils

    words = np.asarray([value >> 32, value & 0xFFFFFFFF], np.uint32).view(np.int32)  # [2]
    got = np.asarray(multihost_utils.process_allgather(words)).reshape(jax.process_count(), 2)
    got = got.view(np.uint32).astype(np.int64)  # [processes, 2]
    return [int(hi) << 32 | int(lo) for hi, lo in got]


def min_over_processes(value: int) -> int:
    """The smallest `value` any process holds (e.g. free device memory)."""
    if not is_multiprocess():
        return value
    return min(_gather(value))


def fingerprint(*parts: Any) -> int:
    """A stable 63-bit digest of the parts' reprs (the same on every host, unlike hash())."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def check_same_everywhere(what: str, *parts: Any) -> None:
    """Raise ConfigError on every process if the processes disagree on `parts` (model, settings)."""
    if not is_multiprocess():
        return
    prints = _gather(fingerprint(*parts))
    differing = [i for i, p in enumerate(prints) if p != prints[0]]
    if differing:
        raise ConfigError(
            f"the {jax.process_count()} processes of this run disagree on {what}: processes {differing} differ "
            f"from process 0. Every process must load the same model with the same settings."
        )


def spans_processes(devices_per_replica: int) -> bool:
    """Whether one engine replica of that many devices spans processes (then every process runs the same
    requests and only process 0 writes); otherwise each process serves its own replicas and requests."""
    return is_multiprocess() and devices_per_replica > jax.local_device_count()


def broadcast_json(value: Any) -> Any:
    """Process 0's JSON-serializable `value` on every process (e.g. which records are still to do)."""
    if not is_multiprocess():
        return value
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.asarray(data.size, np.int32)))
    buffer = np.zeros(size, np.uint8)
    buffer[: min(size, data.size)] = data[:size]
    got = np.asarray(multihost_utils.broadcast_one_to_all(buffer), np.uint8)
    return json.loads(got.tobytes().decode())


def shared_seed(local_seed: int) -> int:
    """Process 0's seed on every process (unseeded requests must draw the same seeds everywhere)."""
    if not is_multiprocess():
        return local_seed
    from jax.experimental import multihost_utils

    words = np.asarray([local_seed >> 32 & 0xFFFFFFFF, local_seed & 0xFFFFFFFF], np.uint32).view(np.int32)
    hi, lo = np.asarray(multihost_utils.broadcast_one_to_all(words)).view(np.uint32).astype(np.int64)
    return int(hi) << 32 | int(lo)


__all__ = ["broadcast_json", "check_same_everywhere", "fingerprint", "initialize", "is_multiprocess", "is_writer",
           "min_over_processes", "shared_seed", "spans_processes"]
