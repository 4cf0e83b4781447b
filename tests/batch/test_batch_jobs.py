"""Batch jobs: strict config (YAML and gin), id checks, and resumability across SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from jaxinfer.batch.job import load_job
from jaxinfer.batch.records import ResumableWriter, check_ids
from jaxinfer.config import ConfigError
from tiny_checkpoint import write_tiny_hf_checkpoint

ENGINE = {"dtype": "float32", "max_model_len": 128, "max_num_seqs": 8, "max_num_batched_tokens": 32, "num_pages": 64}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm2_path) -> Path:
    return write_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny_hf"), smollm2_path, seed=3)


def write_job(tmp: Path, model: Path, n: int, *, name: str = "job", extra: dict | None = None) -> Path:
    prompts = tmp / "prompts.jsonl"
    with open(prompts, "w") as f:
        for i in range(n):
            record = {"id": f"r{i:02d}", "prompt": f"Record number {i}: tell me about item {i * 7 % 13}."}
            if i % 5 == 0:  # per-record override: some records are shorter
                record["sampling"] = {"max_tokens": 6}
            f.write(json.dumps(record) + "\n")
    job = {"model": str(model), "input": {"path": str(prompts)}, "output": {"path": str(tmp / f"{name}.jsonl")},
           "sampling": {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}, "engine": ENGINE, **(extra or {})}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def run_cli(job: Path, cwd: Path) -> subprocess.Popen:
    # The package under test, not whichever jaxinfer the interpreter has installed (cwd is elsewhere).
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    env.pop("XLA_FLAGS", None)  # one CPU device is enough and starts faster
    return subprocess.Popen([sys.executable, "-m", "jaxinfer.cli", "batch", str(job)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def read_output(path: Path) -> dict[str, dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    by_id = {r["id"]: r for r in records}
    assert len(by_id) == len(records), "an id was written twice"
    return by_id


@pytest.mark.slow
def test_sigkill_and_restart_equals_clean_run(tmp_path: Path, tiny_model: Path) -> None:
    clean_job = write_job(tmp_path, tiny_model, 24, name="clean")
    killed_job = write_job(tmp_path, tiny_model, 24, name="killed")
    clean = run_cli(clean_job, tmp_path)
    killed = run_cli(killed_job, tmp_path)
    out = tmp_path / "killed.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 3):
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert clean.wait(timeout=300) == 0, clean.stdout.read().decode()
    partial = len(out.read_text().splitlines())
    assert 3 <= partial < 24, f"the kill came too late to test resumption ({partial} records)"
    resumed = run_cli(killed_job, tmp_path)
    log = resumed.stdout.read().decode()
    assert resumed.wait(timeout=300) == 0, log
    summary = json.loads((tmp_path / "killed.summary.json").read_text())
    assert summary["requests_skipped_as_done"] >= 3 and summary["requests_completed"] == 24 - summary["requests_skipped_as_done"]
    assert 0 < summary["itl_p50_s"] <= summary["itl_p99_s"] and 0 < summary["ttft_p50_s"] <= summary["ttft_p99_s"]
    assert summary["num_compiles_after_warmup"] == 0 and summary["output_tokens_per_s"] > 0
    a, b = read_output(tmp_path / "clean.jsonl"), read_output(out)
    assert sorted(a) == sorted(b) == [f"r{i:02d}" for i in range(24)]
    for rid in a:
        assert (a[rid]["token_ids"], a[rid]["text"]) == (b[rid]["token_ids"], b[rid]["text"]), rid
    assert len(a["r05"]["token_ids"]) == 6 and len(a["r01"]["token_ids"]) == 12  # per-record override


def test_torn_last_line_is_dropped_on_resume(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_text('{"id": "a", "text": "x"}\n{"id": "b", "te')
    with ResumableWriter(path) as w:
        assert w.done == {"a"}
        w.write({"id": "b", "text": "y"})
    assert [json.loads(x)["id"] for x in path.read_text().splitlines()] == ["a", "b"]


def test_duplicate_and_missing_ids_are_reported_before_work() -> None:
    with pytest.raises(ConfigError, match="id 'x' appears twice \\(records 1 and 3\\)"):
        check_ids([{"id": "x"}, {"id": "y"}, {"id": "x"}], "id", "in.jsonl")
    with pytest.raises(ConfigError, match="record 2 has no 'id' field"):
        check_ids([{"id": "x"}, {"prompt": "p"}], "id", "in.jsonl")


@pytest.mark.parametrize(
    "section, bad, message",
    [
        ("sampling", {"max_tokens": 4, "temprature": 0.5}, "unknown key\\(s\\) 'temprature'"),
        ("engine", {"max_num_seqz": 4}, "engine.max_num_seqz is not an argument jaxinfer knows; did you mean "
                                        "max_num_seqs"),
        ("input", {"path": "p.jsonl", "promt_field": "x"}, "input: unknown key\\(s\\) 'promt_field'"),
        ("top", None, "job: unknown key\\(s\\) 'modle'"),
    ],
)
def test_unknown_keys_are_named(tmp_path: Path, section: str, bad, message: str) -> None:
    job = {"model": "m", "input": {"path": "p.jsonl"}, "output": {"path": "o.jsonl"}}
    if section == "top":
        job["modle"] = "x"
    else:
        job[section] = bad
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    with pytest.raises(ConfigError, match=message):
        load_job(path)


def test_gin_job_equals_yaml_job() -> None:
    root = Path(__file__).resolve().parents[2]
    assert load_job(root / "configs/jobs/quickstart.gin").replace(output=None) == load_job(
        root / "configs/jobs/quickstart.yaml").replace(output=None)


def test_multi_host_layout_helpers() -> None:
    """Which records a process runs and which files it writes follow the replica size (runner.run_job)."""
    from jaxinfer.batch.runner import devices_per_replica, process_path

    assert devices_per_replica({"tensor_parallel_size": 4, "expert_parallel_size": 2}) == 8
    assert devices_per_replica({"data_parallel_size": 4}) == 1  # replicas are not one replica's devices
    assert process_path(Path("out/res.jsonl")) == Path("out/res.process0-of-1.jsonl")
