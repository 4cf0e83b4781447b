"""Real SmolLM2-135M (bundled GGUF, float32, CPU) against HF transformers goldens (scripts/make_golden.py)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.batcher import BatchShape, SeqChunk, pack
from jaxinfer.models.fused import split_projections

pytestmark = pytest.mark.slow

# quantization="auto": the GGUF's blocks kept quantized (on CPU the default would dequantize them at load), so the
# goldens pin the quantized path; float weights are pinned by the other parity modules.
ENGINE_KW = dict(dtype="float32", quantization="auto", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
                 num_pages=96, page_size=16, attention_impl="reference", use_tqdm=False)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("smollm2-135m-instruct", **ENGINE_KW)


def greedy_params(n_tokens: int) -> SamplingParams:
    # HF's goldens disable EOS stopping (min_new_tokens == max_new_tokens); ignore_eos does the same here.
    return SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True)


def test_greedy_tokens_equal_hf(llm: LLM, smollm2_golden: dict) -> None:
    cases = smollm2_golden["greedy"]
    outs = llm.generate([c["prompt_ids"] for c in cases], [greedy_params(c["max_new_tokens"]) for c in cases])
    for case, out in zip(cases, outs):
        assert out.token_ids == case["output_ids"], case["prompt"]
    assert llm.engine_stats()["num_compiles_after_warmup"] == 0


def test_prompt_text_tokenizes_like_hf(llm: LLM, smollm2_golden: dict) -> None:
    for case in smollm2_golden["greedy"]:
        assert llm.tokenizer.encode(case["prompt"]) == case["prompt_ids"]


def test_logits_of_first_decode_steps_within_1e4(llm: LLM, smollm2_golden: dict) -> None:
    runner = llm.engine.runner
    shape = BatchShape(tokens=64, seqs=8, pages_per_seq=16)
    for case in smollm2_golden["logits"]:
        ids = list(case["prompt_ids"])
        steps = case["steps"]
        pages = list(range(80, 84))  # pages above what the engine hands out in this module's tests
        start, prev_argmax = 0, None
        for step in steps:
            n = step["input_len"]
            while len(ids) < n:  # the golden's inputs grow by its greedy argmax, one token per step
                ids.append(prev_argmax)
            logits = np.asarray(runner.logits(pack([SeqChunk(ids[start:n], start, pages)], shape, 16)))[0]
            start = n
            idx = np.asarray(step["indices"])
            want = np.asarray(step["values"], np.float64)
            assert np.linalg.norm(logits[idx] - want) / np.linalg.norm(want) < 1e-4
            assert int(logits.argmax()) == step["argmax"]
            assert np.linalg.norm(logits) == pytest.approx(step["norm"], rel=1e-4)
            prev_argmax = step["argmax"]


def test_tensor_parallel_3_equals_hf(smollm2_golden: dict) -> None:
    """9 q heads and 3 kv heads over 3 forced CPU devices: each device owns 3 q heads and 1 kv head. Without
    warmup: the engine compiles only the buckets these prompts use (warmup's full set is the fixture's test)."""
    llm3 = LLM("smollm2-135m-instruct", tensor_parallel_size=3, **{**ENGINE_KW, "warmup": False})
    # Kept quantized from the GGUF, q/k/v joined: each device holds its 3 q heads' and 1 kv head's rows of 64.
    qkv = llm3.weights.layers[0].wq
    assert (qkv.shards, qkv.widths) == (3, (192, 64, 64))
    assert {s.data.shape for s in qkv.w.values.addressable_shards} == {(320, qkv.w.values.shape[1])}
    cases = smollm2_golden["greedy"][:3]
    outs = llm3.generate([c["prompt_ids"] for c in cases], [greedy_params(c["max_new_tokens"]) for c in cases])
    assert [o.token_ids for o in outs] == [c["output_ids"] for c in cases]


def test_gguf_int4_in_plain_order_gives_hf_greedy_tokens(smollm2_golden: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GGUF's Q4_1 blocks packed in plain int4 order, as a GPU stores them (quantization.fit_packs), read
    here through the reference: the same codes, so HF's tokens."""
    from jaxinfer import quantization
    from pallas_kernels.quantized_matmul.reference import NATURAL_PACK

    monkeypatch.setattr(quantization, "NATURAL_INT4_BACKENDS", ("cpu",))
    plain = LLM("smollm2-135m-instruct", **{**ENGINE_KW, "max_num_seqs": 2, "warmup": False})  # compiles what it runs
    assert plain.weights.layers[0].w_down.pack == NATURAL_PACK
    cases = smollm2_golden["greedy"][:2]
    outs = plain.generate([c["prompt_ids"] for c in cases], greedy_params(12))
    assert [o.token_ids for o in outs] == [c["output_ids"][:12] for c in cases]


