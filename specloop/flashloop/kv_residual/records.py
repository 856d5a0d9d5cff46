"""Host bookkeeping of INT4 residual group records: which record holds each group of each plane
(the `RecordPool` the KV manager keeps beside its pages).

With `kv_residual_quantization` on, every plane of a request stores its compact rows in
groups of 64, one record of the device pool (`specloop.flashloop.kv_residual.planes`) per group.
Which positions have rows at a deep plane is decided on the device (token-sparse
selection, adaptive exit), so the host provides records for the most rows a plane can hold
among the positions the request's page tables cover (`row_bound`): every position at a
dense plane; with token-sparse prefill, at a sparse plane, a prompt window's budget of
rows (the selection keeps exactly that many) plus every generated position. The device
fills them in row order and leaves the unused ones empty.

Records reach the device with the plan: a group of a request carries the assignments the
device has not seen yet (`pending`), and `fresh` when the request's rows start over (a new
request, or a recompute after preemption), so the runner resets the cell first. A request
that starts with a cached prefix (prefix caching: shared BF16 pages, written at every
plane) carries `adopt`, its length: the device gives it rows for those positions at every
plane and encodes their full groups into the request's own records from the shared pages,
as its planes would have held them had it computed the prefix (records are never shared).
"""

from __future__ import annotations

import dataclasses

from specloop.flashloop.config import TokenSparsePrefill
from specloop.plan import RecordUpdate
from specloop.scheduling.kv_manager import OutOfPages, PageAllocator

GROUP = 64  # rows of a record (the codec's group)


@dataclasses.dataclass
class _Tables:
    records: list[list[int]]  # [plane] -> record ids of groups 0..
    prompt_len: int  # the prompt's windows bound the rows of sparse planes
    sent: list[int]  # [plane] -> groups the device has
    fresh: bool = True  # the device state of the request's cell must be reset first
    truncate: int | None = None  # a rollback the device has not applied: drop rows at positions >= it
    dropped: list[int] = dataclasses.field(default_factory=list)  # freed once the device drops them
    adopt: int = 0  # cached prefix positions the device has not taken rows for yet


