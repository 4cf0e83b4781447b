"""Run a batch job: stream records through the engine, append results as requests finish, summarize."""

from __future__ import annotations

import json
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from jaxinfer.batch.job import BatchJob, load_job
from jaxinfer.batch.records import ResumableWriter, load_records, pending
from jaxinfer.config import ConfigError, SamplingParams
from jaxinfer.outputs import RequestOutput


def record_params(job: BatchJob, record: dict[str, Any]) -> SamplingParams:
    """The job's sampling settings with the record's own overrides on top."""
    overrides = record.get(job.input.sampling_field) or {}
    merged = {**job.sampling, **overrides}
    return SamplingParams.from_dict(merged, section=f"record {record[job.input.id_field]!r} sampling")


def record_prompt(job: BatchJob, record: dict[str, Any], tokenizer: Any) -> str | list[int]:
    rid = record[job.input.id_field]
    if job.input.messages_field is not None:
        messages = record.get(job.input.messages_field)
        if not isinstance(messages, list):
            raise ConfigError(f"record {rid!r}: {job.input.messages_field!r} must be a list of messages.")
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = record.get(job.input.prompt_field)
    if not isinstance(prompt, str | list):
        raise ConfigError(f"record {rid!r}: {job.input.prompt_field!r} must be a string or a list of token ids.")
    return prompt


def output_record(rid: Any, out: RequestOutput) -> dict[str, Any]:
    first = out.outputs[0]
    record = {
        "id": rid,
        "text": first.text,
        "token_ids": first.token_ids,
        "finish_reason": first.finish_reason.value if first.finish_reason else None,
        "num_prompt_tokens": len(out.prompt_token_ids),
        "num_output_tokens": len(first.token_ids),
        "metrics": out.metrics,
    }
    if len(out.outputs) > 1:
        record["n_outputs"] = [{"text": o.text, "token_ids": o.token_ids} for o in out.outputs]
    return record


class JobStats:
    """Collects what the summary reports."""

    def __init__(self) -> None:
        self.start = time.monotonic()
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
    """Run (or resume) the job at `path`; returns the summary it also prints and writes."""
    job = load_job(path)
    records = load_records(Path(job.input.path), job.input.id_field)
    out_path = Path(job.output.path)
    with ResumableWriter(out_path) as writer:
        todo = pending(records, writer.done, job.input.id_field)
        skipped = len(records) - len(todo)
        llm = _load_llm(job, use_tqdm) if todo else None
        stats = JobStats()
        if llm is not None:
            _generate_all(job, llm, todo, writer, stats, use_tqdm)
        summary = stats.summary(llm.engine_stats() if llm else {}, skipped)
    summary_path = out_path.with_suffix(".summary.json")
    summary_path.write_text(json.dumps(summary, indent=1), encoding="utf-8")
    _print_report(out_path, summary)
    return summary


def _print_report(out_path: Path, summary: dict[str, Any], show: int = 8) -> None:
    """A few finished texts (so a quick job shows its results) and the summary."""
    lines = out_path.read_text(encoding="utf-8").splitlines()
    for line in lines[:show]:
        record = json.loads(line)
        print(f"[{record['id']}] {record.get('text', record.get('error'))!s}".replace("\n", " "))
    if len(lines) > show:
        print(f"... {len(lines) - show} more in {out_path}")
    print(json.dumps(summary, indent=1))


def _load_llm(job: BatchJob, use_tqdm: bool) -> Any:
    from jaxinfer import LLM

    return LLM(job.model, use_tqdm=use_tqdm, **vars(job.engine))


def _generate_all(job: BatchJob, llm: Any, todo: list[dict[str, Any]], writer: ResumableWriter, stats: JobStats,
                  use_tqdm: bool) -> None:
    """Keep up to job.max_in_flight requests in the engine; write each as soon as it finishes."""
    engine = llm.engine
    queue = deque(todo)
    in_flight: dict[str, Any] = {}
    bar = tqdm(total=len(todo), desc="batch", unit="req", disable=not use_tqdm)
    while queue or in_flight:
        while queue and len(in_flight) < job.max_in_flight:
            record = queue.popleft()
            try:
                prompt = record_prompt(job, record, llm.tokenizer)
                rid = engine.add_request(prompt, record_params(job, record))
            except ValueError as e:  # one bad record is reported in the output; the job goes on
                writer.write({"id": record[job.input.id_field], "error": str(e), "finish_reason": "error"})
                bar.update(1)
                continue
            in_flight[rid] = record[job.input.id_field]
        for out in engine.step():
            if out.finished and out.request_id in in_flight:
                writer.write(output_record(in_flight.pop(out.request_id), out))
                stats.add(out, out.inter_token_latencies)
                bar.update(1)
                bar.set_postfix(tok_s=f"{stats.output_tokens / max(time.monotonic() - stats.start, 1e-9):.1f}")
    bar.close()

