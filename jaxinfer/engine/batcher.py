"""Pack a step's sequences into bucketed, static-shape device inputs (pure NumPy, no JAX tracing).

Buckets: the token count T and sequence count S are rounded up to powers of two (with floors), the page
table width M is fixed per engine. So one jitted step serves every batch from a small finite set of shapes:
log2(max_tokens) x log2(max_seqs) at most.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxinfer.engine.runner import StepBatch
from jaxinfer.models.common import AttentionMetadata

MIN_TOKEN_BUCKET = 16  # below this, padding costs less than another compiled shape


def pow2_ceil(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def bucket(n: int, floor: int, cap: int | None = None) -> int:
    """Smallest power of two >= max(n, floor), clipped to `cap` (itself a valid bucket)."""
    b = max(floor, pow2_ceil(n))
    return min(b, cap) if cap is not None else b


def buckets_up_to(cap: int, floor: int) -> list[int]:
    out, b = [], floor
    while b < cap:
        out.append(b)
        b *= 2
    return out + [cap]


@dataclasses.dataclass(frozen=True)
class SeqChunk:
    """One sequence's share of a step: new tokens at positions start_pos... and its page table."""

    token_ids: Sequence[int]
    start_pos: int
    pages: Sequence[int]


@dataclasses.dataclass(frozen=True)
class BatchShape:
    tokens: int  # T
    seqs: int  # S
    pages_per_seq: int  # M


def pack(chunks: Sequence[SeqChunk], shape: BatchShape, page_size: int) -> StepBatch:
    """Host-side StepBatch (NumPy leaves) for `chunks`, padded to `shape`."""
    t_real = sum(len(c.token_ids) for c in chunks)
    if t_real > shape.tokens or len(chunks) > shape.seqs:
        raise ValueError(
            f"batch of {t_real} tokens / {len(chunks)} sequences exceeds bucket {shape.tokens}/{shape.seqs}."
        )
    token_ids = np.zeros(shape.tokens, np.int32)
    positions = np.zeros(shape.tokens, np.int32)
    slots = np.arange(shape.tokens, dtype=np.int32) % page_size  # padding writes land in trash page 0
    cu_q_lens = np.zeros(shape.seqs + 1, np.int32)
    kv_lens = np.zeros(shape.seqs, np.int32)
    page_indices = np.zeros((shape.seqs, shape.pages_per_seq), np.int32)
    logits_indices = np.zeros(shape.seqs, np.int32)
    offset = 0
    for s, c in enumerate(chunks):
        n = len(c.token_ids)
        pos = np.arange(c.start_pos, c.start_pos + n, dtype=np.int32)
        pages = np.asarray(c.pages, np.int32)
        token_ids[offset : offset + n] = c.token_ids
        positions[offset : offset + n] = pos
        slots[offset : offset + n] = pages[pos // page_size] * page_size + pos % page_size
        page_indices[s, : len(pages)] = pages
        kv_lens[s] = c.start_pos + n
        offset += n
        cu_q_lens[s + 1] = offset
        logits_indices[s] = offset - 1
    cu_q_lens[len(chunks) + 1 :] = offset
    md = AttentionMetadata(
        positions=positions,
        slot_mapping=slots,
        cu_q_lens=cu_q_lens,
        kv_lens=kv_lens,
        page_indices=page_indices,
        num_seqs=np.array([len(chunks)], np.int32),
    )
    return StepBatch(token_ids=token_ids, md=md, logits_indices=logits_indices)
