"""Scheduler: budgets, chunking, mixing, priorities, preemption, aborts, n > 1 forks, and an end-to-end
simulation against a fake paged "model" whose output depends on every KV slot it reads."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import pytest

from jaxinfer.engine.page_table import TRASH_PAGE, pages_for_tokens
from jaxinfer.engine.scheduler import RequestRejected, Scheduler
from jaxinfer.engine.step_plan import StepPlan
from jaxinfer.engine.sequence import FinishReason, SeqKey, SequenceGroup, SequenceStatus

# ------------------------------------------------------------------------------------------ fake model

VOCAB = 64
STOP_TOKEN = 0
_MASK = (1 << 62) - 1


def kv_value(prev: int, token: int, pos: int) -> int:
    """The fake KV of a token: depends on the token, its position and (through ``prev``) all earlier tokens."""
    return (prev * 6364136223846793005 + token * 1442695040888963407 + pos + 1) & _MASK


def next_token(kv: np.ndarray, seq_index: int) -> int:
    """The fake model reads every KV slot (like attention), so any wrong page changes the token."""
    data = kv.astype(np.int64).tobytes() + seq_index.to_bytes(4, "little")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") % VOCAB


def reference_output(prompt: list[int], seq_index: int, max_tokens: int, max_model_len: int) -> list[int]:
    """What one sequence generates with unlimited memory and no scheduler at all."""
    kv: list[int] = []
    for pos, token in enumerate(prompt):
        kv.append(kv_value(kv[-1] if kv else 0, token, pos))
    out: list[int] = []
    while True:
        token = next_token(np.asarray(kv, np.int64), seq_index)
        out.append(token)
        if token == STOP_TOKEN or len(out) >= max_tokens or len(prompt) + len(out) >= max_model_len:
            return out
        kv.append(kv_value(kv[-1], token, len(prompt) + len(out) - 1))


class FakeDevice:
    """A paged KV cache of fake values: applies copies, writes new tokens, 'attends' over the page table."""

    def __init__(self, num_pages: int, page_size: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.kv = rng.integers(1, _MASK, size=(num_pages, page_size), dtype=np.int64)  # garbage, never zeros
        self.page_size = page_size

    def run(self, plan: StepPlan) -> dict[SeqKey, int]:
        if plan.page_copies:
            src = [c.src for c in plan.page_copies]
            dst = [c.dst for c in plan.page_copies]
            assert len(set(dst)) == len(dst) and TRASH_PAGE not in dst
            self.kv[dst] = self.kv[src]  # all reads happen before all writes
        writes: dict[tuple[int, int], int] = {}
        for entry in plan.seqs:
            prev = self._slot_value(entry.page_ids, entry.start_pos - 1) if entry.start_pos else 0
            for i, token in enumerate(entry.token_ids):
                pos = entry.start_pos + i
                prev = kv_value(prev, token, pos)
                slot = (entry.page_ids[pos // self.page_size], pos % self.page_size)
                assert slot not in writes, f"two sequences write slot {slot} in one step"
                writes[slot] = prev
        for (page, offset), value in writes.items():
            self.kv[page, offset] = value
        return {
            e.key: next_token(self.kv[list(e.page_ids)].reshape(-1)[: e.kv_len], e.key[1])
            for e in plan.seqs
            if e.sample
        }

    def _slot_value(self, page_ids: tuple[int, ...], pos: int) -> int:
        return int(self.kv[page_ids[pos // self.page_size], pos % self.page_size])


# ------------------------------------------------------------------------------------------ harness


@dataclass(slots=True)
class Req:
    request_id: str
    prompt: list[int]
    max_tokens: int
    n: int = 1
    priority: int = 0
    arrival_step: int = 0
    abort_step: int | None = None


def check_plan(sched: Scheduler, plan: StepPlan, groups: dict[str, SequenceGroup]) -> None:
    """Invariants every step must satisfy, whatever the workload."""
    assert plan.num_batched_tokens == sum(e.num_new_tokens for e in plan.seqs) <= sched.max_num_batched_tokens
    assert len(plan.seqs) <= sched.max_num_seqs and sched.stats()["num_running"] <= sched.max_num_seqs
    assert len({e.key for e in plan.seqs}) == len(plan.seqs)
    for entry in plan.seqs:
        seq = groups[entry.key[0]].seqs[entry.key[1]]
        assert seq.status is SequenceStatus.RUNNING and entry.key not in plan.preempted
        assert entry.num_new_tokens >= 1 and entry.kv_len == entry.start_pos + entry.num_new_tokens
        assert entry.token_ids == tuple(seq.token_ids[entry.start_pos : entry.kv_len])
        assert entry.sample == (entry.kv_len == seq.num_tokens)
        assert len(entry.page_ids) == pages_for_tokens(entry.kv_len, sched.page_size) <= sched.max_pages_per_seq
        assert TRASH_PAGE not in entry.page_ids
        first_written = entry.start_pos // sched.page_size
        for page in entry.page_ids[first_written:]:  # copy-on-write made every written page private
            assert sched.allocator.refcount(page) == 1


def run_workload(sched: Scheduler, requests: list[Req], seed: int = 0) -> dict[str, SequenceGroup]:
    device = FakeDevice(sched.allocator.num_pages, sched.page_size, seed)
    pending = sorted(requests, key=lambda r: r.arrival_step)
    aborts = {r.request_id: r.abort_step for r in requests if r.abort_step is not None}
    groups: dict[str, SequenceGroup] = {}
    step = 0
    while pending or sched.has_unfinished():
        while pending and pending[0].arrival_step <= step:
            req = pending.pop(0)
            groups[req.request_id] = SequenceGroup.create(
                req.request_id, req.prompt, n=req.n, priority=req.priority, max_tokens=req.max_tokens
            )
            sched.add(groups[req.request_id])
        for request_id in [r for r, s in aborts.items() if s == step]:
            sched.abort(request_id)
        plan = sched.schedule()
        assert not plan.is_empty or not sched.has_unfinished(), "scheduler made no progress"
        check_plan(sched, plan, groups)
        sampled = device.run(plan)
        sched.update(plan, sampled, {k: FinishReason.STOP for k, t in sampled.items() if t == STOP_TOKEN})
        step += 1
        assert step < 50_000
    return groups


def assert_all_pages_free(sched: Scheduler) -> None:
    stats = sched.stats()
    assert stats["free_pages"] == stats["total_pages"] == sched.allocator.num_pages - 1
    assert all(sched.allocator.refcount(p) == 0 for p in range(sched.allocator.num_pages))
    assert stats["num_running"] == stats["num_waiting"] == 0 and not sched.has_unfinished()


def assert_outputs_match_reference(requests: list[Req], groups: dict[str, SequenceGroup], max_len: int) -> None:
    for req in requests:
        for seq in groups[req.request_id].seqs:
            expected = reference_output(req.prompt, seq.index, req.max_tokens, max_len)
            if seq.finish_reason is FinishReason.ABORT:
                assert expected[: seq.num_output_tokens] == seq.output_token_ids
            else:
                assert seq.output_token_ids == expected, (req.request_id, seq.index)


def random_workload(rng: np.random.Generator, num_requests: int, max_model_len: int) -> list[Req]:
    shared = [rng.integers(1, VOCAB, size=int(rng.integers(0, 70))).tolist() for _ in range(3)]
    requests: list[Req] = []
    for i in range(num_requests):
        if requests and rng.random() < 0.15:
            prompt = list(requests[int(rng.integers(len(requests)))].prompt)  # submitted twice
        else:
            suffix = rng.integers(1, VOCAB, size=int(rng.integers(1, 26))).tolist()
            prompt = shared[int(rng.integers(len(shared)))] + suffix
        requests.append(
            Req(
                request_id=f"r{i}",
                prompt=prompt,
                max_tokens=int(rng.integers(1, 30)),
                n=int(rng.choice([1, 1, 1, 2, 3])),
                priority=int(rng.integers(0, 3)),
                arrival_step=int(rng.integers(0, 60)),
                abort_step=int(rng.integers(1, 120)) if rng.random() < 0.1 else None,
            )
        )
    return requests


# ------------------------------------------------------------------------------------------ simulation


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix_on", "prefix_off"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_simulation_under_memory_pressure_matches_reference(page_size: int, prefix_caching: bool, seed: int) -> None:
    max_model_len = 96
    rng = np.random.default_rng([seed, page_size])
    requests = random_workload(rng, num_requests=60, max_model_len=max_model_len)
    largest = pages_for_tokens(max_model_len, page_size)
    sched = Scheduler(
        num_pages=largest + 1 + max(1, largest // 8),  # barely more than one full-length sequence
        page_size=page_size,
        max_num_seqs=8,
        max_num_batched_tokens=16,
        max_model_len=max_model_len,
        enable_prefix_caching=prefix_caching,
    )
    groups = run_workload(sched, requests, seed=seed)
    assert_outputs_match_reference(requests, groups, max_model_len)
    assert_all_pages_free(sched)  # with prefix caching, cached-but-unreferenced pages count as free
    stats = sched.stats()
    assert stats["num_preemptions"] >= 10
    assert (stats["prefix_cache_hit_rate"] > 0) == prefix_caching
    assert (sched.prefix_cache is not None and sched.prefix_cache.num_cached_pages > 0) == prefix_caching


def test_running_alone_with_ample_memory_matches_reference() -> None:
    rng = np.random.default_rng(7)
    for i, req in enumerate(random_workload(rng, num_requests=5, max_model_len=96)):
        req.arrival_step, req.abort_step = 0, None
        sched = Scheduler(num_pages=200, page_size=16, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=96)
        groups = run_workload(sched, [req], seed=i)
        assert_outputs_match_reference([req], groups, 96)
        assert sched.stats()["num_preemptions"] == 0
        assert_all_pages_free(sched)


# ------------------------------------------------------------------------------------------ focused tests


def _sched(**overrides: int | bool) -> Scheduler:
    kwargs: dict = dict(num_pages=64, page_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128)
    kwargs.update(overrides)
    return Scheduler(**kwargs)


def _step(sched: Scheduler, token: int = 5, finished: dict | None = None) -> StepPlan:
    plan = sched.schedule()
    sched.update(plan, {e.key: token for e in plan.seqs if e.sample}, finished)
    return plan


def test_long_prompt_is_chunked_to_the_budget() -> None:
    sched = _sched(enable_prefix_caching=False)
    sched.add(SequenceGroup.create("a", list(range(1, 41)), max_tokens=4))
    plans = [_step(sched) for _ in range(3)]
    assert [(e.start_pos, e.num_new_tokens, e.sample) for p in plans for e in p.seqs] == [
        (0, 16, False),
        (16, 16, False),
        (32, 8, True),
    ]
    assert plans[2].seqs[0].kv_len == 40 and len(plans[2].seqs[0].page_ids) == 10


def test_decodes_come_first_and_mix_with_prefill_chunks() -> None:
    sched = _sched()
    sched.add(SequenceGroup.create("a", [1, 2, 3], max_tokens=10))
    _step(sched)  # a's prompt; a now decodes
    sched.add(SequenceGroup.create("b", list(range(10, 50)), max_tokens=10))
    plan = _step(sched)
    assert [(e.key, e.num_new_tokens) for e in plan.seqs] == [(("a", 0), 1), (("b", 0), 15)]
    plan = _step(sched)
    assert [(e.key, e.num_new_tokens) for e in plan.seqs] == [(("a", 0), 1), (("b", 0), 15)]
    assert plan.num_batched_tokens == 16


def test_long_prefill_token_threshold_caps_each_prefill_chunk_and_leaves_budget_to_others() -> None:
    """A prefill runs at most long_prefill_token_threshold tokens a step, whether it is admitted, continuing or
    recomputed; the budget it leaves goes to the next waiting prompt, and a decode's token is never held back."""
    sched = _sched(long_prefill_token_threshold=6, enable_prefix_caching=False)
    sched.add(SequenceGroup.create("a", [1, 2, 3], max_tokens=10))
    assert [e.num_new_tokens for e in _step(sched).seqs] == [3]  # shorter than the threshold: whole
    sched.add(SequenceGroup.create("b", list(range(10, 30)), max_tokens=4))
    sched.add(SequenceGroup.create("c", list(range(30, 40)), max_tokens=4))
    plans = [_step(sched) for _ in range(4)]
    assert [[(e.key[0], e.num_new_tokens) for e in p.seqs] for p in plans] == [
        [("a", 1), ("b", 6), ("c", 6)],
        [("a", 1), ("b", 6), ("c", 4)],  # c's last 4 prompt tokens
        [("a", 1), ("c", 1), ("b", 6)],  # c decodes; b continues, still capped
        [("a", 1), ("c", 1), ("b", 2)],
    ]
    assert all(p.num_batched_tokens <= 16 for p in plans)
    # With no threshold the same arrivals take the budget whole, as before.
    uncapped = _sched(enable_prefix_caching=False)
    uncapped.add(SequenceGroup.create("b", list(range(10, 30)), max_tokens=4))
    assert [e.num_new_tokens for e in _step(uncapped).seqs] == [16]
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be at least 0"):
        _sched(long_prefill_token_threshold=-1)


