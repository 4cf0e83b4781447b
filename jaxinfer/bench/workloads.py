"""Benchmark workloads: per-request input and output lengths, and the random prompts that realize them.

Prompts are random token ids, so no two prompts of a workload share a prefix and the prefix cache never helps
inside one (two workloads drawn from the same seed begin alike, which is why the bench empties the cache between
its sections); every request generates exactly its output length (ignore_eos), as in `vllm bench` with the random
dataset.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# Token ids are drawn below this (and below the vocabulary size), away from special tokens at the top.
PROMPT_ID_LIMIT = 32000


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    input_lens: tuple[int, ...]
    output_lens: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.input_lens) != len(self.output_lens) or not self.input_lens:
            raise ValueError(f"workload {self.name!r}: needs as many input as output lengths, and at least one.")
        if min(self.input_lens) < 1 or min(self.output_lens) < 1:
            raise ValueError(f"workload {self.name!r}: every input and output length must be at least 1.")

    @property
    def num_prompts(self) -> int:
        return len(self.input_lens)

    @property
    def input_tokens(self) -> int:
        return sum(self.input_lens)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def max_len(self) -> int:
        return max(i + o for i, o in zip(self.input_lens, self.output_lens))

    def head(self, n: int) -> Workload:
        """The first n requests (same lengths), for a baseline that cannot afford the whole workload."""
        return Workload(self.name, self.input_lens[:n], self.output_lens[:n])


def fixed(input_len: int, output_len: int, num_prompts: int) -> Workload:
    return Workload(f"{input_len}/{output_len}", (input_len,) * num_prompts, (output_len,) * num_prompts)


def sharegpt_like(num_prompts: int, seed: int = 0, max_input: int = 2048, max_output: int = 1024) -> Workload:
    """A synthetic mix shaped like ShareGPT conversations (no dataset is read: none is available offline).

    Lengths are log-normal with medians 150 (input) and 130 (output) tokens and sigma 0.9, i.e. means of
    about 225 and 195 tokens: the averages usually quoted for the filtered ShareGPT set used by vLLM's
    benchmarks. Clipped to [4, max_input] and [4, max_output].
    """
    rng = np.random.default_rng(seed)
    inputs = np.clip(rng.lognormal(np.log(150), 0.9, num_prompts), 4, max_input).astype(int)
    outputs = np.clip(rng.lognormal(np.log(130), 0.9, num_prompts), 4, max_output).astype(int)
    return Workload("sharegpt-like", tuple(int(x) for x in inputs), tuple(int(x) for x in outputs))


def parse(spec: str, num_prompts: int, seed: int = 0) -> Workload:
    """'1000x1000' (input x output tokens) or 'sharegpt'."""
    if spec == "sharegpt":
        return sharegpt_like(num_prompts, seed)
    try:
        input_len, output_len = (int(x) for x in spec.lower().split("x"))
    except ValueError:
        raise ValueError(f"workload {spec!r}: expected INPUTxOUTPUT token counts (e.g. 1000x1000) or 'sharegpt'.") from None
    return fixed(input_len, output_len, num_prompts)


def prompts(workload: Workload, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    high = min(vocab_size, PROMPT_ID_LIMIT)
    return [rng.integers(0, high, n).tolist() for n in workload.input_lens]
