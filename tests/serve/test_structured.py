"""Structured output: the bitmask inside the jitted sampler, the grammar cache, and the real SmolLM2 sampling
at temperature 0.8 with several seeds, where 100% of outputs must validate (12 JSON schemas, a regex, a choice
list and a Lark grammar: jaxinfer.bench.schemas), through the Python API and through the server."""

from __future__ import annotations

import json
import re

import jax
import jsonschema
import numpy as np
import openai
import pytest

from jaxinfer import LLM, InvalidInput, SamplingParams
from jaxinfer.bench.schemas import CHOICES, LARK_GRAMMAR, REGEX, SCHEMAS
from jaxinfer.engine.grammar import GrammarCache
from jaxinfer.engine.sampling import sample
from jaxinfer.engine.sampling_rows import SamplingArrays
from jaxinfer.structured import StructuredOutputs
from tests.serve.conftest import running

SEEDS = (0, 1, 2)
MAX_TOKENS = 160
LARK_RE = re.compile(r"[0-9]( \+ [0-9]){0,3}")
# attention_impl left at "auto" (the xla attention on a CPU): these tests decode up to MAX_TOKENS for every case and
# seed in batches of up to 16 rows, and the reference attends one sequence at a time.
ENGINE_KW = dict(dtype="float32", max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64, num_pages=160,
                 block_size=16, decode_steps_per_call=4, use_tqdm=False)


def test_bitmask_restricts_greedy_and_random_rows_without_recompiling() -> None:
    vocab, rows = 100, 4
    logits = jax.random.normal(jax.random.key(0), (rows, vocab))
    bitmask = np.full((rows, 4), -1, np.int32)
    bitmask[0] = 0
    bitmask[0, 7 // 32] = 1 << 7  # row 0: only token 7
    bitmask[1] = 0
    bitmask[1, 2] = (1 << (70 - 64)) | (1 << (71 - 64))  # row 1: tokens 70 and 71
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3), SamplingParams(), None]
    arrays = SamplingArrays.from_params(params[:3], rows, vocab, token_bitmask=bitmask)
    # A wrapper of its own: jax.jit(sample) would share its cache with every other test that jits `sample`.
    fn = jax.jit(lambda lg, a: sample(lg, a))
    out = fn(logits, arrays)
    assert int(out.tokens[0]) == 7 and int(out.tokens[1]) in (70, 71)
    free = SamplingArrays.from_params(params[:3], rows, vocab)
    assert int(fn(logits, free).tokens[0]) == int(np.argmax(np.asarray(logits[0])))
    assert fn._cache_size() == 1  # constrained or not: one compiled step


def test_grammar_cache_compiles_once_and_refuses_bad_grammars(smollm2) -> None:
    cache = GrammarCache(smollm2, smollm2.vocab_size, sorted(smollm2.eos_token_ids))
    s = StructuredOutputs(json=SCHEMAS["person"])
    assert cache.compile(s) is cache.compile(StructuredOutputs(json=json.dumps(SCHEMAS["person"])))
    assert cache.num_compiled == 1
    with pytest.raises(InvalidInput) as e:
        cache.compile(StructuredOutputs(regex="[unclosed"))
    assert e.value.field == "structured.regex"
    with pytest.raises(InvalidInput) as e:
        SamplingParams(structured={"json": SCHEMAS["person"], "regex": "a"})
    assert e.value.field == "structured"


def _cases() -> list[tuple[str, dict, str]]:
    """(name, structured, prompt) for every case."""
    out = [(name, {"json": schema}, f"Reply with only a JSON value matching this JSON schema: {json.dumps(schema)}")
           for name, schema in SCHEMAS.items()]
    out.append(("regex", {"regex": REGEX}, "Name a city and a number, like: Lima 42.5"))
    out.append(("choice", {"choice": CHOICES}, "Is the sky green? Answer yes, no or maybe."))
    out.append(("lark", {"grammar": LARK_GRAMMAR}, "Write a sum of small digits, like 1 + 2."))
    return out


def _check(name: str, text: str) -> None:
    if name in SCHEMAS:
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    elif name == "regex":
        assert re.fullmatch(REGEX, text), text
    elif name == "choice":
        assert text in CHOICES, text
    else:
        assert LARK_RE.fullmatch(text), text


@pytest.mark.slow
def test_python_api_every_sample_validates() -> None:
    llm = LLM("smollm2-135m-instruct", **ENGINE_KW)
    cases = _cases()
    prompts = [[{"role": "user", "content": prompt}] for _, _, prompt in cases for _ in SEEDS]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=seed, structured=structured)
              for _, structured, _ in cases for seed in SEEDS]
    outs = llm.chat(prompts, params)
    names = [name for name, _, _ in cases for _ in SEEDS]
    for name, out in zip(names, outs):
        assert out.outputs[0].finish_reason == "stop", (name, out.text)
        _check(name, out.text)
    stats = llm.engine_stats()
    assert stats["num_compiles_after_warmup"] == 0 and stats["free_pages"] == stats["total_pages"]


@pytest.mark.slow
def test_server_every_sample_validates(tmp_path) -> None:
    flags = ["--model", "smollm2-135m-instruct", "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs",
             "16", "--max-num-batched-tokens", "64", "--num-pages", "160", "--block-size", "16",
             "--decode-steps-per-call", "4", "--served-model-name", "m"]
    with running(flags, tmp_path / "server.log") as server:
        client = openai.OpenAI(base_url=server.url("/v1"), api_key="none", timeout=300, max_retries=0)
        import concurrent.futures

        def one(case: tuple[str, dict, str], seed: int) -> tuple[str, str]:
            name, structured, prompt = case
            kind, spec = next(iter(structured.items()))
            extra = {"seed": seed, "max_tokens": MAX_TOKENS, "temperature": 0.8}
            if kind == "json":  # the OpenAI way for JSON schemas; vLLM's extra fields for the others
                extra["response_format"] = {"type": "json_schema", "json_schema": {"name": name, "schema": spec}}
            elif kind == "regex":
                extra["extra_body"] = {"guided_regex": spec}
            else:
                extra["extra_body"] = {"structured_outputs": structured}
            resp = client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}], **extra)
            assert resp.choices[0].finish_reason == "stop", resp.choices[0].message.content
            return name, resp.choices[0].message.content

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda a: one(*a), [(c, s) for c in _cases() for s in SEEDS]))
        for name, text in results:
            _check(name, text)
        obj = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Give me JSON."}],
                                             max_tokens=MAX_TOKENS, temperature=0.8, seed=0,
                                             response_format={"type": "json_object"})
        text = obj.choices[0].message.content  # free-form JSON: nothing bounds its length, so it may be cut
        assert isinstance(json.loads(text), dict) if obj.choices[0].finish_reason == "stop" else text.startswith("{")
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                           extra_body={"guided_regex": "[unclosed"})
        assert e.value.body["param"] == "guided_regex"
