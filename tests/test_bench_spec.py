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

from model_helpers import load_script

REPO = Path(__file__).resolve().parents[1]


def _run(args: list[str], out: Path, timeout: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
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


def test_update_merges_a_run_split_over_two_calls() -> None:
    """`--update`: the GPU run is split over two device calls (k=2,4 then the real model and k=8); the second
    adds its k to the first's curve and recomputes the modelled speedups, keeping both command lines."""
    script = load_script("bench_spec")
    alphas = [0.0, 0.8]
    first = {"command": "a", "device": "H100", "shapes": {
        "alphas": alphas, "seconds_per_step": {"plain": {"1": 0.01}, "spec": {"2": {"1": 0.012}}}}}
    second = {"command": "b", "device": "H100", "measured": {"passed": True, "speedup": 2.0},
              "shapes": {"alphas": alphas, "seconds_per_step": {"plain": {"1": 0.02, "4": 0.011},
                                                                "spec": {"8": {"1": 0.02, "4": 0.03}}}}}
    out = script.merged(first, second)
    assert out["command"] == ["a", "b"] and out["measured"]["speedup"] == 2.0
    curve = out["shapes"]["seconds_per_step"]
    assert curve["plain"] == {"1": 0.01, "4": 0.011} and set(curve["spec"]) == {"2", "8"}
    assert out["shapes"]["modelled_speedup"]["8"]["1"]["0.0"] == pytest.approx(0.01 / 0.02)
    with pytest.raises(SystemExit, match="cannot be merged"):
        script.merged({**first, "device": "H200"}, second)