def test_pallas_tpu_kernel_in_interpret_mode_gives_hf_greedy_tokens(smollm2_golden: dict) -> None:
    """The TPU ragged paged attention kernel, run by Pallas' interpreter on CPU, inside the real model. Single
    decode steps: the two multi-step loop programs took 29 of the 49 s this engine spent compiling on 2 cores;
    the kernel inside the loop is checked on a tiny model (tests/engine/test_tpu_kernel_decode_loop.py). One
    16-token bucket: each interpreted forward took ~70 s of compile in the suite, and the two 18-token prompts
    then prefill in chunks that share steps with decoding rows, which the kernel must take as well. Float weights
    (the fixture's tests pin the kept-quantized ones): the reference's int4 unpacking in every matmul made this
    test 31.5 s instead of 16.0 (alone, from an empty compilation cache)."""
    llm_tpu = LLM("smollm2-135m-instruct", **{**ENGINE_KW, "attention_impl": "pallas_tpu", "interpret": True,
                                              "quantization": "none", "max_num_batched_tokens": 16, "max_num_seqs": 4,
                                              "decode_steps_per_call": 1})
    cases = smollm2_golden["greedy"][1:3]
    outs = llm_tpu.generate([c["prompt_ids"] for c in cases], [greedy_params(12) for _ in cases])
    assert [o.token_ids for o in outs] == [c["output_ids"][:12] for c in cases]


def test_cpu_defaults_give_hf_greedy_tokens(smollm2_golden: dict) -> None:
    """What a new user runs on a CPU: every engine setting at its default (attention_impl="auto", the xla
    attention, over float weights dequantized at load: quantization=None on a CPU). The same settings as
    test_vllm_examples' `LLM(model=...)`, so whichever module runs second finds these programs in the persistent
    compilation cache (a smaller batch here compiled 10 programs that nothing else shared)."""
    llm_cpu = LLM("smollm2-135m-instruct", use_tqdm=False)
    assert llm_cpu.engine.runner.attention_impl == "xla" and not llm_cpu.quant_plan
    cases = smollm2_golden["greedy"]
    outs = llm_cpu.generate([c["prompt_ids"] for c in cases], [greedy_params(c["max_new_tokens"]) for c in cases])
    assert [o.token_ids for o in outs] == [c["output_ids"] for c in cases]


def test_gguf_kept_quantized_in_at_most_1_2x_the_file(llm: LLM, smollm2_path) -> None:
    """quantization="auto" keeps the GGUF's blocks as the kernels' int4/int8 codes + scales: device bytes
    stay near the file's, and kv_cache_bytes is exactly the cache allocated (the goldens above ran on this)."""
    from jaxinfer.kv_cache import bytes_per_page
    from jaxinfer.linear import is_quantized

    stats = llm.engine_stats()
    layer = split_projections(llm.weights).layers[0]
    assert is_quantized(layer.w_down) and is_quantized(layer.wq)
    assert stats["weight_bytes"] <= 1.2 * smollm2_path.stat().st_size
    runner = llm.engine.runner
    assert stats["kv_cache_bytes"] == runner.kv_cache.num_pages * bytes_per_page(llm.model_config, 16, np.float32)