def test_mixed_prefill_token_cap_bounds_the_prefill_of_steps_that_decode_a_few_rows() -> None:
    """mixed_prefill_token_cap bounds a step's prefill tokens, over all its prompts, while 1 to
    mixed_prefill_max_decodes rows decode: a prompt alone takes the whole budget, prompts arriving beside a
    decoding row share the cap (the second waits), and with more decoding rows than that there is no cap."""
    sched = _sched(mixed_prefill_token_cap=5, enable_prefix_caching=False)
    sched.add(SequenceGroup.create("a", list(range(1, 21)), max_tokens=20))
    assert [e.num_new_tokens for e in _step(sched).seqs] == [16]  # nothing decodes: the budget, not the cap
    assert [e.num_new_tokens for e in _step(sched).seqs] == [4]  # a's last 4 prompt tokens, still alone
    sched.add(SequenceGroup.create("b", list(range(30, 42)), max_tokens=4))
    sched.add(SequenceGroup.create("c", list(range(50, 56)), max_tokens=4))
    plans = [_step(sched) for _ in range(5)]
    assert [[(e.key[0], e.num_new_tokens) for e in p.seqs] for p in plans] == [
        [("a", 1), ("b", 5)],  # c waits: the cap is used up, though the budget is not
        [("a", 1), ("b", 5)],
        [("a", 1), ("b", 2), ("c", 3)],  # b's last 2 prompt tokens leave 3 to c
        [("a", 1), ("b", 1), ("c", 3)],
        [("a", 1), ("b", 1), ("c", 1)],
    ]
    both = _sched(mixed_prefill_token_cap=5, long_prefill_token_threshold=3, enable_prefix_caching=False)
    both.add(SequenceGroup.create("a", [1, 2], max_tokens=10))
    _step(both)
    both.add(SequenceGroup.create("b", list(range(30, 50)), max_tokens=4))
    assert [e.num_new_tokens for e in _step(both).seqs] == [1, 3]  # the lower of the two caps
    many = _sched(mixed_prefill_token_cap=5, mixed_prefill_max_decodes=1, enable_prefix_caching=False)
    for rid in "ab":
        many.add(SequenceGroup.create(rid, [1, 2], max_tokens=10))
    _step(many)
    many.add(SequenceGroup.create("c", list(range(30, 50)), max_tokens=4))
    assert [e.num_new_tokens for e in _step(many).seqs] == [1, 1, 14]  # two rows decode: past the limit, no cap
    with pytest.raises(ValueError, match="mixed_prefill_token_cap must be at least 0"):
        _sched(mixed_prefill_token_cap=-1)


