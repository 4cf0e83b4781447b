"""On a GPU the smallest multi-step decode bucket has 2 rows (Engine.decode_row_buckets: at M = 1 XLA:GPU lowers some
projections badly), so a lone decoding row runs beside a padding row: the padding row must change nothing, for a
dense model and for an MoE one (whose padding pairs reach no expert). CPU forces the 2-row bucket here."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer.config import CacheConfig, EngineConfig, SamplingParams
from jaxinfer.engine.engine import Engine
from jaxinfer.models import LLAMA, QWEN3_MOE
from model_helpers import build_runner, tiny_config, tiny_qwen3_moe

CASES = {"llama": (LLAMA, tiny_config()), "qwen3_moe": (QWEN3_MOE, tiny_qwen3_moe())}


def _decode_alone(runner, smallest: int, monkeypatch):
    rows = []
    decode_steps = type(runner).decode_steps

    def spy(self, penalties, batch, *args, **kwargs):
        rows.append(batch.token_ids.shape[0])
        return decode_steps(self, penalties, batch, *args, **kwargs)

    engine = Engine(runner, None, EngineConfig(max_num_seqs=4, max_num_batched_tokens=16),
                    CacheConfig(page_size=4, num_pages=40), use_tqdm=False, decode_steps_per_call=4)
    engine.decode_row_buckets = sorted({smallest, *(b for b in engine.decode_row_buckets if b > 2)})
    engine.warmup()
    monkeypatch.setattr(type(runner), "decode_steps", spy)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    (out,) = engine.generate([[5, 17, 42, 9, 100, 3]], params)
    monkeypatch.undo()
    assert engine.stats()["num_compiles_after_warmup"] == 0
    assert rows and set(rows) == {smallest}, rows  # every decode ran in the multi-step loop's smallest bucket
    completion = out.outputs[0]
    return completion.token_ids, [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]


@pytest.mark.parametrize("name", CASES)
def test_a_two_row_bucket_decodes_a_lone_row_as_the_one_row_bucket(name: str, monkeypatch) -> None:
    family, cfg = CASES[name]
    runner = build_runner(cfg, family=family, num_pages=40, page_size=4)
    (one, one_lp), (two, two_lp) = _decode_alone(runner, 1, monkeypatch), _decode_alone(runner, 2, monkeypatch)
    assert one == two
    np.testing.assert_allclose(one_lp, two_lp, atol=1e-5)


def test_only_the_multi_step_loop_promises_one_token_per_row_to_the_attention(monkeypatch) -> None:
    """The decode loop tells the attention that each row has one new token (the GPU kernel then lays one token per
    tile); prefill and mixed steps, which may carry many tokens of a sequence, never do. Checked at trace time on
    the calls the model makes, whatever kernel the platform runs."""
    import threading

    import jaxinfer.attention as attention
    from jaxinfer.engine.runner import ModelRunner

    tracing_loop, seen = threading.local(), []
    decode_impl, attend = ModelRunner._decode_steps_impl, attention.ragged_paged_attention

    def loop_impl(self, *args, **kwargs):
        tracing_loop.on = True
        try:
            return decode_impl(self, *args, **kwargs)
        finally:
            tracing_loop.on = False

    def spy(*args, one_token_per_seq=False, **kwargs):
        seen.append((getattr(tracing_loop, "on", False), one_token_per_seq))
        return attend(*args, one_token_per_seq=one_token_per_seq, **kwargs)

    monkeypatch.setattr(ModelRunner, "_decode_steps_impl", loop_impl)  # before the runner binds its programs
    monkeypatch.setattr(attention, "ragged_paged_attention", spy)
    runner = build_runner(tiny_config(), num_pages=40, page_size=4)
    engine = Engine(runner, None, EngineConfig(max_num_seqs=4, max_num_batched_tokens=16),
                    CacheConfig(page_size=4, num_pages=40), use_tqdm=False, decode_steps_per_call=4)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.generate([[5, 17, 42, 9, 100, 3], [7, 8]], params)
    assert {in_loop for in_loop, _ in seen} == {True, False}, seen  # both kinds of program were traced
    assert all(in_loop == promised for in_loop, promised in seen), seen
