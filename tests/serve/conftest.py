"""Servers for the serve tests: `jaxinfer serve` in a subprocess on a free loopback port, driven over HTTP.

`tiny_model_yaml` is a two-layer random Llama of SmolLM2's shape family (served with SmolLM2's real
tokenizer and chat template), which compiles in seconds; the real SmolLM2 checkpoint serves the tests that
compare against HF's goldens. Every server is stopped (SIGTERM, then SIGKILL after a bound) when its fixture
ends, and every client call in these tests has a timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 420
ENGINE_FLAGS = ["--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--block-size", "16",
                "--attention-impl", "reference", "--dtype", "float32"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Server:
    proc: subprocess.Popen
    base_url: str
    log: Path

    def url(self, path: str) -> str:
        return self.base_url + path

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


def start_server(args: list[str], log: Path, timeout: float = START_TIMEOUT_S) -> Server:
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "jaxinfer.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    f = open(log, "wb")  # noqa: SIM115 - kept open for the life of the process
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{server.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(server.url("/health"), timeout=2).status_code == 200:
                return server
        time.sleep(0.5)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"the server did not start within {timeout} s:\n{server.log_tail()}")


@pytest.fixture(scope="session")
def tiny_model_yaml(tmp_path_factory) -> Path:
    from jaxinfer.presets import load_preset

    cfg = load_preset("smollm2-135m").replace(hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                                               num_kv_heads=2, head_dim=16, tie_word_embeddings=False)
    values = {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in dataclasses.asdict(cfg).items()}
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


@contextlib.contextmanager
def running(args: list[str], log: Path) -> Iterator[Server]:
    server = start_server(args, log)
    try:
        yield server
    finally:
        server.stop()


def tiny_args(tiny_model_yaml: Path, smollm2_path: Path, *extra: str) -> list[str]:
    return ["--model", str(tiny_model_yaml), "--random-weights", "--tokenizer", str(smollm2_path),
            "--served-model-name", "tiny", "--max-model-len", "128", "--num-pages", "64", *ENGINE_FLAGS, *extra]


def assembled(outs: list, index: int, delta: bool) -> tuple[list[int], str, list]:
    """Sequence `index` of a request's streamed outputs as (ids, text, logprobs): DELTA chunks joined in order,
    or else what the last output holds."""
    if delta:
        chunks = [c for o in outs for c in o.outputs if c.index == index]
        return ([t for c in chunks for t in c.delta_token_ids], "".join(c.delta_text for c in chunks),
                [lp for c in chunks for lp in c.logprobs or []])
    final = next(c for c in outs[-1].outputs if c.index == index)
    return final.token_ids, final.text, final.logprobs
