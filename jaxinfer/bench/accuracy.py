"""Teacher-forced accuracy of a quantized model against its float twin (docs/QUANTIZATION.md).

Both models read the same held texts (`HELD_TEXTS`, written for this purpose, never used to choose a
format), and at every position we compare what each predicts for the next token of the text: the top-1
agreement (the share of positions whose argmax is the same) and the mean |difference| of the log
probability each gives the text's actual next token. Teacher forcing means both always see the real
prefix, so one early disagreement does not derail everything after it (greedy decoding would), and
every position counts once. The prompt logprobs go through the engine's normal prefill (chunked, with
the KV cache written and read back), so a quantized KV cache is measured too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

HELD_TEXTS = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of oil and a "
    "rag. For thirty years he had trimmed the wick and polished the great lens until it threw a beam "
    "twenty miles out to sea. Ships he would never meet passed safely because of him, and he liked it that way.",
    "To make a simple bread, mix five hundred grams of flour with ten grams of salt and seven grams of "
    "yeast. Add three hundred and fifty millilitres of warm water and knead the dough for ten minutes, "
    "until it is smooth and springs back when pressed. Let it rise for an hour, shape it, and bake it hot.",
    "Photosynthesis turns light into chemical energy. In the chloroplasts of a leaf, chlorophyll absorbs "
    "red and blue light, and that energy splits water into oxygen, protons and electrons. The electrons "
    "drive the synthesis of ATP and NADPH, which the Calvin cycle then spends to fix carbon dioxide into sugar.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n    for _ in range(n):\n"
    "        a, b = b, a + b\n    return a\n\n\nif __name__ == \"__main__\":\n    for i in range(10):\n"
    "        print(i, fibonacci(i))\n",
    "Dear Ms. Alvarez, thank you for your letter of the fourth. I am sorry to hear that the parcel arrived "
    "damaged. We have sent a replacement by courier, and it should reach you by Friday. Please keep the "
    "broken item; there is no need to return it. Kind regards, the customer service team.",
    "The river rose through the night. By morning the lower fields were under water and the old stone "
    "bridge, which had stood for two hundred years, was the only way into the village. People carried "
    "sandbags across it in a long line, passing them hand to hand, while the rain kept falling.",
    "A prime number has exactly two divisors, one and itself. The first few are two, three, five, seven, "
    "eleven and thirteen. Euclid proved that there are infinitely many: if there were a largest prime, "
    "multiplying all the primes together and adding one would give a number that none of them divides.",
    "Question: What is the capital of Australia?\nAnswer: Canberra. Many people guess Sydney or Melbourne, "
    "the two largest cities, but Canberra was chosen as a compromise between them and built as a planned "
    "capital in the early twentieth century.\nQuestion: What is the longest river in Africa?\nAnswer: The Nile.",
    "When the orchestra tuned, the oboe played a long A and every other instrument matched it. Then the "
    "hall fell silent, the conductor lifted her baton, and the first notes of the symphony rose softly "
    "from the violins, as if the music had been there all along, waiting to be heard.",
    "Good sleep habits help more than most medicines. Keep a regular schedule, even at weekends; keep the "
    "bedroom dark, quiet and cool; avoid caffeine after midday; and put screens away an hour before bed. "
    "If you cannot sleep after twenty minutes, get up and read something dull until you feel tired.",
    "The committee met on Tuesday to review the budget. Spending on maintenance had risen by twelve percent, "
    "mostly because of the new roof, while income from rentals fell slightly. The treasurer proposed "
    "raising the hall fees modestly and postponing the car park repairs until the spring.",
    "In chess, the knight moves in an L shape: two squares in one direction and one square at a right "
    "angle. It is the only piece that can jump over others, which makes it strong in crowded positions "
    "early in the game and weaker in open endgames, where long-range pieces dominate.",
)


@dataclasses.dataclass(frozen=True)
class TeacherForced:
    """Per position of every text: the model's top-1 next token and its logprob of the actual one."""

    top1: np.ndarray  # [positions] int
    actual_logprob: np.ndarray  # [positions] float


def teacher_forced(llm: Any, texts: tuple[str, ...] = HELD_TEXTS) -> TeacherForced:
    """Prompt logprobs of every held text (positions 1.., each given the real prefix)."""
    from jaxinfer import SamplingParams

    prompts = [llm.tokenizer.encode(t) for t in texts]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, detokenize=False)
    top1, actual = [], []
    for ids, out in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)):
        for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
            top1.append(next(t for t, lp in entry.items() if lp.rank == 1))
            actual.append(float(entry[ids[pos]]))
    return TeacherForced(np.asarray(top1), np.asarray(actual, np.float64))


def compare(reference: TeacherForced, other: TeacherForced) -> dict[str, float]:
    """Top-1 agreement and mean |logprob difference| of `other` against `reference` (the float model)."""
    if reference.top1.shape != other.top1.shape:
        raise ValueError("the two runs read different texts")
    return {"positions": int(reference.top1.size),
            "top1_agreement": float(np.mean(reference.top1 == other.top1)),
            "mean_abs_logprob_diff": float(np.mean(np.abs(reference.actual_logprob - other.actual_logprob)))}


__all__ = ["HELD_TEXTS", "TeacherForced", "compare", "teacher_forced"]