class ResidualRecords:
    """Record ids per request and plane, from a fixed pool, as many per plane as its rows
    can fill (`windows`: token-sparse prefill when some loop is sparse, else None)."""

    def __init__(self, num_planes: int, num_records: int, record_bytes: int,
                 windows: TokenSparsePrefill | None = None) -> None:
        self.num_planes = num_planes
        self.record_bytes = record_bytes
        self.windows = windows if windows is not None and windows.active else None
        self.allocator = PageAllocator(num_records)
        self._requests: dict[str, _Tables] = {}

    @property
    def num_records(self) -> int:
        return self.allocator.num_pages

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def row_bound(self, plane: int, prompt_len: int, num_tokens: int) -> int:
        """The most rows plane `plane` holds among positions [0, num_tokens) of a request with a
        `prompt_len`-token prompt: each complete prompt window keeps its budget at a sparse
        plane, the window `num_tokens` cuts at most that many of the positions below it."""
        w = self.windows
        if w is None:
            return num_tokens
        prompt = min(num_tokens, prompt_len)
        size = w.window
        full = prompt // size  # windows [k * size, (k + 1) * size) below `prompt`, all of full length
        rows = full * (w.budget(plane, size) if w.sparse(plane, size) else size)
        cut = prompt - full * size
        if cut:
            length = min(size, prompt_len - full * size)
            rows += min(cut, w.budget(plane, length) if w.sparse(plane, length) else length)
        return rows + num_tokens - prompt

    def _groups(self, prompt_len: int, num_tokens: int) -> list[int]:
        return [-(-self.row_bound(p, prompt_len, num_tokens) // GROUP) for p in range(self.num_planes)]

    def records_for(self, rid: str | None, num_tokens: int, prompt_len: int = 0) -> int:
        """Records `ensure(rid, num_tokens)` would take, every plane (rid None: a new request
        with a `prompt_len`-token prompt; 0 bounds every plane densely)."""
        tables = self._requests.get(rid) if rid is not None else None
        if tables is None:
            return sum(self._groups(prompt_len, num_tokens))
        want = self._groups(tables.prompt_len, num_tokens)
        return sum(max(0, n - len(t)) for n, t in zip(want, tables.records))

    def add(self, rid: str, prompt_len: int, adopt: int = 0) -> None:
        """Register `rid` with no records (its prompt length sizes its sparse planes);
        `adopt`: it starts with that many cached prefix positions."""
        if rid in self._requests:
            raise ValueError(f"request {rid!r} already has residual records")
        self._requests[rid] = _Tables([[] for _ in range(self.num_planes)], prompt_len, [0] * self.num_planes,
                                      adopt=adopt)

    def ensure(self, rid: str, num_tokens: int) -> None:
        """Records for every row positions [0, num_tokens) may hold, every plane; all or nothing."""
        tables = self._requests[rid]
        want = self._groups(tables.prompt_len, num_tokens)
        grow = [max(0, n - len(t)) for n, t in zip(want, tables.records)]
        need = sum(grow)
        if need == 0:
            return
        if need > self.allocator.num_free:
            raise OutOfPages(f"request {rid!r}: {need} residual records needed, {self.allocator.num_free} free")
        ids = self.allocator.allocate(need)
        for table, n in zip(tables.records, grow):
            table.extend(ids[:n])
            del ids[:n]

    def truncate(self, rid: str, frontier: int, cover: int | None = None) -> None:
        """Roll back to `frontier`: the device drops rows at positions >= it (with the next
        update); records stay for the rows positions [0, cover) may hold (`cover`: the pages
        the request keeps, at least frontier; default frontier), so growth within those pages
        needs none. The others are freed once the update that drops them is sent: until the
        device applies it, its tables still name them (and its unsealing touches them)."""
        tables = self._requests.get(rid)
        if tables is None:
            return
        keep = self._groups(tables.prompt_len, max(frontier, cover or 0))
        tables.dropped += [r for table, k in zip(tables.records, keep) for r in table[k:]]
        for table, k in zip(tables.records, keep):
            del table[k:]
        tables.sent = [min(s, k) for s, k in zip(tables.sent, keep)]
        tables.truncate = frontier if tables.truncate is None else min(tables.truncate, frontier)

    def free(self, rid: str) -> list[int]:
        tables = self._requests.pop(rid, None)
        if tables is None:
            return []
        return self.allocator.decref([r for table in tables.records for r in table] + tables.dropped)

    def pending(self, rid: str) -> tuple[bool, list[int], list[list[int]], int | None, int]:
        """(fresh, [plane] -> first group, [plane] -> record ids from it, truncate, adopt) the
        device has not seen; marks them sent (the plan that carries them runs before any
        later one) and frees the records a truncate dropped (the device drops them before
        any later plan's assignments)."""
        tables = self._requests[rid]
        fresh, first, truncate, adopt = tables.fresh, tables.sent, tables.truncate, tables.adopt
        tables.fresh, tables.sent, tables.truncate, tables.adopt = False, [len(t) for t in tables.records], None, 0
        self.allocator.decref(tables.dropped)
        tables.dropped = []
        return fresh, first, [t[f:] for t, f in zip(tables.records, first)], None if fresh else truncate, adopt

    def update(self, rid: str) -> RecordUpdate | None:
        """What the request's next group carries to the device (`pending`), or None when the
        device has seen everything (planes grow apart: sparse planes hold fewer)."""
        fresh, first, tables, truncate, adopt = self.pending(rid)
        if fresh or any(tables) or truncate is not None or adopt:
            return RecordUpdate(fresh, first, tables, truncate, adopt)
        return None

    def tables(self, rid: str) -> list[list[int]]:
        """A copy of the request's record ids, per plane, in group order."""
        return [list(t) for t in self._requests[rid].records]

    def adopt(self, rid: str) -> None:
        """The device already holds every record of the request (a restored snapshot wrote
        them): nothing to reset or send."""
        tables = self._requests[rid]
        tables.fresh, tables.sent, tables.truncate, tables.adopt = False, [len(t) for t in tables.records], None, 0

    def held(self, rid: str) -> int:
        """Records the request holds, those a truncate dropped and the device still names included."""
        tables = self._requests.get(rid)
        return sum(len(t) for t in tables.records) + len(tables.dropped) if tables is not None else 0

    def bytes_used(self, rid: str) -> int:
        return self.held(rid) * self.record_bytes

    @property
    def total_bytes_used(self) -> int:
        return (self.num_records - self.num_free) * self.record_bytes
