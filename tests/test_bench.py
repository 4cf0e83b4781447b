"""`jaxinfer bench` on CPU: the workload limits against the issue's worked estimate, the workload
generators, and one end-to-end run of every section on a tiny config (numbers checked for consistency,
not speed: CPU timings mean nothing here)."""

import json
import math

import numpy as np
import pytest

from jaxinfer.bench import report
from jaxinfer.bench.limits import ModelCost, attended_context, workload_limit
from jaxinfer.bench.main import add_arguments, execute, hf_comparison
from jaxinfer.bench.workloads import Workload, fixed, parse, prompts, sharegpt_like
from jaxinfer.presets import load_preset
from tests.model_helpers import tiny_config

H100_COPY, H100_MATMUL = 3.0e12, 785e12  # the ceilings DESIGN.md reports for one H100 80GB
GIB = 1 << 30


def _llama8b_limit(workload: Workload) -> dict:
    cost = ModelCost.of(load_preset("llama-3-8b"))
    kv_tokens = int((0.9 * 80 * GIB - cost.weight_bytes_per_step) // cost.kv_bytes_per_token)
    return workload_limit(cost, workload, kv_capacity_tokens=kv_tokens, max_num_seqs=4096,
                          copy_bw=H100_COPY, matmul_rate=H100_MATMUL)


def test_limit_matches_the_worked_estimate_for_llama3_8b():
    # The worked estimate: ~11,000 output tok/s at 1000/1000 (KV-read bound), ~24,000 at 128/128
    # (compute bound). Ours counts the LM head only for sampled tokens, hence a little above 24k.
    long = _llama8b_limit(fixed(1000, 1000, 2048))
    assert long["bound"] == "memory" and 10_000 < long["output_tok_s"] < 12_500
    assert 180 < long["batch"] < 260  # what 80 GB holds at 2000 tokens a sequence
    short = _llama8b_limit(fixed(128, 128, 8192))
    assert short["bound"] == "compute" and 23_000 < short["output_tok_s"] < 29_000


def test_model_cost_counts_llama3_8b_weights():
    cost = ModelCost.of(load_preset("llama-3-8b"))
    total = cost.body_params + 2 * cost.head_params  # untied: embedding + LM head
    assert abs(total - 8.03e9) / 8.03e9 < 0.01
    assert cost.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2


def test_attended_context_equals_brute_force():
    w = Workload("mix", (3, 1, 7), (4, 2, 1))
    brute = sum(i + t for i, o in zip(w.input_lens, w.output_lens) for t in range(o))
    assert attended_context(w) == brute


def test_workloads_parse_and_sharegpt_mix():
    assert parse("128x64", 3) == fixed(128, 64, 3)
    with pytest.raises(ValueError, match="INPUTxOUTPUT"):
        parse("128-64", 3)
    with pytest.raises(ValueError, match="at least 1"):
        fixed(0, 4, 2)
    mix = sharegpt_like(4000, seed=1)
    assert 4 <= min(mix.input_lens) and max(mix.input_lens) <= 2048 and max(mix.output_lens) <= 1024
    assert 190 < np.mean(mix.input_lens) < 260 and 165 < np.mean(mix.output_lens) < 225
    ids = prompts(fixed(5, 1, 2), vocab_size=100, seed=0)
    assert [len(p) for p in ids] == [5, 5] and max(max(p) for p in ids) < 100


def test_hf_comparison_ratio():
    hf = {"device": "X", "best_output_tok_s": {"1000/1000": 50.0}, "best_mode": {"1000/1000": "static"}}
    out = hf_comparison({"output_tok_s": 1000.0}, hf, fixed(1000, 1000, 4))
    assert out["ratio"] == pytest.approx(20.0) and out["hf_best_mode"] == "static"
    assert "ratio" not in hf_comparison({"output_tok_s": 1.0}, {"error": "no GPU"}, fixed(1000, 1000, 4))


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    import argparse

    out = tmp_path_factory.mktemp("bench") / "latest.json"
    argv = ["--grid", "24x12:6", "40x6:3", "--concurrency", "1", "4", "--sweep-workload", "20x5",
            "--decode-batches", "1", "4", "--decode-ctx", "20", "--decode-steps", "8", "--prefill-tokens", "48",
            "--max-num-seqs", "8", "--max-num-batched-tokens", "32", "--page-size", "4", "--num-pages", "96",
            "--decode-steps-per-call", "4", "--dtype", "float32", "--copy-gib", "0.01", "--matmul-n", "128",
            "--hf", "skip", "--out", str(out)]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.model = tiny_config()
    assert execute(args, argv) == 0
    return json.loads(out.read_text()), out


def test_bench_writes_every_headline_key(bench_run):
    result, out = bench_run
    keys = list(result)[:18]
    assert keys == ["device", "decode_mbu_batch1", "decode_mbu_batch64", "decode_mbu_batch1_streamed",
                    "prefill_mfu_4k", "offline_output_tok_s",
                    "offline_fraction_of_limit", "ratio_vs_hf", "recompiles_after_warmup", "warmup_s",
                    "cold_start_s", "warm_start_s", "itl_p99_over_median_c1", "itl_p99_over_median_max_c1_8",
                    "defaults_fraction_of_tuned", "cpu_ratio_vs_hf_b1", "cpu_ratio_vs_hf_b32", "command"]
    sweep_c1 = result["sweep"][0]["itl"]
    assert result["itl_p99_over_median_c1"] == pytest.approx(sweep_c1["p99_ms"] / sweep_c1["median_ms"])
    assert result["itl_p99_over_median_c1"] >= 1
    assert result["recompiles_after_warmup"] == 0 and "partial" not in result
    assert result["warmup_s"] > 0 and result["command"].startswith("jaxinfer bench --grid 24x12:6")
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_headline_carries_start_defaults_and_cpu_figures(tmp_path):
    result = {"grid": [{"workload": "1000/1000", "output_tok_s": 200.0, "fraction_of_limit": 0.5}],
              "start_times": {"cold": {"first_token_s": 50.0}, "warm": {"first_token_s": 9.0}},
              "defaults_run": {"output_tok_s": 190.0},
              "sweep": [{"concurrency": c, "itl": {"median_ms": 10.0, "p99_ms": p}} for c, p in [(1, 20.0), (8, 35.0)]],
              "carried": {"cpu_ratio_vs_hf_b1": (1.7, "cpu.json"), "cpu_ratio_vs_hf_b32": (2.2, "cpu.json"),
                          "warm_start_s": (99.0, "old.json")}}
    report.write(result, tmp_path / "latest.json")
    head = json.loads((tmp_path / "latest.json").read_text())
    assert head["cold_start_s"] == 50.0 and head["warm_start_s"] == 9.0  # measured here: not the carried 99
    assert head["defaults_fraction_of_tuned"] == pytest.approx(0.95)
    assert head["itl_p99_over_median_c1"] == 2.0 and head["itl_p99_over_median_max_c1_8"] == 3.5
    assert (head["cpu_ratio_vs_hf_b1"], head["cpu_ratio_vs_hf_b32"]) == (1.7, 2.2)


def test_only_separately_measured_figures_are_carried(tmp_path):
    from jaxinfer.bench.main import carried_figures

    (tmp_path / "a.json").write_text(json.dumps({"warm_start_s": 9.0, "offline_output_tok_s": 1.0, "device": "X"}))
    (tmp_path / "b.json").write_text(json.dumps({"warm_start_s": 99.0, "cpu_ratio_vs_hf_b1": None,
                                                 "cpu_ratio_vs_hf_b32": 2.5}))
    carried = carried_figures([str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert carried == {"warm_start_s": (9.0, str(tmp_path / "a.json")),
                       "cpu_ratio_vs_hf_b32": (2.5, str(tmp_path / "b.json"))}


def test_warm_start_reuses_the_cold_starts_cache_and_page_count(monkeypatch):
    from jaxinfer.bench import children

    specs, real_run_child = [], children.run_child

    def fake_child(kind, spec, timeout_s=900):
        specs.append((kind, spec))
        return {"num_pages": 77, "first_token_s": 1.0}

    monkeypatch.setattr(children, "run_child", fake_child)
    out = children.start_times("llama-3-8b", {"max_num_seqs": 4, "num_pages": None}, "/tmp/some-cache")
    (k1, cold), (k2, warm) = specs
    assert k1 == k2 == "start" and cold["cache_dir"] == warm["cache_dir"] == "/tmp/some-cache"
    assert cold["engine"]["num_pages"] is None and warm["engine"] == {"max_num_seqs": 4, "num_pages": 77}
    assert out["warm"]["first_token_s"] == 1.0
    failed = real_run_child("start", {"model": "no-such-model", "engine": {}, "cache_dir": "/tmp/x"})
    assert "no-such-model" in failed["error"]  # a child that fails is a record, not a crash


def test_bench_grid_counts_every_token_and_sits_under_its_limit(bench_run):
    result, _ = bench_run
    for g, (n_in, n_out, n) in zip(result["grid"], [(24, 12, 6), (40, 6, 3)]):
        assert g["output_tokens"] == n_out * n and g["input_tokens"] == n_in * n
        assert g["output_tok_s"] == pytest.approx(g["output_tokens"] / g["elapsed_s"])
        assert 0 < g["fraction_of_limit"] < 1  # a CPU run is nowhere near the roofline
        assert g["engine_steps"] > 0 and sum(g["step_time_s"].values()) <= g["elapsed_s"]


def test_bench_sweep_decode_and_prefill_are_consistent(bench_run):
    result, _ = bench_run
    assert [s["concurrency"] for s in result["sweep"]] == [1, 4]
    for s in result["sweep"]:
        assert s["num_prompts"] == max(4, 2 * s["concurrency"])
        for metric in ("ttft", "tpot", "itl", "e2e"):
            assert all(math.isfinite(v) and v >= 0 for v in s[metric].values())
        assert s["ttft"]["median_ms"] <= s["e2e"]["median_ms"]
        # The largest gaps, with the request and token they fell on (5 tokens a request: gaps before tokens 1-4).
        worst = s["itl_worst"]
        assert len(worst) == min(12, 4 * s["num_prompts"]) and [w["ms"] for w in worst] == sorted(
            (w["ms"] for w in worst), reverse=True)
        assert worst[0]["ms"] >= s["itl"]["p99_ms"] and all(1 <= w["token"] <= 4 for w in worst)
        assert {w["request"] for w in worst} <= set(range(s["num_prompts"]))
    decode = {d["batch"]: d for d in result["decode"]}
    assert set(decode) == {1, 4} and all(d["mbu"] > 0 for d in decode.values())
    assert decode[4]["bytes_per_step"] > decode[1]["bytes_per_step"]  # more KV attended
    for d in result["decode_device"]:  # the host-free timing of the same step
        assert d["single_step_ms"] > 0 and d["multi_step_ms_per_iteration"] > 0 and d["decode_steps_per_call"] == 4
        kernels = d["kernels"]  # CPU: no device events, so the host's spans are summed
        assert kernels["source"] == "host" and kernels["top"] and kernels["total_ms_per_call"] > 0
        assert sum(kernels["ms_per_call_by_class"].values()) == pytest.approx(kernels["total_ms_per_call"])
    prefill = result["prefill"]
    assert prefill["tokens"] == 48 and prefill["mfu"] > 0
    assert len(prefill["prefill_times_s"]) == 3 and prefill["prefill_s"] == sorted(prefill["prefill_times_s"])[1]
    text = report.table(result)
    assert "decode batch   1" in text and "offline         24/12" in text and "concurrency    4" in text


def test_a_failed_section_is_recorded_and_the_rest_still_run(tmp_path, monkeypatch):
    import argparse

    from jaxinfer.bench import measure

    def broken(*args, **kwargs):
        raise RuntimeError("profiler unavailable")

    monkeypatch.setattr(measure, "decode_device_profile", broken)
    out = tmp_path / "latest.json"
    # A baseline result as hf_baseline.py writes it (values made up): 2 prompts of 1000/1000.
    hf_json = tmp_path / "hf.json"
    hf_json.write_text(json.dumps({"device": "cpu", "spec": {"throughput": [{"name": "1000/1000", "num_prompts": 2}]},
                                   "best_output_tok_s": {"1000/1000": 0.5}, "best_mode": {"1000/1000": "static"}}))
    argv = ["--grid", "16x4:2", "32x4:2", "32x6:2", "--concurrency", "2", "--sweep-workload", "8x3",
            "--decode-batches", "1", "--decode-ctx", "8", "--decode-steps", "4", "--prefill-tokens", "0",
            "--max-num-seqs", "4",
            "--max-num-batched-tokens", "64", "--page-size", "16", "--num-pages", "200", "--dtype", "float32",
            "--copy-gib", "0.001", "--matmul-n", "64", "--hf-json", str(hf_json), "--hf-prompts", "64",
            "--max-model-len", "2048", "--plot", "none", "--out", str(out)]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.model = tiny_config()
    assert execute(args, argv) == 0
    result = json.loads(out.read_text())
    assert result["errors"] == [{"section": "decode_device", "error": "RuntimeError: profiler unavailable"}]
    assert "decode_device" not in result and len(result["decode"]) == 1
    assert result["grid"][0]["output_tokens"] == 8 and len(result["sweep"]) == 1
    hf = result["hf_comparison"]  # on the baseline's 2 prompts, not --hf-prompts 64
    assert hf["num_prompts"] == 2 and hf["ratio"] == pytest.approx(hf["ours_output_tok_s"] / 0.5)
    # The last two grid workloads draw the same prompts (one seed, one input length): each section starts from an
    # empty prefix cache, so the second computes them again.
    assert [g["prefix_cache_hit_tokens"] for g in result["grid"]] == [0, 0, 0]
    assert result["ratio_vs_hf"] == hf["ratio"]


def test_decode_mbu_survives_rows_that_decode_while_others_prefill():
    # Rows prefilled early decode while the rest prefill; the measurement used to count tokens through
    # engine.requests, which drops finished requests, and then waited forever. Now it tracks its own
    # states, and the engine is left empty.
    from jaxinfer import LLM
    from jaxinfer.bench import measure

    llm = LLM(tiny_config(), random_weights=True, max_num_seqs=8, max_num_batched_tokens=16, page_size=4,
              num_pages=200, max_model_len=96, decode_steps_per_call=4, use_tqdm=False)
    cost = ModelCost.of(llm.model_config, llm.dtype)
    out = measure.decode_mbu(llm, cost, batch=6, ctx=24, steps=5, copy_bw=1e9)
    assert out["batch"] == 6 and out["step_ms"] > 0 and not llm.has_unfinished()
    prof = measure.decode_device_profile(llm, cost, batch=6, ctx=24, copy_bw=1e9)
    assert prof["single_step_ms"] > 0 and not llm.has_unfinished()
    assert llm.engine_stats()["num_compiles_after_warmup"] == 0


def test_decode_mbu_times_generate_and_streamed_requests_on_their_own_paths():
    """The decode section times requests that return when finished (generate's): a small batch of them runs
    multi-step calls; `decode_streamed` times the same batch streamed, which steps singly where
    `single_step_max_rows` covers it (a GPU's default, set here by hand on the CPU)."""
    from jaxinfer import LLM
    from jaxinfer.bench import measure

    llm = LLM(tiny_config(), random_weights=True, max_num_seqs=4, max_num_batched_tokens=16, page_size=4,
              num_pages=200, max_model_len=96, decode_steps_per_call=4, single_step_max_rows=2, use_tqdm=False)
    cost = ModelCost.of(llm.model_config, llm.dtype)
    final = measure.decode_mbu(llm, cost, batch=1, ctx=12, steps=12, copy_bw=1e9)
    streamed = measure.decode_mbu(llm, cost, batch=1, ctx=12, steps=12, copy_bw=1e9, streamed=True)
    assert not final["streamed"] and final["overlapped_calls"] > 0 and final["pipelined_steps"] == 0
    assert streamed["streamed"] and streamed["pipelined_steps"] >= 8 and streamed["overlapped_calls"] == 0
    assert not llm.has_unfinished() and llm.engine_stats()["num_compiles_after_warmup"] == 0
    result = {"decode": [final], "decode_streamed": [streamed]}
    assert report.headline(result)["decode_mbu_batch1_streamed"] == streamed["mbu"]
    text = report.table({**result, "ceilings": {"copy_bw_gbs": 1.0, "matmul_tflops": 1.0}})
    assert "decode batch   1 ctx 12: " in text and "decode batch   1 ctx 12, streamed: " in text


def test_sweep_with_a_request_rate_sends_each_request_at_its_poisson_arrival(tiny_llm_for_sweep, bench_run):
    """--sweep-request-rate: requests arrive as a seeded Poisson process, capped at the concurrency; the run lasts
    at least until the last arrival, and a rate of 0 or below is refused."""
    import argparse

    from jaxinfer.bench import measure

    arrivals = measure.poisson_arrivals(6, 40.0, seed=3)
    assert arrivals == sorted(arrivals) and arrivals[0] > 0 and arrivals == measure.poisson_arrivals(6, 40.0, seed=3)
    assert measure.poisson_arrivals(3, None) == [0.0, 0.0, 0.0]
    out = measure.serve_at_concurrency(tiny_llm_for_sweep, fixed(8, 3, 6), 2, seed=3, request_rate=40.0)
    assert out["request_rate"] == 40.0 and out["duration_s"] >= arrivals[-1]
    assert out["num_prompts"] == 6 and out["ttft"]["median_ms"] > 0 and not tiny_llm_for_sweep.has_unfinished()
    assert "Poisson arrivals, 40 req/s" in report.table({**bench_run[0], "sweep": [out]})
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--sweep-request-rate", "0"])


@pytest.fixture(scope="module")
def tiny_llm_for_sweep():
    from jaxinfer import LLM

    return LLM(tiny_config(), random_weights=True, max_num_seqs=4, max_num_batched_tokens=16, page_size=4,
               num_pages=64, max_model_len=32, decode_steps_per_call=2, use_tqdm=False)


def test_kernel_classes_tell_the_named_pallas_kernels_apart():
    """The Pallas GPU kernels carry kernel_name into profiles: attention kernels count as attention, the quantized
    and grouped matmuls as matmuls (an anonymous Mosaic GPU kernel used to count as attention)."""
    from jaxinfer.bench.measure import kernel_class

    assert kernel_class("ragged_paged_attention_decode_mosaic_gpu_kernel") == "attention"
    for name in ("quantized_matmul_mosaic_gpu_kernel", "fp8_matmul_rows", "grouped_matmul_cols", "gather_matmul_swiglu",
                 "gemm_fusion_dot_97", "nvjet_hsh_128x256"):
        assert kernel_class(name) == "matmul", name
    assert kernel_class("loop_add_fusion_1") == kernel_class("anonymous_mosaic_gpu_kernel") == "other"


def test_limit_counts_the_longest_output_as_sequential_steps():
    # One long request among short ones: its 1000 tokens take 1000 steps, each reading every weight.
    cost = ModelCost.of(load_preset("llama-3-8b"))
    w = Workload("tail", (100,) * 64, (1000,) + (10,) * 63)
    lim = workload_limit(cost, w, kv_capacity_tokens=10**6, max_num_seqs=256, copy_bw=H100_COPY, matmul_rate=H100_MATMUL)
    assert lim["memory_s"] >= 1000 * cost.weight_bytes_per_step / H100_COPY


def test_moe_cost_counts_active_experts_at_batch_1_and_all_of_them_at_large_batch():
    from jaxinfer.models import family_for_config
    from jaxinfer.params import count_params

    cfg = load_preset("qwen3-30b-a3b")
    cost = ModelCost.of(cfg)
    active = cost.body_params + 2 * cost.head_params  # untied embedding + LM head
    assert abs(active - 3.35e9) / 3.35e9 < 0.01  # Qwen3-30B-A3B's published 3.3B activated parameters
    total_bytes = 2 * count_params(family_for_config(cfg).param_specs(cfg, "bfloat16")) - 2 * cost.head_params
    assert cost.weight_bytes(1) == cost.weight_bytes_per_step
    assert cost.weight_bytes(4096) == pytest.approx(total_bytes, rel=1e-3)  # every expert is read
    assert cost.weight_bytes(1) < cost.weight_bytes(8) < cost.weight_bytes(64)
