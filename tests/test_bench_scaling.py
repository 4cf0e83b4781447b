"""`scripts/bench_scaling.py` (the two-GPU run of issue 18) on CPU: 6 forced devices, a tiny model, TP=3 and
DP=3 beside one device, the big-model run and the real-model agreement, all in one command. CPU timings mean
nothing; this checks that every path runs and every key is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from model_helpers import tiny_config

pytestmark = pytest.mark.slow

REPO = Path(__file__).parents[1]


def test_scaling_command_writes_every_tp2_key(tmp_path: Path) -> None:
    cfg = tiny_config(num_heads=6, num_kv_heads=3, hidden_size=96, head_dim=16)
    model = tmp_path / "tiny.yaml"
    model.write_text(yaml.safe_dump({k: (v.value if hasattr(v, "value") else v) for k, v in vars(cfg).items()}))
    out = tmp_path / "tp2.json"
    bench = ("--dtype float32 --max-num-seqs 4 --max-num-batched-tokens 32 --page-size 4 --num-pages 64 "
             "--decode-ctx 8 --decode-steps 4 --decode-steps-per-call 2 --copy-gib 0.001 --matmul-n 64 "
             "--prefill-tokens 0 --max-model-len 64")
    cmd = [sys.executable, "scripts/bench_scaling.py", "--model", str(model), "--big-model", str(model),
           "--devices", "3", "--grid", "12x6:4", "--bench-args", bench, "--agreement-model", "smollm2-135m-instruct",
           "--agreement-tokens", "24", "--out", str(out)]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=6", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for key in ("device", "decode_step_ratio_vs_tp1", "offline_ratio_vs_tp1", "dp2_offline_ratio_vs_tp1",
                "pair_mbu_batch1", "llama70b_decode_mbu_batch1", "llama70b_offline_fraction_of_limit",
                "top1_agreement_tp2_vs_tp1"):
        assert result[key] is not None, key
    runs = result["runs"]
    assert runs["tp"]["mesh"]["mesh"]["tensor"] == 3 and runs["dp"]["mesh"]["data_parallel_size"] == 3
    assert runs["dp"]["mesh"]["num_devices"] == 3 and runs["tp1"]["mesh"]["num_devices"] == 1
    assert all(r["recompiles_after_warmup"] == 0 for r in runs.values())
    assert result["agreement"]["positions"] > 20 and result["top1_agreement_tp2_vs_tp1"] > 0.9
    assert set(result["targets"]) >= {"decode_step_ratio_vs_tp1", "offline_ratio_vs_tp1"}
