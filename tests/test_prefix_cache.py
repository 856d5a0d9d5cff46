"""The prefix cache: chained block hashes, lookup, publish, reference ownership and
eviction of idle leaves in LRU order; a stateful test against a plain model."""

from __future__ import annotations

import collections
import os
import subprocess
import sys

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from specloop.scheduling.kv_manager import PageAllocator
from specloop.scheduling.prefix_cache import HASH_BYTES, PrefixCache, block_hashes, identity_salt

SALT = identity_salt({"model": "ouro-tiny", "token_sparse_prefill": {"enabled": False}})


def _cache(num_pages: int = 16, num_planes: int = 2, block_size: int = 2) -> PrefixCache:
    return PrefixCache(PageAllocator(num_pages), num_planes, block_size)


def _write(cache: PrefixCache, tokens: list[int], salt: str = SALT) -> tuple[list[bytes], list[tuple[int, ...]]]:
    """A request that computed every full block of `tokens` and published them in order;
    returns its hashes and its blocks (it still holds its own reference on each page)."""
    hashes = block_hashes(tokens, cache.block_size, salt)
    pages = cache.allocator.allocate(len(hashes) * cache.num_planes)
    blocks = [tuple(pages[i * cache.num_planes:(i + 1) * cache.num_planes]) for i in range(len(hashes))]
    for i, (block_hash, block) in enumerate(zip(hashes, blocks)):
        assert cache.publish(block_hash, block, hashes[i - 1] if i else None)
    return hashes, blocks


def _release(cache: PrefixCache, blocks: list[tuple[int, ...]]) -> None:
    cache.allocator.decref([page for block in blocks for page in block])


# ----- hashing -----


def test_one_hash_per_full_block():
    assert len(block_hashes(range(7), 3, SALT)) == 2  # the partial block [6] gets none
    assert len(block_hashes(range(6), 3, SALT)) == 2
    assert block_hashes([1, 2], 3, SALT) == [] and block_hashes([], 3, SALT) == []
    assert all(len(h) == HASH_BYTES for h in block_hashes(range(9), 3, SALT))
    assert block_hashes(range(7), 3, SALT) == block_hashes(range(8), 3, SALT)


def test_equal_tokens_and_salt_hash_equal_and_the_identity_separates():
    tokens = [5, 6, 7, 8]
    assert block_hashes(tokens, 2, SALT) == block_hashes(list(tokens), 2, SALT.encode())
    other = identity_salt({"model": "ouro-tiny", "token_sparse_prefill": {"enabled": True}})
    assert set(block_hashes(tokens, 2, SALT)).isdisjoint(block_hashes(tokens, 2, other))
    # the block size is part of the root: blocks of 2 never meet blocks of 4
    assert block_hashes(tokens, 4, SALT)[0] not in block_hashes(tokens + tokens, 2, SALT)


def test_a_block_hashes_differently_after_a_different_prefix():
    a = block_hashes([1, 2, 9, 9], 2, SALT)
    b = block_hashes([3, 4, 9, 9], 2, SALT)
    assert a[0] != b[0] and a[1] != b[1]
    assert block_hashes([9, 9, 1, 2], 2, SALT)[1] != block_hashes([1, 2], 2, SALT)[0]
    assert block_hashes([1, 2, 9, 8], 2, SALT)[0] == a[0]  # a shared prefix shares its hashes


def test_parent_continues_a_chain():
    tokens = list(range(10))
    full = block_hashes(tokens, 2, SALT)
    assert block_hashes(tokens[4:], 2, "ignored", parent=full[1]) == full[2:]
    with pytest.raises(ValueError):
        block_hashes(tokens, 2, SALT, parent=b"short")


def test_bad_tokens_and_block_size_raise():
    with pytest.raises(ValueError):
        block_hashes([1, -1], 2, SALT)
    with pytest.raises(ValueError):
        block_hashes([1, 2**64], 2, SALT)
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0, SALT)


def test_identity_salt_is_sorted_json_and_refuses_unordered_values():
    assert identity_salt({"b": 1, "a": {"y": 2, "x": 1}}) == '{"a":{"x":1,"y":2},"b":1}'
    assert identity_salt({"a": 1, "b": 2}) == identity_salt({"b": 2, "a": 1})
    with pytest.raises(TypeError):
        identity_salt({"a": {1, 2}})
    with pytest.raises(ValueError):
        identity_salt({"a": float("nan")})


