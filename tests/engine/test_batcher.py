"""`pack` (whole-array NumPy) against a row-by-row reference, on random prefill/decode mixes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxinfer.engine.batcher import BatchShape, SeqChunk, pack


def _reference(chunks: list[SeqChunk], shape: BatchShape, page_size: int) -> dict[str, np.ndarray]:
    """The step's arrays written one row and one token at a time."""
    out = {
        "token_ids": np.zeros(shape.tokens, np.int32), "positions": np.zeros(shape.tokens, np.int32),
        "slot_mapping": np.arange(shape.tokens, dtype=np.int32) % page_size,
        "cu_q_lens": np.zeros(shape.seqs + 1, np.int32), "kv_lens": np.zeros(shape.seqs, np.int32),
        "page_indices": np.zeros((shape.seqs, shape.pages_per_seq), np.int32),
        "logits_indices": np.zeros(shape.seqs, np.int32), "num_seqs": np.array([len(chunks)], np.int32),
    }
    t = 0
    for s, c in enumerate(chunks):
        for j, token in enumerate(c.token_ids):
            pos = c.start_pos + j
            out["token_ids"][t], out["positions"][t] = token, pos
            out["slot_mapping"][t] = c.pages[pos // page_size] * page_size + pos % page_size
            t += 1
        out["page_indices"][s, : len(c.pages)] = c.pages
        out["kv_lens"][s] = c.start_pos + len(c.token_ids)
        out["cu_q_lens"][s + 1] = t
        out["logits_indices"][s] = t - 1
    out["cu_q_lens"][len(chunks) + 1 :] = t
    return out


def _random_chunks(rng: np.random.Generator, shape: BatchShape, page_size: int) -> list[SeqChunk]:
    chunks, budget = [], shape.tokens
    for _ in range(int(rng.integers(0, shape.seqs + 1))):
        n = int(rng.integers(1, 4)) if rng.random() < 0.7 else int(rng.integers(1, max(2, budget)))
        n = min(n, shape.pages_per_seq * page_size)
        if n > budget:
            break
        start = int(rng.integers(0, shape.pages_per_seq * page_size - n + 1))
        num_pages = -(-(start + n) // page_size) + int(rng.integers(0, 2))
        num_pages = min(num_pages, shape.pages_per_seq)
        pages = rng.integers(1, 1000, num_pages).tolist()
        chunks.append(SeqChunk(rng.integers(0, 5000, n).tolist(), start, pages))
        budget -= n
    return chunks


def test_pack_equals_row_by_row() -> None:
    rng = np.random.default_rng()
    for _ in range(200):
        shape = BatchShape(tokens=int(rng.choice([16, 64])), seqs=int(rng.choice([1, 4, 16])),
                           pages_per_seq=int(rng.integers(2, 9)))
        chunks = _random_chunks(rng, shape, page_size=4)
        batch = pack(chunks, shape, 4)
        got = {"token_ids": batch.token_ids, "logits_indices": batch.logits_indices,
               **{f.name: getattr(batch.md, f.name) for f in dataclasses.fields(batch.md)}}
        want = _reference(chunks, shape, 4)
        assert got.keys() == want.keys()
        for name, value in want.items():
            assert got[name].dtype == np.int32 and got[name].shape == value.shape, name
            np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_pack_refuses_what_does_not_fit() -> None:
    shape = BatchShape(tokens=16, seqs=2, pages_per_seq=2)
    with pytest.raises(ValueError, match="exceeds bucket"):
        pack([SeqChunk([1] * 17, 0, [1, 2])], shape, 16)
    with pytest.raises(ValueError, match="3 pages; the bucket holds 2"):
        pack([SeqChunk([1], 0, [1, 2, 3])], shape, 16)
    with pytest.raises(ValueError, match="sequence 1 writes past its 1 pages"):
        pack([SeqChunk([1], 0, [1]), SeqChunk([1, 2], 3, [4])], shape, 4)
