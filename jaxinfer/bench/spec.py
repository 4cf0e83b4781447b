"""Speculative-decoding measurements (scripts/bench_spec.py): speedup over plain decoding measured in one run,
the verification step's cost curve, and the speedup it models per acceptance rate.

  * `measure_copy`: one prompt whose answer copies spans of it, batch 1, greedy; plain decoding and
    speculative decoding on the same prompt and tokens, best of `repeats` timed runs each after one
    untimed run (compiles are done at warmup; the first run also fills host caches). Identical output is
    part of the result, not assumed.
  * `cost_curve`: per (batch, k), seconds per speculative step (draft proposals + verification of k
    proposals per row) next to seconds per plain decode iteration at the same batch. With random weights
    the acceptance is ~0, so every speculative step emits one token per row and steps == tokens.
  * `modelled_speedup`: E(alpha, k) * t_plain / t_spec (jaxinfer.engine.speculative.expected_tokens), the
    tokens per second a speculative step would give at acceptance rate alpha over plain decoding's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from jaxinfer.config import SamplingParams
from jaxinfer.engine.speculative import expected_tokens

COPY_TEXT = (
    "The committee met on Tuesday to review the budget for the new library. After a long discussion, the members "
    "agreed to fund the reading room, the children's corner and the archive of local newspapers, but postponed "
    "the decision on the rooftop garden until the spring meeting. The chair thanked the volunteers who had "
    "catalogued more than four thousand books during the summer, and asked the treasurer to publish the final "
    "figures on the town's website before the end of the month."
)
SPEC_STATS = ("spec_draft_tokens", "spec_accepted_tokens", "spec_steps")


def copy_prompt(repeat: int = 1) -> str:
    """A prompt whose natural continuation copies long spans of it (quoting, editing, RAG answers): the text,
    then an instruction to repeat it and its first words, so even a small base model copies."""
    text = " ".join([COPY_TEXT] * repeat)
    return f"Text:\n{text}\n\nThe same text, copied exactly:\n{' '.join(text.split()[:6])}"


def _timed(llm: Any, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]


def best_greedy(llm: Any, prompt: list[int], max_tokens: int, repeats: int) -> tuple[float, list[int]]:
    """Best wall time of `repeats` greedy runs (EOS respected) after one untimed run, and the tokens (the
    same every run)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    _, tokens = _timed(llm, [prompt], params)
    return min(_timed(llm, [prompt], params)[0] for _ in range(repeats)), tokens[0]


def _spec_delta(llm: Any, before: dict[str, Any]) -> dict[str, Any]:
    after = llm.engine_stats()
    drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    return {"spec_draft_tokens": drafted, "spec_accepted_tokens": accepted,
            "spec_acceptance_rate": accepted / drafted if drafted else 0.0,
            "spec_steps": after["spec_steps"] - before["spec_steps"],
            "spec_refused_steps": after["spec_refused_steps"] - before["spec_refused_steps"],
            "spec_mean_accepted_length": after["spec_mean_accepted_length"]}


def measure_copy(plain: tuple[float, list[int]], spec: Any, prompt: list[int], max_tokens: int,
                 repeats: int = 3) -> dict[str, Any]:
    """Speculative decoding of `prompt` at batch 1 against plain decoding's (seconds, tokens) from
    `best_greedy` in the same run: output tok/s, speedup = plain time / speculative time, identical tokens."""
    t_plain, want = plain
    before = spec.engine_stats()
    t_spec, got = best_greedy(spec, prompt, max_tokens, repeats)
    return {"prompt_tokens": len(prompt), "output_tokens": len(want), "plain_s": t_plain, "spec_s": t_spec,
            "plain_tok_s": len(want) / t_plain, "spec_tok_s": len(got) / t_spec, "speedup": t_plain / t_spec,
            "identical": got == want, **_spec_delta(spec, before)}


def decode_seconds_per_iteration(llm: Any, batch: int, prompt_len: int, steps: int, vocab: int) -> float:
    """Seconds per decode iteration at `batch` rows: the time of `steps` + 8 tokens minus that of 8 (which
    removes the prefill and the first call), divided by `steps`."""
    prompts = [[(7 * i + 13 * j) % vocab for j in range(prompt_len)] for i in range(batch)]

    def run(n: int) -> float:
        return _timed(llm, prompts, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0))[0]

    run(steps + 8)  # untimed: host caches and allocator warm
    return (min(run(steps + 8) for _ in range(2)) - min(run(8) for _ in range(2))) / steps


def cost_curve(make_llm: Callable[[int | None], Any], batches: Sequence[int], ks: Sequence[int], prompt_len: int,
               steps: int, vocab: int) -> dict[str, Any]:
    """{"plain": {batch: s per iteration}, "spec": {k: {batch: s per speculative step}}}; `make_llm(k)`
    builds the plain LLM (k None) or a speculative one with k proposals, each released before the next."""
    out: dict[str, Any] = {"plain": {}, "spec": {}}
    llm = make_llm(None)
    for b in batches:
        out["plain"][str(b)] = decode_seconds_per_iteration(llm, b, prompt_len, steps, vocab)
    del llm
    for k in ks:
        llm = make_llm(k)
        llm.engine.spec.cost.worth = lambda *args: True  # the curve measures every step speculating
        out["spec"][str(k)] = {str(b): decode_seconds_per_iteration(llm, b, prompt_len, steps, vocab)
                               for b in batches}
        del llm
    return out


def modelled_speedup(curve: dict[str, Any], alphas: Sequence[float]) -> dict[str, Any]:
    """{k: {batch: {alpha: E(alpha, k) * t_plain / t_spec}}}: >1 where speculation pays at that acceptance."""
    return {k: {b: {f"{a:.1f}": expected_tokens(a, int(k)) * curve["plain"][b] / t for a in alphas}
                for b, t in per_batch.items()}
            for k, per_batch in curve["spec"].items()}
