"""Page allocator: refcounts, exhaustion, the reserved trash page, copy-on-write, cached-page LRU."""

from __future__ import annotations

import pytest

from jaxinfer.engine.page_table import (
    TRASH_PAGE,
    OutOfPages,
    PageAllocator,
    PageCopy,
    kv_bytes_per_page,
    pages_for_memory,
    pages_for_tokens,
    reserve_slots,
)


def test_allocates_every_page_but_the_trash_page_then_runs_out() -> None:
    alloc = PageAllocator(num_pages=5, page_size=4)
    pages = alloc.allocate(4)
    assert sorted(pages) == [1, 2, 3, 4]
    assert TRASH_PAGE not in pages
    assert alloc.num_free == 0
    with pytest.raises(OutOfPages):
        alloc.allocate(1)
    alloc.free(pages)
    assert alloc.num_free == alloc.num_total == 4


def test_failed_allocation_changes_nothing() -> None:
    alloc = PageAllocator(num_pages=4, page_size=2)
    alloc.allocate(2)
    with pytest.raises(OutOfPages):
        alloc.allocate(2)
    assert alloc.num_free == 1
    assert len(alloc.allocate(1)) == 1


def test_refcounts_keep_shared_pages_until_last_free() -> None:
    alloc = PageAllocator(num_pages=3, page_size=2)
    (page,) = alloc.allocate(1)
    alloc.incref([page])
    assert alloc.refcount(page) == 2
    alloc.free([page])
    assert alloc.refcount(page) == 1 and alloc.num_free == 1
    alloc.free([page])
    assert alloc.refcount(page) == 0 and alloc.num_free == 2


def test_double_free_and_sharing_a_free_page_are_errors() -> None:
    alloc = PageAllocator(num_pages=3, page_size=2)
    (page,) = alloc.allocate(1)
    alloc.free([page])
    with pytest.raises(ValueError, match="double free"):
        alloc.free([page])
    with pytest.raises(ValueError, match="free"):
        alloc.incref([page])
    with pytest.raises(ValueError):
        alloc.free([TRASH_PAGE])


def test_cached_pages_count_as_free_and_are_evicted_lru_after_truly_free_ones() -> None:
    evicted: list[int] = []
    alloc = PageAllocator(num_pages=5, page_size=2, on_evict=evicted.append)
    a, b, c = alloc.allocate(3)
    for page in (b, a, c):
        alloc.mark_cached(page)
    alloc.free([b])
    alloc.free([a])
    alloc.free([c])  # LRU order of the cached pages is now b, a, c
    assert alloc.num_free == 4 and alloc.num_evictable == 3
    (fresh,) = alloc.allocate(1)
    assert fresh not in (a, b, c) and evicted == []  # the truly free page goes first
    assert alloc.allocate(2) == [b, a]
    assert evicted == [b, a]
    assert not alloc.is_cached(b) and alloc.is_cached(c)


def test_incref_revives_a_cached_page_out_of_the_lru() -> None:
    alloc = PageAllocator(num_pages=3, page_size=2)
    a, b = alloc.allocate(2)
    alloc.mark_cached(a)
    alloc.free([a, b])
    alloc.incref([a])
    assert alloc.refcount(a) == 1 and alloc.num_free == 1
    assert alloc.allocate(1) == [b]
    with pytest.raises(OutOfPages):
        alloc.allocate(1)


def test_reserve_slots_grows_to_cover_new_tokens() -> None:
    alloc = PageAllocator(num_pages=10, page_size=4)
    pages: list[int] = []
    assert reserve_slots(alloc, pages, 0, 5) == []
    assert len(pages) == 2
    reserve_slots(alloc, pages, 5, 3)  # fills page 2 exactly
    assert len(pages) == 2
    reserve_slots(alloc, pages, 8, 1)
    assert len(pages) == 3


def test_reserve_slots_uses_pages_reserved_ahead_first() -> None:
    alloc = PageAllocator(num_pages=10, page_size=4)
    pages: list[int] = []
    reserve_slots(alloc, pages, 0, 3)
    pages.extend(alloc.allocate(2))  # reserved ahead for multi-step decode: 12 positions in all
    free = alloc.num_free
    assert reserve_slots(alloc, pages, 3, 9) == [] and len(pages) == 3 and alloc.num_free == free
    reserve_slots(alloc, pages, 12, 1)  # past them: grows as usual
    assert len(pages) == 4 and alloc.num_free == free - 1
    with pytest.raises(ValueError, match="2 pages for 9 computed tokens"):
        reserve_slots(alloc, pages[:2], 9, 1)  # too few pages for what is computed is still an error


def test_copy_on_write_replaces_the_page_written_not_the_last_one() -> None:
    alloc = PageAllocator(num_pages=10, page_size=4)
    parent: list[int] = []
    reserve_slots(alloc, parent, 0, 6)
    child = alloc.fork(parent)
    ahead = alloc.allocate(1)[0]
    child.append(ahead)  # a page beyond the shared partial one
    copies = reserve_slots(alloc, child, 6, 1)
    assert copies == [PageCopy(src=parent[1], dst=child[1])] and child[2] == ahead and child[0] == parent[0]


def test_reserve_slots_is_all_or_nothing() -> None:
    alloc = PageAllocator(num_pages=3, page_size=4)
    pages: list[int] = []
    with pytest.raises(OutOfPages):
        reserve_slots(alloc, pages, 0, 9)
    assert pages == [] and alloc.num_free == 2


def test_fork_shares_full_pages_and_copies_the_partial_last_page_on_write() -> None:
    alloc = PageAllocator(num_pages=10, page_size=4)
    parent: list[int] = []
    reserve_slots(alloc, parent, 0, 6)  # one full page, one page holding 2 of 4 tokens
    child = alloc.fork(parent)
    assert child == parent and all(alloc.refcount(p) == 2 for p in parent)

    copies = reserve_slots(alloc, child, 6, 1)
    assert copies == [PageCopy(src=parent[1], dst=child[1])]
    assert child[0] == parent[0] and child[1] != parent[1]
    assert alloc.refcount(parent[0]) == 2 and alloc.refcount(parent[1]) == 1
    # The parent is the last holder of its partial page: it writes in place, no copy.
    assert reserve_slots(alloc, parent, 6, 1) == []
    alloc.free(parent)
    alloc.free(child)
    assert alloc.num_free == alloc.num_total


def test_fork_at_a_page_boundary_needs_no_copy() -> None:
    alloc = PageAllocator(num_pages=10, page_size=4)
    parent: list[int] = []
    reserve_slots(alloc, parent, 0, 8)
    child = alloc.fork(parent)
    assert reserve_slots(alloc, child, 8, 1) == []
    assert child[:2] == parent and len(child) == 3


def test_sizing_helpers() -> None:
    assert pages_for_tokens(0, 16) == 0
    assert pages_for_tokens(16, 16) == 1
    assert pages_for_tokens(17, 16) == 2
    per_page = kv_bytes_per_page(num_layers=2, page_size=16, num_kv_heads=4, head_dim=8, dtype_bytes=2)
    assert per_page == 2 * 2 * 16 * 4 * 8 * 2
    assert pages_for_memory(10 * per_page + 5, per_page) == 10
    with pytest.raises(ValueError, match="at least 2"):
        pages_for_memory(per_page, per_page)
    with pytest.raises(ValueError):
        pages_for_memory(100, 0)
