"""Property-based: arbitrary values for every SamplingParams field, the prompt, chat messages, and a batch job's
records and sections, against one long-lived `LLM` (the shared `text_llm`).

Each case ends in exactly one of two ways: an InvalidInput whose `.field` names something the case set (and
whose message says it), raised before any engine step ran; or a normal completion (finish_reason "stop" or
"length"). After every case the same LLM serves a fixed greedy request with the same tokens as before, with
nothing queued and every page free. Fixed seed and example counts keep it deterministic and bounded.
"""

from __future__ import annotations

import collections
import json
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from jaxinfer import LLM, InvalidInput, SamplingParams
from jaxinfer.batch.job import job_from_dict
from jaxinfer.batch.records import ResumableWriter
from jaxinfer.batch.runner import JobStats, _generate_all, _Sinks
from jaxinfer.config import ConfigError
from jaxinfer.validation import SAMPLING_RULES
from model_helpers import assert_clean

CHECK = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
CHECK_PROMPT = "The fixed greedy request"
RUN = settings(derandomize=True, deadline=None, database=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# Anything a caller might pass: wrong types, edge numbers, odd text, lists and dicts of both.
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 40), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(-3, 3), st.text(max_size=4),
    st.sampled_from(["", " ", "\ud800", "\n", "<|im_end|>", "delta", "final_only"]),
)
ANY = st.one_of(SCALARS, st.lists(SCALARS, max_size=3), st.lists(st.integers(-2, 49160), max_size=3),
                st.dictionaries(st.one_of(st.integers(-2, 49160), st.text(max_size=3)), SCALARS, max_size=3),
                st.builds(object), st.builds(lambda n: np.arange(n), st.integers(0, 3)))
# Values a request would plausibly use, so that cases also get through to generation.
PLAUSIBLE = {
    "n": st.integers(1, 3), "max_tokens": st.one_of(st.none(), st.integers(1, 8)), "min_tokens": st.integers(0, 4),
    "temperature": st.floats(0, 2), "top_k": st.integers(-1, 50), "top_p": st.floats(0.05, 1),
    "min_p": st.floats(0, 1), "repetition_penalty": st.floats(0.5, 2), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "seed": st.integers(0, 2**64),
    "logit_bias": st.dictionaries(st.integers(0, 49151), st.floats(-100, 100), max_size=3),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2), "stop_token_ids": st.lists(st.integers(0, 49151),
                                                                                             max_size=3),
    "logprobs": st.integers(0, 20), "prompt_logprobs": st.integers(0, 5),
    "truncate_prompt_tokens": st.one_of(st.just(-1), st.integers(1, 70)),
    "allowed_token_ids": st.lists(st.integers(0, 49151), min_size=1, max_size=4),
    "bad_words": st.lists(st.text(min_size=1, max_size=6), max_size=2),
    "output_kind": st.sampled_from(["cumulative", "delta", "final_only", 0, 1, 2]),
    "extra_args": st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    "structured": st.sampled_from([{"choice": ["yes", "no"]}, {"regex": "[a-z]{1,4}"}, {"regex": "("},
                                   {"json": {"type": "integer", "minimum": 0, "maximum": 9}}, {"json_object": True},
                                   {"grammar": 'start: "a" | "b"'}, {"choice": []}, {"json": 3}]),
}
FIELDS = [r.name for r in SAMPLING_RULES]
OUTCOMES: collections.Counter = collections.Counter()  # (test, outcome): both outcomes must occur, see the end


def outcome(test: str, what: str) -> None:
    OUTCOMES[test, what] += 1
    event(what)


def field_value(name: str) -> st.SearchStrategy:
    return st.one_of(ANY, PLAUSIBLE.get(name, st.booleans()))


def mostly(plausible: st.SearchStrategy, wild: st.SearchStrategy, ratio: int = 2) -> st.SearchStrategy:
    """`plausible` in `ratio` cases out of ratio + 1, `wild` in the rest: both refusals and completions occur."""
    return st.integers(0, ratio).flatmap(lambda k: plausible if k else wild)


