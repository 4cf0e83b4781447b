"""Paged KV memory on the host: a reference-counted page allocator and per-sequence page tables (no JAX).

A sequence's page table is a plain ``list[int]``: page ``i`` holds token positions ``[i*R, (i+1)*R)``. Pages are
shared by reference count (prefix-cache hits, n > 1 forks). Only the page that receives a sequence's next token
is ever written, so sharing is safe as long as that page is exclusively owned; ``reserve_slots`` guarantees this
with copy-on-write and returns the copies the device must perform before it writes.

Page 0 is the trash page (see docs/ARCHITECTURE.md): padding writes land there, so it is never allocated.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import NamedTuple

TRASH_PAGE = 0


class OutOfPages(RuntimeError):
    """Not enough free (or evictable) pages; the caller preempts or waits."""


class PageCopy(NamedTuple):
    """Copy page ``src`` onto page ``dst`` (all layers, K and V) before the step writes any new KV."""

    src: int
    dst: int


def pages_for_tokens(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold ``num_tokens`` positions."""
    return -(-num_tokens // page_size)


def kv_bytes_per_page(
    *, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype_bytes: int
) -> int:
    """Bytes of one page across the whole cache: K and V, every layer ([L, R, K, H] twice)."""
    return 2 * num_layers * page_size * num_kv_heads * head_dim * dtype_bytes


def pages_for_memory(bytes_available: int, bytes_per_page: int) -> int:
    """``num_pages`` (trash page included) that fit in ``bytes_available``.

    Callers derive ``bytes_available`` from a memory fraction of the device minus weights and activations.
    """
    if bytes_per_page <= 0:
        raise ValueError(f"bytes_per_page must be positive, got {bytes_per_page}.")
    num_pages = int(bytes_available) // int(bytes_per_page)
    if num_pages < 2:
        raise ValueError(
            f"{bytes_available} bytes hold {num_pages} KV pages of {bytes_per_page} bytes; at least 2 are needed "
            "(page 0 is reserved): lower the model size or page size, or raise the memory fraction."
        )
    return num_pages


class PageAllocator:
    """Reference-counted pages ``1 .. num_pages - 1``.

    A page whose refcount drops to 0 is either truly free or, if the prefix cache registered its content
    (``mark_cached``), parked in an LRU of evictable pages: it can still be revived by a cache hit (``incref``),
    and ``allocate`` takes it only when no truly free page is left, calling ``on_evict`` so the cache forgets it.
    ``num_free`` counts both kinds, because both can be handed out.
    """

    def __init__(self, num_pages: int, page_size: int, on_evict: Callable[[int], None] | None = None) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is the reserved trash page), got {num_pages}.")
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {page_size}.")
        self.num_pages = num_pages
        self.page_size = page_size
        self.on_evict = on_evict
        # Plain lists: the scheduler touches single pages, where list indexing beats NumPy scalar access.
        self._refcounts = [0] * num_pages
        self._cached = [False] * num_pages
        self._free: collections.deque[int] = collections.deque(range(1, num_pages))
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest first

    @property
    def num_total(self) -> int:
        """Allocatable pages (all but the trash page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages ``allocate`` can hand out: truly free plus cached-but-unreferenced."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def refcount(self, page: int) -> int:
        return self._refcounts[page]

    def is_cached(self, page: int) -> bool:
        return self._cached[page]

    def allocate(self, num: int = 1) -> list[int]:
        """``num`` fresh pages with refcount 1; raises ``OutOfPages`` (changing nothing) if too few are free."""
        if num > self.num_free:
            raise OutOfPages(f"need {num} pages, {self.num_free} free")
        pages = [self._take_one() for _ in range(num)]
        for page in pages:
            self._refcounts[page] = 1
        return pages

    def _take_one(self) -> int:
        if self._free:
            return self._free.popleft()
        page, _ = self._evictable.popitem(last=False)  # least recently used
        self._cached[page] = False
        if self.on_evict is not None:
            self.on_evict(page)
        return page

    def incref(self, pages: Iterable[int]) -> None:
        """Add a reference to each page; a cached page with refcount 0 leaves the evictable LRU."""
        for page in pages:
            if self._refcounts[page] == 0:
                if page not in self._evictable:
                    raise ValueError(f"page {page} is free; only allocated or cached pages can be shared")
                del self._evictable[page]
            self._refcounts[page] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference to each page; at refcount 0 the page becomes evictable (if cached) or free."""
        for page in pages:
            if page == TRASH_PAGE or self._refcounts[page] <= 0:
                raise ValueError(f"page {page} is not allocated (double free?)")
            self._refcounts[page] -= 1
            if self._refcounts[page] == 0:
                if self._cached[page]:
                    self._evictable[page] = None  # most recently used end
                else:
                    self._free.append(page)

    def mark_cached(self, page: int) -> None:
        """The prefix cache now maps a hash to this page, so keep its content when it is freed."""
        if self._refcounts[page] <= 0:
            raise ValueError(f"page {page} is not allocated; only live pages can be cached")
        self._cached[page] = True

    def uncache(self, page: int) -> None:
        """The page's content is no longer valid: keep it if referenced, else it becomes truly free."""
        self._cached[page] = False
        if page in self._evictable:
            del self._evictable[page]
            self._free.append(page)

    def fork(self, pages: list[int]) -> list[int]:
        """A page table for a new sequence sharing all of ``pages`` (copy-on-write happens in reserve_slots)."""
        self.incref(pages)
        return list(pages)


def cow_page_needed(allocator: PageAllocator, pages: list[int], num_computed: int) -> bool:
    """True when the next write lands in a partially filled page that another sequence also references."""
    offset = num_computed % allocator.page_size
    return offset != 0 and allocator.refcount(pages[num_computed // allocator.page_size]) > 1


def reserve_slots(allocator: PageAllocator, pages: list[int], num_computed: int, num_new: int) -> list[PageCopy]:
    """Grow ``pages`` in place so positions ``num_computed .. num_computed + num_new - 1`` can be written.

    ``pages`` may already hold pages past ``num_computed`` (reserved ahead for multi-step decode); they are
    used before new ones are taken. If the partially filled page that receives the first new token is shared
    (after a fork), this sequence gets a private copy of it and the returned ``PageCopy`` tells the device to
    copy before writing. All or nothing: raises ``OutOfPages`` without changing anything if the pages are not
    available.
    """
    if num_new <= 0:
        return []
    page_size = allocator.page_size
    if len(pages) < pages_for_tokens(num_computed, page_size):
        raise ValueError(f"page table has {len(pages)} pages for {num_computed} computed tokens")
    cow = cow_page_needed(allocator, pages, num_computed)
    num_grow = max(0, pages_for_tokens(num_computed + num_new, page_size) - len(pages))
    if num_grow == 0 and not cow:
        return []  # the common decode case: room left in a private last page
    new_pages = allocator.allocate(num_grow + int(cow))
    copies: list[PageCopy] = []
    if cow:
        index = num_computed // page_size  # the partially filled page the first new token lands in
        dst = new_pages.pop()
        src = pages[index]
        copies.append(PageCopy(src, dst))
        pages[index] = dst
        allocator.free([src])  # the other sharers keep it
    pages.extend(new_pages)
    return copies
