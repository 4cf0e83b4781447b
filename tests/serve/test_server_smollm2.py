"""`jaxinfer serve` on the bundled SmolLM2-135M-Instruct (float32, CPU), driven by the official `openai` client.

One server for the module (started once: loading and compiling dominate), with an API key. Every client call
has a timeout, and every loop is bounded.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.conftest import running

pytestmark = pytest.mark.slow

KEY = "test-key"
MODEL = "smollm2-135m-instruct"
TIMEOUT = 120
METRIC_NAMES = {
    "jaxinfer:num_requests_running", "jaxinfer:num_requests_waiting", "jaxinfer:kv_cache_usage_perc",
    "jaxinfer:prefix_cache_hit_rate", "jaxinfer:num_preemptions_total", "jaxinfer:prompt_tokens_total",
    "jaxinfer:generation_tokens_total", "jaxinfer:time_to_first_token_seconds", "jaxinfer:inter_token_latency_seconds",
    "jaxinfer:e2e_request_latency_seconds",
}
# Float weights and the CPU's default attention (xla), with room for 32 concurrent requests: the engine settings of
# tests/serve/test_structured.py's Python API and server tests, so the three compile the same programs and whichever
# runs later reads them from the persistent compilation cache. test_parity holds the reference attention to HF.
# This module alone, from an empty compilation cache: 83.8 s on the reference attention, 54.1 s on xla; the server's
# start (the first test's setup) 21.3 s, 14.9 s after test_structured's Python API test filled the cache.
FLAGS = ["--model", MODEL, "--api-key", KEY, "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "16",
         "--max-num-batched-tokens", "64", "--num-pages", "160", "--block-size", "16", "--decode-steps-per-call", "4"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running(FLAGS, tmp_path_factory.mktemp("smollm2") / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, timeout=TIMEOUT, max_retries=0)


def metrics(server) -> dict[str, float]:
    """Every sample of /metrics by name, buckets left out (a phase-labelled counter keeps its last phase's)."""
    text = httpx.get(server.url("/metrics"), timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "le" not in s.labels:
                samples[s.name] = s.value
    return samples


def test_greedy_completions_equal_hf_goldens(client, smollm2_golden, smollm2) -> None:
    cases = smollm2_golden["greedy"]
    n = max(c["max_new_tokens"] for c in cases)
    resp = client.completions.create(model=MODEL, prompt=[c["prompt_ids"] for c in cases], max_tokens=n,
                                     temperature=0.0, extra_body={"ignore_eos": True})
    for case, choice in zip(cases, sorted(resp.choices, key=lambda c: c.index)):
        want = case["output_ids"][: case["max_new_tokens"]]
        assert choice.text.startswith(smollm2.decode(want)), case["prompt"]  # n >= this case's token count
    assert resp.usage.prompt_tokens == sum(len(c["prompt_ids"]) for c in cases)
    assert resp.usage.completion_tokens == n * len(cases)


def test_greedy_text_prompt_equals_golden(client, smollm2_golden, smollm2) -> None:
    case = smollm2_golden["greedy"][0]
    resp = client.completions.create(model=MODEL, prompt=case["prompt"], max_tokens=case["max_new_tokens"],
                                     temperature=0.0, extra_body={"ignore_eos": True})
    assert resp.choices[0].text == smollm2.decode(case["output_ids"])


def test_streaming_text_equals_non_streaming(client) -> None:
    kw = dict(model=MODEL, prompt="Write a short poem about the sea.", max_tokens=24, temperature=0.8, seed=11)
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].usage.completion_tokens > 0 and not chunks[-1].choices
    messages = [{"role": "user", "content": "Name three colors."}]
    chat_kw = dict(model=MODEL, messages=messages, max_tokens=20, temperature=0.8, seed=5)
    whole = client.chat.completions.create(**chat_kw).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**chat_kw, stream=True)
                       if c.choices)
    assert streamed == whole


def test_chat_n2_with_logprobs(client) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}], n=2,
                                          max_tokens=8, temperature=1.0, seed=1, logprobs=True, top_logprobs=3)
    assert [c.index for c in resp.choices] == [0, 1]
    for choice in resp.choices:
        content = choice.logprobs.content
        assert content and all(len(t.top_logprobs) == 3 for t in content)
        assert all(t.logprob <= 0 and t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob for t in content)
        assert "".join(t.token for t in content).startswith(choice.message.content[:3])
    assert resp.usage.completion_tokens == sum(len(c.logprobs.content) for c in resp.choices)


