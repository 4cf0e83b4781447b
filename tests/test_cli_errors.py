"""Every user mistake on the command line is one line on stderr and exit code 2, before any model loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from jaxinfer.cli import main


def job(tmp: Path, **sections) -> Path:
    (tmp / "in.jsonl").write_text('{"id": 1, "prompt": "hi"}\n')
    data = {"model": str(tmp / "no-such-model.gguf"), "input": {"path": str(tmp / "in.jsonl")},
            "output": {"path": str(tmp / "out" / "o.jsonl")}, **sections}
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    "case, message",
    [
        (lambda t: ["batch", str(t / "missing.yaml")], "no such job file"),
        (lambda t: ["batch", str(job(t, engine={"max_num_seqs": "many"}))], "engine.max_num_seqs must be None (the platform's"),
        (lambda t: ["batch", str(job(t, engine={"revision": "v1"}))], "engine.revision='v1' is not supported"),
        (lambda t: ["batch", str(job(t, sampling={"temperature": "hot"}))], "SamplingParams.temperature must be"),
        (lambda t: ["batch", str(job(t, sampling={"stop": [""]}))], "SamplingParams.stop must be"),
        (lambda t: ["batch", str(job(t))], "no-such-model.gguf: no such file or directory"),
        (lambda t: (t / "job.yaml").write_text("model: [unclosed") and ["batch", str(t / "job.yaml")], "invalid YAML"),
        (lambda t: (t / "job.yaml").write_bytes(b"model: \xff\xfe") and ["batch", str(t / "job.yaml")],
         "cannot read the file"),
        (lambda t: ["batch", str(job(t, output={"path": "/proc/no/o.jsonl"}))], "output.path: cannot write"),
        (lambda t: ["generate", "--prompt", "x", "--temperature", "-1"], "SamplingParams.temperature must be"),
        (lambda t: ["generate", "--prompt", "x", "--model", "org/not-local"], "nothing is downloaded"),
    ],
)
def test_one_line_and_exit_code_2(tmp_path: Path, capsys, case, message: str) -> None:
    assert main(case(tmp_path)) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