def test_hashes_are_the_same_in_another_process_and_need_no_torch():
    code = ("import sys; from specloop.scheduling.prefix_cache import block_hashes, identity_salt; "
            "print(block_hashes(range(8), 4, identity_salt({'m': 'x', 'r': 4}))[1].hex()); "
            "assert 'torch' not in sys.modules")
    expected = block_hashes(range(8), 4, identity_salt({"r": 4, "m": "x"}))[1].hex()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == expected


# ----- lookup and publish -----


def test_lookup_returns_the_leading_hits_and_stops_at_the_first_miss():
    cache = _cache()
    hashes, blocks = _write(cache, [1, 2, 3, 4, 5, 6])
    assert cache.lookup(hashes) == blocks
    other = block_hashes([1, 2, 7, 7, 5, 6], 2, SALT)
    assert other[0] == hashes[0] and other[1] != hashes[1]
    assert cache.lookup(other) == blocks[:1]
    assert cache.lookup([other[0], other[1], hashes[2]]) == blocks[:1]  # hashes[2] is cached, past a miss
    assert cache.lookup(block_hashes([9, 9], 2, SALT)) == []
    assert cache.lookup([]) == []
    assert (cache.query_tokens, cache.hit_blocks) == (20, 5)
    assert cache.stats() == {"prefix_cache_queries": 20, "prefix_cache_hits": 10}
    assert cache.lookup(hashes, max_hits=2, tokens=7) == blocks[:2]  # a request of 7 tokens, 2 blocks usable
    assert cache.stats() == {"prefix_cache_queries": 27, "prefix_cache_hits": 14}
    cache.check()


def test_lookup_takes_no_reference_and_acquire_does():
    cache = _cache()
    hashes, blocks = _write(cache, [1, 2, 3, 4])
    refs = [cache.allocator.refcount(p) for b in blocks for p in b]
    hits = cache.lookup(hashes)
    assert [cache.allocator.refcount(p) for b in blocks for p in b] == refs == [2, 2, 2, 2]
    cache.acquire(hits)
    assert [cache.allocator.refcount(p) for b in blocks for p in b] == [3, 3, 3, 3]
    cache.check()


def test_publish_takes_one_reference_and_a_duplicate_changes_nothing():
    cache = _cache()
    alloc = cache.allocator
    [h0] = block_hashes([1, 2], 2, SALT)
    mine, theirs = tuple(alloc.allocate(2)), tuple(alloc.allocate(2))
    assert cache.publish(h0, mine, None)
    assert [alloc.refcount(p) for p in mine] == [2, 2] and cache.pages(h0) == mine
    assert not cache.publish(h0, theirs, None)  # the second request keeps its own pages
    assert [alloc.refcount(p) for p in theirs] == [1, 1] and cache.pages(h0) == mine
    assert cache.num_cached_blocks == 1
    cache.check()


def test_publish_refuses_a_block_whose_parent_is_not_cached():
    cache = _cache()
    hashes = block_hashes([1, 2, 3, 4], 2, SALT)
    pages = tuple(cache.allocator.allocate(2))
    assert not cache.publish(hashes[1], pages, hashes[0])  # lookup could never reach it
    assert cache.num_cached_blocks == 0 and cache.allocator.refcount(pages[0]) == 1
    cache.check()


def test_publish_refuses_a_block_whose_cached_parent_is_a_twins():
    """Two requests computed the same first block; the one whose copy was not cached may not
    hang its second block under the other's (it would keep that idle chain from eviction
    while only it runs); the one whose copy was cached may."""
    cache = _cache()
    alloc = cache.allocator
    h0, h1 = block_hashes([1, 2, 3, 4], 2, SALT)
    first, twin = tuple(alloc.allocate(2)), tuple(alloc.allocate(2))
    assert cache.publish(h0, first, None) and not cache.publish(h0, twin, None)
    second = tuple(alloc.allocate(2))
    assert not cache.publish(h1, second, h0, twin)
    assert h1 not in cache and [alloc.refcount(p) for p in second] == [1, 1]
    assert cache.publish(h1, second, h0, first)
    cache.check()


def test_publish_rejects_bad_pages_and_changes_nothing():
    cache = _cache(num_planes=2)
    alloc = cache.allocator
    hashes = block_hashes([1, 2, 3, 4, 5, 6], 2, SALT)
    pages = tuple(alloc.allocate(2))
    assert cache.publish(hashes[0], pages, None)
    with pytest.raises(ValueError):  # a page in two cached blocks
        cache.publish(hashes[1], (pages[0], alloc.allocate(1)[0]), hashes[0])
    with pytest.raises(ValueError):  # one page per plane
        cache.publish(hashes[1], tuple(alloc.allocate(3)), hashes[0])
    with pytest.raises(ValueError):
        cache.publish(hashes[1], (pages[1], pages[1]), hashes[0])
    with pytest.raises(ValueError):  # a free page
        cache.publish(hashes[1], (alloc.free_list()[0], alloc.free_list()[1]), hashes[0])
    assert cache.num_cached_blocks == 1 and hashes[1] not in cache
    cache.check()


