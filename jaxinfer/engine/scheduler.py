"""Iteration-level continuous batching on the host (pure Python + NumPy, no JAX).

Every sequence carries ``num_computed_tokens`` (tokens whose KV is in the cache) and each step lets it catch up
towards ``num_tokens`` (vLLM V1 style). There is no separate prefill phase: a decode is a sequence one token
behind, a prefill chunk is one many tokens behind, and a preempted sequence is one that fell back to 0. So one
``schedule()`` mixes decodes, continuing prefill chunks and new requests under one token budget:

1. running sequences one token behind (decodes), most urgent first;
2. running sequences further behind (continuing prefill chunks), most urgent first;
3. waiting requests by (priority, arrival) while budget, sequence slots and pages last; a prompt longer than
   the remaining budget is chunked. Nothing is admitted in a step that had to preempt, to avoid thrashing.

When a running sequence needs a page and none is free, the least urgent running sequence (highest priority
number, then latest arrival) is preempted by recompute: its pages are freed, ``num_computed_tokens`` drops to 0
and it returns to the waiting queue at its original (priority, arrival) position, ahead of everything that
arrived after it. Its generated tokens are kept, so on readmission it prefills prompt + output and continues
exactly where it stopped.

Requests with n > 1 queue only sequence 0. Its prefill stops one token short of the prompt; then the other
sequences fork from it (sharing every page by refcount) and each runs the last prompt token itself, which gives
each its own logits row to sample from. The shared, partially filled last page is copied on the first write
(``reserve_slots``), and the copies travel in the plan.

Cost per ``schedule()``: O(running + newly admitted) plus the new pages and page tables handed to the batcher;
prefix hashes of a sequence are computed once and cached on it.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Collection, Mapping

from jaxinfer.engine.page_table import PageAllocator, PageCopy, OutOfPages, pages_for_tokens, reserve_slots
from jaxinfer.engine.prefix_cache import PrefixCache
from jaxinfer.engine.sequence import FinishReason, SeqKey, Sequence, SequenceGroup, SequenceStatus
from jaxinfer.engine.step_plan import PlanBuilder, ScheduledSeq, StepPlan
from jaxinfer.errors import InvalidInput

_QUEUED = (SequenceStatus.WAITING, SequenceStatus.PREEMPTED)


class RequestRejected(InvalidInput):
    """The request can never run under this scheduler's limits; the other requests are unaffected."""


def _order(seq: Sequence) -> tuple[int, float, int, int]:
    return seq.order_key


# mixed_prefill_token_cap holds while a step decodes at most this many rows. At 1024/128 requests a client asks
# for ~8 prompt tokens per decoded token, so 16 streaming clients need ~128 prefill tokens a step on average, half
# of a 256-token cap; a full batch's backlog (an offline job of hundreds of prompts) needs the whole budget.
# The cap is off by default: on an H100 (Llama-3-8B, 1024/128, clients that send their next request when the
# last one ends) a 256-token cap raised the ITL p99 / median at concurrency 8 from 1.91 to 3.62. Likely because
# such clients finish together and their next prompts arrive together: uncapped, that backlog is one long step;
# capped, many medium ones, and the p99 counts steps (docs/PERFORMANCE.md, issue 14).
MIXED_PREFILL_MAX_DECODES = 16


