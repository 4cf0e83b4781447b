"""A step's plan: which tokens of which sequences run, the copy-on-write page copies before them, and the
sequences preempted to make room. `jaxinfer.engine.scheduler` builds it (`PlanBuilder`), the batcher runs it, and
the engine reports what it sampled back through `Scheduler.update`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from jaxinfer.engine.page_table import PageCopy
from jaxinfer.engine.sequence import SeqKey, Sequence


class ScheduledSeq(NamedTuple):
    """One sequence's share of a step (a NamedTuple: immutable and cheap to build hundreds of per step).

    key:        (request_id, seq index).
    token_ids:  the new tokens to run this step; their KV is written at positions start_pos .. kv_len - 1.
    start_pos:  absolute position of token_ids[0] (= tokens already in the cache for this sequence).
    page_ids:   the sequence's page table after this step's growth; covers kv_len positions (len ==
                ceil(kv_len / page_size)), or more where pages were reserved ahead for multi-step decode;
                never contains the trash page 0. Pad with 0 to width M.
    kv_len:     total KV length after the step (start_pos + len(token_ids)); ARCHITECTURE.md's kv_lens[s].
    sample:     whether the logits of the last new token are sampled into a token for this sequence
                (true for decodes and for the chunk that reaches the end of prompt + recomputed output).
    num_draft:  speculative proposals appended to a decode (the engine's speculator adds them): token_ids is
                the last token then num_draft proposals, and ``update`` takes the tokens the step emitted
                (accepted proposals, then one more) and rolls back the KV of the rejected ones.
    """

    key: SeqKey
    token_ids: tuple[int, ...]
    start_pos: int
    page_ids: tuple[int, ...]
    kv_len: int
    sample: bool
    num_draft: int = 0

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What the batcher runs in one step, and what the engine reports back through ``Scheduler.update``.

    seqs:               scheduled sequences: decodes first, then prefill chunks, then newly admitted requests.
    page_copies:        copy-on-write (src, dst) page copies; the device applies them before writing any KV of
                        this step (either in list order or all reads before all writes: both are correct).
    preempted:          keys preempted by recompute this step; their earlier KV is gone and they are queued.
    num_batched_tokens: sum of len(token_ids); never above max_num_batched_tokens.
    """

    seqs: tuple[ScheduledSeq, ...]
    page_copies: tuple[PageCopy, ...]
    preempted: tuple[SeqKey, ...]
    num_batched_tokens: int

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass(slots=True)
class _Chunk:
    num_new: int
    copies: list[PageCopy]
    decode: bool


@dataclass(slots=True)
class PlanBuilder:
    """Collects one step's chunks; a chunk can be withdrawn when its sequence is preempted later in the step."""

    budget_left: int
    chunks: dict[Sequence, _Chunk] = field(default_factory=dict)  # insertion order is plan order
    preempted: list[SeqKey] = field(default_factory=list)
    decodes: int = 0  # decoding rows (one token each): each waits for the whole step, prefill chunks included

    def __contains__(self, seq: Sequence) -> bool:
        return seq in self.chunks

    def add(self, seq: Sequence, num_new: int, copies: list[PageCopy], decode: bool = False) -> None:
        self.chunks[seq] = _Chunk(num_new, copies, decode)
        self.budget_left -= num_new
        self.decodes += decode

    def drop(self, seq: Sequence) -> None:
        chunk = self.chunks.pop(seq, None)
        if chunk is not None:
            self.budget_left += chunk.num_new
            self.decodes -= chunk.decode

    def build(self) -> StepPlan:
        seqs: list[ScheduledSeq] = []
        copies: list[PageCopy] = []
        for seq, chunk in self.chunks.items():
            start = seq.num_computed_tokens
            end = start + chunk.num_new
            seqs.append(
                ScheduledSeq(
                    key=seq.key,
                    token_ids=tuple(seq.token_ids[start:end]),
                    start_pos=start,
                    page_ids=tuple(seq.page_ids),
                    kv_len=end,
                    sample=end == seq.num_tokens,
                )
            )
            copies.extend(chunk.copies)
        total = sum(c.num_new for c in self.chunks.values())
        return StepPlan(tuple(seqs), tuple(copies), tuple(self.preempted), total)
