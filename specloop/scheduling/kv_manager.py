"""Logical KV bookkeeping: page ids, per-plane block tables, frontiers, reservations.

A request keeps one block table per depth plane. Table entry i of plane r is the page
that stores positions [i * block_size, (i + 1) * block_size) of that plane, and the flat
slot of a position is `page * block_size + position % block_size`. The physical storage
(BF16 pages now, packed formats later) only consumes those page ids and slots; nothing
here imports torch.

A request may hold a reservation: pages promised to it at admission and kept back from
everyone else, which `ensure` draws on first. The scheduler admits by need (reservation
0: pages come from the free pool as tables grow, and `ensure` raises `OutOfPages` when
the pool cannot serve, which is when the scheduler preempts); reserving prompt +
max_tokens up front is the older policy, kept for comparison.

Invariants (checked after every operation by tests/test_kv_manager.py):

1. Every page is either free (refcount 0, on the free list once) or held (refcount >= 1).
2. Without sharing, the pages held by all requests plus the free pages are exactly
   `range(num_pages)`, and no page is held by two requests.
3. Reserved-but-unallocated pages are never handed to another request: the free pages
   always number at least the outstanding reservations, and `can_admit` only counts
   what is left after them.
4. Every plane of a request has the same number of pages, so all planes cover the
   same positions; `truncate` drops the same table tail in every plane, after which
   `ensure` regrows with fresh pages (inside the kept reservation first).
5. An operation on one request never reads or changes another request's pages.

Sharing (automatic prefix caching, `prefix_cache.py`): a request may start with cached
blocks at the head of its tables (`add_request(prefix=...)`, one reference of its own on
each page) and publishes its own full prompt blocks, so a page may be held by several
requests and by the cache. Invariant 2 then holds per reference, and invariant 3 needs
care: dropping a shared page frees no storage, so a reservation must not count a shared
page as one it can re-allocate for free. Two rules keep it: `truncate` never drops a page
someone else holds (rollbacks stay past the prompt, whose blocks are the only shared
ones), and every check of room counts only free pages plus what the cache can evict
(`PageCache`), never a held page; the cache's idle pages become free (`evict`) before a
reservation or an allocation counts on them.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from specloop.errors import SpecloopError
from specloop.plan import RecordUpdate


class OutOfPages(SpecloopError):
    """Not enough free (or unreserved) KV pages for the requested allocation or admission."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def span_pages(spans: list[int], num_tokens: int, block_size: int) -> int:
    """Pages a request covering `num_tokens` positions holds at most at once when plane p
    holds pages for `spans[p]` positions at a time."""
    full = _ceil_div(num_tokens, block_size)
    return sum(min(full, _ceil_div(span, block_size) + 1) for span in spans)