# ----- eviction -----


def test_eviction_takes_idle_blocks_least_recently_used_first_and_chains_from_the_end():
    cache = _cache(num_pages=16)
    a_hashes, a = _write(cache, [1, 1, 2, 2, 3, 3])
    b_hashes, b = _write(cache, [4, 4, 5, 5])
    _release(cache, a + b)
    assert cache.num_evictable_pages == 10
    cache.lookup(a_hashes)  # a is now the more recent chain
    assert cache.evict(1) == list(b[1])  # at least one page: one whole block, b's last
    assert cache.evict(2) == list(b[0])
    assert cache.evict(3) == list(a[2] + a[1])
    assert cache.lookup(a_hashes) == a[:1]
    assert cache.evict(100) == list(a[0])
    assert cache.num_cached_blocks == 0 and cache.allocator.num_free == 16
    cache.check()


def test_a_parent_goes_right_after_its_last_child_when_it_is_older():
    cache = _cache(num_pages=16)
    hashes, blocks = _write(cache, [1, 1, 2, 2])  # published in order: the parent is older
    other_hashes, other = _write(cache, [7, 7])
    _release(cache, blocks + other)
    cache.touch(other_hashes)
    cache.touch(hashes[1:])  # the child is the most recent block, its parent the oldest
    assert cache.evict(1) == list(other[0])  # the oldest idle leaf
    assert cache.evict(4) == list(blocks[1] + blocks[0])
    cache.check()


def test_blocks_in_use_are_never_freed_and_ancestors_go_last():
    cache = _cache(num_pages=16)
    hashes, blocks = _write(cache, [1, 1, 2, 2, 3, 3])
    _release(cache, blocks)
    cache.acquire(cache.lookup(hashes[:2]))  # a request uses the first two blocks
    assert cache.num_evictable_pages == 2
    assert cache.evict(100) == list(blocks[2])
    assert cache.evict(100) == [] and cache.num_cached_blocks == 2
    assert not cache.is_idle(hashes[0]) and not cache.is_idle(hashes[1])
    cache.check()
    # a request holding only a later block (an INT4 request gave its first pages back): its idle
    # ancestor goes once no idle leaf is left, and takes the block in use out of the cache with it
    # (unreachable without its parent); that block's pages stay with the request
    cache2 = _cache(num_pages=16)
    hashes, blocks = _write(cache2, [1, 1, 2, 2])
    _, other = _write(cache2, [7, 7])
    cache2.allocator.decref(list(blocks[0]) + list(other[0]))
    assert cache2.is_idle(hashes[0]) and cache2.num_evictable_pages == 4
    assert cache2.evict(2) == list(other[0])  # an idle leaf first
    assert cache2.evict(2) == list(blocks[0]) and cache2.num_cached_blocks == 0
    assert all(cache2.allocator.refcount(p) == 1 for p in blocks[1])  # the request's
    cache2.check()


def test_evict_frees_as_many_as_it_can():
    cache = _cache(num_pages=12, num_planes=3)
    hashes, blocks = _write(cache, [1, 1, 2, 2])
    assert cache.evict(6) == []  # the request still holds them
    _release(cache, blocks[1:])
    assert cache.evict(6) == list(blocks[1])  # its parent is still in use
    assert cache.evict(0) == []
    cache.check()


def test_can_evict_answers_without_evicting_and_honours_pinned_blocks():
    cache = _cache(num_pages=16)
    hashes, blocks = _write(cache, [1, 1, 2, 2, 3, 3])
    _release(cache, blocks)
    assert cache.cached_prefix(hashes) == 3 and cache.cached_prefix([bytes(32)] + hashes) == 0
    assert cache.stats() == {"prefix_cache_queries": 0, "prefix_cache_hits": 0}  # asking counts nothing
    assert cache.can_evict(6) and not cache.can_evict(7)
    assert cache.can_evict(2, pinned=hashes[:2]) and not cache.can_evict(3, pinned=hashes[:2])
    assert not cache.can_evict(1, pinned=hashes)
    assert cache.num_cached_blocks == 3 and cache.allocator.num_free == 10
    cache.check()


