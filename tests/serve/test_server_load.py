"""Load and lifecycle of `jaxinfer serve` on a tiny random model: 503 over --max-waiting, and a graceful
SIGTERM (requests in flight finish or end cleanly with [DONE], new ones are refused, exit code 0)."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from tests.serve.conftest import start_server, tiny_args

TIMEOUT = 60


def _stream_lines(url: str, body: dict, out: list[str], started: threading.Event | None = None) -> None:
    with httpx.Client(timeout=TIMEOUT) as h, h.stream("POST", url, json=body) as r:
        out.append(f"status {r.status_code}")
        for line in r.iter_lines():
            if line:
                out.append(line)
                if started is not None:
                    started.set()


def test_503_when_waiting_queue_is_full_and_graceful_sigterm(tmp_path, tiny_model_yaml, smollm2_path) -> None:
    args = tiny_args(tiny_model_yaml, smollm2_path, "--max-waiting", "1", "--shutdown-timeout", "2")
    args[args.index("--max-num-seqs") + 1] = "1"
    # A must still run when the third request comes: long enough (the 64 pages hold 1,024 tokens) that it cannot
    # finish first on a loaded machine, which would let B run and the third request be admitted.
    args[args.index("--max-model-len") + 1] = "1000"
    server = start_server(args, tmp_path / "server.log")
    try:
        url = server.url("/v1/completions")
        long = {"model": "tiny", "prompt": "Once", "max_tokens": 990, "ignore_eos": True, "stream": True}
        a_lines: list[str] = []
        a_started = threading.Event()
        a = threading.Thread(target=_stream_lines, args=(url, long, a_lines, a_started))
        a.start()
        assert a_started.wait(TIMEOUT)  # A runs (max_num_seqs=1)
        b_lines: list[str] = []
        b = threading.Thread(target=_stream_lines, args=(url, long, b_lines))
        b.start()
        deadline, waiting = time.monotonic() + TIMEOUT, False
        while not waiting and time.monotonic() < deadline:  # B waits behind A
            text = httpx.get(server.url("/metrics"), timeout=10).text
            waiting = 'jaxinfer:num_requests_waiting{model_name="tiny"} 1.0' in text
            time.sleep(0.05)
        assert waiting, "B never waited behind A"
        r = httpx.post(url, json={**long, "stream": False}, timeout=TIMEOUT)
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "server_overloaded" and r.json()["error"]["type"] == "server_error"

        server.proc.send_signal(signal.SIGTERM)  # A and B get 2 s, then are aborted; each stream ends with [DONE]
        a.join(TIMEOUT)
        b.join(TIMEOUT)
        assert server.proc.wait(TIMEOUT) == 0
    finally:
        server.stop(signal.SIGKILL)
    for lines in (a_lines, b_lines):
        assert lines[0] == "status 200" and lines[-1] == "data: [DONE]", lines[-3:]
        assert any('"finish_reason":"abort"' in line or '"finish_reason":"length"' in line for line in lines)
    assert "Traceback" not in server.log_tail(20000)


@pytest.mark.parametrize("flag", [["--port", "99999"], ["--max-num-seqs", "0"], ["--temperature", "1"],
                                  ["--stream-interval", "0"]])
def test_bad_flags_are_one_line_and_exit_2(flag, tiny_model_yaml, smollm2_path) -> None:
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "jaxinfer.cli", "serve", "--model", str(tiny_model_yaml), *flag]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) <= 3 and "Traceback" not in r.stderr
