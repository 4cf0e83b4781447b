"""Hash-chained prefix caching of full KV pages (pure Python + NumPy, no JAX).

A full page is identified by ``hash(parent_hash, page tokens)``, so equal hashes mean equal token histories from
position 0: the KV of such a page is identical whichever sequence computed it, and a new sequence can start with
it instead of recomputing. Only full pages are cached because partial pages are still being written.

Pages stay in the cache after their last user frees them (the allocator parks them in an LRU) and are evicted
only when the allocator runs out of truly free pages. The hash is blake2b over int32 token bytes: stable across
processes, unlike Python's salted ``hash()``, and 128 bits make collisions negligible.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence as SequenceLike

import numpy as np

from jaxinfer.engine.page_table import PageAllocator
from jaxinfer.engine.sequence import Sequence

ROOT_HASH = b""


def hash_page(parent_hash: bytes, tokens: SequenceLike[int]) -> bytes:
    """Hash of a full page given the hash of the page before it (``ROOT_HASH`` for the first page)."""
    h = hashlib.blake2b(parent_hash, digest_size=16)
    h.update(np.asarray(tokens, dtype=np.int32).tobytes())
    return h.digest()


def extend_page_hashes(seq: Sequence, num_pages: int, page_size: int) -> list[bytes]:
    """Make ``seq.page_hashes`` cover its first ``num_pages`` full pages (computed once, then reused)."""
    hashes = seq.page_hashes
    for i in range(len(hashes), num_pages):
        parent = hashes[-1] if hashes else ROOT_HASH
        hashes.append(hash_page(parent, seq.token_ids[i * page_size : (i + 1) * page_size]))
    return hashes


class PrefixCache:
    """Maps page hashes to pages whose KV is in the cache, and counts hits."""

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self._page_by_hash: dict[bytes, int] = {}
        self._hash_by_page: dict[int, bytes] = {}
        self.queried_tokens = 0
        self.hit_tokens = 0
        allocator.on_evict = self._forget

    @property
    def num_cached_pages(self) -> int:
        return len(self._page_by_hash)

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the cache / prompt tokens looked up."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def lookup(self, seq: Sequence) -> list[int]:
        """Pages of the longest cached prefix of ``seq``'s tokens, in whole pages.

        Never covers the last token: it must run through the model to produce logits to sample from.
        The caller takes references (``allocator.incref``) before allocating anything else.
        """
        max_pages = (seq.num_tokens - 1) // self.page_size
        hashes = extend_page_hashes(seq, max_pages, self.page_size)
        pages: list[int] = []
        for page_hash in hashes[:max_pages]:
            page = self._page_by_hash.get(page_hash)
            if page is None:
                break
            pages.append(page)
        return pages

    def record_query(self, num_queried: int, num_hit: int) -> None:
        self.queried_tokens += num_queried
        self.hit_tokens += num_hit

    def register_computed(self, seq: Sequence) -> None:
        """Cache the full pages of ``seq`` whose KV is now computed and not yet registered."""
        num_full = seq.num_computed_tokens // self.page_size
        if num_full <= seq.num_cached_pages:
            return
        hashes = extend_page_hashes(seq, num_full, self.page_size)
        for i in range(seq.num_cached_pages, num_full):
            self._register(hashes[i], seq.page_ids[i])
        seq.num_cached_pages = num_full

    def _register(self, page_hash: bytes, page: int) -> None:
        # Another sequence may have computed the same content into a different page in the meantime; the first
        # one stays cached and this page remains private (freed normally).
        if page_hash in self._page_by_hash or page in self._hash_by_page:
            return
        self._page_by_hash[page_hash] = page
        self._hash_by_page[page] = page_hash
        self.allocator.mark_cached(page)

    def clear(self) -> None:
        """Forget every cached page (their KV is gone); unreferenced ones become truly free."""
        for page in list(self._hash_by_page):
            self.allocator.uncache(page)
        self._page_by_hash.clear()
        self._hash_by_page.clear()

    def _forget(self, page: int) -> None:
        page_hash = self._hash_by_page.pop(page)
        del self._page_by_hash[page_hash]
