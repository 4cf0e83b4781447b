"""Teacher-forced top-1 agreement between two engine layouts of the same real model.

Tensor parallelism changes the order of floating-point sums (each all-reduce adds partial products), so
in bf16 a few next-token argmaxes may flip where the top two logits nearly tie. The measure: one text of
`tokens` tokens (sampled once from the model itself at temperature 0.8, seed 0, so it is natural text for
that model), fed to both layouts as a prompt; at every position, does the most likely next token agree?
The prompt logprobs carry each position's top-1 alternative, so this goes through the public API.
"""

from __future__ import annotations

from typing import Any

from jaxinfer import LLM, SamplingParams

ENGINE = dict(dtype="bfloat16", max_num_seqs=4, max_num_batched_tokens=256, use_tqdm=False)


def _top1(position: dict[int, Any] | None) -> int | None:
    if not position:
        return None
    value = lambda item: getattr(item[1], "logprob", item[1])  # noqa: E731 - floats or Logprob objects
    return max(position.items(), key=value)[0]


def teacher_forced_top1(llm: LLM, ids: list[int]) -> list[int | None]:
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0), use_tqdm=False)[0]
    return [_top1(p) for p in out.prompt_logprobs[1:]]


def top1_agreement(model: str, tokens: int, tp: int, **engine: Any) -> dict[str, Any]:
    settings = {**ENGINE, "max_model_len": tokens + 16, **engine}
    base = LLM(model, tensor_parallel_size=1, **settings)
    text = base.generate(["The history of the city begins"], SamplingParams(
        max_tokens=tokens, temperature=0.8, seed=0, ignore_eos=True), use_tqdm=False)[0]
    ids = text.prompt_token_ids + text.token_ids
    want = teacher_forced_top1(base, ids)
    del base
    got = teacher_forced_top1(LLM(model, tensor_parallel_size=tp, **settings), ids)
    same = sum(a == b for a, b in zip(want, got))
    return {"model": model, "tensor_parallel_size": tp, "dtype": settings["dtype"], "positions": len(want),
            "agreement": same / len(want)}
