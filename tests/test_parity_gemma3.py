"""Real Gemma-3-270M (bundled GGUF, float32, CPU) against HF transformers goldens (scripts/make_golden.py).

The golden's long prompt (650 tokens) crosses the 512-token sliding window, and the engine feeds it in
64-token chunks, so local layers attend across chunk boundaries with keys dropping out of the window.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.batcher import BatchShape, SeqChunk, pack
from jaxinfer.models.fused import split_projections

pytestmark = pytest.mark.slow

# quantization="auto": the GGUF's blocks kept quantized (the CPU default would dequantize them at load).
ENGINE_KW = dict(dtype="float32", quantization="auto", max_model_len=768, max_num_seqs=8, max_num_batched_tokens=64,
                 num_pages=160, page_size=16, attention_impl="reference", use_tqdm=False)
LOGITS_PAGES = list(range(110, 160))  # pages above what the engine hands out in this module's tests


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("gemma3-270m", **ENGINE_KW)


def greedy_params(case: dict) -> SamplingParams:
    """HF's goldens ban exactly `suppressed_token_ids` until the last token (min_new_tokens == max_new_tokens).

    Here: no EOS stopping, and the same ids banned through stop_token_ids under min_tokens.
    """
    n = case["max_new_tokens"]
    return SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True,
                          stop_token_ids=tuple(case["suppressed_token_ids"]))


def test_golden_covers_the_sliding_window(gemma3_golden: dict) -> None:
    window = gemma3_golden["config"]["sliding_window"]
    assert max(len(c["prompt_ids"]) for c in gemma3_golden["greedy"]) > window
    assert max(len(c["prompt_ids"]) for c in gemma3_golden["logits"]) > window


def test_config_matches_hf(llm: LLM, gemma3_golden: dict) -> None:
    from jaxinfer.models.gemma3 import gemma3_extras

    hf, cfg = gemma3_golden["config"], llm.model_config
    ex = gemma3_extras(cfg)
    assert (cfg.num_layers, cfg.hidden_size, cfg.head_size, cfg.vocab_size) == (
        hf["num_hidden_layers"], hf["hidden_size"], hf["head_dim"], hf["vocab_size"])
    assert (cfg.sliding_window, cfg.query_pre_attn_scalar) == (hf["sliding_window"], hf["query_pre_attn_scalar"])
    assert cfg.rope_local_theta == hf["rope_parameters"]["sliding_attention"]["rope_theta"]
    assert [("full_attention" if ex.is_global(i) else "sliding_attention") for i in range(cfg.num_layers)] == (
        hf["layer_types"])


def test_greedy_tokens_equal_hf(llm: LLM, gemma3_golden: dict) -> None:
    cases = gemma3_golden["greedy"]
    outs = llm.generate([c["prompt_ids"] for c in cases], [greedy_params(c) for c in cases])
    for case, out in zip(cases, outs):
        assert out.token_ids == case["output_ids"], case["prompt"][:80]
    assert llm.engine_stats()["num_compiles_after_warmup"] == 0


def test_logits_of_first_decode_steps_within_1e4(llm: LLM, gemma3_golden: dict) -> None:
    runner = llm.engine.runner
    shape = BatchShape(tokens=64, seqs=8, pages_per_seq=64)
    for case in gemma3_golden["logits"]:
        ids = list(case["prompt_ids"])
        start, prev_argmax = 0, None
        for step in case["steps"]:
            n = step["input_len"]
            while len(ids) < n:  # the golden's inputs grow by its greedy argmax, one token per step
                ids.append(prev_argmax)
            logits = None
            for chunk_start in range(start, n, 64):  # the long prompt takes several 64-token steps
                chunk = ids[chunk_start : min(chunk_start + 64, n)]
                batch = pack([SeqChunk(chunk, chunk_start, LOGITS_PAGES)], shape, 16)
                logits = np.asarray(runner.logits(runner.place(batch)))[0]
            start = n
            idx = np.asarray(step["indices"])
            want = np.asarray(step["values"], np.float64)
            assert np.linalg.norm(logits[idx] - want) / np.linalg.norm(want) < 1e-4
            assert int(logits.argmax()) == step["argmax"]
            assert np.linalg.norm(logits) == pytest.approx(step["norm"], rel=1e-4)
            prev_argmax = step["argmax"]


def test_gguf_kept_quantized_in_at_most_1_2x_the_file(llm: LLM, gemma3_path) -> None:
    """quantization="auto" keeps the GGUF's blocks as the kernels' int4/int8 codes + scales: device bytes
    stay near the file's, and kv_cache_bytes is exactly the cache allocated (the goldens above ran on this)."""
    from jaxinfer.kv_cache import bytes_per_page
    from jaxinfer.linear import is_quantized

    stats = llm.engine_stats()
    layer = split_projections(llm.weights).layers[0]
    assert is_quantized(layer.w_down) and is_quantized(layer.wq)
    assert stats["weight_bytes"] <= 1.2 * gemma3_path.stat().st_size
    runner = llm.engine.runner
    assert stats["kv_cache_bytes"] == runner.kv_cache.num_pages * bytes_per_page(llm.model_config, 16, np.float32)
