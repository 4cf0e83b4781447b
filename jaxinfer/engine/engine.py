"""The engine loop: scheduler (host) -> batcher (host) -> one jitted step (device) -> outputs (host).

Composition, not inheritance: `Scheduler` decides what runs and owns pages, `pack` builds the bucketed
arrays, `ModelRunner.step` runs forward + sampling on device, `RequestState` turns tokens into text and
decides stops. This class only wires them and keeps the per-sequence sampling state (seeds, penalty
slots) that must survive preemption.

Multi-step decode (`decode_steps_per_call` = N > 1): when a plan holds only decodes (one token each, no
prefill chunk, no preemption), the runner runs up to N decode iterations in one device call. The scheduler
reserved pages for one token, so rows whose last page has less room get pages reserved ahead
(`Scheduler.reserve_lookahead`, free or evictable pages only); the call runs k = min(N, room) iterations,
where room is the least number of free positions left in any row's pages (a row that could not get pages,
or still finishing its prompt, bounds it). The host then replays the k iterations through the ordinary
path: `Scheduler.update` once per iteration with the plan the scheduler would have made (each still
running row decodes its new token), so stop strings, detokenization, prefix-cache registration and LENGTH
limits behave exactly as with N = 1. Tokens a row sampled after the host stopped it are dropped. Waiting
requests are admitted at the next schedule(), i.e. at most k - 1 iterations later than with N = 1.

Overlapped decode (`overlap_decode`, on by default): while nothing waits and the running sequences are the
rows of the multi-step call in flight, the engine launches the call that continues it before reading it
back. That call takes its input tokens and live-row mask from the device outputs of the one before
(`MultiStepOutput.next_tokens`, `alive`), so the device runs it while the host replays the previous call.
Rows the host stops in between run on harmlessly (their writes land in their own or the trash pages, and
pages freed meanwhile are only handed out to work launched later); `_settled` drops their tokens. A new
request therefore waits at most one more call than without overlap.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import itertools
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxinfer.config import CacheConfig, EngineConfig, SamplingParams
from jaxinfer.engine.admission import Admission, Gate, in_batch, per_prompt
from jaxinfer.engine.batcher import MIN_TOKEN_BUCKET, BatchShape, SeqChunk, bucket, buckets_up_to, pack, pow2_ceil
from jaxinfer.engine.detokenize import IncrementalDetokenizer
from jaxinfer.engine.logprobs import TokenTexts, collect_prompt_logprobs, sample_logprobs
from jaxinfer.engine.request import RequestState, SeqOutput
from jaxinfer.engine.runner import DecodeInputs, ModelRunner, MultiStepOutput, SampleInputs, StepBatch, StepOutput
from jaxinfer.engine.sampling import (
    MAX_STOP_IDS,
    PenaltyState,
    PromptLogprobs,
    SamplerOutput,
    SamplingArrays,
    resolve_seed,
    set_rows,
)
from jaxinfer.engine.scheduler import ScheduledSeq, Scheduler, StepPlan
from jaxinfer.engine.sequence import FinishReason, SeqKey, SequenceGroup
from jaxinfer.errors import InvalidInput
from jaxinfer.inputs import parse_prompts
from jaxinfer.outputs import Logprob, RequestOutput
from jaxinfer.sharding import replicated
from jaxinfer.validation import MAX_N, RequestOutputKind

DEFAULT_MAX_MODEL_LEN = 4096  # when the model allows more; the page table width scales with it


def _uses_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


class PhaseTimes:
    """Wall seconds the engine loop spent per phase, summed over steps: a cheap always-on profile.

    schedule: the scheduler's plan; prepare: packing the bucketed host arrays; device: dispatch until the
    sampled tokens are on the host (the device's work plus the launch); apply: turning tokens into request
    state, text and outputs. The loop is synchronous, so the four add up to the time spent in `step`.
    """

    PHASES = ("schedule", "prepare", "device", "apply")

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(self.PHASES, 0.0)

    def add(self, phase: str, since: float) -> float:
        """Charge the time since `since` to `phase`; returns now, the start of the next phase."""
        now = time.perf_counter()
        self.seconds[phase] += now - since
        return now


class PenaltySlots:
    """Stable device rows of the penalty state, one per live sequence; rows are reset on (re)admission."""

    def __init__(self, num_slots: int) -> None:
        self.spare = num_slots  # padding rows read and write this extra row
        self._free = list(range(num_slots - 1, -1, -1))
        self._of: dict[SeqKey, int] = {}

    def get(self, key: SeqKey) -> tuple[int, bool]:
        """(slot, newly assigned)."""
        if key in self._of:
            return self._of[key], False
        slot = self._free.pop()
        self._of[key] = slot
        return slot, True

    def release(self, key: SeqKey) -> None:
        slot = self._of.pop(key, None)
        if slot is not None:
            self._free.append(slot)


@contextlib.contextmanager
def _prompt_gil_handoff(active: bool) -> Iterator[None]:
    """While the host replays tokens (pure Python) beside a call in flight, let the launcher thread take the
    GIL within 0.2 ms instead of Python's default 5 ms switch interval: the call needs it to return and the
    next one to start, and a trace of overlapped decode showed the device idle in 5 ms gaps without this."""
    if not active:
        yield
        return
    interval = sys.getswitchinterval()
    sys.setswitchinterval(min(interval, 2e-4))
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


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Any,
        engine_cfg: EngineConfig,
        cache_cfg: CacheConfig,
        *,
        enable_prefix_caching: bool = True,
        use_tqdm: bool = True,
        decode_steps_per_call: int = 1,
        overlap_decode: bool = True,
        compile_threads: int | None = None,
        seed: int | None = None,
    ) -> None:
        self.runner, self.tokenizer, self.use_tqdm = runner, tokenizer, use_tqdm
        self.decode_steps_per_call = _at_least_one("decode_steps_per_call", decode_steps_per_call)
        self.overlap_decode = overlap_decode
        self._inflight: _InFlight | None = None
        self._launcher = ThreadPoolExecutor(1, thread_name_prefix="jaxinfer-decode")
        self.compile_threads = compile_threads  # None: half the host's cores
        cfg = runner.cfg
        self.vocab_size = cfg.vocab_size
        self.max_model_len = engine_cfg.max_model_len or min(cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        self.page_size = cache_cfg.page_size
        self.max_num_seqs = engine_cfg.max_num_seqs
        self.scheduler = Scheduler(
            num_pages=_pool_size(cache_cfg, runner),
            page_size=self.page_size,
            max_num_seqs=engine_cfg.max_num_seqs,
            max_num_batched_tokens=engine_cfg.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_caching=enable_prefix_caching,
        )
        self.token_buckets = buckets_up_to(pow2_ceil(engine_cfg.max_num_batched_tokens), MIN_TOKEN_BUCKET)
        # A single decoding sequence gets its own 1-row bucket: at M = 1 the weight matmuls are
        # matrix-vector products, which stream the weights faster than a 16-row GEMM does.
        # Above 64 rows, 1.5x steps (96, 192, ...) too: 192 sequences in a 256-row bucket ran a third more
        # rows through every matmul (H100, 1000/1000: 5,815 out tok/s at 192 prompts, 6,560 at 128).
        row_cap = pow2_ceil(engine_cfg.max_num_seqs)
        pow2 = buckets_up_to(row_cap, MIN_TOKEN_BUCKET)
        self.decode_row_buckets = sorted({1, *pow2, *(b * 3 // 2 for b in pow2 if 64 <= b < row_cap)})
        self.times = PhaseTimes()
        self.pages_per_seq = -(-self.max_model_len // self.page_size)
        self.eos_ids = frozenset(tokenizer.eos_token_ids) if tokenizer else frozenset({cfg.eos_token_id} - {None})
        self.slots = PenaltySlots(engine_cfg.max_num_seqs)
        # Placed on the mesh like the step's outputs, so the first step after warmup sees the same sharding.
        empty = PenaltyState.from_tokens([], [], engine_cfg.max_num_seqs + 1, cfg.vocab_size)
        self.penalties = jax.device_put(empty, runner.penalty_sharding())
        self._reset_rows = jax.jit(set_rows, donate_argnums=(0,))
        self.gate = Gate(tokenizer, cfg.vocab_size, self.max_model_len, self.eos_ids)
        self.requests: dict[str, RequestState] = {}
        self._ids = itertools.count()
        self._rng = np.random.default_rng(seed)  # the seeds of unseeded requests: reproducible per engine seed
        self._token_texts = TokenTexts(tokenizer)  # Logprob.decoded_token, decoded once per id
        self.num_failed_steps = 0  # device calls that raised (their requests failed, the engine was reset)
        self._compiles_at_warmup: int | None = None
        self.num_steps = 0
        self.num_overlapped_calls = 0  # decode calls launched before the host read the previous one
        self.expert_counts = np.zeros(runner.num_experts, np.int64)  # MoE load: (token, expert) pairs so far

    def reseed(self, seed: int) -> None:
        """Seed the draws that give unseeded requests their seeds (multi-process runs must agree on them)."""
        self._rng = np.random.default_rng(seed)

    # ------------------------------------------------------------------------------------------ shapes

    def batch_shape(self, num_tokens: int) -> BatchShape:
        tokens = bucket(num_tokens, MIN_TOKEN_BUCKET, self.token_buckets[-1])
        return BatchShape(tokens=tokens, seqs=min(tokens, pow2_ceil(self.max_num_seqs)), pages_per_seq=self.pages_per_seq)

    def warmup(self) -> None:
        """Compile every bucket now, so serving never compiles (checked by engine_stats).

        Every step bucket, and with multi-step decode every decode-row bucket, is traced in turn and then
        compiled ahead of time on `compile_threads` threads at once.
        """
        calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        for t in self.token_buckets:
            calls.append(("step", (self.penalties, *self._step_args(self.batch_shape(t), [], [], [])), {}))
        if self.decode_steps_per_call > 1:
            for rows in self.decode_row_buckets:
                args = self._decode_args(self.decode_shape(rows), [], [], [], 0)
                calls.append(("decode", (self.penalties, *args), {"max_steps": self.decode_steps_per_call}))
        with tqdm(total=1, desc=f"compiling {len(calls)} buckets", disable=not self.use_tqdm, leave=False):
            self.runner.precompile(calls, self.compile_threads)
        self.penalties = self._reset_rows(self.penalties, *self._reset_args([]))  # also compiled up front
        self._compiles_at_warmup = self.runner.num_compiles

    # ------------------------------------------------------------------------------------------ requests

    def add_request(
        self, prompt: Any, params: SamplingParams | None = None, *, request_id: str | None = None,
        priority: int = 0,
    ) -> str:
        """Validate and queue one request; a bad request raises InvalidInput (a ValueError) naming the field,
        and nothing else is affected."""
        return self._queue(self.gate.admit(prompt, params, request_id=request_id, priority=priority))

    def _queue(self, adm: Admission, output_kind: RequestOutputKind | None = None) -> str:
        rid = adm.request_id if adm.request_id is not None else f"req-{next(self._ids)}"
        params = adm.params
        group = SequenceGroup.create(rid, adm.prompt_token_ids, n=params.n, priority=adm.priority,
                                     max_tokens=adm.max_tokens)
        # Prompt logprobs need every prompt position computed, so such requests skip prefix-cache lookups.
        self.scheduler.add(group, use_prefix_cache=params.prompt_logprobs is None)  # may raise RequestRejected
        self.requests[rid] = self._new_state(rid, adm, output_kind or params.output_kind)
        return rid

    def _new_state(self, rid: str, adm: Admission, output_kind: RequestOutputKind) -> RequestState:
        params, ids = adm.params, adm.prompt_token_ids
        seeds = [resolve_seed(params.seed, i, self._rng) for i in range(params.n)]
        text = self.tokenizer is not None and params.detokenize
        detoks = [IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens) if text else None
                  for _ in range(params.n)]
        return RequestState(rid, adm.prompt, ids, params, seeds, [SeqOutput(d) for d in detoks], self.eos_ids,
                            adm.max_tokens, output_kind, adm.bad_words_ids)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its pages return to the pool and its partial output is returned."""
        state = self.requests.pop(request_id, None)
        for key in self.scheduler.abort(request_id):
            self.slots.release(key)
        if state is None:
            return None
        try:
            for i in range(len(state.seqs)):
                state.finish(i, FinishReason.ABORT)
        except Exception as e:  # noqa: BLE001 - the abort stands; the output says what broke
            state.fail(f"{type(e).__name__}: {e}")
        return self._output(state)

    def has_unfinished(self) -> bool:
        # A decode call still in flight when nothing is unfinished holds only rows finished since its launch;
        # the next step() reads it back and drops them.
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------------------------------ stepping

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; outputs of every request that advanced (finished ones included)."""
        if self._inflight is None:
            t = time.perf_counter()
            plan = self.scheduler.schedule()
            for key in plan.preempted:
                self.slots.release(key)
            if not plan.seqs:
                self.times.add("schedule", t)
                return []
            now = time.monotonic()
            for entry in plan.seqs:
                state = self.requests[entry.key[0]]
                if state.scheduled_time is None:  # its first chunk starts after the prefix-cache hits
                    state.scheduled_time, state.num_cached_tokens = now, entry.start_pos
            plan, num_iterations = self._decode_iterations(plan)
            slot_rows = self._slot_rows(plan)
            self.times.add("schedule", t)
            if num_iterations == 1:
                return self._single_step(plan, slot_rows)
            try:
                self._inflight = self._dispatch_decodes(plan, slot_rows, num_iterations)
            except Exception as e:  # noqa: BLE001 - any failure of the device call fails its requests alone
                return self._device_failed(plan, e)
        return self._retire_decodes()

    def _single_step(self, plan: StepPlan, slot_rows: list[int]) -> list[RequestOutput]:
        shape = self.batch_shape(plan.num_batched_tokens)
        try:
            out = self._run(shape, plan.seqs, plan.page_copies, slot_rows)
        except Exception as e:  # noqa: BLE001
            return self._device_failed(plan, e)
        t = time.perf_counter()
        touched = self._apply(plan, out.sampled, out.prompt, range(len(plan.seqs)))
        self.num_steps += 1
        outputs = self._emit(touched)
        self.times.add("apply", t)
        return outputs

    # ------------------------------------------------------------------------------------ multi-step decode

    def _decode_iterations(self, plan: StepPlan) -> tuple[StepPlan, int]:
        """Decode iterations one device call may run for `plan`, and the plan with the pages they need.

        1 unless the plan holds only decodes. A row whose last page has less room than N iterations gets
        pages reserved ahead (`Scheduler.reserve_lookahead`); without them, rows at different page offsets
        would leave the smallest room at about one token and multi-step decode would never engage at batch
        sizes above a few. Rows still finishing their prompt (a fork may share their pages) are not
        extended, and a row that cannot get pages bounds the call by its room."""
        n = self.decode_steps_per_call
        if n == 1 or plan.preempted:
            return plan, 1
        if any(e.num_new_tokens != 1 or not e.sample for e in plan.seqs):
            return plan, 1
        entries, room = [], n
        for e in plan.seqs:
            if len(e.page_ids) * self.page_size - e.start_pos < n and self._is_generating(e):
                e = e._replace(page_ids=self.scheduler.reserve_lookahead(e.key, e.start_pos + n))
            room = min(room, len(e.page_ids) * self.page_size - e.start_pos)
            entries.append(e)
        return dataclasses.replace(plan, seqs=tuple(entries)), room

    def _is_generating(self, entry: ScheduledSeq) -> bool:
        """The row decodes a token it generated (its prompt, and any fork of it, is done)."""
        return entry.start_pos >= len(self.requests[entry.key[0]].prompt_token_ids)

    def decode_shape(self, num_rows: int) -> BatchShape:
        """The bucket of a multi-step call over `num_rows` sequences: one token per row (T == S), rows
        rounded up to the next of `decode_row_buckets` (1; powers of two from 16; 1.5x steps above 64), so
        small batches do not pay for max_num_seqs rows."""
        buckets = self.decode_row_buckets
        rows = buckets[min(bisect.bisect_left(buckets, num_rows), len(buckets) - 1)]
        return BatchShape(tokens=rows, seqs=rows, pages_per_seq=self.pages_per_seq)

    def _apply_decodes(self, plan: StepPlan, out: Any, num_iterations: int) -> dict[str, RequestState]:
        """Replay the call's iterations through `_apply`, one scheduler update per iteration."""
        touched: dict[str, RequestState] = {}
        plan, rows = self._settled(plan)
        for i in range(num_iterations):
            sampled = SamplerOutput(*(a[i] for a in out.sampled))
            touched.update(self._apply(plan, sampled, None, rows))
            if i + 1 < num_iterations:
                plan, rows = self._next_decodes(plan, rows, sampled.tokens, out.valid[i + 1])
        return touched

    def _settled(self, plan: StepPlan) -> tuple[StepPlan, list[int]]:
        """The rows of a call that the host still runs, now that the calls before it are applied.

        A call dispatched ahead (overlapped decode) may hold rows the host has since finished (a stop string,
        an abort) and placeholder input tokens; each kept entry gets its sequence's real last token."""
        entries, rows = [], []
        for row, e in enumerate(plan.seqs):
            seq = self.scheduler.live(e.key) if e.key[0] in self.requests else None
            if seq is None or seq.num_computed_tokens != e.start_pos:
                continue
            if len(e.token_ids) == 1:  # a decode: its input is the token at start_pos, now known
                e = e._replace(token_ids=(seq.token_ids[e.start_pos],))
            entries.append(e)
            rows.append(row)
        return StepPlan(tuple(entries), (), (), len(entries)), rows

    def _decode_args(
        self, shape: BatchShape, entries: Sequence[ScheduledSeq], copies: Sequence[Any], slots: list[int],
        num_iterations: int,
    ) -> tuple[StepBatch, SampleInputs, DecodeInputs]:
        batch, inputs = self._step_args(shape, entries, copies, slots)
        return batch, inputs, self._decode_inputs(shape, entries, num_iterations)

    def _dispatch_decodes(self, plan: StepPlan, slots: list[int], num_iterations: int) -> _InFlight:
        """Launch a multi-step decode call for `plan`; its results are read back later (`_retire_decodes`)."""
        t = time.perf_counter()
        args = self._decode_args(self.decode_shape(len(plan.seqs)), plan.seqs, plan.page_copies, slots, num_iterations)
        self.times.add("prepare", t)
        return self._launch(plan, num_iterations, *args)

    def _launch(
        self, plan: StepPlan, num_iterations: int, batch: StepBatch, inputs: SampleInputs, decode: DecodeInputs,
    ) -> _InFlight:
        """Make the device call on the launcher thread. XLA's GPU runtime reads the loop and branch conditions
        of the multi-step body back to the host, so the call itself returns only when the loop is (nearly)
        done; made from this thread, it would block the host work it is meant to overlap. `self.penalties`
        is handed over and comes back when the call is awaited (`_await`)."""
        penalties, self.penalties = self.penalties, None
        # Transfer the host arrays here: the launcher thread then needs the GIL only briefly, to enter the call.
        placed = self.runner.place((batch, inputs, decode))
        launched = self._launcher.submit(
            self.runner.decode_steps, penalties, *placed, max_steps=self.decode_steps_per_call)
        return _InFlight(plan, num_iterations, inputs, decode, launched)

    def _await(self, call: _InFlight) -> MultiStepOutput:
        self.penalties, out = call.launched.result()
        return out

    def flush(self) -> list[RequestOutput]:
        """Read back the decode call in flight, if any, without launching one to follow it. Afterwards the
        host's state is complete, for callers that drive the scheduler or the runner themselves."""
        return self._retire_decodes(follow_on=False) if self._inflight is not None else []

    def _retire_decodes(self, follow_on: bool = True) -> list[RequestOutput]:
        """Read back the decode call in flight and hand its tokens to the requests. With overlap on, the call
        that continues it is prepared while it runs and launched as soon as it returns, so the device runs the
        next call while the host does this call's work."""
        call = self._inflight
        t = time.perf_counter()
        follow = self._continuation(call) if self.overlap_decode and follow_on else None
        t = self.times.add("prepare", t)
        try:
            out = self._await(call)
            self._inflight = follow(out) if follow is not None else None
            sampled, valid, counts = jax.device_get((out.sampled, out.valid, out.expert_counts))
        except Exception as e:  # noqa: BLE001
            return self._device_failed(call.plan, e)
        self.expert_counts += counts
        t = self.times.add("device", t)
        with _prompt_gil_handoff(self._inflight is not None):
            touched = self._apply_decodes(call.plan, MultiStepOutput(sampled, valid, None, None), call.num_iterations)
            self.num_steps += 1
            outputs = self._emit(touched)
        self.times.add("apply", t)
        return outputs

    def _continuation(self, call: _InFlight) -> Callable[[MultiStepOutput], _InFlight] | None:
        """Prepare the decode call that follows `call` before its tokens reach the host; returns what launches
        it from `call`'s device outputs, or None.

        Only when nothing waits and every running sequence is one of the call's rows (what schedule() would
        plan next is one more decode of each), and every row is past its prompt. The new call keeps the row
        layout: input tokens and the rows still generating come from `call`'s device outputs, positions and
        budgets advance by its iteration count, and pages are reserved ahead as for any multi-step call.
        Rows the host has finished since are given budget 0; a row the host stops after this launch (a stop
        string) runs on and its tokens are dropped when the call is applied (`_settled`).
        """
        n, k = self.decode_steps_per_call, call.num_iterations
        if not self.scheduler.runs_only({e.key for e in call.plan.seqs}):
            return None
        # A continuation reuses the call's sampling arrays, whose recent tokens the host has not seen yet.
        states = (self.requests.get(e.key[0]) for e in call.plan.seqs)
        if any(s is not None and s.has_multi_token_bad_words for s in states):
            return None
        budget = np.maximum(call.decode.budget - k, 0)  # [S]
        entries, room, live = [], n, 0
        for row, e in enumerate(call.plan.seqs):
            start = e.start_pos + k
            seq = self.scheduler.live(e.key)
            if seq is None:
                budget[row] = 0
            elif e.start_pos < seq.num_prompt_tokens:
                return None  # its prompt ended in `call`: a fork may share its pages (see _decode_iterations)
            if budget[row] > 0:
                pages = self.scheduler.reserve_lookahead(e.key, start + n)
                room = min(room, len(pages) * self.page_size - start)
                live += 1
                entries.append(ScheduledSeq(e.key, (0,), start, pages, start + 1, True))
            else:  # the row does not run (its writes go to the trash page): keep a packable entry
                entries.append(e._replace(token_ids=(0,)))
        # Once rows finish, let schedule() pack the rest into a smaller bucket (and admit what waits).
        if live == 0 or room < 1 or self.decode_shape(live).seqs < self.decode_shape(len(entries)).seqs:
            return None
        num_iterations = min(room, n)
        plan = StepPlan(tuple(entries), (), (), len(entries))
        batch = self._pack(self.decode_shape(len(entries)), entries)
        # The same rows with the same knobs: only the PRNG step moves on, and the call's page copies are done.
        prev = call.inputs
        inputs = dataclasses.replace(
            prev, sampling=dataclasses.replace(prev.sampling, step=np.asarray(prev.sampling.step) + k),
            copy_src=np.zeros_like(prev.copy_src), copy_dst=np.zeros_like(prev.copy_dst))
        decode = dataclasses.replace(call.decode, budget=budget, num_steps=np.asarray(num_iterations, np.int32))

        def launch(out: MultiStepOutput) -> _InFlight:
            self.num_overlapped_calls += 1
            return self._launch(plan, num_iterations, dataclasses.replace(batch, token_ids=out.next_tokens),  # T == S
                                inputs, dataclasses.replace(decode, alive=out.alive))

        return launch

    def _decode_inputs(self, shape: BatchShape, entries: Sequence[ScheduledSeq], num_iterations: int) -> DecodeInputs:
        budget = np.zeros(shape.seqs, np.int32)  # [S]
        stop_ids = np.full((shape.seqs, MAX_STOP_IDS), -1, np.int32)  # [S, E]
        for row, e in enumerate(entries):
            state = self.requests[e.key[0]]
            generated = len(state.seqs[e.key[1]].token_ids)
            budget[row] = min(state.max_tokens - generated, self.max_model_len - e.kv_len)
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
            group = self.scheduler.get_group(e.key[0])
            if group is None or group.seqs[e.key[1]].is_finished or not valid[row]:
                continue
            entries.append(ScheduledSeq(e.key, (int(tokens[row]),), e.kv_len, e.page_ids, e.kv_len + 1, True))
            kept.append(row)
        return StepPlan(tuple(entries), (), (), len(entries)), kept

    def _slot_rows(self, plan: StepPlan) -> list[int]:
        rows, resets = [], []
        for entry in plan.seqs:
            slot, new = self.slots.get(entry.key)
            rows.append(slot)
            state = self.requests[entry.key[0]]
            if new and _uses_penalties(state.params):
                group = self.scheduler.get_group(entry.key[0])
                seq = group.seqs[entry.key[1]]
                resets.append((slot, seq.prompt_token_ids, seq.output_token_ids))
        if resets:
            self.penalties = self._reset_rows(self.penalties, *self._reset_args(resets))
        return rows

    def _reset_args(self, resets: list[tuple[int, list[int], list[int]]]) -> tuple[np.ndarray, PenaltyState]:
        num_rows = self.slots.spare + 1
        rows = np.full(num_rows, self.slots.spare, np.int32)
        rows[: len(resets)] = [r[0] for r in resets]
        fresh = PenaltyState.from_tokens([r[1] for r in resets], [r[2] for r in resets], num_rows, self.vocab_size)
        return rows, fresh

    def _step_args(
        self, shape: BatchShape, entries: Sequence[ScheduledSeq], copies: Sequence[Any], slots: list[int]
    ) -> tuple[StepBatch, SampleInputs]:
        return self._pack(shape, entries), self._sample_inputs(shape, entries, copies, slots)

    def _pack(self, shape: BatchShape, entries: Sequence[ScheduledSeq]) -> StepBatch:
        return pack([SeqChunk(e.token_ids, e.start_pos, e.page_ids) for e in entries], shape, self.page_size)

    def _run(
        self, shape: BatchShape, entries: Sequence[ScheduledSeq], copies: Sequence[Any], slots: list[int]
    ) -> StepOutput:
        t = time.perf_counter()
        batch, inputs = self._step_args(shape, entries, copies, slots)
        t = self.times.add("prepare", t)
        self.penalties, out = self.runner.step(self.penalties, batch, inputs)
        # Prompt logprobs are [T, K] per step: copy them to the host only in steps that asked for them.
        prompt = jax.device_get(out.prompt) if inputs.want_prompt_logprobs else None
        sampled, counts = jax.device_get((out.sampled, out.expert_counts))
        self.expert_counts += counts
        out = StepOutput(sampled, prompt)
        self.times.add("device", t)
        return out

    def _sample_inputs(
        self, shape: BatchShape, entries: Sequence[ScheduledSeq], copies: Sequence[Any], slots: list[int]
    ) -> SampleInputs:
        params, steps, seeds, bad, recent = [], [], [], [], []
        for e in entries:
            state = self.requests[e.key[0]]
            generated = state.seqs[e.key[1]].token_ids
            params.append(state.params)
            steps.append(len(generated))
            seeds.append(state.seeds[e.key[1]])
            bad.append(state.bad_words_ids)
            recent.append(generated if state.has_multi_token_bad_words else ())
        sampling = SamplingArrays.from_params(
            params, shape.seqs, self.vocab_size, steps=steps, seeds=seeds, eos_ids=sorted(self.eos_ids),
            bad_words=bad, recent=recent,
        )
        slot_arr = np.full(shape.seqs, self.slots.spare, np.int32)
        slot_arr[: len(slots)] = slots
        mask = np.zeros(shape.seqs, bool)
        mask[: len(entries)] = [e.sample for e in entries]
        src, dst = np.zeros(shape.seqs, np.int32), np.zeros(shape.seqs, np.int32)
        for i, (s, d) in enumerate(copies):
            src[i], dst[i] = s, d
        next_ids, want = self._prompt_next_ids(shape, entries)
        return SampleInputs(sampling, slot_arr, mask, src, dst, next_ids, np.asarray(want))

    def _prompt_next_ids(self, shape: BatchShape, entries: Sequence[ScheduledSeq]) -> tuple[np.ndarray, bool]:
        """Next prompt token at each position, for requests that asked for prompt logprobs."""
        next_ids = np.zeros(shape.tokens, np.int32)
        want, offset = False, 0
        for e in entries:
            state = self.requests[e.key[0]]
            prompt = state.prompt_token_ids
            if state.params.prompt_logprobs is not None and e.key[1] == 0 and not state.prompt_logprobs_done:
                for j in range(len(e.token_ids)):
                    pos = e.start_pos + j
                    if pos + 1 < len(prompt):
                        next_ids[offset + j] = prompt[pos + 1]
                        want = True
            offset += len(e.token_ids)
        return next_ids, want

    # ------------------------------------------------------------------------------------------ outputs

    def _apply(
        self, plan: StepPlan, out: SamplerOutput, prompt: PromptLogprobs | None, rows: Sequence[int]
    ) -> dict[str, RequestState]:
        """Hand one iteration's results (entry j of the plan is row rows[j] of `out`) to the request states
        and the scheduler; returns the requests that advanced.

        Failure isolation: an exception while one request's output is handled (detokenizing, stop matching,
        logprobs) fails that request alone (`_fail`: aborted in the scheduler, so `update` skips it and its
        pages are freed) before the scheduler hears of its token; every other request proceeds exactly as
        it would have."""
        sampled: dict[SeqKey, int] = {}
        finished: dict[SeqKey, FinishReason] = {}
        touched: dict[str, RequestState] = {}
        offset = 0
        for row, entry in zip(rows, plan.seqs):
            state = self.requests[entry.key[0]]
            touched[state.request_id] = state
            start, offset = offset, offset + len(entry.token_ids)
            if state.error is not None:
                continue
            try:
                if prompt is not None:
                    self._collect_prompt_logprobs(state, entry, prompt, start)
                if not entry.sample:
                    continue
                token = int(out.tokens[row])
                top = self._top(state, out, row, token)
                reason = state.on_token(entry.key[1], token, float(out.logprobs[row]), top)
            except Exception as e:  # noqa: BLE001
                self._fail(state, e)
                continue
            sampled[entry.key] = token
            if reason is not None:
                finished[entry.key] = reason
        for key in self.scheduler.update(plan, sampled, finished):
            self.slots.release(key)
            state = self.requests[key[0]]
            try:
                state.finish(key[1], finished.get(key, FinishReason.LENGTH))
            except Exception as e:  # noqa: BLE001
                self._fail(state, e)
        return touched

    def _fail(self, state: RequestState, error: BaseException) -> None:
        """Finish one request with "error" and free its pages; the others never notice."""
        for key in self.scheduler.abort(state.request_id):
            self.slots.release(key)
        state.fail(f"{type(error).__name__}: {error}")

    def _top(self, state: RequestState, out: SamplerOutput, row: int, token: int) -> dict[int, Logprob] | None:
        k = state.params.logprobs
        return None if k is None else sample_logprobs(out, row, token, k, self._token_texts.for_request(state))

    def _collect_prompt_logprobs(
        self, state: RequestState, entry: ScheduledSeq, out: PromptLogprobs, offset: int
    ) -> None:
        collect_prompt_logprobs(state, entry, out, offset, self._token_texts.for_request(state))

    def _emit(self, touched: dict[str, RequestState]) -> list[RequestOutput]:
        """Outputs of the requests that advanced (FINAL_ONLY ones only when finished); finished ones leave."""
        outputs = []
        for rid, state in touched.items():
            if state.finished or state.output_kind is not RequestOutputKind.FINAL_ONLY:
                outputs.append(self._output(state))
            if state.finished:
                del self.requests[rid]
        return outputs

    def _output(self, state: RequestState) -> RequestOutput:
        try:
            return state.to_output()
        except Exception as e:  # noqa: BLE001
            self._fail(state, e)
            return state.error_output()

    # ------------------------------------------------------------------------------------ device failures

    def _device_failed(self, plan: StepPlan, error: BaseException) -> list[RequestOutput]:
        """A device call raised: every request in it finishes with "error", and the engine resets to a
        clean state. The KV cache and the penalty state are rebuilt (a donated buffer may be gone, and what
        they hold is no longer trusted), so every other running sequence is requeued to recompute its KV,
        and the prefix cache forgets every page."""
        self.num_failed_steps += 1
        calls = [c for c in (self._inflight,) if c is not None]
        self._inflight = None
        futures.wait([c.launched for c in calls])  # nothing may still write into the cache being replaced
        failed = dict.fromkeys(e.key[0] for p in (plan, *(c.plan for c in calls)) for e in p.seqs)
        self.scheduler.drop_all_kv()
        self._reset_device_state()
        message = f"the device step failed ({type(error).__name__}: {error}); the engine was reset"
        touched = {}
        for rid in failed:
            state = self.requests.get(rid)
            if state is not None and not state.finished:
                self.scheduler.abort(rid)
                state.fail(message)
                touched[rid] = state
        return self._emit(touched)

    def _reset_device_state(self) -> None:
        cache = self.runner.kv_cache
        for leaf in jax.tree.leaves(cache):
            if not leaf.is_deleted():
                leaf.delete()  # before allocating the new cache, so both never need memory at once
        self.runner.kv_cache = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding), cache)
        self.slots = PenaltySlots(self.max_num_seqs)
        empty = PenaltyState.from_tokens([], [], self.max_num_seqs + 1, self.vocab_size)
        self.penalties = jax.device_put(empty, replicated(self.runner.mesh))

    # ------------------------------------------------------------------------------------------ batch API

    def generate(
        self, prompts: Any, params: SamplingParams | Sequence[SamplingParams] | None = None, *,
        use_tqdm: bool | None = None, priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """All prompts to completion; results in input order, each the complete final output (as vLLM,
        whatever output_kind says). Every request is validated before any is queued, and if this raises
        (Ctrl-C included) its own unfinished requests are aborted, so the engine stays usable."""
        ids = self._add_all(prompts, params, priority, RequestOutputKind.FINAL_ONLY)
        wanted, results = set(ids), {}
        show = self.use_tqdm if use_tqdm is None else use_tqdm
        try:
            with tqdm(total=len(ids), desc="generating", disable=not show) as bar:
                while len(results) < len(ids):
                    for out in self.step():
                        if out.finished and out.request_id in wanted:
                            results[out.request_id] = out
                            bar.update(1)
        except BaseException:
            for rid in wanted - set(results):
                self.abort(rid)
            raise
        if not self.scheduler.has_unfinished():
            self.flush()  # a decode call launched ahead holds only finished rows: return with the device idle
        return [results[rid] for rid in ids]

    def stream(
        self, prompts: Any, params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> Iterator[RequestOutput]:
        """Yield each request's outputs as it advances, as its output_kind asks (CUMULATIVE by default, with
        what is new in `delta_text`/`delta_token_ids`)."""
        ids = set(self._add_all(prompts, params, None, None))
        done: set[str] = set()
        try:
            while done != ids:
                for out in self.step():
                    if out.request_id in ids:
                        done.update([out.request_id] if out.finished else [])
                        yield out
        finally:
            for rid in ids - done:  # the consumer stopped early, or something raised: free what is left
                self.abort(rid)

    def _add_all(self, prompts: Any, params: Any, priority: Sequence[int] | None,
                 output_kind: RequestOutputKind | None) -> list[str]:
        """Check every prompt and its params at the door, then queue them all, or none."""
        parsed = parse_prompts(prompts)
        param_list = per_prompt("sampling_params", params, len(parsed))
        priorities = per_prompt("priority", priority, len(parsed), default=0)
        admitted = []
        for i, (prompt, p, prio) in enumerate(zip(parsed, param_list, priorities)):
            try:
                admitted.append(self.gate.admit(prompt, p, priority=prio))
            except InvalidInput as e:
                raise in_batch(e, i, len(parsed)) from None
        added: list[str] = []
        for i, adm in enumerate(admitted):
            try:
                added.append(self._queue(adm, output_kind))
            except InvalidInput as e:  # the scheduler's limits (pages, n): refuse the whole batch, queue nothing
                for rid in added:
                    self.abort(rid)
                raise in_batch(e, i, len(admitted)) from None
        return added

    def stats(self) -> dict[str, Any]:
        stats = dict(self.scheduler.stats())
        after = None if self._compiles_at_warmup is None else self.runner.num_compiles - self._compiles_at_warmup
        stats.update(num_compiles_after_warmup=after, num_compiles=self.runner.num_compiles, num_steps=self.num_steps,
                     num_overlapped_calls=self.num_overlapped_calls, num_failed_steps=self.num_failed_steps,
                     step_time_s=dict(self.times.seconds))
        if self.expert_counts.size:
            stats.update(expert_load_stats(self.expert_counts))
        return stats


def expert_load_stats(counts: np.ndarray) -> dict[str, Any]:
    """Per-expert (token, expert) pair counts summed over MoE layers and steps, and their balance: max/mean
    is 1.0 for perfectly even routing (random routers come close; trained ones are skewed)."""
    mean = float(counts.mean())
    return {"expert_token_counts": [int(c) for c in counts],
            "expert_load_max_over_mean": float(counts.max()) / mean if mean > 0 else None}


def _at_least_one(name: str, value: int) -> int:
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}.")
    return value


def _pool_size(cache_cfg: CacheConfig, runner: ModelRunner) -> int:
    """Pages the scheduler may hand out: the configured number, at most the pages the cache holds."""
    allocated = runner.kv_cache.num_pages
    if cache_cfg.num_pages is not None and cache_cfg.num_pages > allocated:
        raise ValueError(f"CacheConfig.num_pages={cache_cfg.num_pages} exceeds the {allocated} pages of the KV cache.")
    return cache_cfg.num_pages or allocated