def test_clear_drops_every_idle_block_and_keeps_those_in_use():
    cache = _cache(num_pages=20)
    hashes, blocks = _write(cache, [1, 1, 2, 2, 3, 3])
    _, other = _write(cache, [4, 4])
    _release(cache, blocks + other)
    hits = cache.lookup(block_hashes([1, 1, 5, 5], 2, SALT))
    cache.acquire(hits)  # a second request shares the first block
    assert sorted(cache.clear()) == sorted(blocks[1] + blocks[2] + other[0])
    assert cache.num_cached_blocks == 1 and hashes[0] in cache
    _release(cache, hits)
    assert cache.clear() == list(blocks[0]) and cache.num_cached_blocks == 0
    assert cache.allocator.num_free == 20
    cache.check()


# ----- stateful: random requests against a plain model -----

BLOCK, PLANES, PAGES = 2, 2, 20
PREFIXES = ([], [0, 1], [0, 1, 1, 1], [0, 1, 1, 1, 0, 0], [1, 0, 1])  # shared system prompts
SALTS = (identity_salt({"model": "a"}),) * 3 + (identity_salt({"model": "b"}),)  # mostly one identity


class _Request:
    def __init__(self, hashes: list[bytes], blocks: list[tuple[int, ...]], hits: int) -> None:
        self.hashes = hashes  # one per full block
        self.blocks = blocks  # every block of the prompt, the partial last one included
        self.hits = hits  # leading blocks that came from the cache


