"""Batch jobs keep going past bad records: each bad record (every class the door refuses, and one that fails
alone during generation) lands once in the error file with its id and message, every good one once in the
output, the summary counts failures, exit code 0, and a SIGKILL + resume loses and repeats nothing."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import yaml

from jaxinfer.batch import run_job
from jaxinfer.engine.request import RequestState
from test_batch_jobs import ENGINE, read_output, run_cli
from tiny_checkpoint import write_tiny_hf_checkpoint

BAD_RECORDS = [  # (id, what the record holds past its id, a word the error message must contain)
    ("b-null-id-in-prompt", {"prompt": [1, None, 3]}, "prompt[1]"),
    ("b-float-ids", {"prompt": [504.7]}, "prompt[0]"),
    ("b-no-prompt", {}, "'prompt'"),
    ("b-null-prompt", {"prompt": None}, "prompt"),
    ("b-lone-surrogate", {"prompt": "\ud800 text"}, "surrogate"),
    ("b-empty", {"prompt": ""}, "empty"),
    ("b-outside-vocab", {"prompt": [49152]}, "outside the vocabulary"),
    ("b-too-long", {"prompt": [5] * 200}, "max_model_len"),
    ("b-temperature", {"prompt": "x", "sampling": {"temperature": -1}}, "temperature"),
    ("b-type", {"prompt": "x", "sampling": {"max_tokens": "many"}}, "max_tokens"),
    ("b-unknown-key", {"prompt": "x", "sampling": {"temprature": 1}}, "temprature"),
    ("b-sampling-not-object", {"prompt": "x", "sampling": [1]}, "sampling"),
    ("b-n", {"prompt": "x", "sampling": {"n": 9}}, "max_num_seqs"),
    ("b-bad-stop", {"prompt": "x", "sampling": {"stop": [""]}}, "stop"),
    ("b-fails-in-generation", {"prompt": "FAIL-IN-GENERATION please"}, "simulated failure"),
]
GOOD_EXTRAS = [{"sampling": {"stop": None}}, {"sampling": {"stop_token_ids": None, "max_tokens": 6}},
               {"sampling": {"stop": ["."], "include_stop_str_in_output": True}}, {}]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm2_path) -> Path:
    return write_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny_hf"), smollm2_path, seed=3)


def write_mixed_job(tmp: Path, model: Path, num_good: int, *, generation_failure: bool = True) -> tuple[Path, list, list]:
    good, bad = [], []
    lines = []
    for i in range(num_good):
        rid = f"g{i:02d}"
        good.append(rid)
        lines.append({"id": rid, "prompt": f"Record number {i}: tell me about item {i * 7 % 13}.",
                      **GOOD_EXTRAS[i % len(GOOD_EXTRAS)]})
        if i < len(BAD_RECORDS):  # interleaved, so bad records arrive while good ones run
            rid, fields, _ = BAD_RECORDS[i]
            if generation_failure or rid != "b-fails-in-generation":
                bad.append(rid)
                lines.append({"id": rid, **fields})
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in lines))
    job = {"model": str(model), "input": {"path": str(prompts)}, "output": {"path": str(tmp / "out.jsonl")},
           "sampling": {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True}, "engine": ENGINE}
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path, good, bad


def fail_in_generation(monkeypatch) -> None:
    """A record whose output handling raises during generation (it fails alone, like a tokenizer bug would)."""
    on_token = RequestState.on_token

    def maybe_failing(self, *args):
        if self.prompt and "FAIL-IN-GENERATION" in self.prompt and len(self.seqs[0].token_ids) >= 2:
            raise RuntimeError("simulated failure")
        return on_token(self, *args)

    monkeypatch.setattr(RequestState, "on_token", maybe_failing)


def test_bad_records_go_to_the_error_file_once_and_are_not_retried(tmp_path: Path, tiny_model: Path,
                                                                     monkeypatch, capsys) -> None:
    fail_in_generation(monkeypatch)
    job, good, bad = write_mixed_job(tmp_path, tiny_model, num_good=18)
    summary = run_job(job, use_tqdm=False)
    out, errors = read_output(tmp_path / "out.jsonl"), read_output(tmp_path / "out.errors.jsonl")
    assert sorted(out) == good and sorted(errors) == sorted(bad)
    messages = {rid: word for rid, _, word in BAD_RECORDS}
    for rid, record in errors.items():
        assert messages[rid] in record["error"] and "\n" not in record["error"], record
    assert summary["requests_completed"] == len(good) and summary["requests_failed"] == len(bad)
    assert all(len(out[g]["token_ids"]) == (6 if i % 4 == 1 else 10) or out[g]["finish_reason"] == "stop"
               for i, g in enumerate(good))
    assert f"{len(bad)} record(s) failed" in capsys.readouterr().out
    again = run_job(job, use_tqdm=False)  # resume: nothing left, nothing redone
    assert again["requests_skipped_as_done"] == len(good) + len(bad) and again["requests_completed"] == 0
    assert read_output(tmp_path / "out.jsonl") == out and read_output(tmp_path / "out.errors.jsonl") == errors


def test_chat_records_with_bad_messages(tmp_path: Path, tiny_model: Path) -> None:
    records = [{"id": "good", "messages": [{"role": "user", "content": "Hi"}]},
               {"id": "no-role", "messages": [{"content": "Hi"}]},
               {"id": "content-number", "messages": [{"role": "user", "content": 5}]},
               {"id": "not-a-list", "messages": "Hi"}, {"id": "missing"},
               {"id": "also-good", "messages": [{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    job = {"model": str(tiny_model), "input": {"path": str(tmp_path / "chat.jsonl"), "messages_field": "messages"},
           "output": {"path": str(tmp_path / "chat_out.jsonl"), "error_path": str(tmp_path / "bad.jsonl")},
           "sampling": {"max_tokens": 4, "temperature": 0.0}, "engine": ENGINE}
    (tmp_path / "chat.yaml").write_text(yaml.safe_dump(job))
    summary = run_job(tmp_path / "chat.yaml", use_tqdm=False)
    errors = read_output(tmp_path / "bad.jsonl")
    assert sorted(read_output(tmp_path / "chat_out.jsonl")) == ["also-good", "good"]
    assert errors["no-role"]["error"].startswith("record 'no-role': messages[0].role must be")
    assert "messages[0].content" in errors["content-number"]["error"] and "'messages'" in errors["missing"]["error"]
    assert summary["requests_failed"] == 4


@pytest.mark.slow
def test_mixed_job_survives_sigkill_and_resume(tmp_path: Path, tiny_model: Path) -> None:
    job, good, bad = write_mixed_job(tmp_path, tiny_model, num_good=30, generation_failure=False)
    out = tmp_path / "out.jsonl"
    killed = run_cli(job, tmp_path)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 3):
        assert killed.poll() is None, killed.stdout.read().decode()
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    partial = len(out.read_text().splitlines())
    assert 3 <= partial < len(good), f"the kill came too late to test resumption ({partial} records)"
    resumed = run_cli(job, tmp_path)
    log = resumed.stdout.read().decode()
    assert resumed.wait(timeout=300) == 0, log
    assert sorted(read_output(out)) == good and sorted(read_output(tmp_path / "out.errors.jsonl")) == sorted(bad)
    summary = json.loads((tmp_path / "out.summary.json").read_text())
    done_before = summary["requests_skipped_as_done"]
    assert done_before >= 3 and summary["requests_completed"] + summary["requests_failed"] + done_before == len(
        good) + len(bad)
    assert "Traceback" not in log
