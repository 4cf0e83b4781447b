"""Multi-host on one machine: 2 processes x 2 forced CPU devices on localhost, one tensor-parallel mesh of 4.

Both processes run the same program (tests/distributed/multihost_worker.py) through jax.distributed over
the gloo CPU collectives; the mesh spans them, so every layer's all-reduce crosses processes. Greedy tokens
of the bundled Gemma-3-270M must equal HF's golden tokens, which the single-process parity test also pins,
through the Python API and through a batch job (whose records every process runs and process 0 alone writes).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from model_helpers import xla_flags_with_devices

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("multihost_worker.py")
REPO = Path(__file__).parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_tensor_parallel_4_give_the_golden_tokens(tmp_path: Path, gemma3_path: Path) -> None:
    port = _free_port()
    out = tmp_path / "out.json"
    procs = []
    for pid in range(2):
        env = {**os.environ, "XLA_FLAGS": xla_flags_with_devices(2), "JAX_PLATFORMS": "cpu",
               "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(pid),
               "PYTHONPATH": str(REPO)}
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(out)], env=env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("multi-host workers did not finish in 600 s")
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    result = json.loads(out.read_text())
    assert result["process_count"] == 2 and len(result["devices"]) == 4 and result["mesh"]["tensor"] == 4
    assert result["tokens"] == result["want"]
    # The batch job: both processes ran every record, process 0 alone wrote them, once each.
    assert result["job_tokens"] == result["want"] and result["job_completed"] == 2
    assert sorted(p.name for p in tmp_path.glob("out*.jsonl")) == ["out.errors.jsonl", "out.jsonl"]  # no per-process files