def _error(server, path: str, body: dict, key: str | None = KEY) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    r = httpx.post(server.url(path), json=body, headers=headers, timeout=TIMEOUT)
    return r.status_code, r.json()["error"]


def test_error_envelopes(server, client) -> None:
    ok = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    assert _error(server, "/v1/completions", ok, key=None)[0] == 401
    status, err = _error(server, "/v1/completions", ok, key="wrong")
    assert status == 401 and err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
    status, err = _error(server, "/v1/completions", {**ok, "top_p": 1.5})
    assert status == 400 and err["param"] == "top_p" and "top_p" in err["message"]
    status, err = _error(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                          "logprobs": True, "top_logprobs": 99})
    assert status == 400 and err["param"] == "top_logprobs"
    status, err = _error(server, "/v1/completions", {**ok, "n": "many"})
    assert status == 400 and err["param"] == "n"
    status, err = _error(server, "/v1/completions", {**ok, "model": "gpt-4"})
    assert status == 404 and err["param"] == "model" and err["code"] == "model_not_found"
    status, err = _error(server, "/v1/completions", {**ok, "prompt": "word " * 300})
    assert status == 413 and err["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"min_p": 2})
    assert e.value.body["param"] == "min_p"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="Hi", max_tokens=2)


def test_32_concurrent_streams_finish_with_usage(server) -> None:
    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.url("/v1"), api_key=KEY, timeout=TIMEOUT, max_retries=0)

        async def one(i: int):
            stream = await aclient.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=12,
                temperature=0.7, seed=i, stream=True, stream_options={"include_usage": True})
            text, last = "", None
            async for chunk in stream:
                text += "".join(c.delta.content or "" for c in chunk.choices)
                last = chunk
            return text, last

        results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(32))), TIMEOUT * 2)
        await aclient.close()
        return results

    results = asyncio.run(main())
    assert len(results) == 32
    for _, last in results:
        assert last.usage is not None and 0 < last.usage.completion_tokens <= 12 and last.usage.prompt_tokens > 0


def test_disconnect_mid_stream_frees_pages(server) -> None:
    before = metrics(server)
    body = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 220, "stream": True,
            "temperature": 0.0, "ignore_eos": True}
    with httpx.Client(timeout=TIMEOUT) as h:
        with h.stream("POST", server.url("/v1/completions"), json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
            lines = r.iter_lines()
            got = [line for _, line in zip(range(3), lines) if line.startswith("data:")]
            assert got
            during = metrics(server)
            assert during["jaxinfer:num_requests_running"] >= 1 and during["jaxinfer:kv_cache_usage_perc"] > 0
    # The connection is closed: the request must be aborted and its pages freed long before 220 tokens.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        now = metrics(server)
        if now["jaxinfer:num_requests_running"] == 0 and now["jaxinfer:kv_cache_usage_perc"] == 0:
            break
        time.sleep(0.1)
    assert now["jaxinfer:num_requests_running"] == 0 and now["jaxinfer:kv_cache_usage_perc"] == 0
    made = now["jaxinfer:generation_tokens_total"] - before["jaxinfer:generation_tokens_total"]
    assert made < 220, "the request ran to its end instead of being aborted"


def test_metrics_parse_and_have_the_names(server, client) -> None:
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    text = httpx.get(server.url("/metrics"), timeout=10).text
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    families = {f.name for f in text_string_to_metric_families(text)}
    for name in METRIC_NAMES:
        assert name in names or name in families or f"{name}_count" in names, name
    samples = metrics(server)
    assert samples["jaxinfer:prompt_tokens_total"] > 0 and samples["jaxinfer:generation_tokens_total"] > 0
    assert samples["jaxinfer:time_to_first_token_seconds_count"] > 0
    # The engine loop's counters: steps taken, and where their wall time went.
    assert samples["jaxinfer:engine_steps_total"] >= 4 and samples["jaxinfer:engine_pipelined_steps_total"] >= 0
    phases = {s.labels["phase"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == "jaxinfer:engine_step_seconds_total"}
    assert set(phases) == {"schedule", "prepare", "device", "apply"} and phases["device"] > 0


def test_models_tokenize_detokenize_health(server, client, smollm2) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server.url("/tokenize"), json={"prompt": "Hello world"}, headers=headers, timeout=10).json()
    assert r["tokens"] == smollm2.encode("Hello world") and r["count"] == len(r["tokens"])
    r = httpx.post(server.url("/detokenize"), json={"tokens": r["tokens"]}, headers=headers, timeout=10).json()
    assert r["prompt"] == "Hello world"
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200
