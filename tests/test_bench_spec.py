"""scripts/bench_spec.py (issue 17's speculative-decoding benchmark): the CPU smoke mode writes every key the
GPU run writes; the GPU run itself is marked `gpu`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(args: list[str], out: Path, timeout: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "scripts/bench_spec.py", *args, "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_smoke_writes_the_measured_run_and_the_cost_curve(tmp_path: Path) -> None:
    result = _run(["--smoke"], tmp_path / "spec.json", 600)
    measured = result["measured"]
    assert measured["identical"] and measured["output_tokens"] == 12
    for key in ("plain_tok_s", "spec_tok_s", "speedup", "spec_acceptance_rate", "spec_mean_accepted_length",
                "required_speedup", "passed"):
        assert key in measured
    shapes = result["shapes"]
    assert set(shapes["seconds_per_step"]["plain"]) == {"1", "2"}
    assert set(shapes["modelled_speedup"]["2"]["1"]) == {f"{a:.1f}" for a in shapes["alphas"]}
    assert "passed" in result and result["command"].startswith("python3 scripts/bench_spec.py")


@pytest.mark.gpu
def test_gpu_speedup_on_a_copying_prompt(tmp_path: Path) -> None:
    """The GPU run's measured part alone (the full command is in docs/PERFORMANCE.md)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU (jax.default_backend() != 'gpu')")
    model = os.environ.get("JAXINFER_SMOLLM2_GGUF", "smollm2-135m-instruct")
    result = _run(["--parts", "measured", "--real-model", model], tmp_path / "spec.json", 600)
    assert result["measured"]["identical"]
    assert result["measured"]["speedup"] >= result["measured"]["required_speedup"], result["measured"]
