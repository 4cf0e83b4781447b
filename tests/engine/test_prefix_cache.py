"""Prefix cache: stable chained hashes, longest whole-page prefix lookup, LRU eviction, hit statistics."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numpy as np

from jaxinfer.engine.page_table import PageAllocator, reserve_slots
from jaxinfer.engine.prefix_cache import ROOT_HASH, PrefixCache, hash_page
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.sequence import SequenceGroup

PAGE = 4


def _seq(tokens: list[int], request_id: str = "r"):
    return SequenceGroup.create(request_id, tokens).parent


def _computed(cache: PrefixCache, tokens: list[int], request_id: str = "r"):
    """A sequence whose KV for all ``tokens`` is computed and registered with the cache."""
    seq = _seq(tokens, request_id)
    reserve_slots(cache.allocator, seq.page_ids, 0, len(tokens))
    seq.num_computed_tokens = len(tokens)
    cache.register_computed(seq)
    return seq


def test_hash_is_chained_and_matches_blake2b_over_int32() -> None:
    tokens = [1, 2, 3, 4]
    expected = hashlib.blake2b(ROOT_HASH, digest_size=16)
    expected.update(np.asarray(tokens, np.int32).tobytes())
    assert hash_page(ROOT_HASH, tokens) == expected.digest()
    first_a, first_b = hash_page(ROOT_HASH, [9, 9, 9, 9]), hash_page(ROOT_HASH, [8, 8, 8, 8])
    assert hash_page(first_a, tokens) != hash_page(first_b, tokens)  # same page tokens, different history


def test_hash_does_not_depend_on_python_hash_seed() -> None:
    code = "from jaxinfer.engine.prefix_cache import hash_page; print(hash_page(b'', [5, 6, 7]).hex())"
    digests = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(digests) == 1


def test_lookup_finds_longest_whole_page_prefix() -> None:
    cache = PrefixCache(PageAllocator(num_pages=20, page_size=PAGE))
    owner = _computed(cache, list(range(10)))  # pages [0..3], [4..7] full; [8, 9] partial, not cached
    assert cache.num_cached_pages == 2
    assert cache.lookup(_seq(list(range(10)) + [42])) == owner.page_ids[:2]
    assert cache.lookup(_seq([0, 1, 2, 3, 4, 5, 9, 9, 9])) == owner.page_ids[:1]
    assert cache.lookup(_seq([7, 1, 2, 3, 4, 5, 6, 7, 8])) == []


def test_lookup_never_covers_the_last_token() -> None:
    cache = PrefixCache(PageAllocator(num_pages=20, page_size=PAGE))
    owner = _computed(cache, list(range(8)))
    assert cache.lookup(_seq(list(range(8)))) == owner.page_ids[:1]  # 8 tokens = 2 pages; reuse only 1
    assert cache.lookup(_seq(list(range(9)))) == owner.page_ids[:2]


def test_unreferenced_pages_stay_cached_and_are_evicted_lru() -> None:
    alloc = PageAllocator(num_pages=4, page_size=PAGE)  # 3 usable pages
    cache = PrefixCache(alloc)
    older = _computed(cache, [1] * PAGE, "old")
    newer = _computed(cache, [2] * PAGE, "new")
    alloc.free(older.page_ids)
    alloc.free(newer.page_ids)
    assert alloc.num_free == 3 and cache.num_cached_pages == 2
    assert cache.lookup(_seq([1] * PAGE + [0])) == older.page_ids  # still a hit after its owner left

    alloc.allocate(2)  # one truly free page, then the least recently freed cached page
    assert cache.num_cached_pages == 1
    assert cache.lookup(_seq([1] * PAGE + [0])) == []
    assert cache.lookup(_seq([2] * PAGE + [0])) == newer.page_ids


def test_duplicate_content_keeps_the_first_page() -> None:
    alloc = PageAllocator(num_pages=10, page_size=PAGE)
    cache = PrefixCache(alloc)
    first = _computed(cache, [3] * PAGE, "a")
    second = _computed(cache, [3] * PAGE, "b")
    assert cache.num_cached_pages == 1
    assert cache.lookup(_seq([3] * PAGE + [1])) == first.page_ids
    alloc.free(second.page_ids)
    assert not alloc.is_cached(second.page_ids[0]) and alloc.num_evictable == 0


def _run_to_completion(sched: Scheduler, groups: list[SequenceGroup]) -> None:
    for group in groups:
        sched.add(group)
    while sched.has_unfinished():
        plan = sched.schedule()
        sched.update(plan, {e.key: 1 for e in plan.seqs if e.sample})


def test_repeated_prompt_hits_and_pages_are_free_at_the_end() -> None:
    sched = Scheduler(num_pages=32, page_size=PAGE, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    prompt = list(range(100, 118))  # 18 tokens: 4 full pages
    _run_to_completion(sched, [SequenceGroup.create("a", prompt, max_tokens=2)])
    assert sched.stats()["prefix_cache_hit_rate"] == 0.0
    second = SequenceGroup.create("b", prompt, max_tokens=2)
    sched.add(second)
    plan = sched.schedule()
    (entry,) = plan.seqs
    assert entry.start_pos == 16 and entry.token_ids == tuple(prompt[16:])
    sched.update(plan, {entry.key: 1})
    _run_to_completion(sched, [])
    assert sched.stats()["prefix_cache_hit_rate"] == 16 / 36
    assert sched.stats()["free_pages"] == sched.stats()["total_pages"]
    assert sched.prefix_cache is not None and sched.prefix_cache.num_cached_pages > 0


def test_shared_prefix_hits_only_the_common_whole_pages() -> None:
    sched = Scheduler(num_pages=32, page_size=PAGE, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    system = list(range(200, 210))  # 10 shared tokens: 2 full pages
    _run_to_completion(sched, [SequenceGroup.create("a", system + [1, 2, 3], max_tokens=1)])
    sched.add(SequenceGroup.create("b", system + [7, 7, 7, 7, 7], max_tokens=1))
    (entry,) = sched.schedule().seqs
    assert entry.start_pos == 8


def test_prefix_caching_off_never_hits() -> None:
    sched = Scheduler(
        num_pages=32, page_size=PAGE, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
        enable_prefix_caching=False,
    )
    prompt = list(range(12))
    _run_to_completion(sched, [SequenceGroup.create("a", prompt, max_tokens=1)])
    sched.add(SequenceGroup.create("b", prompt, max_tokens=1))
    (entry,) = sched.schedule().seqs
    assert entry.start_pos == 0 and sched.stats()["prefix_cache_hit_rate"] == 0.0


def test_data_parallel_reset_asks_every_replica() -> None:
    from jaxinfer.engine.replicas import DataParallelEngines

    class Replica:
        use_tqdm, tokenizer, gate = False, None, None

        def __init__(self, caching: bool) -> None:
            self.caching, self.resets = caching, 0

        def reset_prefix_cache(self) -> bool:
            self.resets += 1
            return self.caching

    both = [Replica(True), Replica(True)]
    assert DataParallelEngines(both).reset_prefix_cache() is True and [r.resets for r in both] == [1, 1]
    assert DataParallelEngines([Replica(True), Replica(False)]).reset_prefix_cache() is False