def with_wild_key(plausible: st.SearchStrategy, keys: list[str], values: st.SearchStrategy = ANY) -> st.SearchStrategy:
    """A plausible mapping; in half the cases one of `keys` is set to anything."""
    wild = st.one_of(st.none(), st.tuples(st.sampled_from(keys), values))
    return st.tuples(plausible, wild).map(lambda t: {**t[0], **({t[1][0]: t[1][1]} if t[1] else {})})


PLAUSIBLE_KWARGS = st.lists(st.sampled_from(FIELDS), max_size=4, unique=True).flatmap(
    lambda names: st.fixed_dictionaries({n: PLAUSIBLE.get(n, st.booleans()) for n in names}))
SAMPLING_KWARGS = with_wild_key(PLAUSIBLE_KWARGS, FIELDS)
TOKEN_IDS = st.lists(st.integers(0, 49151), min_size=1, max_size=8)
PLAUSIBLE_PROMPTS = st.one_of(
    st.text(min_size=1, max_size=30), TOKEN_IDS, st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=12)}),
    st.fixed_dictionaries({"prompt_token_ids": TOKEN_IDS}),
    st.lists(st.one_of(st.text(min_size=1, max_size=8), TOKEN_IDS), min_size=1, max_size=3),
)
WILD_PROMPTS = st.one_of(
    ANY, st.lists(st.integers(-2, 49160), max_size=8), st.fixed_dictionaries({"prompt": ANY}),
    st.fixed_dictionaries({"prompt_token_ids": st.one_of(st.lists(st.integers(-1, 49160), max_size=6), ANY)}),
    st.lists(st.one_of(st.text(max_size=8), ANY), max_size=3),
    st.integers(70, 90).map(lambda n: list(range(100, 100 + n))),  # longer than max_model_len
)
PROMPTS = mostly(PLAUSIBLE_PROMPTS, WILD_PROMPTS)
ROLES = ["user", "system", "assistant"]
PLAUSIBLE_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": st.text(max_size=12)})
MESSAGE = st.one_of(
    ANY,
    st.fixed_dictionaries({"role": st.one_of(st.sampled_from(ROLES), ANY),
                           "content": st.one_of(st.text(max_size=12), ANY,
                                                st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                                "text": st.text(max_size=5)}),
                                                         max_size=2))}),
)
PLAUSIBLE_CONVERSATION = st.lists(PLAUSIBLE_MESSAGE, min_size=1, max_size=3)


@pytest.fixture(scope="module")
def llm(text_llm: LLM):
    baseline = text_llm.generate(CHECK_PROMPT, CHECK)[0].token_ids
    text_llm.baseline = baseline
    yield text_llm
    assert_clean(text_llm)


def assert_serving(llm: LLM) -> None:
    assert_clean(llm)
    assert llm.generate(CHECK_PROMPT, CHECK)[0].token_ids == llm.baseline


def assert_names_a_field(error: InvalidInput, given: set[str]) -> None:
    """The error's field is one the case set (or the prompt/messages it passed), and its message says so."""
    assert error.field, f"no field named: {error}"
    root = error.field.split("[")[0].split(".")[0]
    assert root in given, f"{error.field!r} is not among {sorted(given)}: {error}"
    assert root in str(error), str(error)


def assert_finished_normally(outs: list) -> None:
    for out in outs:
        assert out.finished and out.error is None
        assert all(c.finish_reason in ("stop", "length") for c in out.outputs), out


@settings(RUN, max_examples=120)
@given(kwargs=SAMPLING_KWARGS, prompt=PROMPTS)
def test_any_sampling_params_and_prompt(llm: LLM, kwargs: dict[str, Any], prompt: Any) -> None:
    named = set(kwargs) | {"prompt", "prompts", "n", "max_tokens"}  # the scheduler's limits apply to n, max_tokens
    try:
        try:
            params = SamplingParams(**kwargs)
        except InvalidInput as e:
            assert_names_a_field(e, set(kwargs))
            outcome("params", "refused by SamplingParams")
            return
        steps = llm.engine.num_steps
        try:
            outs = llm.generate(prompt, params, use_tqdm=False)
        except InvalidInput as e:
            assert llm.engine.num_steps == steps, "refused after a step ran"
            assert_names_a_field(e, named)
            outcome("params", "refused by generate")
            return
        assert_finished_normally(outs)
        outcome("params", "completed")
    finally:
        assert_serving(llm)


