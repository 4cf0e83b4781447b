"""`jaxinfer bench-serve` against a live tiny-model server: closed loop at two concurrencies and an open loop,
the sweep JSON in `jaxinfer bench`'s format, and a plot."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.serve.conftest import REPO, running, tiny_args


def test_bench_serve_closed_and_open_loop(tmp_path, tiny_model_yaml, smollm2_path) -> None:
    with running(tiny_args(tiny_model_yaml, smollm2_path), tmp_path / "server.log") as server:
        out = tmp_path / "serve.json"
        base = [sys.executable, "-m", "jaxinfer.cli", "bench-serve", "--base-url", server.base_url, "--workload",
                "16x8", "--num-prompts", "12"]
        r = subprocess.run([*base, "--concurrency", "1", "4", "--out", str(out)], cwd=REPO, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        result = json.loads(out.read_text())
        assert [s["concurrency"] for s in result["sweep"]] == [1, 4]
        for s in result["sweep"]:
            assert s["completed"] == 12 and s["output_tokens"] == 12 * 8
            for key in ("ttft", "tpot", "itl", "e2e"):
                assert set(s[key]) == {"mean_ms", "median_ms", "p90_ms", "p99_ms"}
            assert s["output_throughput"] > 0 and s["ttft"]["median_ms"] > 0
        assert out.with_suffix(".png").stat().st_size > 0
        r = subprocess.run([*base, "--endpoint", "chat", "--request-rate", "20", "--concurrency", "8", "--structured",
                            "person", "--out", str(tmp_path / "open.json"), "--plot", "none"], cwd=REPO,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        level = json.loads((tmp_path / "open.json").read_text())["sweep"][0]
        assert level["completed"] == 12 and level["request_rate"] == 20
        # A run whose requests take another run's lengths, request by request (the structured-output twin).
        lens = tmp_path / "lens.json"
        lens.write_text(json.dumps([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4]))
        r = subprocess.run([*base, "--concurrency", "4", "--output-lens", str(lens), "--out",
                            str(tmp_path / "lens_run.json"), "--plot", "none"], cwd=REPO, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        level = json.loads((tmp_path / "lens_run.json").read_text())["sweep"][0]
        assert level["per_request_tokens"] == json.loads(lens.read_text())


def test_output_lens_must_give_one_integer_per_prompt(tmp_path) -> None:
    import pytest

    from jaxinfer.bench.serve_bench import with_output_lens
    from jaxinfer.bench.workloads import parse

    path = tmp_path / "lens.json"
    path.write_text("[3, 4]")
    assert with_output_lens(parse("16x8", 2, 0), path).output_lens == (3, 4)
    for bad in ("[3]", "[3, 4.5]", '{"a": 1}'):
        path.write_text(bad)
        with pytest.raises(ValueError, match="one per prompt"):
            with_output_lens(parse("16x8", 2, 0), path)


def test_each_load_level_sends_prompts_no_earlier_level_sent() -> None:
    """The server's prefix cache keeps what one level sent; the next must not find it there (one seed, as
    `jaxinfer bench` workloads, would resend the same prompts and time cached prefills)."""
    from jaxinfer.bench.serve_bench import level_prompts
    from jaxinfer.bench.workloads import parse, prompts

    workload = parse("sharegpt", 6, 0)
    warm = prompts(workload, 1000, 0)[0]
    levels = [level_prompts(workload, 1000, 0, k) for k in range(3)]
    firsts = {tuple(p[:16]) for batch in levels for p in batch} | {tuple(warm[:16])}
    assert len(firsts) == 3 * 6 + 1  # no two prompts share even a first page
    assert all([len(p) for p in batch] == list(workload.input_lens) for batch in levels)
