"""Run a batch job: stream records through the engine, append results as requests finish, summarize.

A job keeps going past bad records. A record that fails the checks at the door (its prompt, messages or
sampling overrides; jaxinfer.engine.admission) or fails alone during generation (finish_reason "error") is
written to the job's error file with its id and message, counts as done (a resumed job does not retry it),
and the summary counts it; every other record is written to the output once.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxinfer import distributed
from jaxinfer.batch.job import BatchJob, load_job
from jaxinfer.batch.records import ResumableWriter, load_records, pending
from jaxinfer.chat import chat_prompts
from jaxinfer.config import SamplingParams
from jaxinfer.errors import InvalidInput, InvalidInputType
from jaxinfer.llm import LLM
from jaxinfer.outputs import FinishReason, RequestOutput


def record_params(job: BatchJob, record: dict[str, Any]) -> SamplingParams:
    """The job's sampling settings with the record's own overrides on top."""
    section = f"record {record[job.input.id_field]!r} sampling"
    overrides = record.get(job.input.sampling_field)
    if overrides is not None and not isinstance(overrides, dict):
        raise InvalidInputType(f"{section}: expected an object of SamplingParams fields, got "
                               f"{type(overrides).__name__}.", field=job.input.sampling_field, value=overrides)
    return SamplingParams.from_dict({**job.sampling, **(overrides or {})}, section=section)


def record_prompt(job: BatchJob, record: dict[str, Any], tokenizer: Any) -> Any:
    """The record's prompt in a form the engine checks (chat messages are rendered here)."""
    rid = record[job.input.id_field]
    if job.input.messages_field is not None:
        if job.input.messages_field not in record:
            raise InvalidInput(f"record {rid!r} has no {job.input.messages_field!r} field.",
                               field=job.input.messages_field)
        try:
            return chat_prompts(tokenizer, record[job.input.messages_field])[0]
        except InvalidInput as e:
            raise type(e)(f"record {rid!r}: {e}", field=e.field, value=e.value, accepted=e.accepted) from None
    if job.input.prompt_field not in record:
        raise InvalidInput(f"record {rid!r} has no {job.input.prompt_field!r} field.", field=job.input.prompt_field)
    return record[job.input.prompt_field]


def output_record(rid: Any, out: RequestOutput) -> dict[str, Any]:
    first = out.outputs[0]
    record = {
        "id": rid,
        "text": first.text,
        "token_ids": first.token_ids,
        "finish_reason": first.finish_reason.value if first.finish_reason else None,
        "stop_reason": first.stop_reason,
        "num_prompt_tokens": len(out.prompt_token_ids),
        "num_output_tokens": len(first.token_ids),
        "metrics": dict(out.metrics or {}),
    }
    if len(out.outputs) > 1:
        record["n_outputs"] = [{"text": o.text, "token_ids": o.token_ids} for o in out.outputs]
    return record


class JobStats:
    """Collects what the summary reports."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.failed = 0
        self.requests = 0
        self.output_tokens = 0
        self.ttft: list[float] = []
        self.itl: list[float] = []

    def add(self, out: RequestOutput, itl: list[float]) -> None:
        self.requests += 1
        self.output_tokens += sum(len(o.token_ids) for o in out.outputs)
        if out.metrics and "ttft_s" in out.metrics:
            self.ttft.append(out.metrics["ttft_s"])
        self.itl.extend(itl)

    def summary(self, engine_stats: dict[str, Any], skipped: int) -> dict[str, Any]:
        elapsed = time.monotonic() - self.start
        pct = lambda xs, q: float(np.percentile(xs, q)) if xs else None  # noqa: E731
        return {
            "requests_completed": self.requests,
            "requests_failed": self.failed,
            "requests_skipped_as_done": skipped,
            "elapsed_s": elapsed,
            "output_tokens": self.output_tokens,
            "output_tokens_per_s": self.output_tokens / elapsed if elapsed > 0 else 0.0,
            "requests_per_s": self.requests / elapsed if elapsed > 0 else 0.0,
            "ttft_p50_s": pct(self.ttft, 50), "ttft_p99_s": pct(self.ttft, 99),
            "itl_p50_s": pct(self.itl, 50), "itl_p99_s": pct(self.itl, 99),
            "num_preemptions": engine_stats.get("num_preemptions"),
            "prefix_cache_hit_rate": engine_stats.get("prefix_cache_hit_rate"),
            "num_compiles_after_warmup": engine_stats.get("num_compiles_after_warmup"),
        }


def run_job(path: str | Path, *, use_tqdm: bool = True) -> dict[str, Any]:
    """Run (or resume) the job at `path`; returns the summary it also prints and writes.

    Multi-host (after jaxinfer.distributed.initialize): when one engine replica spans the processes, every
    process must run the same requests, so each reads the whole input, process 0 decides what is still to do
    (its output files are the record) and only process 0 writes. Otherwise each process takes its own shard
    of the input and writes its own files, named `<output>.process<i>-of-<n>.jsonl`."""
    job = load_job(path)
    spans = distributed.spans_processes(devices_per_replica(job.llm_kwargs))
    records = load_records(Path(job.input.path), job.input.id_field, shard=not spans)
    out_path, error_path = (Path(p) for p in (job.output.path, job.output.errors))
    if distributed.is_multiprocess() and not spans:
        out_path, error_path = process_path(out_path), process_path(error_path)
    writes = distributed.is_writer() or not spans
    # Both files key their lines by "id" (whatever the input's id_field is called).
    with _writer(out_path, "output.path", writes) as writer, _writer(error_path, "output.error_path", writes) as errors:
        todo = pending(records, writer.done | errors.done, job.input.id_field)
        if spans:  # the same records on every process, in the same order: process 0's list
            done = set(distributed.broadcast_json(sorted(map(str, writer.done | errors.done))))
            todo = [r for r in records if str(r[job.input.id_field]) not in done]
        skipped = len(records) - len(todo)
        llm = _load_llm(job, use_tqdm) if todo else None
        stats = JobStats()
        if llm is not None:
            _generate_all(job, llm, todo, _Sinks(writer, errors), stats, use_tqdm)
        summary = stats.summary(llm.engine_stats() if llm else {}, skipped)
    if writes:
        out_path.with_suffix(".summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
        _print_report(out_path, error_path, summary)
    return summary


def devices_per_replica(llm_kwargs: dict[str, Any]) -> int:
    return math.prod(int(llm_kwargs.get(f"{k}_parallel_size", 1) or 1) for k in ("tensor", "expert", "sequence"))


def process_path(path: Path) -> Path:
    """This process's own file beside `path` (per-host replicas each write their share)."""
    return path.with_name(f"{path.stem}.process{jax.process_index()}-of-{jax.process_count()}{path.suffix}")


