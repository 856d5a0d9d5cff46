"""The logical KV manager: page allocator, block tables, reservations, rollback, accounting."""

from __future__ import annotations

import collections
import random
import subprocess
import sys

import pytest

from specloop.scheduling.kv_manager import KVManager, OutOfPages, PageAllocator
from specloop.errors import SpecloopError


# ----- PageAllocator -----


def test_allocate_takes_from_the_front_and_freed_pages_join_the_back():
    alloc = PageAllocator(6)
    assert alloc.allocate(2) == [0, 1]
    assert alloc.allocate(1) == [2]
    assert alloc.decref([1, 0]) == [1, 0]
    assert alloc.free_list() == [3, 4, 5, 1, 0]
    assert alloc.allocate(4) == [3, 4, 5, 1]
    assert alloc.num_free == 1
    assert alloc.allocate(0) == []


def test_out_of_pages_leaves_the_allocator_unchanged():
    alloc = PageAllocator(4)
    held = alloc.allocate(3)
    with pytest.raises(OutOfPages):
        alloc.allocate(2)
    assert isinstance(OutOfPages("x"), SpecloopError)
    assert alloc.num_free == 1 and alloc.free_list() == [3]
    assert [alloc.refcount(p) for p in held] == [1, 1, 1]
    assert alloc.allocate(1) == [3]


def test_refcounts_follow_incref_and_decref():
    alloc = PageAllocator(3)
    pages = alloc.allocate(2)
    assert [alloc.refcount(p) for p in range(3)] == [1, 1, 0]
    alloc.incref(pages)
    alloc.incref([0])
    assert [alloc.refcount(p) for p in range(3)] == [3, 2, 0]
    assert alloc.decref(pages) == []  # still shared
    assert alloc.decref([1]) == [1]
    assert alloc.decref([0, 0]) == [0]  # repeated entries drop one reference each
    assert alloc.num_free == 3 and alloc.free_list() == [2, 1, 0]


def test_shared_page_is_freed_only_by_its_last_owner():
    alloc = PageAllocator(2)
    [page] = alloc.allocate(1)
    alloc.incref([page])  # a second request shares it (prefix reuse)
    assert alloc.decref([page]) == []
    assert alloc.num_free == 1
    assert alloc.decref([page]) == [page]
    assert alloc.num_free == 2


def test_double_free_and_sharing_a_free_page_are_errors_that_change_nothing():
    alloc = PageAllocator(3)
    alloc.allocate(2)
    assert alloc.decref([1]) == [1]
    with pytest.raises(ValueError):
        alloc.decref([0, 1])  # 1 is free: nothing happens, not even to 0
    assert alloc.refcount(0) == 1
    with pytest.raises(ValueError):
        alloc.decref([0, 0])  # more releases than references
    assert alloc.refcount(0) == 1
    with pytest.raises(ValueError):
        alloc.incref([0, 2])
    assert alloc.refcount(0) == 1 and alloc.refcount(2) == 0
    with pytest.raises(ValueError):
        alloc.refcount(3)
    with pytest.raises(ValueError):
        alloc.allocate(-1)
    assert alloc.free_list() == [2, 1]


