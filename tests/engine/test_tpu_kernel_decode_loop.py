"""The TPU ragged paged attention kernel (Pallas' interpreter on CPU) inside the engine's multi-step decode loop,
where each iteration builds its attention metadata on device (`runner.decode_metadata`): the same tokens and
logprobs as the reference attention, on a tiny random model. The real-model parity test of the kernel
(tests/test_parity.py) decodes in single steps, which keeps its compile time down; this covers the loop."""

from __future__ import annotations

import numpy as np

from jaxinfer.config import CacheConfig, EngineConfig, SamplingParams
from jaxinfer.engine.engine import Engine
from model_helpers import build_runner, tiny_config

CFG = tiny_config(head_dim=64, num_heads=4, num_kv_heads=2)  # a head as wide as SmolLM2's
STEPS = 4


def _generate(attention_impl: str) -> tuple[list[list[int]], list[list[float]], dict, int]:
    runner = build_runner(CFG, seed=5, num_pages=48, page_size=16, attention_impl=attention_impl,
                          interpret=attention_impl == "pallas_tpu")
    engine = Engine(runner, None, EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128),
                    CacheConfig(page_size=16), use_tqdm=False, decode_steps_per_call=STEPS)
    engine.warmup()
    loop_calls = []
    decode_steps = runner.decode_steps

    def counted(*args, **kwargs):
        loop_calls.append(1)
        return decode_steps(*args, **kwargs)

    runner.decode_steps = counted  # the engine's decode loop looks it up on the instance
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, CFG.vocab_size, n)] for n in (5, 19, 11)]
    # Different lengths: rows finish in different iterations, and two cross a page boundary while decoding.
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0) for n in (14, 9, 21)]
    outs = engine.generate(prompts, params)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return tokens, logprobs, engine.stats(), len(loop_calls)


def test_tpu_kernel_in_the_multi_step_loop_gives_the_reference_tokens() -> None:
    want_tokens, want_lp, _, _ = _generate("reference")
    got_tokens, got_lp, stats, loop_calls = _generate("pallas_tpu")
    assert got_tokens == want_tokens
    for g, w in zip(got_lp, want_lp):
        np.testing.assert_allclose(g, w, atol=2e-5)
    assert loop_calls >= 3, loop_calls  # most tokens came out of the multi-step loop
    assert stats["num_compiles_after_warmup"] == 0
