"""Data parallelism: N engine replicas in one process, each over its own devices, behind one front end.

`DataParallelEngines` has the step-level interface of `Engine` (add_request, step, abort, has_unfinished,
stats, warmup), so `LLM` and the batch API run over one replica or many alike:
- a new request goes to the least-loaded replica (fewest unfinished requests, then fewest waiting and
  running sequences, then the lowest index), and stays there until it finishes;
- `step()` steps every replica that has work at the same time, one thread per replica: a replica's step
  spends most of its time waiting for its own devices, which releases the GIL, so N replicas keep N
  device groups busy from one Python process;
- request ids are unique across replicas (each replica numbers its own with a replica prefix).

Replicas share nothing on device: each has its own weights (views of one load, see `split_replicas`), KV
cache, scheduler and compiled executables.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxinfer.engine import frontend
from jaxinfer.engine.admission import Admission
from jaxinfer.engine.bookkeeping import expert_load_stats
from jaxinfer.errors import InvalidInput
from jaxinfer.outputs import RequestOutput


class DataParallelEngines:
    def __init__(self, engines: Sequence[Any]) -> None:
        if not engines:
            raise ValueError("DataParallelEngines needs at least one engine.")
        self.engines = list(engines)
        self.use_tqdm = self.engines[0].use_tqdm
        self.tokenizer = self.engines[0].tokenizer
        self.gate = self.engines[0].gate  # the checks at the door: the same model on every replica
        self._owner: dict[str, int] = {}  # request id -> replica index
        self._pool = ThreadPoolExecutor(len(self.engines), thread_name_prefix="jaxinfer-replica")
        self._ids = 0

    # ------------------------------------------------------------------------------------ requests

    def _load(self, i: int) -> tuple[int, int, int]:
        stats = self.engines[i].scheduler.stats()
        return len(self.engines[i].requests), stats["num_waiting"] + stats["num_running"], i

    def least_loaded(self) -> int:
        return min(range(len(self.engines)), key=self._load)

    def add_request(self, prompt: Any, params: Any = None, *, request_id: str | None = None,
                    priority: int = 0) -> str:
        """Check at the door (every replica has the same model), then queue on the least-loaded replica."""
        return self.queue(self.gate.admit(prompt, params, request_id=request_id, priority=priority))

    def queue(self, adm: Admission, output_kind: Any = None) -> str:
        if adm.request_id is None:
            adm = adm._replace(request_id=f"req-{self._ids}")
            self._ids += 1
        if adm.request_id in self._owner:
            raise InvalidInput(f"request_id {adm.request_id!r} is already in use by an unfinished request.",
                               field="request_id", value=adm.request_id)
        replica = self.least_loaded()
        rid = self.engines[replica].queue(adm, output_kind)
        self._owner[rid] = replica
        return rid

    def generate(self, prompts: Any, params: Any = None, *, use_tqdm: bool | None = None,
                 priority: Any = None) -> list[RequestOutput]:
        return frontend.generate(self, prompts, params, use_tqdm=use_tqdm, priority=priority)

    def stream(self, prompts: Any, params: Any = None) -> Any:
        return frontend.stream(self, prompts, params)

    # ------------------------------------------------------------------------------------ stepping

    def step(self) -> list[RequestOutput]:
        """One step of every replica that has work, run concurrently; their outputs, in replica order."""
        busy = [e for e in self.engines if e.has_unfinished()]
        if not busy:
            return []
        if len(busy) == 1:
            outputs = busy[0].step()
        else:
            outputs = [out for outs in self._pool.map(lambda e: e.step(), busy) for out in outs]
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        return outputs

    def abort(self, request_id: str) -> RequestOutput | None:
        replica = self._owner.pop(request_id, None)
        return None if replica is None else self.engines[replica].abort(request_id)

    def reset_prefix_cache(self) -> bool:
        return all([e.reset_prefix_cache() for e in self.engines])

    def has_unfinished(self) -> bool:
        return any(e.has_unfinished() for e in self.engines)

    def flush(self) -> list[RequestOutput]:
        return [out for e in self.engines for out in e.flush()]

    def warmup(self) -> None:
        for engine in self.engines:  # compiles in parallel inside each engine already
            engine.warmup()

    def wait_for_background_compile(self, timeout: float | None = None) -> bool:
        return all([e.wait_for_background_compile(timeout) for e in self.engines])

    def stats(self) -> dict[str, Any]:
        """Counts summed over replicas, rates averaged, and each replica's own stats under `replicas`."""
        per = [e.stats() for e in self.engines]
        out: dict[str, Any] = {}
        for key, value in per[0].items():
            values = [p[key] for p in per]
            if isinstance(value, bool) or not all(isinstance(v, int | float) for v in values):
                continue
            out[key] = sum(values) if isinstance(value, int) else float(np.mean(values))
        out["num_compiles_after_warmup"] = _sum_or_none([p["num_compiles_after_warmup"] for p in per])
        out["step_time_s"] = {k: sum(p["step_time_s"][k] for p in per) for k in per[0]["step_time_s"]}
        if "expert_token_counts" in per[0]:
            out.update(expert_load_stats(np.sum([p["expert_token_counts"] for p in per], axis=0)))
        out["data_parallel_size"] = len(self.engines)
        out["replicas"] = per
        return out

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)


def _sum_or_none(values: list[int | None]) -> int | None:
    return None if any(v is None for v in values) else sum(values)


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """The `data` slices of `mesh`, each a mesh of the same axes with data = 1."""
    grid = mesh.devices  # [data, ...]
    return [Mesh(grid[i : i + 1], mesh.axis_names) for i in range(grid.shape[0])]


def split_replicas(tree: Any, replicas: Sequence[Mesh]) -> list[Any]:
    """Arrays over a whole (data, ...) mesh, replicated over `data` -> one tree per replica mesh, each array
    made of the shards already on that replica's devices (no copy, no transfer)."""

    def one(mesh: Mesh) -> Any:
        devices = set(mesh.devices.flat)

        def view(a: jax.Array) -> jax.Array:
            sharding = NamedSharding(mesh, a.sharding.spec)
            shards = [s.data for s in a.addressable_shards if s.device in devices]
            return jax.make_array_from_single_device_arrays(a.shape, sharding, shards)

        return jax.tree.map(view, tree)

    return [one(m) for m in replicas]