def test_priority_then_arrival_order_for_admission() -> None:
    sched = _sched(max_num_seqs=1)
    for rid, priority in (("late_low", 2), ("first_mid", 1), ("second_mid", 1), ("urgent", 0)):
        sched.add(SequenceGroup.create(rid, [1, 2], priority=priority, max_tokens=1))
    order = [_step(sched).seqs[0].key[0] for _ in range(4)]
    assert order == ["urgent", "first_mid", "second_mid", "late_low"]


def test_max_num_seqs_limits_running() -> None:
    sched = _sched(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(4):
        sched.add(SequenceGroup.create(f"r{i}", [1, 2, 3], max_tokens=5))
    plan = _step(sched)
    assert len(plan.seqs) == 2
    assert sched.stats()["num_running"] == 2 and sched.stats()["num_waiting"] == 2


def test_preemption_recomputes_the_latest_arrival_and_keeps_its_output() -> None:
    sched = _sched(num_pages=5, page_size=2, enable_prefix_caching=False)  # 4 usable pages
    sched.add(SequenceGroup.create("old", [1, 2, 3], max_tokens=4))
    sched.add(SequenceGroup.create("new", [4, 5, 6], max_tokens=4))
    _step(sched, token=7)  # both prompts: 2 pages each, both now hold 4 tokens
    plan = _step(sched, token=8)  # both decode within their second page
    assert not plan.preempted
    plan = _step(sched, token=9)  # old needs a 3rd page: new is preempted
    assert plan.preempted == (("new", 0),)
    assert [e.key for e in plan.seqs] == [("old", 0)]
    new = sched.get_group("new").parent
    assert new.status is SequenceStatus.PREEMPTED and new.num_computed_tokens == 0 and new.page_ids == []
    assert new.output_token_ids == [7, 8]
    assert sched.stats()["num_preemptions"] == 1 and sched.stats()["num_waiting"] == 1
    sched.add(SequenceGroup.create("later", [1], max_tokens=1))
    sched.abort("old")
    plan = _step(sched)
    assert [(e.key[0], e.token_ids, e.start_pos, e.sample) for e in plan.seqs] == [
        ("new", (4, 5, 6, 7, 8), 0, True),  # back ahead of requests that arrived after it
        ("later", (1,), 0, True),
    ]


def test_preemption_prefers_the_least_urgent_even_if_already_scheduled() -> None:
    sched = _sched(num_pages=6, page_size=2, enable_prefix_caching=False, max_num_batched_tokens=4)
    sched.add(SequenceGroup.create("low", [1, 2, 3], priority=5, max_tokens=4))
    _step(sched)  # low's prompt: 2 pages; low decodes from now on
    sched.add(SequenceGroup.create("high", list(range(10, 18)), priority=0, max_tokens=1))
    plan = _step(sched)  # low decodes in place; high's first chunk (3 tokens) takes 2 pages: 4 of 5 used
    assert [(e.key[0], e.num_new_tokens) for e in plan.seqs] == [("low", 1), ("high", 3)]
    plan = _step(sched)  # low's decode takes the last page, then high's chunk needs one more: low goes
    assert plan.preempted == (("low", 0),)
    assert [(e.key[0], e.start_pos, e.num_new_tokens) for e in plan.seqs] == [("high", 3, 3)]
    assert sched.get_group("low").parent.output_token_ids == [5, 5]


def test_abort_mid_prefill_mid_decode_and_while_waiting() -> None:
    sched = _sched(max_num_seqs=2)
    sched.add(SequenceGroup.create("prefill", list(range(1, 41)), max_tokens=4))
    sched.add(SequenceGroup.create("decode", [1, 2], max_tokens=10))
    sched.add(SequenceGroup.create("waiting", [3, 4], max_tokens=10))
    _step(sched)
    _step(sched)
    decode = sched.get_group("decode").parent
    assert decode.num_output_tokens == 0  # it did not fit in the first budget
    assert sched.abort("prefill") == [("prefill", 0)]
    _step(sched)
    assert decode.num_output_tokens >= 1 and decode.status is SequenceStatus.RUNNING
    assert sched.abort("decode") == [("decode", 0)]
    assert decode.finish_reason is FinishReason.ABORT and decode.page_ids == []
    assert sched.abort("waiting") == [("waiting", 0)]
    assert sched.abort("unknown") == []
    assert_all_pages_free(sched)


def test_abort_between_schedule_and_update_is_skipped() -> None:
    sched = _sched()
    sched.add(SequenceGroup.create("a", [1, 2, 3], max_tokens=10))
    sched.add(SequenceGroup.create("b", [4, 5, 6], max_tokens=10))
    plan = sched.schedule()
    sched.abort("a")
    sched.update(plan, {("b", 0): 9})
    assert sched.get_group("a") is None
    assert sched.get_group("b").parent.output_token_ids == [9]


def test_update_finishes_on_engine_stop_and_on_length() -> None:
    sched = _sched(max_model_len=6)
    sched.add(SequenceGroup.create("stop", [1, 2], max_tokens=10))
    sched.add(SequenceGroup.create("max_tokens", [1, 2], max_tokens=2))
    sched.add(SequenceGroup.create("model_len", [1, 2, 3, 4], max_tokens=10))
    plan = sched.schedule()
    assert sched.update(plan, {e.key: 3 for e in plan.seqs}, {("stop", 0): FinishReason.STOP}) == [("stop", 0)]
    plan = sched.schedule()
    done = sched.update(plan, {e.key: 3 for e in plan.seqs})
    assert sorted(done) == [("max_tokens", 0), ("model_len", 0)]
    assert sched.get_group("stop") is None and not sched.has_unfinished()
    assert_all_pages_free(sched)


def test_n_forks_after_the_prompt_and_copies_the_shared_partial_page() -> None:
    sched = _sched(enable_prefix_caching=False)
    sched.add(SequenceGroup.create("a", [1, 2, 3, 4, 5, 6], n=3, max_tokens=3))
    plan = _step(sched)
    (parent_chunk,) = plan.seqs
    assert parent_chunk.key == ("a", 0) and parent_chunk.token_ids == (1, 2, 3, 4, 5) and not parent_chunk.sample
    assert sched.stats()["num_running"] == 3  # forked: all share the parent's 2 pages
    plan = sched.schedule()
    assert [(e.key[1], e.token_ids, e.start_pos, e.sample) for e in plan.seqs] == [
        (i, (6,), 5, True) for i in range(3)
    ]
    first_pages = {e.page_ids[0] for e in plan.seqs}
    last_pages = {e.page_ids[1] for e in plan.seqs}
    assert len(first_pages) == 1 and len(last_pages) == 3  # full page shared, partial page private
    assert len(plan.page_copies) == 2
    assert {c.src for c in plan.page_copies} == {parent_chunk.page_ids[1]}
    assert {c.dst for c in plan.page_copies} | {parent_chunk.page_ids[1]} == last_pages
    sched.update(plan, {e.key: 10 + e.key[1] for e in plan.seqs})
    assert [s.output_token_ids for s in sched.get_group("a").seqs] == [[10], [11], [12]]
    while sched.has_unfinished():
        _step(sched)
    assert_all_pages_free(sched)


def test_n_fork_at_admission_when_the_prompt_is_cached() -> None:
    sched = _sched()
    prompt = list(range(1, 10))  # 9 tokens: the first 8 (2 full pages) can come from the cache
    sched.add(SequenceGroup.create("warm", prompt, max_tokens=1))
    _step(sched)
    sched.add(SequenceGroup.create("a", prompt, n=2, max_tokens=2))
    plan = sched.schedule()
    assert [(e.key, e.start_pos, e.token_ids) for e in plan.seqs] == [(("a", 0), 8, (9,)), (("a", 1), 8, (9,))]
    assert plan.page_copies == ()
    sched.abort("a")
    assert_all_pages_free(sched)


def test_requests_that_can_never_fit_are_rejected_clearly() -> None:
    sched = _sched(num_pages=5, page_size=4, max_model_len=64)  # 4 usable pages: 16 tokens of KV
    with pytest.raises(RequestRejected, match="max_model_len"):
        sched.add(SequenceGroup.create("long", [1] * 65, max_tokens=1))
    with pytest.raises(RequestRejected, match="KV pages"):
        sched.add(SequenceGroup.create("big", [1] * 10, max_tokens=8))
    with pytest.raises(RequestRejected, match="KV pages"):
        sched.add(SequenceGroup.create("unbounded", [1] * 10))  # may grow to max_model_len
    with pytest.raises(RequestRejected, match="empty"):
        sched.add(SequenceGroup.create("empty", []))
    with pytest.raises(RequestRejected, match="max_num_seqs"):
        sched.add(SequenceGroup.create("wide", [1], n=5, max_tokens=1))
    sched.add(SequenceGroup.create("fits", [1] * 10, max_tokens=7))  # 16 tokens, last one needs no KV
    with pytest.raises(RequestRejected, match="already in use"):
        sched.add(SequenceGroup.create("fits", [1], max_tokens=1))
    assert sched.stats()["num_waiting"] == 1


def test_stats_report_the_engine_gauges() -> None:
    sched = _sched(num_pages=10)
    assert sched.stats() == {
        "num_running": 0,
        "num_waiting": 0,
        "free_pages": 9,
        "total_pages": 9,
        "num_preemptions": 0,
        "prefix_cache_hit_rate": 0.0,
        "prefix_cache_queried_tokens": 0,
        "prefix_cache_hit_tokens": 0,
    }


def test_n_with_a_one_token_prompt_forks_at_admission() -> None:
    sched = _sched()
    sched.add(SequenceGroup.create("a", [42], n=3, max_tokens=2))
    plan = sched.schedule()
    assert [(e.key, e.token_ids, e.start_pos, e.sample) for e in plan.seqs] == [
        (("a", i), (42,), 0, True) for i in range(3)
    ]
    assert len({e.page_ids for e in plan.seqs}) == 3 and plan.page_copies == ()


def test_abort_before_the_fork_finishes_every_sequence_of_the_request() -> None:
    sched = _sched(max_num_seqs=3)
    group = SequenceGroup.create("a", list(range(1, 30)), n=3, max_tokens=2)
    sched.add(group)
    _step(sched)  # 16 of 28 prefill tokens; slots for the children are held
    sched.add(SequenceGroup.create("b", [1], max_tokens=1))
    assert [e.key for e in sched.schedule().seqs] == [("a", 0)]  # b finds no free slot: a reserved 3
    assert sched.abort("a") == [("a", 0), ("a", 1), ("a", 2)]
    assert all(s.finish_reason is FinishReason.ABORT for s in group.seqs)
    assert [e.key for e in _step(sched).seqs] == [("b", 0)]
    assert_all_pages_free(sched)


def test_lookahead_pages_are_capped_never_preempt_and_are_freed() -> None:
    sched = _sched(num_pages=9, page_size=4, max_model_len=20, enable_prefix_caching=False)  # 8 usable pages
    sched.add(SequenceGroup.create("a", [1, 2, 3], max_tokens=16))
    sched.add(SequenceGroup.create("b", [4, 5, 6], max_tokens=16))
    _step(sched)  # both prompts, one page each; both now decode their 4th token
    pages = sched.reserve_lookahead(("a", 0), 3 + 100)  # capped at max_model_len: 5 pages in all
    assert len(pages) == 5 and list(pages) == sched.get_group("a").parent.page_ids
    assert sched.stats()["free_pages"] == 2
    assert len(sched.reserve_lookahead(("b", 0), 3 + 100)) == 3  # what is free, and nobody is preempted
    assert sched.stats()["num_preemptions"] == 0 and sched.stats()["free_pages"] == 0
    plan = _step(sched)  # a's reserved pages are used, not grown again
    assert len(next(e for e in plan.seqs if e.key == ("a", 0)).page_ids) == 5
    sched.abort("a")
    sched.abort("b")
    assert_all_pages_free(sched)
