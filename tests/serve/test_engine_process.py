"""EngineClient: the engine in a child process, over a tiny random Llama (the serve tests' YAML shape) with
SmolLM2's tokenizer. Its outputs equal LLM's for the same model and seed (greedy and sampled, logprobs, n=2,
each output kind, structured output); a refusal comes back as the InvalidInput naming the field; aborts free
pages; a child that dies fails the open streams instead of hanging them; the server process never starts a
JAX backend of its own."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxinfer import InvalidInput, SamplingParams
from jaxinfer.async_llm import EngineDead
from jaxinfer.engine_process import EngineClient
from jaxinfer.validation import RequestOutputKind
from tests.serve.conftest import assembled, running, tiny_args

KW = dict(random_weights=True, max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32, block_size=16,
          num_pages=40, attention_impl="reference", dtype="float32", decode_steps_per_call=4)


@pytest.fixture(scope="module")
def reference_llm(tiny_model_yaml, smollm2_path):
    from jaxinfer import LLM

    return LLM(str(tiny_model_yaml), tokenizer=str(smollm2_path), use_tqdm=False, **KW)


@pytest.fixture(scope="module")
def client(tiny_model_yaml, smollm2_path):
    c = EngineClient(str(tiny_model_yaml), tokenizer=str(smollm2_path), **KW)
    yield c
    c.close()


def _collect(client, prompt, params, rid):
    async def main():
        return [o async for o in client.generate(prompt, params, request_id=rid)]

    return asyncio.run(main())


@pytest.mark.parametrize("kind", ["CUMULATIVE", "DELTA", "FINAL_ONLY"])
def test_outputs_equal_llm_for_every_output_kind(client, reference_llm, kind) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True, logprobs=2, n=2,
                            output_kind=RequestOutputKind[kind])
    want = reference_llm.generate(["The capital of Peru is"], params, use_tqdm=False)[0]
    outs = _collect(client, "The capital of Peru is", params, f"kinds-{kind}")
    last = outs[-1]
    assert last.finished and last.prompt_token_ids == want.prompt_token_ids and last.prompt == want.prompt
    if kind == "FINAL_ONLY":
        assert len(outs) == 1
    for index, expected in enumerate(want.outputs):
        ids, text, logprobs = assembled(outs, index, delta=kind == "DELTA")
        assert ids == expected.token_ids and text == expected.text
        assert [{k: (float(v), v.rank, v.decoded_token) for k, v in step.items()} for step in logprobs] == \
               [{k: (float(v), v.rank, v.decoded_token) for k, v in step.items()} for step in expected.logprobs]
    assert last.outputs[0].finish_reason == "length" and last.metrics["ttft_s"] is not None


def test_token_prompts_prompt_logprobs_and_structured_output(client, reference_llm) -> None:
    ids = [1, 504, 3458, 314]
    params = SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=1, ignore_eos=True)
    want = reference_llm.generate([ids], params, use_tqdm=False)[0]
    got = _collect(client, {"prompt_token_ids": ids}, params, "ids")[-1]
    assert got.token_ids == want.token_ids
    assert _collect(client, np.asarray(ids, np.int64), params, "array")[-1].token_ids == want.token_ids
    assert [None if s is None else {k: float(v) for k, v in s.items()} for s in got.prompt_logprobs] == \
           [None if s is None else {k: float(v) for k, v in s.items()} for s in want.prompt_logprobs]
    choice = SamplingParams(max_tokens=8, temperature=0.9, seed=1, structured={"choice": ["yes", "no", "maybe"]})
    assert _collect(client, "Answer:", choice, "choice")[-1].text in ("yes", "no", "maybe")


def test_refusals_name_the_field_and_the_engine_goes_on(client) -> None:
    async def main():
        errors = []
        for params, prompt in [(SamplingParams(logit_bias={10**9: 1.0}), "hi"),
                               (SamplingParams(allowed_token_ids=[10**9]), "hi"),
                               (SamplingParams(structured={"regex": "("}), "hi"),
                               ({"max_tokens": 3}, "hi"),
                               (SamplingParams(), [10**9])]:
            with pytest.raises(InvalidInput) as err:
                async for _ in client.generate(prompt, params):
                    pass
            errors.append(err.value)
        out = [o async for o in client.generate("hi", SamplingParams(max_tokens=3, ignore_eos=True))][-1]
        return errors, out

    errors, out = asyncio.run(main())
    assert [e.field for e in errors] == ["logit_bias", "allowed_token_ids", "structured.regex", "sampling_params",
                                         "prompt[0]"]
    assert isinstance(errors[3], TypeError)  # InvalidInputType stays a TypeError across the pipe
    assert len(out.token_ids) == 3


def test_aborts_and_consumers_that_leave_free_pages(client) -> None:
    params = SamplingParams(max_tokens=60, ignore_eos=True, output_kind="DELTA")

    async def main():
        gen = client.generate("Once upon a time", params, request_id="leaves")
        await gen.__anext__()
        await gen.aclose()  # the consumer leaves: the request is aborted
        outs = []
        async for out in client.generate("A long story", params, request_id="abort-me"):
            outs.append(out)
            if len(outs) == 1:
                await client.abort("abort-me")
        waiting = [asyncio.ensure_future(_drain(client.generate("x", params, request_id=f"all-{i}"))) for i in range(6)]
        await asyncio.sleep(0.3)
        aborted = await client.abort_all()
        finals = await asyncio.gather(*waiting)
        await asyncio.sleep(0.2)
        return outs, aborted, finals, await client.full_engine_stats(), client.engine_stats()

    outs, aborted, finals, full, published = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert aborted >= 1 and all(f.finished for f in finals)
    assert {f.outputs[0].finish_reason for f in finals} <= {"abort", "length"}
    for stats in (full, published):
        assert stats["free_pages"] == stats["total_pages"] and stats["num_running"] == 0
    assert client.num_streams == 0


async def _drain(gen):
    last = None
    async for out in gen:
        last = out
    return last


def test_a_load_that_fails_raises_its_error_and_a_dead_child_fails_open_streams(tiny_model_yaml, smollm2_path):
    with pytest.raises(InvalidInput) as err:
        EngineClient(str(tiny_model_yaml), tokenizer=str(smollm2_path), **{**KW, "max_num_seqs": -1})
    assert err.value.field == "max_num_seqs"

    from jaxinfer.presets import load_preset

    with pytest.raises(InvalidInput, match="name or a path") as err:
        EngineClient(load_preset("smollm2-135m"), **KW)
    assert err.value.field == "model"

    c = EngineClient(str(tiny_model_yaml), tokenizer=str(smollm2_path), **KW)

    async def main():
        gen = c.generate("Once", SamplingParams(max_tokens=80, ignore_eos=True, output_kind="DELTA"))
        await gen.__anext__()
        os.kill(c._proc.pid, signal.SIGKILL)
        with pytest.raises(EngineDead):
            async for _ in gen:
                pass
        with pytest.raises(EngineDead):
            async for _ in c.generate("again", SamplingParams(max_tokens=2)):
                pass

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        c.close()


def test_the_server_side_leaves_the_devices_alone_and_its_death_ends_the_child(tmp_path, tiny_model_yaml,
                                                                               smollm2_path) -> None:
    """The server process starts no JAX backend (the devices are the engine process's), and a SIGKILLed server
    leaves no engine process holding them: the closed pipe stops it."""
    script = tmp_path / "server.py"
    script.write_text(
        "import sys, time\n"
        "from jaxinfer.engine_process import EngineClient\n"
        f"c = EngineClient({str(tiny_model_yaml)!r}, tokenizer={str(smollm2_path)!r}, **{KW!r})\n"
        "from jax._src import xla_bridge\n"
        "print(c._proc.pid, len(xla_bridge._backends), flush=True)\n"
        "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        child, backends = map(int, proc.stdout.readline().split())
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.2)
    assert not _alive(child)
    assert backends == 0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_server_whose_engine_dies_says_so(tmp_path, tiny_model_yaml, smollm2_path) -> None:
    """`jaxinfer serve` (engine process by default) with its engine SIGKILLed mid-stream: the open stream ends
    with an engine_dead error event and [DONE], /health turns 503, a new request gets a 503 envelope."""
    import httpx

    with running(tiny_args(tiny_model_yaml, smollm2_path), tmp_path / "server.log") as server:
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    events.append(line[5:].strip())
                    if len(events) == 2:
                        children = open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read().split()
                        assert len(children) == 1, children
                        os.kill(int(children[0]), signal.SIGKILL)
        assert events[-1] == "[DONE]"
        assert '"engine_dead"' in events[-2], events[-3:]
        assert httpx.get(server.url("/health"), timeout=10).status_code == 503
        r = httpx.post(server.url("/v1/completions"), json={**body, "stream": False}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