class Scheduler:
    """Decides, step by step, which tokens of which sequences run, and owns their KV pages."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        max_pages_per_seq: int | None = None,
        long_prefill_token_threshold: int = 0,
        mixed_prefill_token_cap: int = 0,
        mixed_prefill_max_decodes: int = MIXED_PREFILL_MAX_DECODES,
    ) -> None:
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", max_model_len),
        ):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}.")
        for name, value in (("long_prefill_token_threshold", long_prefill_token_threshold),
                            ("mixed_prefill_token_cap", mixed_prefill_token_cap)):
            if value < 0:
                raise ValueError(f"{name} must be at least 0, got {value}.")
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # A prefill chunk's largest size in one step (0: whatever the budget leaves): a long prompt then takes
        # several steps, each short enough not to hold the decoding rows of the same step for long.
        self.long_prefill_token_threshold = long_prefill_token_threshold
        # The prefill tokens of a step that also decodes at most mixed_prefill_max_decodes rows (0: no cap). Every
        # decoding row waits for the whole step, so this bounds the gap between two of its tokens. A step with
        # nothing decoding keeps the whole budget (a lone long prompt is not slowed down), and so does one with
        # many decoding rows: there the prefill backlog of a full batch needs the budget, and the step is long
        # anyway.
        self.mixed_prefill_token_cap = mixed_prefill_token_cap
        self.mixed_prefill_max_decodes = mixed_prefill_max_decodes
        self.max_model_len = max_model_len
        self.max_pages_per_seq = max_pages_per_seq or pages_for_tokens(max_model_len, page_size)
        self.allocator = PageAllocator(num_pages, page_size)
        self.prefix_cache = PrefixCache(self.allocator) if enable_prefix_caching else None
        self._groups: dict[str, SequenceGroup] = {}  # unfinished requests
        self._running: list[Sequence] = []  # sorted by order_key: most urgent first, preemption victim last
        self._waiting: list[tuple[tuple[int, float, int, int], Sequence]] = []  # heap; finished entries are stale
        self._num_waiting = 0
        self._reserved_slots = 0  # slots held for the not yet forked children of running n > 1 parents
        self._num_preemptions = 0
        self._no_prefix_lookup: set[str] = set()  # requests that must compute every prompt position
        # Set by the engine for one step at a time: admit nothing now (the pipeline's admission waves).
        self.hold_admission = False

    # ----------------------------------------------------------------------------------------- public API

    def add(self, group: SequenceGroup, *, use_prefix_cache: bool = True) -> None:
        """Queue a request; raises ``RequestRejected`` if it could never be scheduled.

        ``use_prefix_cache=False`` makes the request compute its whole prompt (its pages are still cached for
        others): needed when the caller wants something of every prompt position, e.g. prompt logprobs.
        """
        if group.request_id in self._groups:
            raise RequestRejected(f"request_id {group.request_id!r} is already in use by an unfinished request.",
                                  field="request_id", value=group.request_id)
        self._validate(group)
        if not use_prefix_cache:
            self._no_prefix_lookup.add(group.request_id)
        self._groups[group.request_id] = group
        self._push_waiting(group.parent)

    def abort(self, request_id: str) -> list[SeqKey]:
        """Finish every unfinished sequence of the request with ABORT and free its pages; returns their keys.

        Safe between ``schedule`` and ``update``: ``update`` skips the aborted sequences. The device may still
        write the in-flight step into the freed pages, which is harmless because pages are only reallocated by
        the next ``schedule``.
        """
        group = self._groups.get(request_id)
        if group is None:
            return []
        keys = [seq.key for seq in group.seqs if not seq.is_finished]
        for seq in group.seqs:
            if not seq.is_finished:
                self._finish(seq, FinishReason.ABORT)
        return keys

    def schedule(self) -> StepPlan:
        builder = PlanBuilder(self.max_num_batched_tokens)
        self._schedule_running(builder, decodes=True)
        self._schedule_running(builder, decodes=False)
        if not builder.preempted and not self.hold_admission:
            self._admit_waiting(builder)
        return builder.build()

    def update(
        self,
        plan: StepPlan,
        sampled: Mapping[SeqKey, int],
        finished: Mapping[SeqKey, FinishReason] | None = None,
    ) -> list[SeqKey]:
        """Record that ``plan`` ran: advance computed tokens, append sampled tokens, finish sequences.

        ``sampled`` must hold a token for every entry with ``sample=True`` (aborted ones may be missing); for
        an entry with proposals (``num_draft``), the tuple of tokens the step emitted for it.
        ``finished`` holds the engine's stop decisions, applied after the sampled tokens are appended (so a
        stop token is in ``output_token_ids``; hiding it is the detokenizer's business). A sequence that
        reaches ``max_tokens`` or ``max_model_len`` is finished with LENGTH even if the engine did not say so,
        because it could not be scheduled further. Returns the keys finished by this call.
        """
        done: list[SeqKey] = []
        sampling: list[Sequence] = []
        for entry in plan.seqs:
            seq = self._live(entry.key)
            if seq is not None:
                self._apply(seq, entry, sampled)
                if entry.sample:
                    sampling.append(seq)
        for key, reason in (finished or {}).items():
            seq = self._live(key)
            if seq is not None:
                self._finish(seq, reason)
                done.append(key)
        for seq in sampling:
            if not seq.is_finished and self._at_length_limit(seq):
                self._finish(seq, FinishReason.LENGTH)
                done.append(seq.key)
        return done

    def has_unfinished(self) -> bool:
        return bool(self._groups)

    def drop_all_kv(self) -> list[SeqKey]:
        """The device's KV cache was lost (a failed device call): every running sequence is preempted, to
        recompute its KV when readmitted, and the prefix cache forgets every page. Returns the preempted keys."""
        builder = PlanBuilder(0)
        for seq in list(self._running):
            self._preempt(seq, builder)
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        return list(builder.preempted)

    def reserve_lookahead(self, key: SeqKey, num_tokens: int) -> tuple[int, ...]:
        """Give a decoding sequence pages for positions up to ``num_tokens`` (capped by max_model_len) ahead of
        time, so one device call can run several decode iterations; takes only pages that are free or
        evictable now, never preempting. Returns the page table, which callers use for this call's rows.
        The extra pages are ordinary pages of the sequence: later steps fill them first, and freeing the
        sequence frees them."""
        seq = self._live(key)
        if seq is None:
            return ()
        cap = min(pages_for_tokens(min(num_tokens, self.max_model_len), self.allocator.page_size), self.max_pages_per_seq)
        take = min(cap - len(seq.page_ids), self.allocator.num_free)  # short of pages: fewer iterations
        if take > 0:
            seq.page_ids.extend(self.allocator.allocate(take))
        return tuple(seq.page_ids)

    def reserve_draft_slots(self, key: SeqKey, start: int, num: int) -> tuple[tuple[int, ...], list[PageCopy]] | None:
        """Pages for ``num`` speculative proposals at positions ``start ..``, right after a decode the plan
        already holds pages for; never preempts. (page table, copy-on-write copies), or None when the pages
        are not free now (the sequence then decodes without proposals)."""
        seq = self._live(key)
        if seq is None:
            return None
        try:
            copies = reserve_slots(self.allocator, seq.page_ids, start, num)
        except OutOfPages:
            return None
        return tuple(seq.page_ids), copies

    def runs_only(self, keys: Collection[SeqKey]) -> bool:
        """Nothing waits to be admitted and every running sequence is one of ``keys``: what ``schedule()``
        would plan next is one more decode of each of them, so the engine may plan it itself, before the
        results of the call in flight are known (overlapped decode)."""
        return self._peek_waiting() is None and all(seq.key in keys for seq in self._running)

    def decodes_only(self, keys: Collection[SeqKey]) -> bool:
        """What ``schedule()`` would plan next is one more decode of each of ``keys`` (pipelined single steps):
        every running sequence is one of them and no waiting request could be admitted, because none waits, the
        head of the queue finds no sequence slot (admission never preempts for a slot) or admission is held."""
        if not all(seq.key in keys for seq in self._running):
            return False
        head = self._peek_waiting()
        if head is None or self.hold_admission:
            return True
        slots = self._groups[head.request_id].n if self._fork_pending(head) else 1
        return len(self._running) + self._reserved_slots + slots > self.max_num_seqs

    @property
    def num_free_slots(self) -> int:
        """Sequence slots a waiting request could take now."""
        return self.max_num_seqs - len(self._running) - self._reserved_slots

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def running_request_ids(self) -> set[str]:
        return {seq.request_id for seq in self._running}

    def live(self, key: SeqKey) -> Sequence | None:
        """The sequence if it is still unfinished (not stopped, aborted or finished by length)."""
        return self._live(key)

    def get_group(self, request_id: str) -> SequenceGroup | None:
        return self._groups.get(request_id)

    def stats(self) -> dict[str, int | float]:
        """Engine gauges. ``free_pages`` counts cached-but-unreferenced pages as free (they are reusable)."""
        return {
            "num_running": len(self._running),
            "num_waiting": self._num_waiting,
            "free_pages": self.allocator.num_free,
            "total_pages": self.allocator.num_total,
            "num_preemptions": self._num_preemptions,
            "prefix_cache_hit_rate": self.prefix_cache.hit_rate if self.prefix_cache else 0.0,
            # vLLM's prefix_cache_queries / prefix_cache_hits counters, in tokens
            "prefix_cache_queried_tokens": self.prefix_cache.queried_tokens if self.prefix_cache else 0,
            "prefix_cache_hit_tokens": self.prefix_cache.hit_tokens if self.prefix_cache else 0,
        }

    # -------------------------------------------------------------------------------------- validation

    def _validate(self, group: SequenceGroup) -> None:
        parent = group.parent
        prompt_len = parent.num_prompt_tokens
        if prompt_len == 0:
            raise RequestRejected(f"request {group.request_id!r}: the prompt is empty; it needs at least one token.",
                                  field="prompt", value=[])
        if prompt_len > self.max_model_len:
            raise RequestRejected(
                f"request {group.request_id!r}: prompt has {prompt_len} tokens, more than "
                f"max_model_len={self.max_model_len}.", field="prompt", value=prompt_len,
            )
        if parent.max_tokens is not None and parent.max_tokens < 1:
            raise RequestRejected(f"request {group.request_id!r}: max_tokens must be at least 1.", field="max_tokens",
                                  value=parent.max_tokens)
        if group.n > self.max_num_seqs:
            raise RequestRejected(
                f"request {group.request_id!r}: n={group.n} exceeds max_num_seqs={self.max_num_seqs}.", field="n",
                value=group.n, accepted=f"at most max_num_seqs={self.max_num_seqs}",
            )
        self._validate_pages(group.request_id, parent)

    def _validate_pages(self, request_id: str, seq: Sequence) -> None:
        # The longest history one sequence can reach; its last sampled token never needs KV.
        max_len = self.max_model_len
        if seq.max_tokens is not None:
            max_len = min(max_len, seq.num_prompt_tokens + seq.max_tokens)
        needed = pages_for_tokens(max(seq.num_prompt_tokens, max_len - 1), self.page_size)
        limit = min(self.allocator.num_total, self.max_pages_per_seq)
        if needed > limit:
            raise RequestRejected(
                f"request {request_id!r}: up to {max_len} tokens need {needed} KV pages, more than the "
                f"{limit} one sequence can hold (num_pages={self.allocator.num_pages} incl. the trash page, "
                f"max_pages_per_seq={self.max_pages_per_seq}); lower max_tokens or add pages.", field="max_tokens",
                value=seq.max_tokens,
            )

    # -------------------------------------------------------------------------------------- scheduling

    def _schedule_running(self, builder: PlanBuilder, *, decodes: bool) -> None:
        for seq in list(self._running):
            if builder.budget_left == 0:
                return
            if seq.status is not SequenceStatus.RUNNING or seq in builder:
                continue  # preempted earlier in this step, or already scheduled
            remaining = self._prefill_target(seq) - seq.num_computed_tokens
            if remaining <= 0 or (remaining == 1) != decodes:
                continue
            if num_new := self._chunk(remaining, builder):  # 0: the step's prefill cap is used up
                self._schedule_or_preempt(builder, seq, num_new, decode=remaining == 1)

    def _schedule_or_preempt(self, builder: PlanBuilder, seq: Sequence, num_new: int, decode: bool) -> None:
        """Reserve pages for ``num_new`` tokens, preempting the least urgent running sequences as needed."""
        while True:
            try:
                copies = reserve_slots(self.allocator, seq.page_ids, seq.num_computed_tokens, num_new)
            except OutOfPages:
                victim = self._running[-1]
                self._preempt(victim, builder)
                if victim is seq:
                    return
                continue
            builder.add(seq, num_new, copies, decode)
            return

    def _try_schedule(self, builder: PlanBuilder, seq: Sequence) -> bool:
        """Schedule the next chunk of ``seq`` if budget and free pages allow, without preempting anyone."""
        num_new = self._chunk(self._prefill_target(seq) - seq.num_computed_tokens, builder)
        if num_new <= 0:
            return False
        try:
            copies = reserve_slots(self.allocator, seq.page_ids, seq.num_computed_tokens, num_new)
        except OutOfPages:
            return False
        builder.add(seq, num_new, copies)
        return True

    def _admit_waiting(self, builder: PlanBuilder) -> None:
        # Strict (priority, arrival) order: if the head does not fit, nothing behind it may overtake it.
        while builder.budget_left > 0 and self._prefill_room(builder) != 0:
            seq = self._peek_waiting()
            if seq is None or not self._try_admit(seq, builder):
                return

    def _try_admit(self, seq: Sequence, builder: PlanBuilder) -> bool:
        slots = self._groups[seq.request_id].n if self._fork_pending(seq) else 1
        if len(self._running) + self._reserved_slots + slots > self.max_num_seqs:
            return False
        seq.page_ids = self._take_prefix_hits(seq)
        num_computed = len(seq.page_ids) * self.page_size
        num_new = self._chunk(self._prefill_target(seq) - num_computed, builder)
        try:
            copies = reserve_slots(self.allocator, seq.page_ids, num_computed, num_new)
        except OutOfPages:
            self._release(seq)  # gives the hit pages back to the cache
            return False
        heapq.heappop(self._waiting)
        self._num_waiting -= 1
        self._start_running(seq, num_computed)
        self._reserved_slots += slots - 1
        if self.prefix_cache is not None:
            self.prefix_cache.record_query(seq.num_tokens, num_computed)
        if num_new > 0:
            builder.add(seq, num_new, copies)
        if self._fork_pending(seq) and num_computed == seq.num_prompt_tokens - 1:
            self._fork(seq)  # whole prompt but its last token was cached (or the prompt is one token long)
            for member in self._groups[seq.request_id].seqs:
                if not self._try_schedule(builder, member):
                    break
        return True

    def _take_prefix_hits(self, seq: Sequence) -> list[int]:
        if self.prefix_cache is None or seq.request_id in self._no_prefix_lookup:
            return []
        pages = self.prefix_cache.lookup(seq)
        self.allocator.incref(pages)  # before any allocation, so they cannot be evicted under us
        return pages

    def _start_running(self, seq: Sequence, num_computed: int) -> None:
        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens = num_computed
        seq.num_cached_pages = num_computed // self.page_size  # the prefix-cache hits
        bisect.insort(self._running, seq, key=_order)

    # ------------------------------------------------------------------------ fork, preempt, finish

    def _fork_pending(self, seq: Sequence) -> bool:
        return seq.index == 0 and not self._groups[seq.request_id].forked

    def _chunk(self, remaining: int, builder: PlanBuilder) -> int:
        """Tokens of a sequence's `remaining` to run this step: what the budget leaves, and for a prefill at most
        long_prefill_token_threshold and what the step's mixed prefill cap leaves (decodes are scheduled first;
        a decode's one token is never held back)."""
        num_new = min(remaining, builder.budget_left)
        if remaining > 1:
            if self.long_prefill_token_threshold:
                num_new = min(num_new, self.long_prefill_token_threshold)
            if (room := self._prefill_room(builder)) is not None:
                num_new = min(num_new, room)
        return num_new

    def _prefill_room(self, builder: PlanBuilder) -> int | None:
        """Prefill tokens this step may still take under mixed_prefill_token_cap; None when it does not apply."""
        if not self.mixed_prefill_token_cap or not 0 < builder.decodes <= self.mixed_prefill_max_decodes:
            return None
        prefill_tokens = self.max_num_batched_tokens - builder.budget_left - builder.decodes
        return max(0, self.mixed_prefill_token_cap - prefill_tokens)

    def _prefill_target(self, seq: Sequence) -> int:
        """How many tokens ``num_computed_tokens`` should catch up to."""
        # A parent about to fork stops one short so each child runs the last prompt token for its own logits.
        return seq.num_prompt_tokens - 1 if self._fork_pending(seq) else seq.num_tokens

    def _fork(self, parent: Sequence) -> None:
        group = self._groups[parent.request_id]
        group.forked = True
        self._reserved_slots -= group.n - 1
        for child in group.seqs[1:]:
            if child.is_finished:
                continue
            child.page_ids = self.allocator.fork(parent.page_ids)
            child.num_computed_tokens = parent.num_computed_tokens
            child.page_hashes = list(parent.page_hashes)  # same prompt, so the same hash chain
            child.num_cached_pages = parent.num_cached_pages
            child.status = SequenceStatus.RUNNING
            bisect.insort(self._running, child, key=_order)

    def _preempt(self, seq: Sequence, builder: PlanBuilder) -> None:
        builder.drop(seq)
        self._running.remove(seq)
        if self._fork_pending(seq):
            self._reserved_slots -= self._groups[seq.request_id].n - 1
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        self._push_waiting(seq)
        builder.preempted.append(seq.key)
        self._num_preemptions += 1

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        group = self._groups[seq.request_id]
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
            if self._fork_pending(seq):
                self._reserved_slots -= group.n - 1
        elif seq.status in _QUEUED and not self._is_unforked_child(seq):
            self._num_waiting -= 1  # its heap entry goes stale and is skipped by _peek_waiting
        if self._fork_pending(seq):
            group.forked = True  # the children will never fork: finish them with their parent
            for child in group.seqs[1:]:
                child.status, child.finish_reason = reason.status, reason
        self._release(seq)
        seq.status, seq.finish_reason = reason.status, reason
        if group.is_finished:
            del self._groups[seq.request_id]
            self._no_prefix_lookup.discard(seq.request_id)

    def _is_unforked_child(self, seq: Sequence) -> bool:
        return seq.index > 0 and not self._groups[seq.request_id].forked

    def _release(self, seq: Sequence) -> None:
        self.allocator.free(seq.page_ids)
        seq.page_ids = []
        seq.num_cached_pages = 0

    # -------------------------------------------------------------------------------------- update

    def _apply(self, seq: Sequence, entry: ScheduledSeq, sampled: Mapping[SeqKey, int]) -> None:
        if seq.status is not SequenceStatus.RUNNING or seq.num_computed_tokens != entry.start_pos:
            raise RuntimeError(
                f"plan entry for {entry.key} does not match the sequence (stale plan or update called twice)."
            )
        seq.num_computed_tokens = entry.kv_len
        if entry.sample:
            if entry.key not in sampled:
                raise KeyError(f"no sampled token for {entry.key}, which the plan marked as sampling.")
            if entry.num_draft:
                self._apply_verified(seq, entry, sampled[entry.key])
            else:
                seq.append_token(sampled[entry.key])
        if self.prefix_cache is not None:
            self.prefix_cache.register_computed(seq)
        if self._fork_pending(seq) and seq.num_computed_tokens == seq.num_prompt_tokens - 1:
            self._fork(seq)

    def _apply_verified(self, seq: Sequence, entry: ScheduledSeq, tokens: tuple[int, ...]) -> None:
        """A speculative row emitted ``tokens``: the proposals accepted before the last of them are now
        computed; the KV written for rejected proposals lies past ``num_computed_tokens``, so no step reads
        it, and the pages that hold nothing but such KV go back to the pool (rollback)."""
        if not 1 <= len(tokens) <= entry.num_draft + 1:
            raise ValueError(f"{entry.key}: {len(tokens)} tokens emitted for {entry.num_draft} proposals.")
        seq.num_computed_tokens = entry.start_pos + len(tokens)
        for token in tokens:
            seq.append_token(token)
        keep = pages_for_tokens(seq.num_computed_tokens + 1, self.page_size)  # room for the next token's KV
        if len(seq.page_ids) > keep:
            self.allocator.free(seq.page_ids[keep:])
            del seq.page_ids[keep:]

    def _at_length_limit(self, seq: Sequence) -> bool:
        if seq.num_tokens >= self.max_model_len:
            return True
        return seq.max_tokens is not None and seq.num_output_tokens >= seq.max_tokens

    def _live(self, key: SeqKey) -> Sequence | None:
        group = self._groups.get(key[0])
        if group is None or not 0 <= key[1] < group.n:
            return None
        seq = group.seqs[key[1]]
        return None if seq.is_finished else seq

    # -------------------------------------------------------------------------------------- waiting queue

    def _push_waiting(self, seq: Sequence) -> None:
        heapq.heappush(self._waiting, (seq.order_key, seq))
        self._num_waiting += 1

    def _peek_waiting(self) -> Sequence | None:
        while self._waiting:
            seq = self._waiting[0][1]
            if seq.status in _QUEUED:
                return seq
            heapq.heappop(self._waiting)  # finished (aborted) while queued
        return None
