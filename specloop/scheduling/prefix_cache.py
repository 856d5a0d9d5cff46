"""Automatic prefix caching: full prompt blocks, kept by content, shared between requests.

A *block* is one full block of `block_size` prompt positions at every depth plane: a
tuple of `num_planes` page ids, entry p being the page that holds those positions in
plane p. Blocks are found by content, never by request: block i of a prompt is named by
a hash chained over everything before it,

    root    = H_root(block_size, salt)
    hash[i] = H_block(hash[i-1] or root, token ids of block i)

so equal hashes mean an equal prefix, and a block's KV at every plane is a function of
its prefix alone (attention is causal, and a token's exit depth depends only on its own
prefix). The *salt* is the cache identity: model, dtype, backend and the effective
FlashLoop configuration, in one string (`identity_salt`); different identities never
share a block. Hashes are blake2b over a fixed little-endian encoding, the same in every
process (never Python's `hash`, which is salted per process).

Reference ownership (`PageAllocator` counts): the cache holds one reference on every page
of every cached block, so cached pages are never free; a request that puts a cached
block in its tables takes a reference of its own (`acquire`). A block is therefore *in
use* while any of its pages has refcount > 1, and *idle* when only the cache holds it
(every page at refcount 1). Nobody tells the cache when a request drops its references
(`KVManager.free` decrefs the allocator directly), so idleness is read from the
refcounts when needed, never tracked.

Eviction: descendants first. The cached blocks form a forest (each block's parent is the
block before it in the chain), and idle *leaves* (no cached child) are evicted first, the
least recently used first; a parent becomes a candidate once its last child has gone.
This keeps every cached block reachable: `lookup` walks a chain from its root, so a
block whose parent is gone could never be hit again while still holding `num_planes`
pages. Only when those fall short does eviction drop an idle block that has a block in
use below it, with every cached block below it (those in use keep their pages for their
requests and leave the cache): a running INT4 request gives its leading prompt pages back
while its later blocks are still in its tables, and they would otherwise pin the chain.
`publish` refuses a block whose parent is not cached. Recency is the last lookup
hit, publish or `touch` (the scheduler may touch a finishing request's blocks, so that
they are the last to go, as in vLLM's free queue); hits are marked deepest first, so the
walk from the old end meets a chain's later blocks before its earlier ones and rarely
passes over a parent.

Integration (`Scheduler`, `KVManager`; the engine option `enable_prefix_caching`):
- the scheduler computes a request's hashes once, looks up
  `hashes[:(num_host_tokens - 1) // block_size]` (the last host token is always
  recomputed: its final hidden state feeds the head), puts the hit pages at the head of
  every plane's table with references of the request's own (`KVManager.add_request(prefix=
  ...)`, the increfs `acquire` makes) and starts every depth's frontier past them: cached
  blocks are skipped at every depth, not only at depth 0;
- a request publishes block i (`publish(hashes[i], pages, hashes[i - 1] if i else None)`)
  once the ticket of the plan whose group finished it at the last depth has completed:
  every plane and layer of it is written then, and prompt rows are never rolled back;
- admission and `KVManager.ensure` count what the cache can evict (`can_evict`, which
  takes the admitted request's own hits as pinned) only when the free list falls short,
  and `evict` runs before `OutOfPages` or a preemption; `KVManager.truncate` refuses to
  drop a shared page, so a reservation never counts one as re-allocatable (kv_manager's
  note on invariant 3);
- token-sparse prefill: a window's selection depends on every token of the window, so
  the scheduler looks up and offers whole windows only (`PromptPlanning.shared_prefix`);
- INT4 residuals (`kv_residual_quantization`): the cache holds the BF16 pages as ever; a
  request keeps its prompt pages until it has offered them (its planes would otherwise give
  them back as its groups seal), and a request that hits them encodes its own group records
  from them (records are never shared: `PackedResiduals.adopt`), with rows where the
  publisher's planes had them (noted per page slot by the plan that finished the block).

Costs: `lookup`, `touch`, `publish` and `acquire` are O(blocks touched). `evict` walks
the recency order from its old end and stops once it has freed enough: O(blocks freed +
older blocks passed over because they are in use or still have children).
`can_evict` is the same walk without dropping anything. `num_evictable_pages` and
`check` scan every cached block. Nothing here imports torch.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import struct
from collections.abc import Iterable, Mapping, Sequence

from specloop.scheduling.kv_manager import PageAllocator

HASH_BYTES = 32
# blake2b personalisations (<= 16 bytes): a root is never the digest of a block, whatever
# the salt and the tokens.
_ROOT_PERSON = b"specloop.root"
_BLOCK_PERSON = b"specloop.block"


def identity_salt(fields: Mapping[str, object]) -> str:
    """The salt for an identity given as JSON-able fields (model name, dtype, backend, the
    effective FlashLoop groups ...): sorted, compact JSON, so equal identities give equal
    salts in every process. Non-JSON values (sets, objects, NaN) raise rather than being
    encoded in some order."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def root_hash(block_size: int, salt: bytes | str) -> bytes:
    """The parent of a chain's first block: the identity and the block size."""
    if isinstance(salt, str):
        salt = salt.encode("utf-8")
    digest = hashlib.blake2b(struct.pack("<Q", block_size), digest_size=HASH_BYTES, person=_ROOT_PERSON)
    digest.update(salt)
    return digest.digest()


