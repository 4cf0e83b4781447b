"""Host-side records of sequences and requests (pure Python, no JAX).

A request (``SequenceGroup``) owns ``n`` sequences that share one prompt. Each ``Sequence`` carries its tokens,
how many of them already have KV in the paged cache (``num_computed_tokens``), and the pages holding that KV.
The scheduler mutates these records; the engine reads ``output_token_ids`` and ``status`` from them.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Sequence as SequenceLike
from dataclasses import dataclass, field

# (request_id, index of the sequence within its request); index > 0 only for n > 1.
SeqKey = tuple[str, int]


class FinishReason(enum.Enum):
    """Why a sequence stopped; the values are the OpenAI-style strings shown to users."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"

    @property
    def status(self) -> SequenceStatus:
        return _FINISHED_STATUS[self]


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()  # never ran, or a child of an n > 1 request waiting for its parent's prefill
    RUNNING = enum.auto()  # holds pages and is scheduled every step the budget allows
    PREEMPTED = enum.auto()  # pages were taken back; recomputes prompt + output when readmitted
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED}
)
_FINISHED_STATUS = {
    FinishReason.STOP: SequenceStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: SequenceStatus.FINISHED_LENGTH,
    FinishReason.ABORT: SequenceStatus.FINISHED_ABORTED,
}

# Breaks ties between requests that arrive within the clock's resolution, so FCFS order is exact.
_arrival_counter = itertools.count()


@dataclass(slots=True, eq=False)
class Sequence:
    """One generated continuation of a prompt.

    ``token_ids`` holds the prompt followed by the outputs, so a preempted sequence can recompute its whole
    history as one prefill. Identity equality (``eq=False``) lets sequences be dict keys.
    """

    request_id: str
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    priority: int = 0  # lower is more urgent (vLLM convention)
    arrival_time: float = 0.0
    arrival_order: int = 0  # tie-break for equal arrival times
    max_tokens: int | None = None  # output cap; the scheduler needs it to bound the pages a request can use
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0  # leading tokens whose KV is in the cache
    page_ids: list[int] = field(default_factory=list)  # page table: page i holds positions [i*R, (i+1)*R)
    page_hashes: list[bytes] = field(default_factory=list)  # prefix-cache hash chain of the full pages so far
    num_cached_pages: int = 0  # leading pages already hit in or registered with the prefix cache

    @property
    def key(self) -> SeqKey:
        return (self.request_id, self.index)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def order_key(self) -> tuple[int, float, int, int]:
        """Scheduling order: most urgent first, then earliest arrival, then sequence index."""
        return (self.priority, self.arrival_time, self.arrival_order, self.index)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(int(token_id))


@dataclass(slots=True, eq=False)
class SequenceGroup:
    """A request: ``n`` sequences sampled from one prompt.

    With n > 1 only sequence 0 is queued; the others are forked from it once the prompt (all but its last
    token) is in the cache, so they share the prompt's pages. ``forked`` is True once that happened (and from
    the start when n == 1).
    """

    request_id: str
    seqs: list[Sequence]
    forked: bool

    @classmethod
    def create(
        cls,
        request_id: str,
        prompt_token_ids: SequenceLike[int],
        *,
        n: int = 1,
        priority: int = 0,
        max_tokens: int | None = None,
        arrival_time: float | None = None,
    ) -> SequenceGroup:
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}.")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        order = next(_arrival_counter)
        prompt = [int(t) for t in prompt_token_ids]
        seqs = [
            Sequence(
                request_id=request_id,
                index=i,
                token_ids=list(prompt),
                num_prompt_tokens=len(prompt),
                priority=priority,
                arrival_time=arrival,
                arrival_order=order,
                max_tokens=max_tokens,
            )
            for i in range(n)
        ]
        return cls(request_id=request_id, seqs=seqs, forked=n == 1)

    @property
    def n(self) -> int:
        return len(self.seqs)

    @property
    def parent(self) -> Sequence:
        return self.seqs[0]

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
