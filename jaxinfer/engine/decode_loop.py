"""Multi-step and overlapped decode: several decode iterations per device call, and the next call launched
before the last one is read back. A collaborator of `Engine` (it reads the engine's scheduler, runner and
request states, and hands tokens to its output path); the engine decides when a plan is all decodes.

Multi-step decode (`decode_steps_per_call` = N > 1): when a plan holds only decodes (one token each, no prefill
chunk, no preemption) and either more rows than `single_step_max_rows` or no row that streams (smaller streamed
batches run pipelined single steps: `Engine.decodes_singly`), the runner runs up to N decode iterations in one
device call. The scheduler reserved pages for one token, so rows whose last page has less room get pages
reserved ahead (`Scheduler.reserve_lookahead`, free or evictable pages only); the call runs k = min(N, room)
iterations, where room is the least number of free positions left in any row's pages (a row that could not get
pages, or still finishing its prompt, bounds it). The host then replays the k iterations through the ordinary
path: `Scheduler.update` once per iteration with the plan the scheduler would have made (each still running row
decodes its new token), so stop strings, detokenization, prefix-cache registration and LENGTH limits behave
exactly as with N = 1. Tokens a row sampled after the host stopped it are dropped. Waiting requests are admitted
at the next schedule(), i.e. at most k - 1 iterations later than with N = 1.

Overlapped decode (`overlap_decode`, on by default): while nothing waits and the running sequences are the
rows of the multi-step call in flight, the engine launches the call that continues it before reading it
back. That call takes its input tokens and live-row mask from the device outputs of the one before
(`MultiStepOutput.next_tokens`, `alive`), so the device runs it while the host replays the previous call.
Rows the host stops in between run on harmlessly (their writes land in their own or the trash pages, and
pages freed meanwhile are only handed out to work launched later); `settle` drops their tokens. A new
request therefore waits at most one more call than without overlap.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxinfer.engine.batcher import BatchShape
from jaxinfer.engine.page_table import PageCopy
from jaxinfer.engine.request import RequestState
from jaxinfer.engine.step_io import DecodeInputs, MultiStepOutput, SampleInputs, StepBatch
from jaxinfer.engine.sampling import SamplerOutput
from jaxinfer.engine.sampling_rows import PenaltyState
from jaxinfer.validation import MAX_STOP_IDS
from jaxinfer.engine.step_plan import ScheduledSeq, StepPlan
from jaxinfer.outputs import RequestOutput

if TYPE_CHECKING:
    from jaxinfer.engine.engine import Engine


HANDOFF_SWITCH_INTERVAL_S = 2e-4  # Python's GIL switch interval while a launcher thread must run promptly


@contextlib.contextmanager
def prompt_gil_handoff(active: bool) -> Iterator[None]:
    """While the host replays tokens (pure Python) beside a call in flight, let the launcher thread take the
    GIL within 0.2 ms instead of Python's default 5 ms switch interval: the call needs it to return and the
    next one to start, and a trace of overlapped decode showed the device idle in 5 ms gaps without this."""
    if not active:
        yield
        return
    interval = sys.getswitchinterval()
    sys.setswitchinterval(min(interval, HANDOFF_SWITCH_INTERVAL_S))
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


@dataclasses.dataclass(frozen=True)
class _InFlight:
    """A multi-step decode call launched on the device whose results the host has not read yet."""

    plan: StepPlan  # row j of the call is plan.seqs[j]; a continuation's input tokens are placeholders
    num_iterations: int
    inputs: SampleInputs  # host arrays it was launched with
    decode: DecodeInputs  # host arrays, except `alive` of a continuation
    launched: Future[tuple[PenaltyState, MultiStepOutput]]  # device arrays, once the launcher thread made the call


class DecodeLoop:
    """The engine's multi-step decode calls: at most one in flight (`inflight`), launched from a thread."""

    def __init__(self, engine: Engine, steps_per_call: int, overlap: bool) -> None:
        self.engine = engine
        self.steps_per_call = steps_per_call
        self.overlap = overlap
        self.inflight: _InFlight | None = None
        self.launcher = ThreadPoolExecutor(1, thread_name_prefix="jaxinfer-decode")
        self.num_overlapped_calls = 0  # decode calls launched before the host read the previous one
        # Send a continuation's host arrays while the call before it runs, not between the two: sent between
        # them they took 2.5 of the ~3.5 ms the launcher thread sat idle before each call in a trace of batch-1
        # Qwen3-30B-A3B, whose calls take about as long to launch as to run (docs/PERFORMANCE.md, issue 13).
        # Not when the mesh spans processes: each must then make its transfers and device calls in one order,
        # and a transfer racing a collective across processes deadlocks (pipeline.StepPipeline._submit).
        self.place_ahead = jax.process_count() == 1

    def iterations(self, plan: StepPlan) -> tuple[StepPlan, int]:
        """Decode iterations one device call may run for `plan`, and the plan with the pages they need.

        1 unless the plan holds only decodes. A row whose last page has less room than N iterations gets
        pages reserved ahead (`Scheduler.reserve_lookahead`); without them, rows at different page offsets
        would leave the smallest room at about one token and multi-step decode would never engage at batch
        sizes above a few. Rows still finishing their prompt (a fork may share their pages) are not
        extended, and a row that cannot get pages bounds the call by its room."""
        n = self.steps_per_call
        if n == 1 or plan.preempted or self.engine.decodes_singly(len(plan.seqs), (e.key[0] for e in plan.seqs)):
            return plan, 1
        if any(e.num_new_tokens != 1 or not e.sample for e in plan.seqs):
            return plan, 1
        # A structured-output row needs its grammar's next mask, which depends on the token just sampled:
        # the host advances its matcher between tokens, so the call runs one iteration.
        if any(self.engine.requests[e.key[0]].has_grammar for e in plan.seqs):
            return plan, 1
        entries, room = [], n
        for e in plan.seqs:
            if len(e.page_ids) * self.engine.page_size - e.start_pos < n and self._is_generating(e):
                e = e._replace(page_ids=self.engine.scheduler.reserve_lookahead(e.key, e.start_pos + n))
            room = min(room, len(e.page_ids) * self.engine.page_size - e.start_pos)
            entries.append(e)
        return dataclasses.replace(plan, seqs=tuple(entries)), room

    def _is_generating(self, entry: ScheduledSeq) -> bool:
        """The row decodes a token it generated (its prompt, and any fork of it, is done)."""
        return entry.start_pos >= len(self.engine.requests[entry.key[0]].prompt_token_ids)

    def _apply_decodes(self, plan: StepPlan, out: Any, num_iterations: int) -> dict[str, RequestState]:
        """Replay the call's iterations through the output path, one scheduler update per iteration."""
        touched: dict[str, RequestState] = {}
        plan, rows = self.settle(plan)
        for i in range(num_iterations):
            sampled = SamplerOutput(*(a[i] for a in out.sampled))
            touched.update(self.engine.out.apply(plan, sampled, None, rows))
            if i + 1 < num_iterations:
                plan, rows = self._next_decodes(plan, rows, sampled.tokens, out.valid[i + 1])
        return touched

    def settle(self, plan: StepPlan) -> tuple[StepPlan, list[int]]:
        """The rows of a call that the host still runs, now that the calls before it are applied.

        A call dispatched ahead (overlapped decode) may hold rows the host has since finished (a stop string,
        an abort) and placeholder input tokens; each kept entry gets its sequence's real last token."""
        entries, rows = [], []
        for row, e in enumerate(plan.seqs):
            seq = self.engine.scheduler.live(e.key) if e.key[0] in self.engine.requests else None
            if seq is None or seq.num_computed_tokens != e.start_pos:
                continue
            if len(e.token_ids) == 1:  # a decode: its input is the token at start_pos, now known
                e = e._replace(token_ids=(seq.token_ids[e.start_pos],))
            entries.append(e)
            rows.append(row)
        return StepPlan(tuple(entries), (), (), len(entries)), rows

    def args(
        self, shape: BatchShape, entries: Sequence[ScheduledSeq], slots: list[int], num_iterations: int,
    ) -> tuple[StepBatch, SampleInputs, DecodeInputs]:
        batch, inputs = self.engine._step_args(shape, entries, slots)
        return batch, inputs, self._decode_inputs(shape, entries, num_iterations)

    def dispatch(self, plan: StepPlan, slots: list[int], num_iterations: int) -> _InFlight:
        """Launch a multi-step decode call for `plan`; its results are read back later (`retire`)."""
        t = time.perf_counter()
        args = self.args(self.engine.decode_shape(len(plan.seqs)), plan.seqs, slots, num_iterations)
        self.engine.times.add("prepare", t)
        return self._launch(plan, num_iterations, *args, copies=plan.page_copies)

    def _launch(
        self, plan: StepPlan, num_iterations: int, batch: StepBatch, inputs: SampleInputs, decode: DecodeInputs,
        copies: Sequence[PageCopy] = (),
    ) -> _InFlight:
        """Make the device call on the launcher thread. XLA's GPU runtime reads the loop and branch conditions
        of the multi-step body back to the host, so the call itself returns only when the loop is (nearly)
        done; made from this thread, it would block the host work it is meant to overlap. `self.engine.penalties`
        is handed over and comes back when the call is awaited (`_await`)."""
        # Transfer the host arrays here: the launcher thread then needs the GIL only briefly, to enter the call.
        placed = self.engine.runner.place((batch, inputs, decode))
        return self._submit(plan, num_iterations, placed, inputs, decode, copies)

    def _submit(
        self, plan: StepPlan, num_iterations: int, placed: tuple[StepBatch, SampleInputs, DecodeInputs],
        inputs: SampleInputs, decode: DecodeInputs, copies: Sequence[PageCopy] = (),
    ) -> _InFlight:
        """Hand the call's device arguments (`placed`) to the launcher thread; `inputs` and `decode` are the host
        arrays they came from, kept for the continuation and the replay."""
        penalties, self.engine.penalties = self.engine.penalties, None
        runner = self.engine.runner
        launched = self.launcher.submit(runner.decode_steps, penalties, *placed, max_steps=self.steps_per_call,
                                        branch_free=runner.takes_branch_free(inputs.sampling), copies=copies)
        return _InFlight(plan, num_iterations, inputs, decode, launched)

    def _await(self, call: _InFlight) -> MultiStepOutput:
        self.engine.penalties, out = call.launched.result()
        return out

    def flush(self) -> list[RequestOutput]:
        """Read back the decode call in flight, if any, without launching one to follow it. Afterwards the
        host's state is complete, for callers that drive the scheduler or the runner themselves."""
        return self.retire(follow_on=False) if self.inflight is not None else []

    def retire(self, follow_on: bool = True) -> list[RequestOutput]:
        """Read back the decode call in flight and hand its tokens to the requests. With overlap on, the call
        that continues it is prepared while it runs and launched as soon as it returns, so the device runs the
        next call while the host does this call's work."""
        call = self.inflight
        t = time.perf_counter()
        follow = self._continuation(call) if self.overlap and follow_on else None
        t = self.engine.times.add("prepare", t)
        self.engine.waiting_on_device()
        try:
            out = self._await(call)
            self.inflight = follow(out) if follow is not None else None
            sampled, valid, counts = jax.device_get((out.sampled, out.valid, out.expert_counts))
        except Exception as e:  # noqa: BLE001
            return self.engine._device_failed(call.plan, e)
        self.engine.expert_counts += counts
        t = self.engine.times.add("device", t)
        with prompt_gil_handoff(self.inflight is not None):
            touched = self._apply_decodes(call.plan, MultiStepOutput(sampled, valid, None, None), call.num_iterations)
            self.engine.num_steps += 1
            outputs = self.engine.out.emit(touched)
        self.engine.times.add("apply", t)
        return outputs

    def _continuation(self, call: _InFlight) -> Callable[[MultiStepOutput], _InFlight] | None:
        """Prepare the decode call that follows `call` before its tokens reach the host; returns what launches
        it from `call`'s device outputs, or None.

        Only when nothing waits and every running sequence is one of the call's rows (what schedule() would
        plan next is one more decode of each), and every row is past its prompt. The new call keeps the row
        layout: input tokens and the rows still generating come from `call`'s device outputs, positions and
        budgets advance by its iteration count, and pages are reserved ahead as for any multi-step call.
        Rows the host has finished since are given budget 0; a row the host stops after this launch (a stop
        string) runs on and its tokens are dropped when the call is applied (`settle`).
        """
        n, k = self.steps_per_call, call.num_iterations
        if self.engine.spec is not None:  # every step is planned, so each can speculate
            return None
        if not self.engine.scheduler.runs_only({e.key for e in call.plan.seqs}):
            return None
        # A continuation reuses the call's sampling arrays, whose recent tokens the host has not seen yet.
        states = (self.engine.requests.get(e.key[0]) for e in call.plan.seqs)
        if any(s is not None and s.has_multi_token_bad_words for s in states):
            return None
        budget = np.maximum(call.decode.budget - k, 0)  # [S]
        entries, room, live = [], n, 0
        for row, e in enumerate(call.plan.seqs):
            start = e.start_pos + k
            seq = self.engine.scheduler.live(e.key)
            if seq is None:
                budget[row] = 0
            elif e.start_pos < seq.num_prompt_tokens:
                return None  # its prompt ended in `call`: a fork may share its pages (see iterations)
            if budget[row] > 0:
                pages = self.engine.scheduler.reserve_lookahead(e.key, start + n)
                room = min(room, len(pages) * self.engine.page_size - start)
                live += 1
                entries.append(ScheduledSeq(e.key, (0,), start, pages, start + 1, True))
            else:  # the row does not run (its writes go to the trash page): keep a packable entry
                entries.append(e._replace(token_ids=(0,)))
        # Once rows finish, let schedule() pack the rest into a smaller bucket (and admit what waits).
        if live == 0 or room < 1 or self.engine.decode_shape(live).seqs < self.engine.decode_shape(len(entries)).seqs:
            return None
        num_iterations = min(room, n)
        plan = StepPlan(tuple(entries), (), (), len(entries))
        batch = self.engine._pack(self.engine.decode_shape(len(entries)), entries)
        # The same rows with the same knobs: only the PRNG step moves on (the call's page copies are done).
        prev = call.inputs
        inputs = dataclasses.replace(prev, sampling=dataclasses.replace(prev.sampling,
                                                                         step=np.asarray(prev.sampling.step) + k))
        decode = dataclasses.replace(call.decode, budget=budget, num_steps=np.asarray(num_iterations, np.int32))
        # All but the two fields that come from `call`'s outputs, sent while it runs (`place_ahead`).
        host = (dataclasses.replace(batch, token_ids=None), inputs, dataclasses.replace(decode, alive=None))
        ahead = self.engine.runner.place(host) if self.place_ahead else None

        def launch(out: MultiStepOutput) -> _InFlight:
            self.num_overlapped_calls += 1
            b, i, d = ahead if ahead is not None else self.engine.runner.place(host)
            placed = (dataclasses.replace(b, token_ids=out.next_tokens), i, dataclasses.replace(d, alive=out.alive))
            return self._submit(plan, num_iterations, placed, inputs, dataclasses.replace(decode, alive=out.alive))

        return launch

    def _decode_inputs(self, shape: BatchShape, entries: Sequence[ScheduledSeq], num_iterations: int) -> DecodeInputs:
        budget = np.zeros(shape.seqs, np.int32)  # [S]
        stop_ids = np.full((shape.seqs, MAX_STOP_IDS), -1, np.int32)  # [S, E]
        for row, e in enumerate(entries):
            state = self.engine.requests[e.key[0]]
            generated = len(state.seqs[e.key[1]].token_ids)
            budget[row] = min(state.max_tokens - generated, self.engine.max_model_len - e.kv_len)
            # The device only needs to stop early; the host checks every stop id again, so truncating is safe.
            ids = state.stop_ids()[:MAX_STOP_IDS]
            stop_ids[row, : len(ids)] = ids
        return DecodeInputs(budget=budget, stop_ids=stop_ids, num_steps=np.asarray(num_iterations, np.int32),
                            alive=np.ones(shape.seqs, bool))

    def _next_decodes(
        self, plan: StepPlan, rows: list[int], tokens: np.ndarray, valid: np.ndarray
    ) -> tuple[StepPlan, list[int]]:
        """The plan the scheduler would make for the next iteration: every row still running on the host and
        on the device decodes the token it just sampled (tokens, valid: [S])."""
        entries, kept = [], []
        for row, e in zip(rows, plan.seqs):
            group = self.engine.scheduler.get_group(e.key[0])
            if group is None or group.seqs[e.key[1]].is_finished or not valid[row]:
                continue
            entries.append(ScheduledSeq(e.key, (int(tokens[row]),), e.kv_len, e.page_ids, e.kv_len + 1, True))
            kept.append(row)
        return StepPlan(tuple(entries), (), (), len(entries)), kept