@settings(RUN, max_examples=60)
@given(messages=mostly(st.one_of(PLAUSIBLE_CONVERSATION, st.lists(PLAUSIBLE_CONVERSATION, min_size=1, max_size=2)),
                       st.one_of(ANY, st.lists(MESSAGE, max_size=3),
                                 st.lists(st.lists(MESSAGE, min_size=1, max_size=2), min_size=1, max_size=2))),
       add_generation_prompt=st.booleans(), continue_final_message=mostly(st.just(False), st.just(True)))
def test_any_chat_messages(llm: LLM, messages: Any, add_generation_prompt: bool, continue_final_message: bool) -> None:
    steps = llm.engine.num_steps
    try:
        outs = llm.chat(messages, CHECK.replace(max_tokens=2), add_generation_prompt=add_generation_prompt,
                        continue_final_message=continue_final_message, use_tqdm=False)
    except InvalidInput as e:
        assert llm.engine.num_steps == steps
        assert_names_a_field(e, {"messages", "continue_final_message", "prompt", "prompts"})
        outcome("chat", "refused")
    else:
        assert_finished_normally(outs)
        outcome("chat", "completed")
    finally:
        assert_serving(llm)


JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 49160), st.floats(allow_nan=False), st.text(max_size=6)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6,
)
JSON_SAMPLING = st.lists(st.sampled_from(FIELDS), max_size=4, unique=True).flatmap(
    lambda names: st.fixed_dictionaries({n: JSON for n in names}))
JSON_MESSAGE = st.one_of(JSON, st.fixed_dictionaries({"role": st.one_of(st.just("user"), JSON),
                                                       "content": st.one_of(st.text(max_size=8), JSON)}))
WILD_RECORD = st.fixed_dictionaries(  # what a JSONL line can hold
    {"id": st.just("r")},
    optional={"prompt": st.one_of(st.text(max_size=20), JSON), "messages": st.one_of(JSON, st.lists(JSON_MESSAGE,
                                                                                                   max_size=2)),
              "sampling": st.one_of(JSON, JSON_SAMPLING)},
)
PLAUSIBLE_RECORD = st.fixed_dictionaries(
    {"id": st.just("r"), "prompt": st.text(min_size=1, max_size=20), "messages": PLAUSIBLE_CONVERSATION},
    optional={"sampling": with_wild_key(PLAUSIBLE_KWARGS.map(lambda d: json.loads(json.dumps(d))), FIELDS, JSON)},
)
RECORD = mostly(PLAUSIBLE_RECORD, WILD_RECORD)


@settings(RUN, max_examples=60)
@given(record=RECORD, chat=st.booleans())
def test_any_batch_record(llm: LLM, tmp_path_factory, record: dict[str, Any], chat: bool) -> None:
    field = {"messages_field": "messages"} if chat else {}
    job = job_from_dict({"model": "m", "input": {"path": "in.jsonl", **field}, "output": {"path": "o.jsonl"},
                         "sampling": {"max_tokens": 3, "temperature": 0}}, "job.yaml")
    folder = tmp_path_factory.mktemp("record")
    out, errors = ResumableWriter(folder / "out.jsonl"), ResumableWriter(folder / "errors.jsonl")
    try:
        with out, errors:
            _generate_all(job, llm, [record], _Sinks(out, errors), JobStats(), use_tqdm=False)
        written = [json.loads(line) for line in (folder / "out.jsonl").read_text().splitlines()]
        failed = [json.loads(line) for line in (folder / "errors.jsonl").read_text().splitlines()]
        assert len(written) + len(failed) == 1, (written, failed)  # exactly once, in exactly one file
        if failed:
            assert failed[0]["id"] == "r" and failed[0]["error"]
            outcome("record", "to the error file")
        else:
            assert written[0]["finish_reason"] in ("stop", "length")
            outcome("record", "to the output")
    finally:
        assert_serving(llm)


