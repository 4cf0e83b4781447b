"""scripts/bench_quantized.py's result file: a run with --only adds to what an earlier run wrote (the GPU figures
come from several device calls, each under its time limit) instead of blanking the figures it did not measure."""

from __future__ import annotations

from model_helpers import load_script


def test_a_partial_run_keeps_the_rows_and_figures_of_the_run_before() -> None:
    merge = load_script("bench_quantized").merge_section
    first = {"by_format": {"bf16": {"step_ms": 6.6}, "int8": {"step_ms": 4.8, "speedup_over_bf16": 1.39}},
             "decode_b1_int8_speedup": 1.39, "decode_b1_int4_speedup": None, "section_s": 100.0}
    second = {"by_format": {"bf16": {"step_ms": 6.1}, "int4": {"step_ms": 4.1, "speedup_over_bf16": 1.48}},
              "decode_b1_int8_speedup": None, "decode_b1_int4_speedup": 1.48, "section_s": 90.0}
    merged = merge(first, second)
    assert merged["by_format"] == {"bf16": {"step_ms": 6.1}, "int8": {"step_ms": 4.8, "speedup_over_bf16": 1.39},
                                   "int4": {"step_ms": 4.1, "speedup_over_bf16": 1.48}}
    assert (merged["decode_b1_int8_speedup"], merged["decode_b1_int4_speedup"]) == (1.39, 1.48)
    assert merged["section_s"] == 90.0
    assert merge(None, second) == second
