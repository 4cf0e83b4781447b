"""The engine loop: scheduler (host) -> batcher (host) -> one jitted step (device) -> outputs (host).

Composition, not inheritance: `Scheduler` decides what runs and owns pages, `pack` builds the bucketed
arrays, `ModelRunner.step` runs forward + sampling on device, `RequestState` turns tokens into text and
decides stops. This class wires them, builds each step's host arrays, and keeps the per-sequence sampling
state (seeds, penalty slots) that must survive preemption. Its collaborators: `DecodeLoop` (decode_loop.py:
several decode iterations per device call, overlapped with the host), `StepPipeline` (pipeline.py: single
steps as a forward and a sampler program, the next forward launched before the host reads the tokens),
`OutputPath` (output_path.py: tokens to request states and outputs, where one request can fail alone), the
batch API (frontend.py), and, with
speculative decoding configured, `Speculator` (speculative.py: proposals, one verification step, rollback).
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent import futures
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxinfer.config import CacheConfig, EngineConfig, SamplingParams
from jaxinfer.engine.admission import Admission, Gate
from jaxinfer.engine import frontend, warmup
from jaxinfer.engine.batcher import MIN_TOKEN_BUCKET, BatchShape, SeqChunk, bucket, buckets_up_to, pack, pow2_ceil
from jaxinfer.engine.bookkeeping import PenaltySlots, PhaseTimes, expert_load_stats
from jaxinfer.engine.decode_loop import DecodeLoop
from jaxinfer.engine.detokenize import IncrementalDetokenizer
from jaxinfer.engine.logprobs import TokenTexts
from jaxinfer.engine.output_path import OutputPath
from jaxinfer.engine.pipeline import StepPipeline
from jaxinfer.engine.request import RequestState, SeqOutput
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.engine.step_io import DecodeInputs, SampleInputs, StepBatch
from jaxinfer.engine.sampling_rows import PenaltyState, SamplingArrays, resolve_seed, set_rows, unconstrained_bitmask
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.step_plan import ScheduledSeq, StepPlan
from jaxinfer.engine.speculative import speculator_for
from jaxinfer.engine.sequence import FinishReason, SequenceGroup
from jaxinfer.outputs import RequestOutput
from jaxinfer.validation import RequestOutputKind

DEFAULT_MAX_MODEL_LEN = 4096  # when the model allows more; the page table width scales with it


def _uses_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


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
        single_step_max_rows: int = 0,
        overlap_decode: bool = True,
        compile_threads: int | None = None,
        seed: int | None = None,
        speculative: Any = None,
        draft_runner: ModelRunner | None = None,
        long_prefill_token_threshold: int = 0,
        mixed_prefill_token_cap: int = 0,
    ) -> None:
        self.runner, self.tokenizer, self.use_tqdm = runner, tokenizer, use_tqdm
        self.loop = DecodeLoop(self, _at_least_one("decode_steps_per_call", decode_steps_per_call), overlap_decode)
        self.pipeline = StepPipeline(self, overlap_decode)
        self.single_step_max_rows = single_step_max_rows  # see decodes_singly
        # Decode-only single steps of a few rows run in token buckets of 2, 4 and 8 rather than the smallest of
        # `token_buckets` (16), where such batches step singly (GPU, TPU) and the pipeline runs (one process).
        # One decoding row of Llama-3-8B on an H100 took 7.21 ms of device time per step in the 16-row bucket,
        # 6.39 in the 2-row one, 6.44 and 6.60 in the 4- and 8-row ones (attention over 16 query rows, scatters
        # for the KV writes, matmuls and elementwise work over padding); and 7.53 in a 1-row bucket, where XLA
        # turns the narrow k/v projections into reductions over the weights' strided columns
        # (docs/PERFORMANCE.md, twelfth session). They compile in the background after warmup: see step_shape.
        # A bucket is kept when some row count up to single_step_max_rows lands in it (2 holds 1 and 2 rows).
        self.small_step_buckets = tuple(
            b for b in (2, 4, 8) if single_step_max_rows >= 1 and (b == 2 or b // 2 < single_step_max_rows)
        ) if jax.process_count() == 1 else ()
        # Streamed (DELTA/CUMULATIVE) requests get an output every this many tokens (and at their first and
        # last): the server's --stream-interval. Each output is host work on this thread and an event on a
        # server's loop, one per row per step for rows that decode one token per step (structured output).
        self.stream_interval = 1
        # Called on this thread just before it blocks on the device (`waiting_on_device`): a front end on
        # another thread (AsyncLLM) hands the previous step's outputs to its event loop then, so that the
        # loop's work runs while this thread waits instead of competing with it for the GIL.
        self.on_device_wait: Callable[[], None] | None = None
        self.out = OutputPath(self)
        self.compile_threads = compile_threads  # None: one per core of the host
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
            long_prefill_token_threshold=long_prefill_token_threshold,
            mixed_prefill_token_cap=mixed_prefill_token_cap,
        )
        self.token_buckets = buckets_up_to(pow2_ceil(engine_cfg.max_num_batched_tokens), MIN_TOKEN_BUCKET)
        # A single decoding sequence gets its own small bucket: at one or two rows the weight matmuls are
        # matrix-vector products, which stream the weights faster than a 16-row GEMM does. On a GPU it has two
        # rows (the second is padding): at M = 1 XLA:GPU lowers some projections to elementwise products and
        # reductions instead of GEMMs (Qwen3-30B-A3B's attention output wrote and read a [N, H, D] temporary
        # in every layer) or copies the q/k/v weights transposed once per call (tests/engine/test_no_copies).
        # Above 64 rows, 1.5x steps (96, 192, ...) too: 192 sequences in a 256-row bucket ran a third more
        # rows through every matmul (H100, 1000/1000: 5,815 out tok/s at 192 prompts, 6,560 at 128).
        row_cap = pow2_ceil(engine_cfg.max_num_seqs)
        pow2 = buckets_up_to(row_cap, MIN_TOKEN_BUCKET)
        smallest = 2 if runner.platform == "gpu" else 1
        self.decode_row_buckets = sorted({smallest, *pow2, *(b * 3 // 2 for b in pow2 if 64 <= b < row_cap)})
        self.times = PhaseTimes()
        self.pages_per_seq = -(-self.max_model_len // self.page_size)
        self.eos_ids = frozenset(tokenizer.eos_token_ids) if tokenizer else frozenset({cfg.eos_token_id} - {None})
        self.slots = PenaltySlots(engine_cfg.max_num_seqs)
        # Placed on the mesh like the step's outputs, so the first step after warmup sees the same sharding.
        empty = PenaltyState.from_tokens([], [], engine_cfg.max_num_seqs + 1, cfg.vocab_size)
        self.penalties = jax.device_put(empty, runner.penalty_sharding())
        self._reset_rows = jax.jit(set_rows, donate_argnums=(0,))
        self.gate = Gate(tokenizer, cfg.vocab_size, self.max_model_len, self.eos_ids)
        self._open_bitmasks: dict[int, Any] = {}  # row bucket -> all-allowed token bitmask on device
        self.requests: dict[str, RequestState] = {}
        self._ids = itertools.count()
        self._rng = np.random.default_rng(seed)  # the seeds of unseeded requests: reproducible per engine seed
        self._token_texts = TokenTexts(tokenizer)  # Logprob.decoded_token, decoded once per id
        self.num_failed_steps = 0  # device calls that raised (their requests failed, the engine was reset)
        self._compiles_at_warmup: int | None = None
        self._background_compile: threading.Thread | None = None  # see warmup
        self.num_steps = 0
        self.expert_counts = np.zeros(runner.num_experts, np.int64)  # MoE load: (token, expert) pairs so far
        self.spec = speculator_for(self, speculative, draft_runner)

    @property
    def decode_steps_per_call(self) -> int:
        return self.loop.steps_per_call

    def reseed(self, seed: int) -> None:
        """Seed the draws that give unseeded requests their seeds (multi-process runs must agree on them)."""
        self._rng = np.random.default_rng(seed)

    def batch_shape(self, num_tokens: int) -> BatchShape:
        tokens = bucket(num_tokens, MIN_TOKEN_BUCKET, self.token_buckets[-1])
        return BatchShape(tokens=tokens, seqs=min(tokens, pow2_ceil(self.max_num_seqs)), pages_per_seq=self.pages_per_seq)

    def step_shape(self, num_tokens: int, num_rows: int) -> BatchShape:
        """The bucket of a single step of `num_tokens` tokens over `num_rows` rows: for one token per row and at
        most 8 rows, the smallest of `small_step_buckets` that holds it, once warmup's background compiles are
        done (until then, and otherwise, the token bucket)."""
        shape = next((s for s in self.small_step_shapes() if num_tokens <= s.tokens), None)
        if (shape is not None and num_tokens == num_rows and num_rows <= shape.seqs
                and self._background_done()):
            return shape
        return self.batch_shape(num_tokens)

    def small_step_shapes(self) -> list[BatchShape]:
        """The shapes of `small_step_buckets` (warmup compiles them in the background)."""
        return [BatchShape(b, min(b, pow2_ceil(self.max_num_seqs)), self.pages_per_seq) for b in self.small_step_buckets]

    def decode_shape(self, num_rows: int) -> BatchShape:
        """The bucket of a multi-step call over `num_rows` sequences: one token per row (T == S), rows rounded
        up to the next of `decode_row_buckets` (1, or 2 on a GPU; powers of two from 16; 1.5x steps above 64),
        so small batches do not pay for max_num_seqs rows."""
        buckets = self.decode_row_buckets
        rows = buckets[min(bisect.bisect_left(buckets, num_rows), len(buckets) - 1)]
        return BatchShape(tokens=rows, seqs=rows, pages_per_seq=self.pages_per_seq)

    def warmup(self) -> None:
        """Compile every bucket now, so serving never compiles (checked by engine_stats); what only makes some
        calls faster compiles in the background right after (jaxinfer.engine.warmup says what and why).

        Programs are traced in turn and compiled ahead of time on `compile_threads` threads at once.
        """
        todo = warmup.plan(self)
        with tqdm(total=1, desc=f"compiling {len(todo.now)} buckets", disable=not self.use_tqdm, leave=False):
            self.runner.precompile(todo.now, self.compile_threads)
            if todo.draft:
                self.spec.draft.runner.precompile(todo.draft, self.compile_threads)
        self.penalties = self._reset_rows(self.penalties, *self._reset_args([]))  # also compiled up front
        self._compiles_at_warmup = self.num_compiles
        if todo.later:
            self._background_compile = self.runner.precompile_in_background(todo.later, self.compile_threads)

    def wait_for_background_compile(self, timeout: float | None = None) -> bool:
        """Block until the programs warmup left to the background are compiled (measurements of steady-state
        speed start after this); True when none is left."""
        if self._background_compile is not None:
            self._background_compile.join(timeout)
        return self._background_done()

    def _background_done(self) -> bool:
        return self._background_compile is None or not self._background_compile.is_alive()

    def add_request(
        self, prompt: Any, params: SamplingParams | None = None, *, request_id: str | None = None,
        priority: int = 0,
    ) -> str:
        """Validate and queue one request; a bad request raises InvalidInput (a ValueError) naming the field,
        and nothing else is affected."""
        return self.queue(self.gate.admit(prompt, params, request_id=request_id, priority=priority))

    def queue(self, adm: Admission, output_kind: RequestOutputKind | None = None) -> str:
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
        seqs = [SeqOutput(d) for d in detoks]
        if adm.grammar is not None:  # structured output: each of the n sequences walks the grammar on its own
            for seq in seqs:
                seq.matcher = self.gate.grammars.matcher(adm.grammar)
        return RequestState(rid, adm.prompt, ids, params, seeds, seqs, self.eos_ids, adm.max_tokens, output_kind,
                            adm.bad_words_ids)

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
        return self.out.output(state)

    def decodes_singly(self, num_rows: int, request_ids: Iterable[str]) -> bool:
        """Whether a decode-only step of `num_rows` rows (those of `request_ids`) runs one iteration per device
        call (pipelined: engine/pipeline.py) rather than `decode_steps_per_call`: always at 1, and up to
        `single_step_max_rows` rows when the pipeline can launch each call ahead and some row streams
        (jaxinfer.platform says why; speculative decoding never pipelines, so its plain steps keep the multi-step
        loop).

        Single steps are for streaming: each token reaches its client as it is sampled. A batch whose requests
        all return only when finished (`RequestOutputKind.FINAL_ONLY`: `generate`, batch jobs, a server's
        non-streamed requests) gains nothing from that, and the multi-step loop runs the same tokens faster on
        a GPU, whose host cannot launch a single step's kernels as fast as the device runs them."""
        if self.decode_steps_per_call == 1:
            return True
        if not (self.pipeline.enabled and self.spec is None and num_rows <= self.single_step_max_rows):
            return False
        return any(self._streamed(rid) for rid in request_ids)

    def _streamed(self, request_id: str) -> bool:
        state = self.requests.get(request_id)
        return state is not None and state.output_kind is not RequestOutputKind.FINAL_ONLY

    def waiting_on_device(self) -> None:
        """This thread is about to block until the device returns (see `on_device_wait`)."""
        if self.on_device_wait is not None:
            self.on_device_wait()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix page, so later requests compute their whole prompts (vLLM's
        `LLM.reset_prefix_cache`; benchmarks that repeat prompts call it). Pages that running requests hold stay
        theirs. False when prefix caching is off."""
        if self.scheduler.prefix_cache is None:
            return False
        self.scheduler.prefix_cache.clear()
        return True

    def has_unfinished(self) -> bool:
        # A decode call still in flight when nothing is unfinished holds only rows finished since its launch;
        # the next step() reads it back and drops them.
        return self.scheduler.has_unfinished()

    def flush(self) -> list[RequestOutput]:
        """Read back the decode call in flight, if any, without launching one to follow it. Afterwards the
        host's state is complete, for callers that drive the scheduler or the runner themselves."""
        self.pipeline.drain()
        return self.loop.flush()

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; outputs of every request that advanced (finished ones included)."""
        self.pipeline.hold_admission()
        if self.pipeline.ahead is not None:
            return self.pipeline.resume()
        if self.loop.inflight is None:
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
            if self.spec is not None:
                self.times.add("schedule", t)
                outputs = self.spec.run(plan)
                if outputs is not None:
                    return outputs
                t = time.perf_counter()
            plan, num_iterations = self.loop.iterations(plan)
            slot_rows = self._slot_rows(plan)
            self.times.add("schedule", t)
            if num_iterations == 1:
                return self.pipeline.run(plan, slot_rows)
            try:
                self.loop.inflight = self.loop.dispatch(plan, slot_rows, num_iterations)
            except Exception as e:  # noqa: BLE001 - any failure of the device call fails its requests alone
                return self._device_failed(plan, e)
        return self.loop.retire()

    def _decode_args(self, shape: BatchShape, entries: Sequence[ScheduledSeq], slots: list[int],
                     num_iterations: int) -> tuple[StepBatch, SampleInputs, DecodeInputs]:
        return self.loop.args(shape, entries, slots, num_iterations)

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

    def _step_args(self, shape: BatchShape, entries: Sequence[ScheduledSeq], slots: list[int]
                   ) -> tuple[StepBatch, SampleInputs]:
        return self._pack(shape, entries), self._sample_inputs(shape, entries, slots)

    def _pack(self, shape: BatchShape, entries: Sequence[ScheduledSeq]) -> StepBatch:
        return pack([SeqChunk(e.token_ids, e.start_pos, e.page_ids) for e in entries], shape, self.page_size)

    def _sample_inputs(self, shape: BatchShape, entries: Sequence[ScheduledSeq], slots: list[int]) -> SampleInputs:
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
            bad_words=bad, recent=recent, token_bitmask=self._grammar_bitmask(shape, entries),
        )
        slot_arr = np.full(shape.seqs, self.slots.spare, np.int32)
        slot_arr[: len(slots)] = slots
        mask = np.zeros(shape.seqs, bool)
        mask[: len(entries)] = [e.sample for e in entries]
        next_ids, want = self._prompt_next_ids(shape, entries)
        return SampleInputs(sampling, slot_arr, mask, next_ids, np.asarray(want))

    def _grammar_bitmask(self, shape: BatchShape, entries: Sequence[ScheduledSeq]) -> Any:
        """Allowed-token bits of the rows that sample under a structured-output grammar, filled by their
        matchers in parallel (llguidance's threads); the cached all-allowed device mask when no row has one
        (the common case)."""
        rows = []
        for row, e in enumerate(entries):
            matcher = self.requests[e.key[0]].seqs[e.key[1]].matcher if e.sample else None
            if matcher is not None:
                rows.append((matcher, row))
        if not rows:  # one all-allowed mask per row bucket, kept on device: not 4 MB built and sent per call
            mask = self._open_bitmasks.get(shape.seqs)
            if mask is None:
                mask = self._open_bitmasks[shape.seqs] = self.runner.place(
                    unconstrained_bitmask(shape.seqs, self.vocab_size))
            return mask
        bitmask = unconstrained_bitmask(shape.seqs, self.vocab_size)
        self.gate.grammars.fill(rows, bitmask)
        return bitmask

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

    def _device_failed(self, plan: StepPlan, error: BaseException) -> list[RequestOutput]:
        """A device call raised: every request in it finishes with "error", and the engine resets to a
        clean state. The KV cache and the penalty state are rebuilt (a donated buffer may be gone, and what
        they hold is no longer trusted), so every other running sequence is requeued to recompute its KV,
        and the prefix cache forgets every page."""
        self.num_failed_steps += 1
        calls = [c for c in (self.loop.inflight, self.pipeline.ahead) if c is not None]
        self.loop.inflight = None
        self.pipeline.drain()  # (its forward is among `calls`)
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
        return self.out.emit(touched)

    def _reset_device_state(self) -> None:
        cache = self.runner.kv_cache
        for leaf in jax.tree.leaves(cache):
            if not leaf.is_deleted():
                leaf.delete()  # before allocating the new cache, so both never need memory at once
        self.runner.kv_cache = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding), cache)
        self.slots = PenaltySlots(self.max_num_seqs)
        empty = PenaltyState.from_tokens([], [], self.max_num_seqs + 1, self.vocab_size)
        self.penalties = jax.device_put(empty, self.runner.penalty_sharding())
        if self.spec is not None:
            self.spec.reset()

    @property
    def num_compiles(self) -> int:
        """Programs compiled so far: the model's and a draft model's, with their transfers' unpack programs."""
        draft = self.spec.draft if self.spec is not None else None
        runners = [self.runner] + ([draft.runner] if draft is not None else [])
        return sum(r.num_compiles + r.transfer.num_compiles for r in runners)

    def generate(self, prompts: Any, params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool | None = None, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """All prompts to completion, in input order (jaxinfer.engine.frontend.generate)."""
        return frontend.generate(self, prompts, params, use_tqdm=use_tqdm, priority=priority)

    def stream(self, prompts: Any, params: SamplingParams | Sequence[SamplingParams] | None = None
               ) -> Iterator[RequestOutput]:
        """Each request's outputs as it advances (jaxinfer.engine.frontend.stream)."""
        return frontend.stream(self, prompts, params)

    def stats(self) -> dict[str, Any]:
        stats = dict(self.scheduler.stats())
        after = None if self._compiles_at_warmup is None else self.num_compiles - self._compiles_at_warmup
        stats.update(num_compiles_after_warmup=after, num_compiles=self.num_compiles, num_steps=self.num_steps,
                     num_background_compiles=(self.runner.num_background_compiles
                                              + self.runner.transfer.num_background_compiles),
                     background_compile_pending=not self.wait_for_background_compile(0),
                     num_overlapped_calls=self.loop.num_overlapped_calls,
                     num_pipelined_steps=self.pipeline.num_pipelined_steps, num_failed_steps=self.num_failed_steps,
                     step_time_s=dict(self.times.seconds))
        if self.expert_counts.size:
            stats.update(expert_load_stats(self.expert_counts))
        if self.spec is not None:
            stats.update(self.spec.stats.as_dict())
        return stats


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
