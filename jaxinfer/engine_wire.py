"""What crosses the pipe between a server process and its engine process (jaxinfer.engine_process): sampling
parameters, request outputs and refusals as plain JSON-able dicts, one message per line. No pickle: both ends
are our own code, but a pipe carries data, never code.

A request's prompt (its text, ids and prompt logprobs) travels once, with its first output
(`encode_output(..., with_prompt=True)`); the receiving side keeps it (`PromptCache`) and puts it back on
every later output, so a streamed 1,024-token prompt is not re-sent with each of its tokens.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any

from jaxinfer.config import SamplingParams
from jaxinfer.errors import InvalidInput, InvalidInputType
from jaxinfer.outputs import CompletionOutput, FinishReason, Logprob, RequestMetrics, RequestOutput

_DEFAULTS = SamplingParams()


def dumps(message: dict[str, Any]) -> bytes:
    """One message as one line (json.dumps escapes newlines inside strings)."""
    return json.dumps(message, ensure_ascii=False, separators=(",", ":"), default=_plain).encode() + b"\n"


def _plain(value: Any) -> Any:
    """What JSON has no type for: NumPy scalars and arrays (a prompt's ids, a stat) as numbers and lists, sets
    as lists, anything else as its text."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, set | frozenset):
        return sorted(value, key=str)
    return str(value)


def loads(line: bytes) -> dict[str, Any]:
    return json.loads(line)


# ------------------------------------------------------------------------------------------ sampling params

def encode_params(params: SamplingParams | None) -> dict[str, Any] | None:
    """The fields that differ from the defaults, in JSON types (logit_bias as [id, bias] pairs: JSON object
    keys are strings)."""
    if params is None:
        return None
    out: dict[str, Any] = {}
    for f in dataclasses.fields(SamplingParams):
        value = getattr(params, f.name)
        if value == getattr(_DEFAULTS, f.name):
            continue
        if f.name == "logit_bias":
            value = [[int(k), float(v)] for k, v in value.items()]
        elif f.name == "structured":
            value = {k: v for k, v in dataclasses.asdict(value).items() if v not in (None, False)}
        elif isinstance(value, enum.Enum):
            value = value.value
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def decode_params(data: dict[str, Any] | None) -> SamplingParams | None:
    if data is None:
        return None
    data = dict(data)
    if "logit_bias" in data:
        data["logit_bias"] = {int(k): v for k, v in data["logit_bias"]}
    return SamplingParams.from_dict(data)


# ------------------------------------------------------------------------------------------------- outputs

def _encode_logprobs(step: dict[int, Logprob] | None) -> list[list[Any]] | None:
    """{id: Logprob} as [[id, logprob, rank, decoded_token], ...] (None stays None: the first prompt token)."""
    if step is None:
        return None
    return [[int(i), float(lp), getattr(lp, "rank", None), getattr(lp, "decoded_token", None)]
            for i, lp in step.items()]


def _decode_logprobs(step: list[list[Any]] | None) -> dict[int, Logprob] | None:
    if step is None:
        return None
    return {i: Logprob(lp, rank, text) for i, lp, rank, text in step}


def _encode_completion(c: CompletionOutput) -> dict[str, Any]:
    return {"index": c.index, "text": c.text, "token_ids": list(c.token_ids),
            "finish_reason": None if c.finish_reason is None else str(c.finish_reason),
            "logprobs": None if c.logprobs is None else [_encode_logprobs(s) for s in c.logprobs],
            "cumulative_logprob": c.cumulative_logprob, "stop_reason": c.stop_reason,
            "delta_text": c.delta_text, "delta_token_ids": list(c.delta_token_ids)}


def _decode_completion(d: dict[str, Any]) -> CompletionOutput:
    reason = d["finish_reason"]
    logprobs = d["logprobs"]
    return CompletionOutput(
        index=d["index"], text=d["text"], token_ids=d["token_ids"],
        finish_reason=None if reason is None else FinishReason(reason),
        logprobs=None if logprobs is None else [_decode_logprobs(s) for s in logprobs],
        cumulative_logprob=d["cumulative_logprob"], stop_reason=d["stop_reason"], delta_text=d["delta_text"],
        delta_token_ids=d["delta_token_ids"])


def encode_output(out: RequestOutput, *, with_prompt: bool) -> dict[str, Any]:
    msg: dict[str, Any] = {
        "request_id": out.request_id, "outputs": [_encode_completion(c) for c in out.outputs],
        "finished": out.finished, "metrics": None if out.metrics is None else dict(out.metrics),
        "num_cached_tokens": out.num_cached_tokens, "error": out.error,
        "inter_token_latencies": list(out.inter_token_latencies)}
    if with_prompt:
        msg["prompt"] = {"text": out.prompt, "token_ids": list(out.prompt_token_ids),
                         "logprobs": None if out.prompt_logprobs is None
                         else [_encode_logprobs(s) for s in out.prompt_logprobs]}
    return msg


class PromptCache:
    """The receiving side's copy of each open request's prompt (sent once, with its first output)."""

    def __init__(self) -> None:
        self._prompts: dict[str, tuple[str | None, list[int], Any]] = {}

    def decode(self, msg: dict[str, Any]) -> RequestOutput | None:
        """The output `msg` carries; None for a request this side no longer follows (an output still in flight
        after the request was aborted here). Safe from two threads: each step is one dict operation."""
        rid = msg["request_id"]
        if "prompt" in msg:
            p = msg["prompt"]
            logprobs = None if p["logprobs"] is None else [_decode_logprobs(s) for s in p["logprobs"]]
            prompt = (p["text"], p["token_ids"], logprobs)
            if not msg["finished"]:
                self._prompts[rid] = prompt
        else:
            prompt = self._prompts.pop(rid, None) if msg["finished"] else self._prompts.get(rid)
            if prompt is None:
                return None
        text, ids, prompt_logprobs = prompt
        metrics = msg["metrics"]
        return RequestOutput(
            request_id=rid, prompt=text, prompt_token_ids=ids,
            outputs=[_decode_completion(c) for c in msg["outputs"]], finished=msg["finished"],
            prompt_logprobs=prompt_logprobs, metrics=None if metrics is None else RequestMetrics(metrics),
            num_cached_tokens=msg["num_cached_tokens"], error=msg["error"],
            inter_token_latencies=msg["inter_token_latencies"])

    def forget(self, request_id: str) -> None:
        self._prompts.pop(request_id, None)


# ------------------------------------------------------------------------------------------------- refusals

def encode_error(e: BaseException) -> dict[str, Any]:
    """A refusal as data: InvalidInput keeps its field, value (as text when JSON cannot hold it) and accepted."""
    msg: dict[str, Any] = {"type": type(e).__name__, "message": str(e)}
    if isinstance(e, InvalidInput):
        value = e.value
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            value = repr(value)
        msg.update(field=e.field, value=value, accepted=e.accepted)
    return msg


def decode_error(d: dict[str, Any]) -> BaseException:
    """The exception the engine side raised, rebuilt: the InvalidInput types as they were, anything else as a
    RuntimeError naming the original type."""
    kinds = {"InvalidInput": InvalidInput, "InvalidInputType": InvalidInputType}
    cls = kinds.get(d["type"])
    if cls is not None:
        return cls(d["message"], field=d.get("field"), value=d.get("value"), accepted=d.get("accepted"))
    return RuntimeError(f"{d['type']}: {d['message']}")
