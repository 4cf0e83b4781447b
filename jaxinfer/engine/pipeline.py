"""Pipelined single steps: the next step's forward is launched before this step's tokens reach the host.

A single step is two device programs, the model's forward (each row's last-token logits) and the sampler (logits,
the rows' knobs and structured-output masks -> tokens). When a step is all decodes and what `schedule()` would
plan next is one more decode of the same rows (nothing else runs, and nothing that waits could be admitted:
`Scheduler.decodes_only`), the engine launches the next forward right behind the sampler, with the sampler's
device tokens as its input ids, and only then reads the tokens back. The host's work on this step's tokens (detokenizing, stop checks, advancing
the grammar matchers, filling the next step's masks) then overlaps the next forward instead of leaving the device
idle. This is how structured-output rows keep the device busy: each of their masks depends on the token before,
so they cannot run multi-step decode (decode_loop.py). It serves plain decode too, at decode_steps_per_call=1
and for streamed decode batches of at most `single_step_max_rows` rows (`Engine.decodes_singly`: tokens reach
their clients one by one, where a multi-step call delivers them eight at a time).

The next forward is planned from what the host knows when it launches (tokens up to the step before): each row
decodes at the next position, with pages reserved ahead (`Scheduler.reserve_lookahead`); rows already finished,
or sure to finish on this step's token (no budget left), run in the trash page. A row the host stops after the
launch (EOS, a stop string, an abort) runs on harmlessly: its writes land in its own pages, which are handed out
again only to work launched later, and `DecodeLoop.settle` drops it before the sampler. Each step's sampler
arrays and masks are built from the host's state just before that sampler runs, so penalties, seeds and
multi-token bad words see every earlier token. A request that arrives meanwhile waits at most one step more,
or, when it could be admitted but few slots are free, up to ADMISSION_WAVE_STEPS steps so that it comes in with
others (`StepPipeline.hold_admission`).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxinfer.engine.batcher import BatchShape
from jaxinfer.engine.decode_loop import HANDOFF_SWITCH_INTERVAL_S
from jaxinfer.engine.page_table import TRASH_PAGE, PageCopy
from jaxinfer.engine.step_io import SampleInputs, StepBatch, StepLogits
from jaxinfer.engine.sampling import PromptLogprobs, SamplerOutput
from jaxinfer.engine.sampling_rows import PenaltyState
from jaxinfer.engine.step_plan import ScheduledSeq, StepPlan
from jaxinfer.outputs import RequestOutput

if TYPE_CHECKING:
    from jaxinfer.engine.engine import Engine


# Pipelined steps a request that could be admitted may be held back so that others join its admission wave: the
# 8 iterations of a multi-step call, within which the plain decode path also sees finishes (and admits) together.
ADMISSION_WAVE_STEPS = 8

# What the launcher hands back from a sampler: penalty state, tokens, expert counts [E], prompt logprobs or None.
_Sampled = tuple[PenaltyState, SamplerOutput, jax.Array, PromptLogprobs | None]


@dataclasses.dataclass(frozen=True)
class _Ahead:
    """A forward launched before the host read the tokens it runs on."""

    plan: StepPlan  # row j is plan.seqs[j]; its token ids are placeholders (the device has them)
    shape: BatchShape
    launched: Future[StepLogits]


class StepPipeline:
    """The engine's single steps, each forward launched from the decode loop's launcher thread, so device calls
    stay in one order and a forward that syncs on a branch predicate never blocks the host."""

    def __init__(self, engine: Engine, enabled: bool) -> None:
        self.engine = engine
        # Not across processes: there every device call is made inline, in one order on every process, and a
        # forward launched ahead would only reorder work against the decode loop's calls (the 2-process test
        # timed out under load with it).
        self.enabled = enabled and jax.process_count() == 1
        self.ahead: _Ahead | None = None
        self.num_pipelined_steps = 0  # steps whose forward was launched before the host had their input tokens
        self._threaded = jax.process_count() == 1
        self._interval: float | None = None  # Python's switch interval while pipelining lowered it
        self._held_steps = 0  # steps in a row that held admissible requests back (`hold_admission`)

    def run(self, plan: StepPlan, slot_rows: list[int]) -> list[RequestOutput]:
        """One step for a plan of `schedule()`."""
        engine = self.engine
        t = time.perf_counter()
        shape = engine.step_shape(plan.num_batched_tokens, len(plan.seqs))
        forward = self._launch_forward(engine._pack(shape, plan.seqs), plan.page_copies)
        # The sampler's arrays (grammar masks included) are built while the forward runs.
        inputs = engine._sample_inputs(shape, plan.seqs, slot_rows)
        engine.times.add("prepare", t)
        return self._sample(plan, list(range(len(plan.seqs))), len(plan.seqs), shape, inputs, forward)

    def resume(self) -> list[RequestOutput]:
        """The step whose forward was launched ahead: drop the rows finished since, sample the rest."""
        engine, ahead = self.engine, self.ahead
        self.ahead = None
        t = time.perf_counter()
        plan, rows = engine.loop.settle(ahead.plan)
        if not plan.seqs:  # every row finished: nothing to sample (the forward ran in order, harmlessly)
            self._gil_handoff(False)
            engine.times.add("schedule", t)
            return []
        slots = engine._slot_rows(plan)
        inputs = _to_rows(engine._sample_inputs(ahead.shape, plan.seqs, slots), rows, ahead.shape.seqs)
        engine.times.add("prepare", t)
        self.num_pipelined_steps += 1
        return self._sample(plan, rows, len(ahead.plan.seqs), ahead.shape, inputs, ahead.launched)

    def drain(self) -> None:
        """Wait for a forward launched ahead and forget it: the host state stays complete without it (the KV
        it wrote is written again, the same, by the step that schedule() plans next)."""
        ahead, self.ahead = self.ahead, None
        self._gil_handoff(False)
        if ahead is not None:
            ahead.launched.exception()

    def _sample(
        self, plan: StepPlan, rows: list[int], num_rows: int, shape: BatchShape, inputs: SampleInputs,
        forward: Future[StepLogits],
    ) -> list[RequestOutput]:
        """Run the sampler over `forward`'s logits (entry j of `plan` is row rows[j] of `num_rows`), launch the
        next forward if the pipeline may go on, then read the tokens and hand them to the requests."""
        engine = self.engine
        t = time.perf_counter()
        # No branch in the sampler, where it would hold up the launch of the next forward (sampling._when).
        branch_free = engine.runner.takes_branch_free(inputs.sampling)
        placed = engine.runner.place((inputs.sampling, inputs.slots, inputs.sample_mask))
        # Prompt logprobs are [T, K] per step: computed (and copied to the host) only in steps that ask.
        prompt_ids = engine.runner.place(inputs.prompt_next_ids) if inputs.want_prompt_logprobs else None
        ahead = self._plan_ahead(plan, rows, num_rows, shape)
        penalties, engine.penalties = engine.penalties, None  # handed to the launcher; back from `sampled`
        sampled: Future[_Sampled] = Future()
        # One job samples and then launches the next forward at once: the launcher thread must not wait for
        # the GIL between the two while this thread turns tokens into text.
        launched = self._submit(self._sample_then_forward, sampled, forward, penalties, placed, branch_free,
                                prompt_ids, ahead)
        if ahead is not None:
            self.ahead = _Ahead(ahead[0], shape, launched)
        self._gil_handoff(self.ahead is not None)
        t = engine.times.add("prepare", t)
        engine.waiting_on_device()
        try:
            engine.penalties, out, counts, prompt = sampled.result()
            out, counts, prompt = jax.device_get((out, counts, prompt))
        except Exception as e:  # noqa: BLE001 - any failure of the device calls fails their requests alone
            return engine._device_failed(plan, e)
        engine.expert_counts += counts
        if engine.spec is not None:
            engine.spec.cost.record("step", shape.tokens, time.perf_counter() - t)
        t = engine.times.add("device", t)
        touched = engine.out.apply(plan, out, prompt, rows)
        engine.num_steps += 1
        outputs = engine.out.emit(touched)
        engine.times.add("apply", t)
        return outputs

    def _gil_handoff(self, on: bool) -> None:
        """While a forward runs ahead, this thread's host work (masks, text, the next sampler's arrays) would
        hold the GIL for Python's 5 ms switch interval at a time, and the launcher thread needs it to return
        from one device call and make the next: keep the interval at 0.2 ms until the pipeline stops."""
        if on and self._interval is None:
            self._interval = sys.getswitchinterval()
            sys.setswitchinterval(min(self._interval, HANDOFF_SWITCH_INTERVAL_S))
        elif not on and self._interval is not None:
            sys.setswitchinterval(self._interval)
            self._interval = None

    def _submit(self, fn: Any, *args: Any) -> Future[Any]:
        """Run `fn` on the launcher thread; inline when the mesh spans processes: every process must then make
        its device calls and transfers in one order, and the host work this thread would overlap with a call
        places arrays of its own (a transfer racing a collective across processes deadlocked)."""
        if not self._threaded:
            done: Future[Any] = Future()
            try:
                done.set_result(fn(*args))
            except Exception as e:  # noqa: BLE001 - raised where the result is read, as from the thread
                done.set_exception(e)
            return done
        return self.engine.loop.launcher.submit(fn, *args)

    def _launch_forward(self, batch: StepBatch, copies: Sequence[PageCopy]) -> Future[StepLogits]:
        return self._submit(self.engine.runner.forward, self.engine.runner.place(batch), copies)

    def _sample_then_forward(
        self, sampled: Future[_Sampled], forward: Future[StepLogits], penalties: PenaltyState,
        placed: tuple[Any, ...], branch_free: bool, prompt_ids: jax.Array | None,
        ahead: tuple[StepPlan, StepBatch] | None,
    ) -> StepLogits | None:
        """On the launcher: the sampler over `forward`'s logits and, when `prompt_ids` are given, the prompt
        logprobs over its hidden states (their results into `sampled`), then the forward of the step planned
        ahead, on the sampler's device tokens. Returns that forward's logits, or None."""
        runner = self.engine.runner
        try:
            step = forward.result()
            penalties, out = runner.sample(penalties, step.logits, *placed, branch_free=branch_free)
            prompt = runner.prompt_logprobs(step.hidden, prompt_ids) if prompt_ids is not None else None
        except BaseException as e:
            sampled.set_exception(e)
            raise
        sampled.set_result((penalties, out, step.expert_counts, prompt))
        if ahead is None:
            return None
        _, batch = ahead
        tokens = out.tokens  # [S] on device: the input ids of rows 0..S-1
        if tokens.shape != batch.token_ids.shape:  # S < T (max_num_seqs under the smallest token bucket)
            tokens = _splice(batch.token_ids, tokens)
        return runner.forward(dataclasses.replace(batch, token_ids=tokens))

    def _plan_ahead(
        self, plan: StepPlan, rows: list[int], num_rows: int, shape: BatchShape
    ) -> tuple[StepPlan, StepBatch] | None:
        """The next step's plan and its placed batch, when the pipeline may launch it now; else None.

        Only for decode-only steps whose rows are the scheduler's whole running set with nothing admissible
        waiting (a full batch admits a new request only once a row finished, which the next step sees), and
        that are structured output or run one decode iteration per call anyway (otherwise the multi-step loop
        serves them better). Rows keep their places, so the sampler's tokens [S] are the next step's first S
        input ids as they are; the next bucket must stay this one."""
        engine = self.engine
        if not self.enabled or engine.spec is not None or plan.preempted:
            return None
        if any(e.num_new_tokens != 1 or not e.sample or e.num_draft for e in plan.seqs):
            return None
        states = [engine.requests[e.key[0]] for e in plan.seqs]
        single = engine.decodes_singly(len(plan.seqs), (s.request_id for s in states))
        if not single and not any(s.has_grammar for s in states):
            return None
        if any(e.start_pos < len(s.prompt_token_ids) for e, s in zip(plan.seqs, states)):
            return None  # a prompt ends in this step: a fork may share its pages (DecodeLoop.iterations)
        if not engine.scheduler.decodes_only({e.key for e in plan.seqs}):
            return None
        entries = [_trash_entry(None)] * num_rows
        live = 0
        for row, e, state in zip(rows, plan.seqs, states):
            generated = len(state.seqs[e.key[1]].token_ids) + 1  # with this step's token
            if generated >= state.max_tokens or e.start_pos + 2 >= engine.max_model_len:
                entries[row] = _trash_entry(e.key)  # this step's token is its last
                continue
            pages = engine.scheduler.reserve_lookahead(e.key, e.start_pos + 2)
            if len(pages) * engine.page_size < e.start_pos + 2:
                return None  # no page for the next position without preempting: schedule() decides
            entries[row] = ScheduledSeq(e.key, (0,), e.start_pos + 1, pages, e.start_pos + 2, True)
            live += 1
        if live == 0 or engine.step_shape(live, live) != shape:
            return None  # let schedule() pack what is left into its own bucket
        next_plan = StepPlan(tuple(entries), (), (), num_rows)
        return next_plan, engine.runner.place(engine._pack(shape, next_plan.seqs))

    def hold_admission(self) -> None:
        """Decide, once per engine step, whether requests that could be admitted wait this step, so that they
        come in as one wave (`Scheduler.hold_admission`): only while single steps serve the running rows, for at
        most ADMISSION_WAVE_STEPS steps in a row, and until a wave's worth of sequence slots (an eighth of
        max_num_seqs) is free. Under closed-loop load a finished row otherwise lets one prompt in at the next
        step, and each such step runs one prefill, padded up to its token bucket, beside every decode row: on
        an H100 (64 constrained rows, 1,024-token prompts) most steps that were not pipelined stalled the whole
        batch ~60 ms for a single prompt. The multi-step loop gets its waves for free (finishes show up every
        8 iterations)."""
        engine = self.engine
        scheduler = engine.scheduler
        free = scheduler.num_free_slots
        hold = (self.enabled and engine.spec is None and scheduler.num_waiting > 0
                and 0 < free < max(1, scheduler.max_num_seqs // 8) and self._held_steps < ADMISSION_WAVE_STEPS
                and self._single_steps(scheduler.running_request_ids))
        self._held_steps = self._held_steps + 1 if hold else 0
        scheduler.hold_admission = hold

    def _single_steps(self, running: set[str]) -> bool:
        """The running rows decode by single steps: one iteration per call, or a row under a grammar among them."""
        engine = self.engine
        if not running:
            return False
        return engine.decodes_singly(len(running), running) or any(
            state is not None and state.has_grammar for state in map(engine.requests.get, running))


@functools.partial(jax.jit, donate_argnums=(0,))
def _splice(ids: jax.Array, tokens: jax.Array) -> jax.Array:
    return ids.at[: tokens.shape[0]].set(tokens)  # [T] <- [S] in front


def _trash_entry(key: Any) -> ScheduledSeq:
    """A row that does not run: one token at position 0 of the trash page, not sampled."""
    return ScheduledSeq(key or ("", 0), (0,), 0, (TRASH_PAGE,), 1, False)


def _to_rows(inputs: SampleInputs, rows: Sequence[int], num_rows: int) -> SampleInputs:
    """Move the sampler rows built for entries 0..n-1 to rows[0..n-1]; the other rows get a padding row."""
    if list(rows) == list(range(len(rows))):
        return inputs
    take = np.full(num_rows, len(rows), np.int64)  # len(rows) < num_rows here: a padding row exists
    take[list(rows)] = np.arange(len(rows))

    def move(a: Any) -> Any:
        return a[take] if isinstance(a, np.ndarray) else a  # a device leaf is the uniform all-allowed mask

    sampling = jax.tree.map(move, inputs.sampling)
    return dataclasses.replace(inputs, sampling=sampling, slots=move(inputs.slots), sample_mask=move(inputs.sample_mask))