class PrefixCacheMachine(RuleBasedStateMachine):
    """Requests over a small pool and a two-token vocabulary, so prefixes meet often. The
    model keeps the cached blocks (hash -> pages, parent) and their recency as a list, and
    evicts by the policy written naively: repeatedly the oldest idle leaf, then the oldest
    idle blocks with a block in use below them, each with its subtree."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = PageAllocator(PAGES)
        self.cache = PrefixCache(self.alloc, PLANES, BLOCK)
        self.requests: list[_Request] = []
        self.cached: dict[bytes, tuple[tuple[int, ...], bytes | None]] = {}
        self.order: list[bytes] = []  # least recently used first
        self.queries = self.hits = 0

    # --- the model ---

    def _held(self) -> collections.Counter[int]:
        return collections.Counter(p for req in self.requests for block in req.blocks for p in block)

    def _touch(self, hashes: list[bytes]) -> None:
        for h in reversed(hashes):
            if h in self.cached:
                self.order.remove(h)
                self.order.append(h)

    def _evictable(self, gone: list[bytes]) -> list[bytes]:
        """Idle leaves once `gone` are dropped, oldest first."""
        held = self._held()
        parents = {self.cached[h][1] for h in self.cached if h not in gone}
        return [h for h in self.order if h not in gone and h not in parents
                and not any(held[p] for p in self.cached[h][0])]

    def _idle(self, h: bytes) -> bool:
        held = self._held()
        return not any(held[p] for p in self.cached[h][0])

    def _evict(self, num_pages: int) -> None:
        victims: list[bytes] = []
        while len(victims) * PLANES < num_pages:
            candidates = self._evictable(victims)
            if not candidates:
                break
            victims.append(candidates[0])
        # then idle blocks with a block in use below them, oldest first, each with its subtree
        idle = {h for h in self.cached if self._idle(h)}
        freed_blocks = len(victims)
        for h in self.order:
            if freed_blocks * PLANES >= num_pages:
                break
            if h in victims or h not in idle:
                continue
            subtree: list[bytes] = []

            def below(x: bytes) -> None:
                for child in [c for c in self.order if self.cached[c][1] == x and c not in victims + subtree]:
                    below(child)
                subtree.append(x)
            below(h)
            victims += subtree
            freed_blocks += sum(x in idle for x in subtree)
        refcounts = {p: self.alloc.refcount(p) for h in victims if h in idle for p in self.cached[h][0]}
        assert self.cache.can_evict(num_pages) == (freed_blocks * PLANES >= num_pages)  # the same walk, dry
        freed = self.cache.evict(num_pages)
        assert freed == [p for h in victims if h in idle for p in self.cached[h][0]]
        assert all(count == 1 for count in refcounts.values())  # only the cache held them
        for h in victims:
            del self.cached[h]
            self.order.remove(h)
        assert len(freed) >= num_pages or not any(self._idle(h) for h in self.cached)

    # --- rules ---

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 1), max_size=4),
          salt=st.sampled_from(SALTS), prefill=st.booleans())
    def start_request(self, prefix, suffix, salt, prefill):
        """Look up, take the hits, allocate the rest (evicting if short); `prefill`: the
        prompt is then written and its full blocks published in order."""
        tokens = prefix + suffix
        hashes = block_hashes(tokens, BLOCK, salt)
        lookable = hashes[:max(0, len(tokens) - 1) // BLOCK]  # the last prompt token is recomputed
        expected = []
        for h in lookable:
            if h not in self.cached:
                break
            expected.append(self.cached[h][0])
        assert self.cache.cached_prefix(lookable) == len(expected)  # asked first, nothing counted
        hits = self.cache.lookup(lookable)
        assert hits == expected  # never an evicted block
        self.queries += len(lookable)
        self.hits += len(hits)
        self._touch(lookable[:len(hits)])
        self.cache.acquire(hits)
        req = _Request(hashes, list(hits), len(hits))
        self.requests.append(req)  # holding its hits while it evicts for the rest
        need = (-(-len(tokens) // BLOCK) - len(hits)) * PLANES
        if need > self.alloc.num_free:
            self._evict(need - self.alloc.num_free)
        if need > self.alloc.num_free:  # does not fit: give the hits back
            self.requests.pop()
            self.alloc.decref([p for block in hits for p in block])
            return
        pages = self.alloc.allocate(need)
        req.blocks += [tuple(pages[i:i + PLANES]) for i in range(0, need, PLANES)]
        if prefill:
            self.publish_all(len(self.requests) - 1)

    @precondition(lambda self: self.requests)
    @rule(pick=st.integers(0, 99), index=st.integers(0, 4))
    def publish(self, pick, index):
        """A block offered in any order: out of order, its parent may be missing."""
        req = self.requests[pick % len(self.requests)]
        if index >= len(req.hashes):
            return
        h, parent = req.hashes[index], req.hashes[index - 1] if index else None
        expected = h not in self.cached and (parent is None or parent in self.cached)
        assert self.cache.publish(h, req.blocks[index], parent) == expected
        if expected:
            self.cached[h] = (req.blocks[index], parent)
            self.order.append(h)

    @precondition(lambda self: self.requests)
    @rule(pick=st.integers(0, 99))
    def publish_all(self, pick):
        req = self.requests[pick % len(self.requests)]
        for index in range(req.hits, len(req.hashes)):
            self.publish(pick, index)

    @precondition(lambda self: self.requests)
    @rule(pick=st.integers(0, 99), touch=st.booleans())
    def finish_request(self, pick, touch):
        req = self.requests.pop(pick % len(self.requests))
        self.alloc.decref([p for block in req.blocks for p in block])
        if touch:  # what the scheduler may do on a finish: its blocks become the most recent
            self.cache.touch(req.hashes)
            self._touch(req.hashes)

    @precondition(lambda self: self.cached)
    @rule(num_pages=st.integers(0, 12))
    def evict(self, num_pages):
        self._evict(num_pages)

    @precondition(lambda self: self.cached)
    @rule()
    def clear(self):
        self._evict(len(self.cached) * PLANES)
        assert self.cache.num_evictable_pages == 0

    # --- invariants ---

    @invariant()
    def pages_are_accounted_for(self):
        self.cache.check()
        held = self._held()
        cached = collections.Counter(p for pages, _ in self.cached.values() for p in pages)
        assert max(cached.values(), default=0) <= 1  # no page in two cached blocks
        for page in range(PAGES):
            assert self.alloc.refcount(page) == held[page] + cached[page]
        assert self.alloc.num_free + sum(1 for p in range(PAGES) if self.alloc.refcount(p)) == PAGES
        assert sorted(self.alloc.free_list()) == [p for p in range(PAGES) if not self.alloc.refcount(p)]

    @invariant()
    def cache_matches_the_model(self):
        assert self.cache.num_cached_blocks == len(self.cached)
        for h, (pages, _) in self.cached.items():
            assert self.cache.pages(h) == pages
        assert self.cache.num_evictable_pages == sum(self._idle(h) for h in self.cached) * PLANES
        held = self._held()
        cached = {p for pages, _ in self.cached.values() for p in pages}
        assert self.cache.num_idle_pages == sum(page in cached and not held[page] for page in range(PAGES))
        assert self.cache.stats() == {"prefix_cache_queries": self.queries * BLOCK,
                                      "prefix_cache_hits": self.hits * BLOCK}


PrefixCacheMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
test_prefix_cache_machine = PrefixCacheMachine.TestCase
