"""Automatic prefix caching in the scheduler, host side only: no torch, no engine.

The scheduler runs against a KV manager and a `PrefixCache`; a "ticket" completes when the
test says so (`Scheduler.ticket_done`), nothing executes. Checked: a block reaches the
cache only once the ticket whose group finished it at the last depth completed; a request
whose prompt starts with cached blocks shares their pages at the head of every plane and
plans no row for them at any depth; the last prompt token is always computed; two
requests finishing the same block keep one copy; a recompute preemption looks up again;
idle cached pages are evicted before a request waits or is preempted, in-use ones never;
and reservations never count a shared page.
"""

from __future__ import annotations

import collections
import random
import subprocess
import sys

import pytest

from specloop.plan import Plan
from specloop.sampling_params import SamplingParams
from specloop.scheduling.kv_manager import KVManager
from specloop.scheduling.prefix_cache import PrefixCache
from specloop.scheduling.request import Request, Status
from specloop.scheduling.scheduler import Scheduler

R, BS = 4, 4
BASE = list(range(10, 26))  # 16 tokens: four full blocks


def _scheduler(num_pages: int = 400, max_rows: int = 64) -> tuple[KVManager, PrefixCache, Scheduler]:
    kv = KVManager(R, BS, num_pages, page_bytes=1)
    cache = PrefixCache(kv.allocator, R, BS)
    kv.cache = cache
    sched = Scheduler(kv, R, max_rows, max_seqs=8, num_token_slots=1024, adaptive_exit=False,
                      prefix_cache=cache, prefix_salt="tests")
    return kv, cache, sched


def _request(rid: str, prompt: list[int], arrival: int, max_tokens: int = 2) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0), arrival=arrival)


def _step(sched: Scheduler) -> Plan | None:
    """One plan whose ticket completes at once."""
    plan = sched.schedule()
    if plan is not None:
        sched.ticket_done(plan.ticket_id)
    return plan


def _run(sched: Scheduler, *reqs: Request) -> list[Plan]:
    """Plans (each completed at once) until nothing is left to do; the requests then end."""
    plans = []
    while (plan := _step(sched)) is not None:
        plans.append(plan)
        assert len(plans) < 500
    for req in reqs:
        if req.status is not Status.FINISHED:
            sched.finish(req, "length")
    return plans


def _rows(plans: list[Plan], rid: str) -> list[tuple[int, int, int]]:
    """(depth, position, loops) of every row `rid` ran."""
    return [(g.depth + loop, pos, g.loops) for plan in plans for g in plan.groups if g.request_id == rid
            for pos in range(g.start, g.end) for loop in range(g.loops)]


def _clean(kv: KVManager, cache: PrefixCache) -> None:
    """No request left: every page is free or held only by the cache."""
    assert not kv.requests()
    held = [p for p in range(kv.num_pages) if kv.allocator.refcount(p)]
    assert all(kv.allocator.refcount(p) == 1 for p in held)
    assert len(held) == cache.num_cached_blocks * R
    cache.check()