def block_hashes(tokens: Sequence[int], block_size: int, salt: bytes | str,
                 parent: bytes | None = None) -> list[bytes]:
    """One chained hash per full block of `tokens`; a trailing partial block gets none.

    `parent`: the hash of the block just before `tokens[0]`, to continue a chain hashed
    earlier (the salt is then already in the chain and is not read again); None starts at
    the root of `salt`."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if parent is None:
        parent = root_hash(block_size, salt)
    elif len(parent) != HASH_BYTES:
        raise ValueError(f"parent must be a {HASH_BYTES}-byte block hash, got {len(parent)} bytes")
    encode = struct.Struct(f"<{block_size}Q").pack
    hashes = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        try:
            data = encode(*tokens[start:start + block_size])
        except struct.error as exc:
            raise ValueError(f"token ids must be integers in [0, 2**64): {exc}") from None
        parent = hashlib.blake2b(parent + data, digest_size=HASH_BYTES, person=_BLOCK_PERSON).digest()
        hashes.append(parent)
    return hashes


@dataclasses.dataclass(slots=True)
class _Block:
    pages: tuple[int, ...]  # one page per plane
    parent: bytes | None  # the previous block's hash; None for a chain's first block
    children: int  # cached blocks whose parent this is
    tick: int  # last use; the recency order is sorted by it


class PrefixCache:
    """Full prompt blocks by chained hash over a `PageAllocator`; LRU eviction of idle
    leaves (see the module docstring for ownership and policy).

    Invariants (`check`, run after every step by tests/test_prefix_cache.py):

    1. Every page of a cached block has refcount >= 1, one of those references being the
       cache's; no page belongs to two cached blocks, and each block has one page per plane.
    2. A cached block's parent is cached (or it is a chain's first block), and each block's
       child count is the number of cached blocks naming it as parent.
    3. The recency order holds exactly the cached blocks, sorted by their ticks.
    4. Every page with more than one reference is a cached block's (only the cache shares
       pages), and the allocator's count of such pages is right (`num_idle_pages` needs both).
    """

    def __init__(self, allocator: PageAllocator, num_planes: int, block_size: int) -> None:
        if num_planes < 1 or block_size < 1:
            raise ValueError(f"num_planes ({num_planes}) and block_size ({block_size}) must be >= 1")
        self.allocator = allocator
        self.num_planes = num_planes
        self.block_size = block_size
        self._blocks: dict[bytes, _Block] = {}
        self._recency: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # oldest first
        self._owner: dict[int, bytes] = {}  # page -> the cached block holding it
        self._clock = 0
        self.query_tokens = 0  # positions requests asked for at `lookup` (vLLM counts a request's every token)
        self.hit_blocks = 0  # of those, found
        self.evicted_blocks = 0  # dropped by `evict` to make room

    # ----- queries -----

    @property
    def num_cached_blocks(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def pages(self, block_hash: bytes) -> tuple[int, ...]:
        """The pages of a cached block (KeyError if it is not cached); no recency change."""
        return self._blocks[block_hash].pages

    def is_idle(self, block_hash: bytes) -> bool:
        """Whether only the cache holds the block (every page at refcount 1)."""
        return self._idle(self._blocks[block_hash])

    @property
    def num_idle_pages(self) -> int:
        """Pages only the cache holds, in O(1): every cached page less those a request holds
        too (only the cache shares pages, so those are the allocator's shared pages). A block
        that a request holds at some planes only (INT4 planes give leading pages back at
        their own pace) counts its other pages here, though `evict` takes whole blocks."""
        return len(self._owner) - self.allocator.num_shared

    @property
    def num_evictable_pages(self) -> int:
        """Pages `evict` could free now: those of every idle block (a scan of every block;
        ask only when the free list falls short)."""
        return sum(self._idle(block) for block in self._blocks.values()) * self.num_planes

    def cached_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many leading `hashes` are cached: what `lookup` would hit, without counting a
        query or changing recency (admission asks before it knows the request fits)."""
        hits = 0
        for block_hash in hashes:
            if block_hash not in self._blocks:
                break
            hits += 1
        return hits

    def stats(self) -> dict[str, int]:
        """Counters in tokens, as vLLM reports them: positions looked up and positions hit."""
        return {"prefix_cache_queries": self.query_tokens,
                "prefix_cache_hits": self.hit_blocks * self.block_size}

    # ----- requests -----

    def lookup(self, hashes: Sequence[bytes], max_hits: int | None = None,
               tokens: int | None = None) -> list[tuple[int, ...]]:
        """The pages of the longest run of leading `hashes` that are cached (stops at the
        first miss, or after `max_hits`: a caller that can use only whole windows of
        them); counts the query (`tokens`: the request's positions, as vLLM counts them;
        default the hashes' blocks) and the hits and marks the hits recently used. Takes
        no reference: the caller `acquire`s the pages it puts in its tables."""
        hits = []
        for block_hash in hashes[:max_hits]:
            block = self._blocks.get(block_hash)
            if block is None:
                break
            hits.append(block.pages)
        self.query_tokens += len(hashes) * self.block_size if tokens is None else tokens
        self.hit_blocks += len(hits)
        self.touch(hashes[:len(hits)])
        return hits

    def touch(self, hashes: Sequence[bytes]) -> None:
        """Mark the cached ones of `hashes` (one chain, root first) recently used, deepest
        first so that the chain's earlier blocks end up the more recent."""
        for block_hash in reversed(hashes):
            block = self._blocks.get(block_hash)
            if block is not None:
                self._clock += 1
                block.tick = self._clock
                self._recency.move_to_end(block_hash)

    def acquire(self, blocks: Iterable[tuple[int, ...]]) -> None:
        """Take one reference on every page of `blocks` (pages `lookup` returned) for a request."""
        self.allocator.incref([page for pages in blocks for page in pages])

    def publish(self, block_hash: bytes, pages: tuple[int, ...], parent: bytes | None,
                parent_pages: tuple[int, ...] | None = None) -> bool:
        """Offer a block a request has fully written at every plane and layer; `parent` is
        the previous block's hash (None for a prompt's first block), `parent_pages` the
        request's own pages of that block (None: not checked).

        Cached (True) when the hash is new and its parent is cached as the request's own
        pages: the cache takes a reference on each page. False, changing nothing, when the
        hash is cached already (the request keeps its own pages), the parent is not (the
        block could not be reached), or the parent is cached with other pages (a twin
        request computed it: a child in use would keep the twin's idle chain from eviction
        while this request runs, and a request restored into a tight pool could then not
        evict what it needs to grow). A page already in another cached block is an error."""
        if len(pages) != self.num_planes or len(set(pages)) != self.num_planes:
            raise ValueError(f"a block is {self.num_planes} distinct pages, one per plane, got {pages}")
        if block_hash in self._blocks or (parent is not None and parent not in self._blocks):
            return False
        if parent is not None and parent_pages is not None and self._blocks[parent].pages != tuple(parent_pages):
            return False
        shared = [page for page in pages if page in self._owner]
        if shared:
            raise ValueError(f"pages {shared} already belong to a cached block")
        self.allocator.incref(list(pages))  # raises on a free page, before anything changes
        self._clock += 1
        self._blocks[block_hash] = _Block(tuple(pages), parent, 0, self._clock)
        self._recency[block_hash] = None
        for page in pages:
            self._owner[page] = block_hash
        if parent is not None:
            self._blocks[parent].children += 1
        return True

    # ----- eviction -----

    def evict(self, num_pages: int) -> list[int]:
        """Free at least `num_pages` pages, or as many as eviction can, by dropping idle
        leaves least recently used first (a parent as soon as its last child went, if it is
        older than where the walk has got to), then, when those fall short, idle blocks
        below which a block is still in use, least recently used first, each with every
        cached block below it (`_victims`); returns the freed pages, block by block."""
        victims = self._victims(num_pages, frozenset())
        self.evicted_blocks += len(victims)
        return self._drop(victims)

    def can_evict(self, num_pages: int, pinned: Iterable[bytes] = ()) -> bool:
        """Whether `evict(num_pages)` would free that many pages, counting the blocks of
        `pinned` as in use (a chain a request is about to acquire); changes nothing. The
        same walk as `evict`'s, so it stops as soon as it has found enough."""
        victims = self._victims(num_pages, frozenset(pinned))
        return sum(self._idle(self._blocks[h]) for h in victims) * self.num_planes >= num_pages

    def _victims(self, num_pages: int, pinned: frozenset[bytes]) -> list[bytes]:
        """The blocks `evict` drops, children before parents (`pinned`: taken as in use).

        First idle leaves, as they come in the recency order. When those fall short, idle
        blocks that are ancestors of blocks in use, in the recency order, each with every
        cached block below it: the blocks in use among those leave the cache (unreachable
        once their ancestor is gone) but keep their pages for the requests holding them.
        That second walk is what frees a running INT4 request's prompt pages: it gives its
        leading pages back as its groups seal, the cache keeps them, and the request's own
        later blocks, still in its tables, would pin the whole chain until it ends."""
        victims = self._idle_leaves(num_pages, pinned)
        freed = len(victims) * self.num_planes
        if freed >= num_pages:
            return victims
        dropped = set(victims)
        children: dict[bytes, list[bytes]] = collections.defaultdict(list)
        for block_hash in self._recency:  # oldest first: each parent's children in recency order
            parent = self._blocks[block_hash].parent
            if parent is not None and block_hash not in dropped:
                children[parent].append(block_hash)
        for block_hash in self._recency:
            if freed >= num_pages:
                break
            if block_hash in dropped or block_hash in pinned or not self._idle(self._blocks[block_hash]):
                continue
            subtree: list[bytes] = []  # post-order: children before parents

            def below(h: bytes) -> None:
                for child in children.get(h, ()):
                    if child not in dropped:
                        below(child)
                subtree.append(h)
                dropped.add(h)
            below(block_hash)
            victims += subtree
            freed += sum(self._idle(self._blocks[h]) for h in subtree) * self.num_planes
        return victims

    def _idle_leaves(self, num_pages: int, pinned: frozenset[bytes]) -> list[bytes]:
        """`_victims`' first walk: idle leaves, children before parents."""
        victims: list[bytes] = []
        gone: collections.Counter[bytes] = collections.Counter()  # children among the victims

        def enough() -> bool:
            return len(victims) * self.num_planes >= num_pages

        def take(block_hash: bytes, block: _Block) -> bool:
            if block.children - gone[block_hash] or block_hash in pinned or not self._idle(block):
                return False
            victims.append(block_hash)
            if block.parent is not None:
                gone[block.parent] += 1
            return True

        for block_hash in self._recency:  # read-only walk; the caller drops the victims after it
            if enough():
                break
            block = self._blocks[block_hash]
            if not take(block_hash, block):
                continue
            parent = block.parent  # ancestors the walk has passed become candidates now
            while parent is not None and not enough():
                above = self._blocks[parent]
                if above.tick > block.tick or not take(parent, above):
                    break
                parent = above.parent
        return victims

    def clear(self) -> list[int]:
        """Drop every block that eviction can (when weights or configuration change; blocks
        in use stay until a later eviction, unreachable once the salt has changed)."""
        return self._drop(self._victims(len(self._blocks) * self.num_planes, frozenset()))

    def _drop(self, victims: list[bytes]) -> list[int]:
        """Forget `victims` (children before parents) and give back the cache's references;
        returns the pages that became free (a block in use keeps its pages)."""
        pages = []
        for block_hash in victims:
            block = self._blocks.pop(block_hash)
            del self._recency[block_hash]
            if block.parent is not None:
                self._blocks[block.parent].children -= 1
            for page in block.pages:
                del self._owner[page]
            pages.extend(block.pages)
        return self.allocator.decref(pages)

    def _idle(self, block: _Block) -> bool:
        refcount = self.allocator.refcount
        return all(refcount(page) == 1 for page in block.pages)

    # ----- invariants -----

    def check(self) -> None:
        """Assert the class invariants (tests)."""
        assert list(self._recency) == sorted(self._blocks, key=lambda h: self._blocks[h].tick)
        assert len(self._owner) == len(self._blocks) * self.num_planes
        children: collections.Counter[bytes] = collections.Counter()
        for block_hash, block in self._blocks.items():
            assert len(block.pages) == self.num_planes
            for page in block.pages:
                assert self._owner[page] == block_hash
                assert self.allocator.refcount(page) >= 1
            if block.parent is not None:
                assert block.parent in self._blocks, "a cached block's parent was dropped"
                children[block.parent] += 1
        for block_hash, block in self._blocks.items():
            assert block.children == children[block_hash]
        shared = [page for page in range(self.allocator.num_pages) if self.allocator.refcount(page) >= 2]
        assert all(page in self._owner for page in shared), "only the cache shares pages"
        assert self.allocator.num_shared == len(shared)
        assert 0 <= self.hit_blocks * self.block_size <= self.query_tokens
