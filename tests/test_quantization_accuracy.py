"""Teacher-forced top-1 agreement of each quantized mode with the float model, on the bundled SmolLM2
(jaxinfer.bench.accuracy; the full table over every held text, Gemma 3 too, is docs/QUANTIZATION.md's).

The float model is the GGUF dequantized (quantization="none"); each mode reads the same four held texts
(264 positions). Issue 15 asks for >= 99% (int8 weights, fp8 KV, int8 KV) and >= 95% (int4 weights). int4
and int8 KV meet it (int8 KV since the cache is stored in a rotated basis, jaxinfer.attention.kv_rotation:
99.6% here, 99.2% over every held text). int8 weights (97.3%) and fp8 KV (98.1% here, 96.6% over every held
text: e4m3 keeps 3 mantissa bits whatever the scale, which no rotation changes) do not yet on this model,
whose next-token choice is often a near tie. Those two are held here to what they reach today, so a
regression fails CI, with the issue's target beside each; raising them is open work.
No warmup: only the buckets these prefills use are compiled, which keeps the module fast.
"""

from __future__ import annotations

import pytest

from jaxinfer import LLM
from jaxinfer.bench.accuracy import HELD_TEXTS, compare, teacher_forced

pytestmark = pytest.mark.slow

MODEL, TEXTS = "smollm2-135m-instruct", HELD_TEXTS[:4]
ENGINE = dict(dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256, num_pages=48,
              page_size=16, attention_impl="reference", use_tqdm=False, warmup=False)
MODES = {  # label -> (LLM arguments, least top-1 agreement held in CI, issue 15's target)
    "int8 weights": (dict(quantization="int8"), 0.965, 0.99),
    "int4 weights": (dict(quantization="int4"), 0.95, 0.95),
    "fp8 KV": (dict(quantization="none", kv_cache_dtype="fp8"), 0.975, 0.99),
    "int8 KV": (dict(quantization="none", kv_cache_dtype="int8"), 0.99, 0.99),
}


@pytest.fixture(scope="module")
def float_run():
    return teacher_forced(LLM(MODEL, quantization="none", **ENGINE), TEXTS)


@pytest.mark.parametrize("mode", MODES)
def test_teacher_forced_top1_agreement_with_the_float_model(float_run, mode: str) -> None:
    kwargs, floor, target = MODES[mode]
    result = compare(float_run, teacher_forced(LLM(MODEL, **ENGINE, **kwargs), TEXTS))
    assert result["positions"] >= 250
    assert result["top1_agreement"] >= floor, (mode, result, f"issue 15's target: {target}")
