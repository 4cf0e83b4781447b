"""`scripts/bench_scaling.py` (the two-GPU runs of issues 18 and 19) on CPU with forced devices: every layout
beside one device in one command, every key written. CPU timings mean nothing; this checks that every path
runs. And the teacher-forced agreement measure on a real bundled model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from model_helpers import tiny_config, xla_flags_with_devices

pytestmark = pytest.mark.slow

REPO = Path(__file__).parents[1]
BENCH = ("--dtype float32 --max-num-seqs 4 --max-num-batched-tokens 32 --page-size 4 --num-pages 64 --decode-ctx 8 "
         "--decode-steps 4 --decode-steps-per-call 2 --copy-gib 0.001 --matmul-n 64 --prefill-tokens 0 "
         "--max-model-len 64")


def run_scaling(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "result.json"
    cmd = [sys.executable, "scripts/bench_scaling.py", "--devices", "2", "--grid", "12x6:4", "--bench-args", BENCH,
           "--agreement-model", "none", "--out", str(out), *args]
    env = {**os.environ, "XLA_FLAGS": xla_flags_with_devices(2), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_tp_mode_writes_every_tp2_key(tmp_path: Path) -> None:
    model = tmp_path / "tiny.yaml"
    model.write_text(yaml.safe_dump({k: getattr(v, "value", v) for k, v in vars(tiny_config()).items()}))
    result = run_scaling(tmp_path, "--model", str(model), "--big-model", str(model))
    for key in ("device", "decode_step_ratio_vs_tp1", "offline_ratio_vs_tp1", "dp2_offline_ratio_vs_tp1",
                "pair_mbu_batch1", "llama70b_decode_mbu_batch1", "llama70b_offline_fraction_of_limit"):
        assert result[key] is not None, key
    runs = result["runs"]
    assert runs["tp"]["mesh"]["mesh"]["tensor"] == 2 and runs["dp"]["mesh"]["data_parallel_size"] == 2
    assert runs["dp"]["mesh"]["num_devices"] == 2 and runs["tp1"]["mesh"]["num_devices"] == 1
    assert all(r["recompiles_after_warmup"] == 0 for r in runs.values())
    assert result["targets"]["offline_ratio_vs_tp1"]["bar"] == ">= 1.8"


def test_moe_mode_writes_every_moe_key_with_expert_load(tmp_path: Path) -> None:
    """One device and EP=2 only (`--layouts`): the TP and DP runs are the bench's own layouts, run on a model by the
    test above, and each layout is a bench process of its own (~20-30 s here)."""
    result = run_scaling(tmp_path, "--mode", "moe", "--model", str(REPO / "tests/data/mixtral-tiny"),
                         "--layouts", "tp1", "ep")
    for key in ("device", "ep2_offline_ratio_vs_ep1", "ep2_decode_step_ratio", "expert_load_max_over_mean"):
        assert result[key] is not None, key
    assert set(result["runs"]) == {"tp1", "ep"}
    assert result["tp2_offline_ratio_vs_ep1"] is None and result["dp2_offline_ratio_vs_ep1"] is None
    assert result["runs"]["ep"]["mesh"]["mesh"]["expert"] == 2
    counts = result["expert_token_counts"]
    assert len(counts) == 8 and sum(counts) > 0


def test_top1_agreement_of_tensor_parallel_with_one_device_on_real_weights() -> None:
    from jaxinfer.bench.agreement import top1_agreement

    # Single decode steps: the 24 sampled tokens then need no multi-step loop program, whose compile was a quarter
    # of this test (alone, from an empty compilation cache: 37.8 / 39.8 -> 28.5 / 32.4 s).
    out = top1_agreement("smollm2-135m-instruct", 24, 3, dtype="float32", max_num_batched_tokens=64, warmup=False,
                         decode_steps_per_call=1)
    assert out["positions"] > 20 and out["agreement"] > 0.95