class PageAllocator:
    """Fixed pool of page ids with a free list and reference counts.

    The free list is FIFO: `allocate` takes from the front, freed pages join the back.
    Recently freed pages are therefore reused last, which keeps their contents around
    longest (useful for a later prefix cache) and makes allocation order deterministic.
    Every failing call leaves the allocator unchanged.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self.num_pages = num_pages
        self._refcounts = [0] * num_pages
        self._free: collections.deque[int] = collections.deque(range(num_pages))
        self._num_shared = 0  # pages with refcount >= 2, kept as counts change (stats read it every step)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_shared(self) -> int:
        """Pages with more than one reference (only the prefix cache shares pages)."""
        return self._num_shared

    def free_list(self) -> list[int]:
        """The free pages in the order `allocate` will hand them out."""
        return list(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` pages off the free list with refcount 1; all or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free):
            raise OutOfPages(f"cannot allocate {n} KV pages: only {len(self._free)} are free.")
        pages = [self._free.popleft() for _ in range(n)]
        for page in pages:
            self._refcounts[page] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        """Add one reference to each held page (sharing); a free page is an error."""
        self._check_held(pages)
        for page in pages:
            self._refcounts[page] += 1
            self._num_shared += self._refcounts[page] == 2

    def decref(self, pages: list[int]) -> list[int]:
        """Drop one reference per entry; returns the pages that became free, in order.

        Dropping more references than a page has (a double free) raises before any
        count changes.
        """
        self._check_held(pages)
        released = []
        for page in pages:
            self._refcounts[page] -= 1
            self._num_shared -= self._refcounts[page] == 1
            if self._refcounts[page] == 0:
                self._free.append(page)
                released.append(page)
        return released

    def refcount(self, page: int) -> int:
        self._check_range(page)
        return self._refcounts[page]

    def _check_range(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page {page} is outside the pool of {self.num_pages} pages")

    def _check_held(self, pages: list[int]) -> None:
        """Each page must have at least as many references as it appears in `pages`."""
        for page, times in collections.Counter(pages).items():
            self._check_range(page)
            if self._refcounts[page] < times:
                raise ValueError(
                    f"page {page} has {self._refcounts[page]} references, cannot release or share it {times} times"
                )


class PageCache(Protocol):
    """Pages held only by a cache that gives them back on demand (the prefix cache's idle
    blocks): the KV manager counts them as room and evicts them when the free list falls
    short, before it refuses an allocation (`OutOfPages`)."""

    @property
    def num_idle_pages(self) -> int:
        """Pages only the cache holds (O(1): read for every step's stats)."""

    @property
    def num_evictable_pages(self) -> int:
        """Pages `evict` could free now (changes nothing)."""

    def can_evict(self, num_pages: int, pinned: Iterable[bytes] = ()) -> bool:
        """Whether `evict(num_pages)` would free that many pages, the blocks of `pinned`
        (a chain a request is about to take) counted as in use (changes nothing)."""

    def evict(self, num_pages: int) -> list[int]:
        """Free at least `num_pages` pages if it can; returns the pages freed."""


class RecordPool(Protocol):
    """A second pool whose holdings follow the positions a request's pages cover (a packed
    KV format's group records: `specloop.flashloop.kv_residual`): the KV manager takes and
    gives back a request's records with its pages, so pages and records never disagree."""

    record_bytes: int

    @property
    def num_records(self) -> int: ...

    @property
    def num_free(self) -> int: ...

    @property
    def total_bytes_used(self) -> int: ...

    def records_for(self, rid: str | None, num_tokens: int, prompt_len: int = 0) -> int:
        """Records `ensure(rid, num_tokens)` would take (rid None: a new request)."""

    def add(self, rid: str, prompt_len: int) -> None: ...

    def ensure(self, rid: str, num_tokens: int) -> None: ...

    def truncate(self, rid: str, frontier: int, cover: int | None = None) -> None: ...

    def free(self, rid: str) -> list[int]: ...

    def bytes_used(self, rid: str) -> int: ...

    def update(self, rid: str) -> RecordUpdate | None:
        """The record assignments (and reset, rollback) the device has not seen; marks them sent."""


@dataclasses.dataclass
class _RequestKV:
    """One request's logical KV: per-plane tables and frontiers within a page reservation."""

    reserved_pages: int
    tables: list[list[int]]  # [plane] -> page ids; every plane has the same length
    frontiers: list[int]  # [plane] -> positions [0, frontier) written
    released: list[int] = dataclasses.field(default_factory=list)  # [plane] -> leading pages given back
    # (INT4 residuals: every position on them reads its packed groups; the table keeps the sink page there)

    @property
    def pages_per_plane(self) -> int:
        return len(self.tables[0])

    @property
    def held_pages(self) -> int:
        return sum(len(table) - r for table, r in zip(self.tables, self.released))

    @property
    def outstanding_pages(self) -> int:
        """Reserved pages not allocated yet; kept back from every other request."""
        return max(0, self.reserved_pages - self.held_pages)


class KVManager:
    """Per request and per depth plane: a block table over fixed-size pages and a written frontier.

    Tables grow by `ensure` (from the request's reservation first, then from pages nobody
    has a claim on), truncate rolls back and returns whole pages past the new frontier to
    the pool while keeping the reservation, free releases everything.
    `page_bytes` is the storage of one page of one plane (all layers, K and V), used only
    for accounting.
    """

    def __init__(self, num_planes: int, block_size: int, num_pages: int, page_bytes: int) -> None:
        if num_planes < 1 or block_size < 1 or page_bytes < 0:
            raise ValueError(
                f"need num_planes >= 1, block_size >= 1, page_bytes >= 0; got {num_planes}, {block_size}, {page_bytes}"
            )
        self.num_planes = num_planes
        self.block_size = block_size
        self.page_bytes = page_bytes
        self.allocator = PageAllocator(num_pages)
        self._requests: dict[str, _RequestKV] = {}
        self._outstanding = 0  # sum of outstanding_pages over requests
        # A packed format's group records, kept alongside the pages (set by the composition
        # root; its pool is sized so that pages run out first), None: pages alone.
        self.records: RecordPool | None = None
        # A format that gives a plane's leading pages back once no query reads them exact
        # (`release_prefix`; set by the composition root), None: every position's pages are
        # held until the request ends. `plane_spans(ahead)`: per plane, the most positions a
        # request holds pages for at once (its tail and the wavefront's span) when a plan
        # enters at most `ahead` prompt positions at depth 0; `aheads`: the prompt chunks to
        # choose from, largest first; `prompt_pages`: the pages one request's prompt working
        # set may take (`prompt_ahead`).
        self.plane_spans: Callable[[int], list[int]] | None = None
        self.aheads: tuple[int, ...] = ()
        self.prompt_pages = num_pages
        self._aheads_for: dict[int, int] = {}
        self.sink_page = num_pages  # the page the KV storage keeps past the pool (written by padding rows, never read)
        # Automatic prefix caching (set by the composition root): the cache whose idle pages
        # count as room and are evicted when the free list falls short; None: no cache.
        self.cache: PageCache | None = None

    # ----- capacity -----

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` positions in every plane."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return self.num_planes * _ceil_div(num_tokens, self.block_size)

    @property
    def num_free_pages(self) -> int:
        """Pages on the allocator's free list, including ones promised to admitted requests."""
        return self.allocator.num_free

    @property
    def num_reserved_pages(self) -> int:
        """Pages promised to admitted requests but not allocated yet."""
        return self._outstanding

    @property
    def num_available_pages(self) -> int:
        """Free pages that no admitted request has a claim on."""
        return self.allocator.num_free - self._outstanding

    @property
    def usage(self) -> float:
        """Fraction of the pool held or reserved, in [0, 1]. Pages only the prefix cache
        holds count as free, as in vLLM: eviction hands them to the first request short of
        room, so a full cache of idle blocks is not a full pool (a page of a block that a
        request still holds at another plane counts as free here, though eviction takes
        whole blocks)."""
        if self.num_pages == 0:
            return 0.0
        return 1.0 - (self.num_available_pages + self._idle_pages) / self.num_pages

    @property
    def _idle_pages(self) -> int:
        return self.cache.num_idle_pages if self.cache is not None else 0

    @property
    def total_bytes_used(self) -> int:
        """Bytes of the pages (and residual records) held by requests (a shared page counts
        once); pages only the prefix cache holds count as free, as in `usage`."""
        used = (self.num_pages - self.allocator.num_free - self._idle_pages) * self.page_bytes
        return used + (self.records.total_bytes_used if self.records is not None else 0)

    def can_admit(self, reserve_tokens: int) -> bool:
        return self.can_take(self.pages_for(reserve_tokens))

    def can_take(self, num_pages: int, pinned: Iterable[bytes] = ()) -> bool:
        """Whether `num_pages` more pages can be promised or allocated beyond every
        reservation: from the free pages nobody has a claim on, and, when those fall short,
        from what the cache can evict (asked only then), the cached blocks `pinned` excepted."""
        short = num_pages - self.num_available_pages
        return short <= 0 or (self.cache is not None and self.cache.can_evict(short, pinned))

    def _reclaim(self, num_pages: int) -> None:
        """Make the unclaimed free pages number at least `num_pages` by evicting cached ones
        (the caller checked `can_take`)."""
        short = num_pages - self.num_available_pages
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
        assert num_pages <= self.num_available_pages, "can_take promised these pages"

    @property
    def releases_tails(self) -> bool:
        """Whether planes give their leading pages back while the request runs (`plane_spans`):
        then a prompt takes its pages a plan's rows at a time, and plans carry release scans."""
        return self.plane_spans is not None

    def records_for_new(self, num_tokens: int, prompt_len: int) -> int:
        """Records a new request covering `num_tokens` positions takes (0 without a record pool)."""
        return self.records.records_for(None, num_tokens, prompt_len) if self.records is not None else 0

    @property
    def num_free_records(self) -> int:
        return self.records.num_free if self.records is not None else 0

    def records_free_for(self, num_tokens: int, prompt_len: int) -> bool:
        """Whether the free records cover a new request of `num_tokens` positions (no record
        pool: always)."""
        return self.records is None or self.records.records_for(None, num_tokens, prompt_len) <= self.records.num_free

    def prompt_claim(self, rid: str, reserve_tokens: int, prompt_tokens: int) -> tuple[int, int]:
        """(pages, records) a request still entering its prompt may take before the prompt is
        in: pages up to its pages at once (`pages_at_once`), records for every prompt position
        (records are kept to the end). With INT4 residuals a prompt's tables grow a plan at a
        time, so admission counts these for the prompts already running (`Scheduler`)."""
        pages = max(0, self.pages_at_once(reserve_tokens) - self.held_pages(rid))
        records = self.records.records_for(rid, prompt_tokens) if self.records is not None else 0
        return pages, records

    def pages_at_once(self, num_tokens: int) -> int:
        """The most pages a request covering `num_tokens` positions holds at one time: all
        of them, or with INT4 residuals (`plane_spans`) those of each plane's span (a span
        not aligned to pages touches one page more)."""
        if self.plane_spans is None:
            return self.pages_for(num_tokens)
        return span_pages(self.plane_spans(self.prompt_ahead(num_tokens)), num_tokens, self.block_size)

    def prompt_ahead(self, num_tokens: int) -> int:
        """With `plane_spans`: the prompt positions a plan may enter at depth 0 past the
        depth-0 frontier of a request covering `num_tokens` positions: the largest chunk
        whose pages at once fit `prompt_pages` (the smallest if none does)."""
        ahead = self._aheads_for.get(num_tokens)
        if ahead is None:
            fits = [a for a in self.aheads
                    if span_pages(self.plane_spans(a), num_tokens, self.block_size) <= self.prompt_pages]
            ahead = self._aheads_for[num_tokens] = fits[0] if fits else self.aheads[-1]
        return ahead

    def fits_ever(self, reserve_tokens: int, prompt_len: int = 0) -> bool:
        """Whether the request could run alone in an otherwise empty pool: its pages at once
        and, with INT4 residuals, the records it keeps for all its groups."""
        if self.pages_at_once(reserve_tokens) > self.num_pages:
            return False
        records = self.records
        return records is None or records.records_for(None, reserve_tokens, prompt_len) <= records.num_records

    # ----- request lifecycle -----

    def requests(self) -> list[str]:
        return list(self._requests)

    def add_request(self, rid: str, reserve_tokens: int = 0, prompt_len: int = 0,
                    prefix: Sequence[Sequence[int]] = ()) -> None:
        """Admit `rid`, reserving pages for `reserve_tokens` positions in every plane (0: none,
        admission by need). `prompt_len` sizes INT4 residual records of token-sparse planes
        (0: every plane as dense). `prefix`: cached blocks (one page per plane each, written
        at every plane) that become the head of its tables, with a reference of its own on
        each page; every plane's frontier starts past them. All or nothing."""
        if rid in self._requests:
            raise ValueError(f"request {rid!r} already has KV state")
        if any(len(block) != self.num_planes for block in prefix):
            raise ValueError(f"a prefix block is one page per plane ({self.num_planes}), got {list(prefix)}")
        covered = len(prefix) * self.block_size
        if covered and self.records is not None and \
                self.records.records_for(None, covered, prompt_len) > self.records.num_free:
            raise OutOfPages(f"request {rid!r}: not enough free INT4 residual records for its cached prefix")
        shared = [page for block in prefix for page in block]
        self.allocator.incref(shared)  # first: the cache cannot evict them for this request's own pages
        needed = self.pages_for(reserve_tokens)
        outstanding = max(0, needed - len(shared))
        if not self.can_take(outstanding):
            self.allocator.decref(shared)
            raise OutOfPages(
                f"request {rid!r} needs {outstanding} KV pages but only {self.num_available_pages} are unreserved."
            )
        self._reclaim(outstanding)
        tables = [[block[plane] for block in prefix] for plane in range(self.num_planes)]
        self._requests[rid] = _RequestKV(needed, tables, [covered] * self.num_planes, [0] * self.num_planes)
        self._outstanding += outstanding
        if self.records is not None:  # its own records for the prefix's groups, encoded from the shared pages
            self.records.add(rid, prompt_len, adopt=covered)
            self.records.ensure(rid, covered)

    def add_restored(self, rid: str, pages_per_plane: int, released: list[int], prompt_len: int = 0) -> None:
        """Admit `rid` (a snapshot restore) covering `pages_per_plane` pages a plane, of
        which plane p's leading `released[p]` were given back (INT4 residuals): pages only
        for the others, the given-back entries `sink_page`, and records for the coverage.
        All or nothing."""
        if rid in self._requests:
            raise ValueError(f"request {rid!r} already has KV state")
        if len(released) != self.num_planes or not all(0 <= r <= pages_per_plane for r in released):
            raise ValueError(f"released {released} must give 0..{pages_per_plane} pages for each of "
                             f"{self.num_planes} planes")
        need = sum(pages_per_plane - r for r in released)
        if not self.can_take(need):
            raise OutOfPages(f"request {rid!r} needs {need} KV pages but only {self.num_available_pages} "
                             f"are unreserved.")
        covered = pages_per_plane * self.block_size
        if self.records is not None and self.records.records_for(None, covered, prompt_len) > self.records.num_free:
            raise OutOfPages(f"request {rid!r}: not enough free INT4 residual records")
        self.add_request(rid, 0, prompt_len)
        if self.records is not None:
            self.records.ensure(rid, covered)
        self._reclaim(need)
        pages = iter(self.allocator.allocate(need))
        req = self._requests[rid]
        req.tables = [[self.sink_page] * r + [next(pages) for _ in range(pages_per_plane - r)] for r in released]
        req.released = list(released)

    def pages_to_cover(self, rid: str, num_tokens: int) -> int:
        """Pages `ensure(rid, num_tokens)` would allocate (0 when already covered)."""
        return max(0, _ceil_div(num_tokens, self.block_size) - self._get(rid).pages_per_plane) * self.num_planes

    def can_ensure(self, rid: str, num_tokens: int) -> bool:
        """Whether `ensure(rid, num_tokens)` would succeed: its reservation plus the free pages
        nobody has a claim on (and what the cache can evict) cover the growth."""
        if self.records is not None and self.records.records_for(rid, num_tokens) > self.records.num_free:
            return False
        return self.can_take(self.pages_to_cover(rid, num_tokens) - self._get(rid).outstanding_pages)

    def ensure(self, rid: str, num_tokens: int) -> None:
        """Grow every plane's table to cover positions [0, num_tokens); never shrinks.

        Draws on the request's reservation first, then on unclaimed free pages, evicting
        cached pages when those fall short; raises `OutOfPages` (changing nothing) when
        nothing covers the growth."""
        req = self._get(rid)
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        grow = _ceil_div(num_tokens, self.block_size) - req.pages_per_plane
        if grow <= 0:
            return
        if not self.can_ensure(rid, num_tokens):
            raise OutOfPages(f"request {rid!r}: covering {num_tokens} positions needs {grow * self.num_planes} more "
                             f"KV pages; {req.outstanding_pages} reserved and {self.num_available_pages} unclaimed")
        before = req.outstanding_pages
        self._reclaim(grow * self.num_planes - before)
        if self.records is not None:
            self.records.ensure(rid, (req.pages_per_plane + grow) * self.block_size)
        pages = self.allocator.allocate(grow * self.num_planes)
        for plane, table in enumerate(req.tables):
            table.extend(pages[plane * grow:(plane + 1) * grow])
        self._outstanding += req.outstanding_pages - before

    def truncate(self, rid: str, frontier: int) -> list[int]:
        """Roll back to `frontier`: every plane's frontier becomes min(frontier, current).

        Pages wholly at or beyond the new frontier leave every plane's table and go back
        to the pool (returned, plane by plane, in table order); the reservation is kept so
        the request can regrow. A page someone else holds too (a cached block) is never
        dropped: that raises ValueError, changing nothing.
        """
        req = self._get(rid)
        if frontier < 0:
            raise ValueError(f"frontier must be >= 0, got {frontier}")
        keep = _ceil_div(frontier, self.block_size)
        dropped = [page for table, r in zip(req.tables, req.released) for page in table[max(keep, r):]]
        shared = [page for page in dropped if self.allocator.refcount(page) > 1]
        if shared:  # (a rollback stays past the prompt; only prompt blocks are shared)
            raise ValueError(f"request {rid!r}: truncating to {frontier} would drop pages {shared} that are "
                             f"shared (prefix cache): dropping them frees nothing the reservation could reuse")
        req.frontiers = [min(frontier, f) for f in req.frontiers]
        before = req.outstanding_pages
        req.released = [min(r, keep) for r in req.released]
        for table in req.tables:
            del table[keep:]
        self._outstanding += req.outstanding_pages - before
        if self.records is not None:  # the exact position: rows past it leave the device planes; records
            self.records.truncate(rid, frontier, keep * self.block_size)  # stay for the pages kept
        return self.allocator.decref(dropped)

    def free(self, rid: str) -> list[int]:
        """Release all of `rid`'s pages and its reservation; returns the pages that became free."""
        req = self._get(rid)
        del self._requests[rid]
        self._outstanding -= req.outstanding_pages
        if self.records is not None:
            self.records.free(rid)
        return self.allocator.decref([page for table, r in zip(req.tables, req.released) for page in table[r:]])

    def release_prefix(self, rid: str, plane: int, pages: int) -> list[int]:
        """Give back the plane's pages [0, pages) (INT4 residuals: no query will read those
        positions exact again); their table entries become `sink_page`. Idempotent for
        counts at or below the current one; returns the pages that became free."""
        req = self._get(rid)
        pages = min(pages, len(req.tables[plane]))
        if pages <= req.released[plane]:
            return []
        freed = req.tables[plane][req.released[plane]: pages]
        req.released[plane] = pages
        before = req.outstanding_pages
        out = self.allocator.decref(freed)
        self._outstanding += req.outstanding_pages - before
        return out

    def released(self, rid: str, plane: int) -> int:
        """Leading pages of the plane given back (`release_prefix`)."""
        return self._get(rid).released[plane]

    def pending_records(self, rid: str) -> RecordUpdate | None:
        """What the request's next group carries to the device of its records (None: no record
        pool, or nothing new); marks it sent."""
        if self.records is None:
            return None
        update = self.records.update(rid)
        if update is not None and update.adopt:  # the shared pages its planes' groups encode from
            pages = _ceil_div(update.adopt, self.block_size)
            update = dataclasses.replace(update, adopt_tables=[table[:pages] for table in self._get(rid).tables])
        return update

    # ----- per-request views -----

    def page_table(self, rid: str, plane: int) -> list[int]:
        """A copy of the pages of `rid`'s plane, in position order (released ones: `sink_page`)."""
        table = self._table(rid, plane)
        released = self._get(rid).released[plane]
        return [self.sink_page] * released + table[released:]

    def coverage(self, rid: str) -> int:
        """Positions [0, coverage) have a page in every plane."""
        return self._get(rid).pages_per_plane * self.block_size

    def slot(self, rid: str, plane: int, position: int) -> int:
        """KV slot of `position` in `plane`: page * block_size + position % block_size (the
        runner computes the same on the device from page tables; this is the host reference)."""
        table = self._table(rid, plane)
        if not 0 <= position < len(table) * self.block_size:
            raise IndexError(f"request {rid!r} plane {plane}: position {position} has no page")
        page = table[position // self.block_size]
        return page * self.block_size + position % self.block_size

    def frontier(self, rid: str, plane: int) -> int:
        self._table(rid, plane)  # validates plane
        return self._get(rid).frontiers[plane]

    def advance(self, rid: str, plane: int, new_frontier: int) -> None:
        """Mark positions [0, new_frontier) of `plane` written; monotone and within coverage."""
        req = self._get(rid)
        current = self.frontier(rid, plane)
        if not current <= new_frontier <= self.coverage(rid):
            raise ValueError(
                f"request {rid!r} plane {plane}: frontier {new_frontier} must lie in "
                f"[{current}, {self.coverage(rid)}]"
            )
        req.frontiers[plane] = new_frontier

    def held_pages(self, rid: str) -> int:
        """Pages `rid` holds over all planes."""
        return self._get(rid).held_pages

    def bytes_used(self, rid: str) -> int:
        used = self._get(rid).held_pages * self.page_bytes
        return used + (self.records.bytes_used(rid) if self.records is not None else 0)

    def _get(self, rid: str) -> _RequestKV:
        try:
            return self._requests[rid]
        except KeyError:
            raise KeyError(f"request {rid!r} has no KV state") from None

    def _table(self, rid: str, plane: int) -> list[int]:
        req = self._get(rid)
        if not 0 <= plane < self.num_planes:
            raise IndexError(f"plane {plane} is outside [0, {self.num_planes})")
        return req.tables[plane]
