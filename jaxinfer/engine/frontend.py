"""The batch API over an engine core: generate (all prompts to completion) and stream (outputs as they come).

A core is anything with the step-level interface: `gate` (the checks at the door, jaxinfer.engine.admission),
`queue(admission, output_kind)`, `step()`, `abort(id)`, `has_unfinished()`, `flush()` and `use_tqdm`: one
`Engine`, or `DataParallelEngines` routing each request to a replica. Every prompt of a batch is checked
before any is queued, so a bad one refuses the whole batch and queues nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from jaxinfer.config import SamplingParams
from jaxinfer.engine.admission import in_batch, per_prompt
from jaxinfer.errors import InvalidInput
from jaxinfer.inputs import parse_prompts
from jaxinfer.outputs import RequestOutput
from jaxinfer.validation import RequestOutputKind


def generate(
    core: Any, prompts: Any, params: SamplingParams | Sequence[SamplingParams] | None = None, *,
    use_tqdm: bool | None = None, priority: Sequence[int] | None = None,
) -> list[RequestOutput]:
    """All prompts to completion; results in input order, each the complete final output (as vLLM,
    whatever output_kind says). Every request is validated before any is queued, and if this raises
    (Ctrl-C included) its own unfinished requests are aborted, so the engine stays usable."""
    ids = add_all(core, prompts, params, priority, RequestOutputKind.FINAL_ONLY)
    wanted, results = set(ids), {}
    show = core.use_tqdm if use_tqdm is None else use_tqdm
    try:
        with tqdm(total=len(ids), desc="generating", disable=not show) as bar:
            while len(results) < len(ids):
                for out in core.step():
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
                        bar.update(1)
    except BaseException:
        for rid in wanted - set(results):
            core.abort(rid)
        raise
    if not core.has_unfinished():
        core.flush()  # a decode call launched ahead holds only finished rows: return with the device idle
    return [results[rid] for rid in ids]


def stream(
    core: Any, prompts: Any, params: SamplingParams | Sequence[SamplingParams] | None = None
) -> Iterator[RequestOutput]:
    """Yield each request's outputs as it advances, as its output_kind asks (CUMULATIVE by default, with
    what is new in `delta_text`/`delta_token_ids`)."""
    ids = set(add_all(core, prompts, params, None, None))
    done: set[str] = set()
    try:
        while done != ids:
            for out in core.step():
                if out.request_id in ids:
                    done.update([out.request_id] if out.finished else [])
                    yield out
    finally:
        for rid in ids - done:  # the consumer stopped early, or something raised: free what is left
            core.abort(rid)


def add_all(core: Any, prompts: Any, params: Any, priority: Sequence[int] | None,
            output_kind: RequestOutputKind | None) -> list[str]:
    """Check every prompt and its params at the door, then queue them all, or none."""
    parsed = parse_prompts(prompts)
    param_list = per_prompt("sampling_params", params, len(parsed))
    priorities = per_prompt("priority", priority, len(parsed), default=0)
    admitted = []
    for i, (prompt, p, prio) in enumerate(zip(parsed, param_list, priorities)):
        try:
            admitted.append(core.gate.admit(prompt, p, priority=prio))
        except InvalidInput as e:
            raise in_batch(e, i, len(parsed)) from None
    added: list[str] = []
    for i, adm in enumerate(admitted):
        try:
            added.append(core.queue(adm, output_kind))
        except InvalidInput as e:  # the scheduler's limits (pages, n): refuse the whole batch, queue nothing
            for rid in added:
                core.abort(rid)
            raise in_batch(e, i, len(admitted)) from None
    return added