def test_a_block_is_published_when_the_ticket_that_finishes_it_completes():
    kv, cache, sched = _scheduler(max_rows=8)  # small plans: the prompt moves through the depths over many
    a = _request("a", BASE + [1, 2], arrival=0, max_tokens=1)
    sched.add(a)
    plans = []
    while (plan := sched.schedule()) is not None:  # every ticket still in flight
        plans.append(plan)
    assert cache.num_cached_blocks == 0 and kv.frontier(a.kv_key, R - 1) == 18
    tables = [kv.page_table(a.kv_key, p) for p in range(R)]
    deepest = 0  # positions done at the last depth once the tickets so far completed
    for plan in plans:
        sched.ticket_done(plan.ticket_id)
        deepest = max([deepest] + [g.end for g in plan.groups if g.last_depth == R - 1])
        blocks = min(deepest // BS, 4)
        assert cache.num_cached_blocks == blocks, plan.ticket_id
        for i, h in enumerate(a.block_hashes[:blocks]):
            assert cache.pages(h) == tuple(t[i] for t in tables)
    assert deepest == 18 and a.published_blocks == 4
    sched.finish(a, "length")
    _clean(kv, cache)
    assert cache.num_cached_blocks == 4


def test_a_cached_prefix_is_skipped_at_every_depth_and_shares_its_pages():
    kv, cache, sched = _scheduler()
    a = _request("a", BASE + [1, 2], arrival=0)
    sched.add(a)
    _run(sched, a)
    assert cache.stats() == {"prefix_cache_queries": 18, "prefix_cache_hits": 0}  # a's every position
    b = _request("b", BASE + [7, 8, 9, 10, 11], arrival=1)  # 21 tokens: blocks 0-4 may be looked up
    sched.add(b)
    first = sched.schedule()
    assert cache.stats() == {"prefix_cache_queries": 18 + 21, "prefix_cache_hits": 16}
    assert [kv.frontier(b.kv_key, p) for p in range(1, R)] == [16] * (R - 1)  # (depth 0: the plan entered 16..21)
    for i, h in enumerate(b.block_hashes[:4]):
        assert tuple(kv.page_table(b.kv_key, p)[i] for p in range(R)) == cache.pages(h)
        assert all(kv.allocator.refcount(page) == 2 for page in cache.pages(h))
    sched.ticket_done(first.ticket_id)
    rows = _rows([first] + _run(sched, b), "b")
    assert min(pos for _, pos, _ in rows) == 16
    prompt_rows = [(d, pos) for d, pos, _ in rows if pos < 21]
    assert sorted(prompt_rows) == [(d, pos) for d in range(R) for pos in range(16, 21)]
    _clean(kv, cache)
    assert cache.num_cached_blocks == 5  # a's four and b's own fifth


def test_the_last_prompt_token_is_always_computed():
    kv, cache, sched = _scheduler()
    a = _request("a", BASE, arrival=0)
    sched.add(a)
    _run(sched, a)
    b = _request("b", BASE, arrival=1)  # the same 16 tokens: all four blocks are cached
    sched.add(b)
    rows = _rows(_run(sched, b), "b")
    assert cache.stats()["prefix_cache_hits"] == 12  # three blocks: the fourth holds the last token
    assert sorted((d, pos) for d, pos, _ in rows if pos < 16) == [(d, pos) for d in range(R) for pos in range(12, 16)]
    _clean(kv, cache)


def test_one_token_past_the_hits_runs_every_loop_in_one_group():
    """Its earlier positions are done at every depth (by the cache), so the last prompt token
    runs loops 1..R in one call and samples, as a decode token does."""
    kv, cache, sched = _scheduler()
    a = _request("a", BASE, arrival=0)
    sched.add(a)
    _run(sched, a)
    b = _request("b", BASE[:13], arrival=1)
    sched.add(b)
    plan = _step(sched)
    [group] = [g for g in plan.groups if g.request_id == "b"]
    assert (group.depth, group.start, group.end, group.loops) == (0, 12, 13, R) and group.head is not None
    _run(sched, b)
    _clean(kv, cache)


def test_two_requests_finishing_the_same_block_keep_one_copy():
    kv, cache, sched = _scheduler()
    a, b = _request("a", BASE + [1], arrival=0), _request("b", BASE + [2], arrival=1)
    sched.add(a)
    sched.add(b)  # admitted together: neither finds the other's blocks
    _run(sched, a, b)
    assert cache.stats()["prefix_cache_hits"] == 0 and cache.num_cached_blocks == 4
    _clean(kv, cache)
    assert kv.num_free_pages == kv.num_pages - 4 * R  # the copy the cache did not take went back


def test_a_recompute_preemption_looks_the_prefix_up_again():
    kv, cache, sched = _scheduler()
    a = _request("a", BASE + [1, 2], arrival=0)
    sched.add(a)
    _run(sched, a)
    b = _request("b", BASE + [3, 4, 5], arrival=1, max_tokens=4)
    sched.add(b)
    _step(sched)
    _step(sched)
    first_key = b.kv_key
    sched.preempt(b)
    assert b.status is Status.WAITING and b.published_blocks == 0 and first_key not in kv.requests()
    _step(sched)  # re-admitted: the same hits, looked up (and counted) again
    assert b.status is Status.RUNNING and b.kv_key != first_key
    assert cache.stats()["prefix_cache_hits"] == 2 * 16
    assert [kv.frontier(b.kv_key, p) for p in range(1, R)] == [16] * (R - 1)
    _run(sched, b)
    _clean(kv, cache)


def test_idle_blocks_are_evicted_before_a_request_waits_and_in_use_ones_never():
    """A pool of 12 pages a plane. a's five blocks stay cached after it ends (20 pages, 28 free);
    d shares the first two (4 pages of its own); c, 29 tokens of another prompt, takes 8 pages a
    plane: its admission evicts two of a's idle blocks, leaves first, and preempts nobody; the
    ones d holds stay."""
    kv, cache, sched = _scheduler(num_pages=12 * R)
    a = _request("a", BASE + [1, 2, 3, 4], arrival=0, max_tokens=1)
    sched.add(a)
    _run(sched, a)
    assert cache.num_cached_blocks == 5 and kv.num_free_pages == 7 * R
    d = _request("d", BASE[:8] + [99], arrival=1, max_tokens=1)  # shares a's first two blocks
    sched.add(d)
    _step(sched)
    c = _request("c", list(range(100, 129)), arrival=2, max_tokens=1)
    sched.add(c)
    _step(sched)
    assert c.status is Status.RUNNING and sched.num_preemptions == 0
    assert [h in cache for h in a.block_hashes] == [True, True, True, False, False]
    assert kv.allocator.refcount(cache.pages(a.block_hashes[0])[0]) == 2  # d's and the cache's
    _run(sched, c, d)
    _clean(kv, cache)


def test_a_request_waits_rather_than_evict_its_own_hits():
    """With a's four blocks cached and nothing else to evict, b (a's prompt then 16 more
    tokens) needs 20 new pages beside its 16 shared ones and 16 are free: it waits; were its
    hits counted as evictable room, its admission would have failed half-way."""
    kv, cache, sched = _scheduler(num_pages=8 * R)
    a = _request("a", BASE, arrival=0, max_tokens=1)
    sched.add(a)
    _run(sched, a)
    b = _request("b", BASE + list(range(40, 56)), arrival=1, max_tokens=4)
    sched.add(b)
    assert sched.schedule() is None and b.status is Status.WAITING
    assert cache.num_cached_blocks == 4 and cache.stats()["prefix_cache_queries"] == 16  # a's own lookup
    _clean(kv, cache)


def test_reservations_count_only_the_pages_past_a_shared_prefix():
    """Reserving prompt + max_tokens: b (a's 16 tokens then 4 more, max_tokens 4) reserves 6
    pages a plane of which 4 are shared: 8 new pages, which fit beside a's cached blocks
    in a pool of 6 pages a plane only because the shared ones are not counted twice."""
    kv, cache, sched = _scheduler(num_pages=6 * R)
    sched.reserve_max_tokens = True
    a = _request("a", BASE, arrival=0, max_tokens=4)
    sched.add(a)
    _run(sched, a)
    b = _request("b", BASE + [1, 2, 3, 4], arrival=1, max_tokens=4)
    sched.add(b)
    while (plan := _step(sched)) is not None:
        assert kv.num_free_pages >= kv.num_reserved_pages  # invariant 3
        assert plan.ticket_id < 100
    assert cache.stats()["prefix_cache_hits"] == 16 and sched.num_preemptions == 0
    sched.finish(b, "length")
    _clean(kv, cache)


@pytest.mark.parametrize("seed", range(6))
def test_random_arrivals_preemptions_and_aborts_account_for_every_page(seed):
    """Requests over three shared prefixes arrive, are preempted (recompute) and aborted at
    random in a pool of 12 pages a plane, with up to two tickets in flight. After every plan:
    each page's references are exactly the tables holding it plus the cache's, reservations
    stay backed by free pages, and the cache's invariants hold; at the end only the cache
    holds pages, and hits happened."""
    rng = random.Random(seed)
    kv, cache, sched = _scheduler(num_pages=12 * R, max_rows=rng.choice([6, 16, 48]))
    sched.reserve_max_tokens = seed % 3 == 2
    prefixes = [BASE[:8], BASE, list(range(50, 62)), []]
    live: list[Request] = []
    hashes: set[bytes] = set()
    inflight: collections.deque[int] = collections.deque()
    for step in range(1000):
        draw = rng.random() if step < 300 else 1.0  # then the rest runs out
        if draw < 0.2:
            prompt = rng.choice(prefixes) + [rng.randrange(100, 103) for _ in range(rng.randint(1, 6))]
            req = _request(f"r{step}", prompt, arrival=step, max_tokens=rng.randint(1, 5))
            sched.add(req)
            live.append(req)
        elif draw < 0.25 and sched.running:
            sched.preempt(rng.choice(sched.running))
        elif draw < 0.28 and live:
            sched.finish(live.pop(rng.randrange(len(live))), "abort")
        for req in [r for r in live if r.status is Status.RUNNING and not r.wants_more_samples
                    and kv.frontier(r.kv_key, R - 1) >= r.num_tokens]:
            sched.finish(req, "length")
            live.remove(req)
        waited = bool(inflight)  # (as the engine: no plan while tickets are in flight is no stall)
        plan = sched.schedule()
        if plan is not None:
            inflight.append(plan.ticket_id)
        while len(inflight) > 2 or (plan is None and inflight):
            sched.ticket_done(inflight.popleft())
        assert plan is not None or waited or not live or sched.running, "stalled"
        hashes |= {h for r in live for h in r.block_hashes or ()}
        _check_references(kv, cache, hashes)
        if step >= 300 and not live and not inflight:
            break
    assert not live, "requests left"
    _clean(kv, cache)
    assert cache.stats()["prefix_cache_hits"] > 0


def _check_references(kv: KVManager, cache: PrefixCache, hashes: set[bytes]) -> None:
    refs = collections.Counter(p for rid in kv.requests() for plane in range(R) for p in kv.page_table(rid, plane))
    refs.update(p for h in hashes if h in cache for p in cache.pages(h))
    assert all(kv.allocator.refcount(p) == refs[p] for p in range(kv.num_pages))
    assert kv.num_free_pages >= kv.num_reserved_pages
    cache.check()


def test_without_a_cache_nothing_is_hashed():
    kv = KVManager(R, BS, 100, page_bytes=1)
    sched = Scheduler(kv, R, 64, max_seqs=8, num_token_slots=1024, adaptive_exit=False)
    a = _request("a", BASE + [1], arrival=0)
    sched.add(a)
    _run(sched, a)
    assert a.block_hashes is None and kv.num_free_pages == 100


def test_the_scheduler_still_imports_no_torch():
    code = "import specloop.scheduling.scheduler, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