# ----- KVManager: slots and tables -----


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_slot_arithmetic_across_page_boundaries(block_size):
    kv = KVManager(num_planes=2, block_size=block_size, num_pages=64, page_bytes=1)
    kv.add_request("other", 2 * block_size + 1)
    kv.ensure("other", 2 * block_size + 1)  # so "r" gets pages that are not 0, 1, 2...
    n = 3 * block_size + 1
    kv.add_request("r", n)
    kv.ensure("r", n)
    for plane in range(2):
        table = kv.page_table("r", plane)
        assert len(table) == 4
        expected = [table[p // block_size] * block_size + p % block_size for p in range(kv.coverage("r"))]
        assert [kv.slot("r", plane, p) for p in range(kv.coverage("r"))] == expected
        with pytest.raises(IndexError):
            kv.slot("r", plane, kv.coverage("r"))
        with pytest.raises(IndexError):
            kv.slot("r", plane, -1)
    all_slots = [kv.slot(rid, pl, p) for rid in ("r", "other") for pl in range(2) for p in range(kv.coverage(rid))]
    assert len(set(all_slots)) == len(all_slots)


def test_ensure_grows_all_planes_equally_and_never_shrinks():
    kv = KVManager(num_planes=4, block_size=4, num_pages=32, page_bytes=1)
    kv.add_request("r", 16)
    kv.ensure("r", 5)
    assert [kv.page_table("r", p) for p in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert kv.coverage("r") == 8
    kv.ensure("r", 8)  # already covered: no allocation
    kv.ensure("r", 2)
    assert kv.num_free_pages == 24
    kv.ensure("r", 9)
    assert [kv.page_table("r", p) for p in range(4)] == [[0, 1, 8], [2, 3, 9], [4, 5, 10], [6, 7, 11]]
    kv.ensure("r", 17)  # beyond the reservation of 16 positions: from unclaimed pages
    assert kv.coverage("r") == 20 and kv.num_reserved_pages == 0
    assert not kv.can_ensure("r", 17 + 4 * 4) and kv.can_ensure("r", 17 + 3 * 4)
    with pytest.raises(OutOfPages):
        kv.ensure("r", 17 + 4 * 4)  # 4 more pages per plane; 12 are free
    assert kv.coverage("r") == 20 and kv.num_free_pages == 12  # a refused ensure changes nothing


def test_admission_by_need_grows_from_the_free_pool_and_runs_out():
    """Without a reservation (admission by need) tables grow while free pages last; another
    request's reservation is never drawn on."""
    kv = KVManager(num_planes=2, block_size=4, num_pages=10, page_bytes=1)
    kv.add_request("held", 8)  # reserves 4 pages
    kv.add_request("r")
    assert kv.pages_to_cover("r", 9) == 6 and kv.can_ensure("r", 9)
    kv.ensure("r", 9)
    assert kv.num_free_pages == 4 and kv.num_available_pages == 0
    with pytest.raises(OutOfPages):
        kv.ensure("r", 13)  # the 4 free pages are "held"'s
    kv.ensure("held", 8)
    assert kv.num_free_pages == 0 and kv.num_reserved_pages == 0
    kv.free("r")
    assert kv.num_available_pages == 6


def test_page_table_is_a_copy():
    kv = KVManager(num_planes=1, block_size=2, num_pages=4, page_bytes=1)
    kv.add_request("r", 4)
    kv.ensure("r", 4)
    kv.page_table("r", 0).append(99)
    assert kv.page_table("r", 0) == [0, 1]


def test_unknown_request_and_plane_are_errors():
    kv = KVManager(num_planes=2, block_size=2, num_pages=4, page_bytes=1)
    with pytest.raises(KeyError):
        kv.free("nope")
    with pytest.raises(KeyError):
        kv.ensure("nope", 1)
    kv.add_request("r", 2)
    with pytest.raises(ValueError):
        kv.add_request("r", 2)
    with pytest.raises(IndexError):
        kv.page_table("r", 2)
    with pytest.raises(IndexError):
        kv.frontier("r", -1)


# ----- KVManager: reservations -----


def test_reservation_blocks_a_second_request_until_the_first_frees():
    kv = KVManager(num_planes=2, block_size=4, num_pages=10, page_bytes=1)
    assert kv.pages_for(0) == 0 and kv.pages_for(1) == 2 and kv.pages_for(9) == 6
    kv.add_request("a", 9)  # 6 pages reserved, none allocated yet
    assert kv.num_free_pages == 10 and kv.num_reserved_pages == 6 and kv.num_available_pages == 4
    assert kv.can_admit(8) and not kv.can_admit(9)
    with pytest.raises(OutOfPages):
        kv.add_request("b", 9)
    assert kv.requests() == ["a"]
    kv.ensure("a", 9)
    assert kv.num_free_pages == 4 and kv.num_reserved_pages == 0
    assert not kv.can_admit(9)
    kv.free("a")
    assert kv.can_admit(9) and kv.num_available_pages == 10
    kv.add_request("b", 9)
    assert kv.requests() == ["b"]


def test_fits_ever():
    kv = KVManager(num_planes=4, block_size=16, num_pages=8, page_bytes=1)
    assert kv.fits_ever(32) and not kv.fits_ever(33)
    kv.add_request("a", 32)
    assert kv.fits_ever(32) and not kv.can_admit(1)


def test_truncate_keeps_the_reservation():
    kv = KVManager(num_planes=2, block_size=4, num_pages=8, page_bytes=1)
    kv.add_request("a", 16)
    kv.ensure("a", 16)
    kv.truncate("a", 4)
    assert kv.num_free_pages == 6 and kv.num_reserved_pages == 6
    assert not kv.can_admit(1)  # the freed pages still belong to "a"'s reservation
    kv.ensure("a", 16)
    assert kv.num_free_pages == 0


# ----- KVManager: truncate and free -----


def _written(kv: KVManager, rid: str, n: int) -> None:
    kv.ensure(rid, n)
    for plane in range(kv.num_planes):
        kv.advance(rid, plane, n)


def test_truncate_inside_a_page_keeps_the_page():
    kv = KVManager(num_planes=2, block_size=4, num_pages=16, page_bytes=1)
    kv.add_request("r", 12)
    _written(kv, "r", 10)  # plane 0: [0, 1, 2], plane 1: [3, 4, 5]
    assert kv.truncate("r", 9) == []
    assert [kv.frontier("r", p) for p in range(2)] == [9, 9]
    assert kv.page_table("r", 0) == [0, 1, 2]


def test_truncate_at_a_page_boundary_frees_exactly_the_pages_past_it():
    kv = KVManager(num_planes=2, block_size=4, num_pages=16, page_bytes=1)
    kv.add_request("r", 12)
    _written(kv, "r", 10)
    assert kv.truncate("r", 8) == [2, 5]
    assert kv.page_table("r", 0) == [0, 1] and kv.page_table("r", 1) == [3, 4]
    assert [kv.frontier("r", p) for p in range(2)] == [8, 8]
    assert kv.allocator.refcount(2) == 0 and kv.allocator.refcount(5) == 0
    with pytest.raises(IndexError):
        kv.slot("r", 0, 8)


def test_truncate_across_page_boundaries_then_ensure_regrows():
    kv = KVManager(num_planes=2, block_size=4, num_pages=16, page_bytes=1)
    kv.add_request("r", 12)
    _written(kv, "r", 12)  # plane 0: [0, 1, 2], plane 1: [3, 4, 5]
    assert kv.truncate("r", 3) == [1, 2, 4, 5]
    assert kv.page_table("r", 0) == [0] and kv.page_table("r", 1) == [3]
    assert [kv.frontier("r", p) for p in range(2)] == [3, 3]
    kv.ensure("r", 12)  # fresh pages from the front of the free list
    assert kv.page_table("r", 0) == [0, 6, 7] and kv.page_table("r", 1) == [3, 8, 9]
    kv.advance("r", 0, 12)
    assert kv.frontier("r", 0) == 12 and kv.frontier("r", 1) == 3


def test_truncate_takes_the_min_with_each_plane_frontier():
    kv = KVManager(num_planes=3, block_size=4, num_pages=16, page_bytes=1)
    kv.add_request("r", 12)
    kv.ensure("r", 12)
    for plane, f in enumerate([12, 7, 2]):  # a wavefront: deeper planes lag
        kv.advance("r", plane, f)
    assert kv.truncate("r", 5) == [2, 5, 8]  # pages past position 8 in every plane
    assert [kv.frontier("r", p) for p in range(3)] == [5, 5, 2]
    assert kv.truncate("r", 0) == [0, 1, 3, 4, 6, 7]
    assert [kv.frontier("r", p) for p in range(3)] == [0, 0, 0] and kv.coverage("r") == 0


def test_advance_is_monotone_and_within_coverage():
    kv = KVManager(num_planes=2, block_size=4, num_pages=16, page_bytes=1)
    kv.add_request("r", 16)
    kv.ensure("r", 5)
    kv.advance("r", 1, 5)
    kv.advance("r", 1, 8)  # whole pages are covered
    with pytest.raises(ValueError):
        kv.advance("r", 1, 9)
    with pytest.raises(ValueError):
        kv.advance("r", 1, 7)
    assert kv.frontier("r", 1) == 8 and kv.frontier("r", 0) == 0


def test_free_returns_every_page_and_leaves_other_requests_alone():
    kv = KVManager(num_planes=2, block_size=2, num_pages=16, page_bytes=1)
    kv.add_request("a", 6)
    kv.add_request("b", 4)
    kv.ensure("a", 3)  # a: [0, 1], [2, 3]
    kv.ensure("b", 4)  # b: [4, 5], [6, 7]
    kv.ensure("a", 5)  # a: [0, 1, 8], [2, 3, 9]
    b_tables = [kv.page_table("b", p) for p in range(2)]
    assert sorted(kv.free("a")) == [0, 1, 2, 3, 8, 9]
    assert [kv.page_table("b", p) for p in range(2)] == b_tables
    assert all(kv.allocator.refcount(p) == 1 for t in b_tables for p in t)
    assert kv.requests() == ["b"] and kv.num_reserved_pages == 0
    with pytest.raises(KeyError):
        kv.free("a")
    assert kv.free("b") == [4, 5, 6, 7]
    assert kv.num_free_pages == 16 and kv.usage == 0.0


def test_free_of_an_unallocated_reservation_releases_it():
    kv = KVManager(num_planes=2, block_size=2, num_pages=4, page_bytes=1)
    kv.add_request("a", 4)
    assert not kv.can_admit(1)
    assert kv.free("a") == []
    assert kv.can_admit(4)


# ----- KVManager: accounting -----


def test_bytes_and_usage_accounting():
    kv = KVManager(num_planes=2, block_size=4, num_pages=10, page_bytes=1000)
    kv.add_request("a", 8)  # 4 pages reserved
    assert kv.bytes_used("a") == 0 and kv.total_bytes_used == 0 and kv.usage == pytest.approx(0.4)
    kv.ensure("a", 3)
    assert kv.bytes_used("a") == 2000 and kv.total_bytes_used == 2000 and kv.usage == pytest.approx(0.4)
    kv.add_request("b", 4)
    kv.ensure("b", 4)
    assert kv.bytes_used("b") == 2000 and kv.total_bytes_used == 4000 and kv.usage == pytest.approx(0.6)
    kv.truncate("a", 0)
    assert kv.bytes_used("a") == 0 and kv.total_bytes_used == 2000 and kv.usage == pytest.approx(0.6)
    kv.free("a")
    assert kv.total_bytes_used == 2000 and kv.usage == pytest.approx(0.2)


def test_bookkeeping_does_not_import_torch():
    code = "import specloop.scheduling.kv_manager, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ----- randomized property test against a simple model -----


class _Model:
    """The manager's expected state, written the obvious way: a FIFO free list and dicts."""

    def __init__(self, planes: int, block_size: int, num_pages: int) -> None:
        self.planes, self.bs, self.num_pages = planes, block_size, num_pages
        self.free = collections.deque(range(num_pages))
        self.reserved: dict[str, int] = {}
        self.tables: dict[str, list[list[int]]] = {}
        self.frontiers: dict[str, list[int]] = {}

    def pages_for(self, n: int) -> int:
        return self.planes * -(-n // self.bs)

    def outstanding(self, rid: str) -> int:
        return max(0, self.reserved[rid] - sum(map(len, self.tables[rid])))

    def available(self) -> int:
        return len(self.free) - sum(self.outstanding(r) for r in self.reserved)

    def add(self, rid: str, n: int) -> None:
        self.reserved[rid] = self.pages_for(n)
        self.tables[rid] = [[] for _ in range(self.planes)]
        self.frontiers[rid] = [0] * self.planes

    def ensure(self, rid: str, n: int) -> None:
        grow = -(-n // self.bs) - len(self.tables[rid][0])
        for table in self.tables[rid]:
            table.extend(self.free.popleft() for _ in range(max(grow, 0)))

    def truncate(self, rid: str, frontier: int) -> None:
        keep = -(-frontier // self.bs)
        self.frontiers[rid] = [min(f, frontier) for f in self.frontiers[rid]]
        for table in self.tables[rid]:
            self.free.extend(table[keep:])
            del table[keep:]

    def release(self, rid: str) -> list[int]:
        pages = [p for t in self.tables.pop(rid) for p in t]
        self.free.extend(pages)
        del self.reserved[rid], self.frontiers[rid]
        return pages


def _check_invariants(kv: KVManager, model: _Model) -> None:
    alloc = kv.allocator
    free = alloc.free_list()
    assert free == list(model.free)
    assert len(set(free)) == len(free)
    held = [p for rid in kv.requests() for plane in range(kv.num_planes) for p in kv.page_table(rid, plane)]
    assert len(set(held)) == len(held), "a page is held twice"
    assert sorted(held + free) == list(range(kv.num_pages))
    assert all(alloc.refcount(p) == 1 for p in held) and all(alloc.refcount(p) == 0 for p in free)
    outstanding = sum(model.outstanding(rid) for rid in model.reserved)
    assert kv.num_reserved_pages == outstanding <= kv.num_free_pages
    assert kv.num_available_pages == model.available()
    assert kv.usage == pytest.approx(1 - model.available() / kv.num_pages)
    assert kv.total_bytes_used == len(held) * kv.page_bytes
    assert sorted(kv.requests()) == sorted(model.tables)
    for rid, tables in model.tables.items():
        assert [kv.page_table(rid, p) for p in range(kv.num_planes)] == tables
        assert [kv.frontier(rid, p) for p in range(kv.num_planes)] == model.frontiers[rid]
        assert kv.bytes_used(rid) == sum(map(len, tables)) * kv.page_bytes


def _random_step(kv: KVManager, model: _Model, rng: random.Random, reserve: dict[str, int]) -> str | None:
    """Apply one random operation to both; returns the request it targeted."""
    op = rng.choice(["add", "add", "ensure", "ensure", "advance", "advance", "truncate", "free"])
    names = [f"r{i}" for i in range(8)]
    if op == "add":
        rid, n = rng.choice(names), rng.randint(0, 6 * kv.block_size)
        if rid in model.tables:
            with pytest.raises(ValueError):
                kv.add_request(rid, n)
        elif model.pages_for(n) > model.available():
            assert not kv.can_admit(n)
            with pytest.raises(OutOfPages):
                kv.add_request(rid, n)
        else:
            assert kv.can_admit(n)
            kv.add_request(rid, n)
            model.add(rid, n)
            reserve[rid] = n
        return rid
    if not model.tables:
        return None
    rid = rng.choice(sorted(model.tables))
    if op == "ensure":
        n = rng.randint(0, reserve[rid] + 3 * kv.block_size)
        grow = max(0, model.pages_for(n) - sum(map(len, model.tables[rid])))
        assert kv.pages_to_cover(rid, n) == grow
        if grow > model.outstanding(rid) + model.available():
            assert not kv.can_ensure(rid, n)
            with pytest.raises(OutOfPages):
                kv.ensure(rid, n)
        else:
            assert kv.can_ensure(rid, n)
            kv.ensure(rid, n)
            model.ensure(rid, n)
    elif op == "advance":
        plane = rng.randrange(kv.num_planes)
        current, cover = model.frontiers[rid][plane], len(model.tables[rid][0]) * kv.block_size
        new = rng.randint(max(current - 1, 0), cover + 1)
        if current <= new <= cover:
            kv.advance(rid, plane, new)
            model.frontiers[rid][plane] = new
        else:
            with pytest.raises(ValueError):
                kv.advance(rid, plane, new)
    elif op == "truncate":
        frontier = rng.randint(0, len(model.tables[rid][0]) * kv.block_size + 2)
        before = list(model.free)
        model.truncate(rid, frontier)
        assert kv.truncate(rid, frontier) == list(model.free)[len(before):]
    else:
        assert kv.free(rid) == model.release(rid)
    return rid


@pytest.mark.parametrize("planes,block_size", [(1, 1), (2, 3), (4, 4), (4, 16)])
@pytest.mark.parametrize("seed", range(3))
def test_random_operations_keep_the_invariants(planes, block_size, seed):
    rng = random.Random(seed)
    num_pages = rng.randint(4 * planes, 16 * planes)
    kv = KVManager(planes, block_size, num_pages, page_bytes=rng.randint(1, 4096))
    model = _Model(planes, block_size, num_pages)
    reserve: dict[str, int] = {}
    for _ in range(400):
        others = {r: [kv.page_table(r, p) for p in range(planes)] for r in kv.requests()}
        target = _random_step(kv, model, rng, reserve)
        _check_invariants(kv, model)
        for rid, tables in others.items():
            if rid != target:
                assert [kv.page_table(rid, p) for p in range(planes)] == tables


def test_add_restored_takes_pages_only_past_the_given_back_ones():
    """A restore covering 5 pages a plane with 3, 0, 5 and 1 leading pages given back takes
    11 pages, shows the given-back entries as the sink page, and truncate / free return
    exactly the pages it took (an OutOfPages refusal changes nothing)."""
    kv = KVManager(num_planes=4, block_size=4, num_pages=12, page_bytes=1)
    with pytest.raises(OutOfPages):
        KVManager(num_planes=4, block_size=4, num_pages=10, page_bytes=1).add_restored("r", 5, [3, 0, 5, 1])
    kv.add_restored("r", 5, [3, 0, 5, 1])
    assert kv.held_pages("r") == 11 and kv.num_free_pages == 1 and kv.coverage("r") == 20
    assert [kv.released("r", p) for p in range(4)] == [3, 0, 5, 1]
    assert kv.page_table("r", 2) == [kv.sink_page] * 5 and kv.page_table("r", 0)[:3] == [kv.sink_page] * 3
    taken = {page for p in range(4) for page in kv.page_table("r", p) if page != kv.sink_page}
    assert len(taken) == 11 and taken <= set(range(12))
    kv.truncate("r", 8)  # 2 pages a plane kept: planes 0, 1 and 3 give back 2, 3 and 3 of theirs
    assert kv.held_pages("r") == 2 + 1 and kv.num_free_pages == 9
    kv.free("r")
    assert kv.num_free_pages == 12 and sorted(kv.allocator.free_list()) == list(range(12))
    with pytest.raises(ValueError):
        kv.add_restored("s", 2, [3, 0, 0, 0])


# ----- shared prefix pages (automatic prefix caching) -----


def _cached_kv(num_pages: int, planes: int = 2, block_size: int = 4):
    """A KV manager whose idle cached pages count as room (`KVManager.cache`)."""
    from specloop.scheduling.prefix_cache import PrefixCache

    kv = KVManager(planes, block_size, num_pages, page_bytes=1)
    kv.cache = PrefixCache(kv.allocator, planes, block_size)
    return kv, kv.cache


def _publish_chain(kv: KVManager, cache, rid: str, blocks: int, tag: bytes) -> list[bytes]:
    """`rid` covers `blocks` blocks and offers each to the cache; returns their (fake) hashes."""
    kv.add_request(rid)
    kv.ensure(rid, blocks * kv.block_size)
    hashes = [tag + bytes([i]) * 31 for i in range(blocks)]
    for i, h in enumerate(hashes):
        assert cache.publish(h, tuple(kv.page_table(rid, p)[i] for p in range(kv.num_planes)),
                             hashes[i - 1] if i else None)
    return hashes


def test_a_prefix_heads_every_plane_with_a_reference_of_its_own():
    kv, cache = _cached_kv(12)
    hashes = _publish_chain(kv, cache, "a", 2, b"a")
    tables = [kv.page_table("a", p) for p in range(2)]
    kv.free("a")  # the cache keeps the pages
    assert kv.num_free_pages == 8 and all(kv.allocator.refcount(p) == 1 for t in tables for p in t)
    kv.add_request("b", prefix=cache.lookup(hashes))
    assert [kv.page_table("b", p) for p in range(2)] == tables
    assert [kv.frontier("b", p) for p in range(2)] == [8, 8] and kv.coverage("b") == 8
    assert all(kv.allocator.refcount(p) == 2 for t in tables for p in t)
    kv.ensure("b", 10)  # one page a plane past the prefix, from the free list
    assert kv.held_pages("b") == 6 and kv.num_free_pages == 6
    own = [kv.page_table("b", p)[2] for p in range(2)]
    assert kv.free("b") == own and kv.num_free_pages == 8  # the shared pages stay with the cache
    assert all(kv.allocator.refcount(p) == 1 for t in tables for p in t)
    cache.check()


def test_a_failed_admission_with_a_prefix_changes_nothing():
    kv, cache = _cached_kv(8)
    hashes = _publish_chain(kv, cache, "a", 2, b"a")  # a holds 4 pages (and the cache its references)
    prefix = cache.lookup(hashes)
    with pytest.raises(OutOfPages):  # 5 pages a plane reserved, the first shared: 8 new > 4 free
        kv.add_request("b", reserve_tokens=4 * 5, prefix=prefix[:1])
    assert "b" not in kv.requests() and all(kv.allocator.refcount(p) == 2 for b in prefix for p in b)
    with pytest.raises(ValueError):
        kv.add_request("b", prefix=[(0,)])  # one page per plane
    assert "b" not in kv.requests()


def test_reservations_and_growth_evict_idle_blocks_before_running_out():
    """Idle cached pages are room: a reservation or a table that outgrows the free pages
    evicts them (least recently used leaf first), keeping free >= reserved; pages a request
    holds are never evicted."""
    kv, cache = _cached_kv(12)
    old = _publish_chain(kv, cache, "a", 2, b"a")
    kv.free("a")
    new = _publish_chain(kv, cache, "b", 2, b"b")
    kv.free("b")
    assert kv.num_free_pages == 4 and cache.num_cached_blocks == 4
    assert kv.can_admit(4 * 3) and not kv.can_admit(4 * 7)  # 4 free + 8 evictable
    kv.add_request("c", reserve_tokens=4 * 3)  # 6 pages reserved: one block (a's last) goes
    assert kv.num_reserved_pages == 6 <= kv.num_free_pages == 6
    assert old[1] not in cache and old[0] in cache and all(h in cache for h in new)
    kv.add_request("d", prefix=cache.lookup(new))  # d holds b's blocks: they can no longer go
    assert kv.can_ensure("c", 4 * 4) and not kv.can_ensure("c", 4 * 5)
    kv.ensure("c", 4 * 4)  # 8 pages: 6 reserved, 2 from a's first block
    assert cache.num_cached_blocks == 2 and kv.num_free_pages == 0 and kv.num_reserved_pages == 0
    with pytest.raises(OutOfPages):
        kv.ensure("d", 4 * 3)
    cache.check()


def test_truncate_never_drops_a_shared_page():
    kv, cache = _cached_kv(12)
    hashes = _publish_chain(kv, cache, "a", 2, b"a")
    kv.free("a")
    kv.add_request("b", prefix=cache.lookup(hashes))
    kv.ensure("b", 12)
    tables = [kv.page_table("b", p) for p in range(2)]
    with pytest.raises(ValueError, match="shared"):
        kv.truncate("b", 3)
    assert [kv.page_table("b", p) for p in range(2)] == tables and kv.frontier("b", 0) == 8
    assert kv.truncate("b", 8) == [tables[0][2], tables[1][2]]  # past the prefix: its own pages
