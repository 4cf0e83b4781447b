"""Offline scripts written the way vLLM's documentation shows its basic, chat and logprobs examples, run with
only the import line changed (`from vllm import` -> `from jaxinfer import`), on the bundled SmolLM2 through
its hub id (which resolves to the bundled GGUF with a notice; nothing is downloaded).

The scripts are executed as they stand. To load the model once rather than three times, the harness makes
`LLM(...)` calls with identical arguments return one shared instance; each script still constructs it."""

from __future__ import annotations

import contextlib
import io
import warnings

import pytest

import jaxinfer

BASIC = '''
from vllm import LLM, SamplingParams

questions = [
    "My favourite season is",
    "Rivers always flow toward",
    "The best way to learn a new language is",
]
params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24)


def main():
    llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct")
    for result in llm.generate(questions, params):
        completion = result.outputs[0]
        print(f"{result.prompt!r} -> {completion.text!r} [{completion.finish_reason}]")


if __name__ == "__main__":
    main()
'''

CHAT = '''
from vllm import LLM, SamplingParams

llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct")
params = SamplingParams(temperature=0.5, max_tokens=32)


def show(outputs):
    for result in outputs:
        print(f"{result.prompt!r} => {result.outputs[0].text!r}")
    print("=" * 40)


conversation = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! What would you like to know?"},
    {"role": "user", "content": "Why do cats purr?"},
]
show(llm.chat(conversation, sampling_params=params, use_tqdm=False))

# Several conversations in one call.
other = [{"role": "user", "content": "Name a prime number larger than ten."}]
show(llm.chat([conversation, other], sampling_params=params, use_tqdm=False))

# A template of one's own instead of the model's.
template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\\n{% endfor %}[assistant] "
show(llm.chat(other, sampling_params=params, use_tqdm=False, chat_template=template))
'''

LOGPROBS = '''
from vllm import LLM, SamplingParams

llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct")
params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2)
result = llm.generate(["The opposite of hot is"], params)[0]
completion = result.outputs[0]

for position, (chosen, candidates) in enumerate(zip(completion.token_ids, completion.logprobs)):
    for token_id, logprob in sorted(candidates.items(), key=lambda item: item[1].rank):
        marker = "*" if token_id == chosen else " "
        print(f"{position} {marker} rank={logprob.rank} {logprob.logprob:.3f} {logprob.decoded_token!r}")

print("first prompt position:", result.prompt_logprobs[0])
for position, candidates in enumerate(result.prompt_logprobs[1:], start=1):
    actual = result.prompt_token_ids[position]
    print(f"prompt {position}: {candidates[actual].decoded_token!r} rank={candidates[actual].rank}")
print("cumulative:", completion.cumulative_logprob, completion.finish_reason)
'''


@pytest.fixture(scope="module")
def run_script():
    """Execute a vLLM-style script with its import line changed; returns what it printed."""
    real, shared = jaxinfer.LLM, {}

    def llm(*args, **kwargs):
        key = repr((args, sorted(kwargs.items())))
        if key not in shared:
            shared[key] = real(*args, **kwargs)
        return shared[key]

    def run(source: str) -> str:
        assert source.count("from vllm import") == 1
        code = source.replace("from vllm import", "from jaxinfer import")
        out = io.StringIO()
        jaxinfer.LLM = llm
        try:
            with contextlib.redirect_stdout(out), warnings.catch_warnings():
                warnings.simplefilter("ignore", jaxinfer.Notice)  # which bundled file stands in for the hub id
                exec(compile(code, "<vllm-style example>", "exec"), {"__name__": "__main__"})
        finally:
            jaxinfer.LLM = real
        return out.getvalue()

    return run


@pytest.mark.slow
def test_basic_example(run_script) -> None:
    lines = run_script(BASIC).splitlines()
    assert len(lines) == 3 and all(" -> " in line for line in lines)
    assert lines[0].startswith("'My favourite season is' -> ") and ("[length]" in lines[0] or "[stop]" in lines[0])


@pytest.mark.slow
def test_chat_example(run_script) -> None:
    blocks = run_script(CHAT).split("=" * 40 + "\n")
    assert [b.count(" => ") for b in blocks[:3]] == [1, 2, 1] and blocks[3] == ""
    assert "<|im_start|>user\\nWhy do cats purr?<|im_end|>\\n<|im_start|>assistant\\n' => " in blocks[0]
    assert blocks[2].startswith("'[user] Name a prime number larger than ten.\\n[assistant] ' => ")


@pytest.mark.slow
def test_logprobs_example(run_script) -> None:
    lines = run_script(LOGPROBS).splitlines()
    chosen = [line for line in lines if line[2:3] == "*"]
    assert len(chosen) == 6 and all("rank=1 " in line for line in chosen)  # greedy: the top token each time
    assert sum(1 for line in lines if line[:1].isdigit()) == 6 * 3  # the sampled token is among the top 3
    assert "first prompt position: None" in lines
    assert any(line.startswith("prompt 1: ") for line in lines) and lines[-1].startswith("cumulative: -")