def _writer(path: Path, setting: str, writes: bool) -> Any:
    """The resumable writer, or on a process that only follows process 0, one that keeps nothing."""
    return ResumableWriter(path, "id", setting) if writes else _NoWriter()


class _NoWriter:
    done: set[Any] = frozenset()

    def write(self, record: dict[str, Any]) -> None:
        pass

    def __enter__(self) -> _NoWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class _Sinks:
    """Where finished records go: results to the output, failures (id + message) to the error file."""

    def __init__(self, output: ResumableWriter, errors: ResumableWriter) -> None:
        self.output, self.errors = output, errors

    def error(self, rid: Any, message: str, stats: JobStats) -> None:
        self.errors.write({"id": rid, "error": message})
        stats.failed += 1


def _print_report(out_path: Path, error_path: Path, summary: dict[str, Any], show: int = 8) -> None:
    """A few finished texts (so a quick job shows its results), how many failed, and the summary."""
    lines = out_path.read_text(encoding="utf-8").splitlines()
    for line in lines[:show]:
        record = json.loads(line)
        print(f"[{record['id']}] {record.get('text')!s}".replace("\n", " "))
    if len(lines) > show:
        print(f"... {len(lines) - show} more in {out_path}")
    failed = error_path.read_text(encoding="utf-8").splitlines() if error_path.exists() else []
    if failed:
        print(f"{len(failed)} record(s) failed; their ids and messages are in {error_path}")
    print(json.dumps(summary, indent=1))


def _load_llm(job: BatchJob, use_tqdm: bool) -> LLM:
    return LLM(job.model, **{"use_tqdm": use_tqdm, **job.llm_kwargs})


def _generate_all(job: BatchJob, llm: Any, todo: list[dict[str, Any]], sinks: _Sinks, stats: JobStats,
                  use_tqdm: bool) -> None:
    """Keep up to job.max_in_flight requests in the engine; write each as soon as it finishes."""
    engine = llm.engine
    queue = deque(todo)
    in_flight: dict[str, Any] = {}
    bar = tqdm(total=len(todo), desc="batch", unit="req", disable=not use_tqdm)
    while queue or in_flight:
        while queue and len(in_flight) < job.max_in_flight:
            record = queue.popleft()
            rid = record[job.input.id_field]
            try:
                request_id = engine.add_request(record_prompt(job, record, llm.tokenizer), record_params(job, record))
            except InvalidInput as e:  # refused at the door: reported, not retried, and the job goes on
                sinks.error(rid, str(e), stats)
                bar.update(1)
                continue
            in_flight[request_id] = rid
        for out in engine.step():
            if out.finished and out.request_id in in_flight:
                _write_finished(sinks, in_flight.pop(out.request_id), out, stats)
                bar.update(1)
                bar.set_postfix(tok_s=f"{stats.output_tokens / max(time.monotonic() - stats.start, 1e-9):.1f}")
    bar.close()


def _write_finished(sinks: _Sinks, rid: Any, out: RequestOutput, stats: JobStats) -> None:
    if out.finish_reason == FinishReason.ERROR:  # failed alone during generation
        sinks.error(rid, out.error or "failed during generation", stats)
        return
    sinks.output.write(output_record(rid, out))
    stats.add(out, out.inter_token_latencies)