SECTION_KEYS = {
    "input": ["path", "id_field", "prompt_field", "messages_field", "sampling_field", "bogus"],
    "output": ["path", "error_path", "bogus"],
    "sampling": [*FIELDS[:6], "stop", "bogus"],
    "engine": ["dtype", "max_model_len", "max_num_seqs", "block_size", "page_size", "gpu_memory_utilization",
               "trust_remote_code", "revision", "bogus"],
}


PLAUSIBLE_SECTIONS = st.fixed_dictionaries(
    {"model": st.just("m"), "input": st.just({"path": "in.jsonl"}), "output": st.just({"path": "o.jsonl"})},
    optional={"sampling": PLAUSIBLE_KWARGS.map(lambda d: json.loads(json.dumps(d))),
              "engine": st.fixed_dictionaries({}, optional={
                  "dtype": st.sampled_from(["auto", "float32", "bfloat16", "half"]), "max_num_seqs": st.integers(1, 64),
                  "block_size": st.sampled_from([8, 16]), "page_size": st.sampled_from([8, 16]),
                  "max_model_len": st.integers(2, 4096), "gpu_memory_utilization": st.floats(0.1, 1.0),
                  "trust_remote_code": st.booleans()})},
)


def section(name: str) -> st.SearchStrategy:
    keys = st.lists(st.sampled_from(SECTION_KEYS[name]), max_size=3, unique=True)
    return st.one_of(ANY, keys.flatmap(lambda ks: st.fixed_dictionaries({k: field_value(k) for k in ks})))


WILD_SECTIONS = st.fixed_dictionaries({"model": st.one_of(st.just("m"), ANY)},
                                      optional={name: section(name) for name in SECTION_KEYS})


@settings(RUN, max_examples=150)
@given(sections=mostly(PLAUSIBLE_SECTIONS, WILD_SECTIONS, ratio=1),
       top_extra=st.one_of(st.none(), st.sampled_from(["max_in_flight", "modle"])), extra_value=ANY)
def test_any_batch_job_sections(sections: dict[str, Any], top_extra: str | None, extra_value: Any) -> None:
    data = {"input": {"path": "in.jsonl"}, "output": {"path": "o.jsonl"}, **sections}
    if top_extra is not None:
        data[top_extra] = extra_value
    try:
        job = job_from_dict(data, "job.yaml")
    except ConfigError as e:  # the file, then the section or key
        message = str(e)
        assert message.startswith("job.yaml: ") and len(message.splitlines()) == 1
        mentioned = [k for k in [*data, *(k for v in data.values() if isinstance(v, dict) for k in v)]
                     if str(k) in message]
        assert mentioned or "missing" in message, message
        outcome("sections", "refused")
        return
    assert isinstance(job.model, str) and job.max_in_flight >= 1
    job.base_sampling  # noqa: B018 - a valid job's sampling section builds
    outcome("sections", "loaded")


def test_both_outcomes_occurred() -> None:
    """Runs after the properties above (file order): each saw refusals and successes in fair numbers."""
    for test, outcomes in [("params", ["refused by SamplingParams", "refused by generate", "completed"]),
                           ("chat", ["refused", "completed"]), ("record", ["to the error file", "to the output"]),
                           ("sections", ["refused", "loaded"])]:
        for what in outcomes:
            assert OUTCOMES[test, what] >= 5, (test, what, dict(OUTCOMES))


def test_the_suite_covers_every_sampling_field() -> None:
    assert set(FIELDS) - set(PLAUSIBLE) == {"include_stop_str_in_output", "ignore_eos", "detokenize",
                                            "skip_special_tokens", "spaces_between_special_tokens",
                                            "speculative"}  # booleans
