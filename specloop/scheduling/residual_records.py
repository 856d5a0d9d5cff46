"""Host bookkeeping of INT4 residual group records: which record holds each group of each plane.

With `kv_residual_quantization` on, every plane of a request stores its compact rows in
groups of 64, one record of the device pool (`specloop.runtime.kv_residual`) per group.
Which positions have rows at a deep plane is decided on the device (token-sparse
selection, adaptive exit), so the host provides records for the most rows a plane can hold:
one per 64 positions the request's page tables cover, in every plane. The device fills
them in row order and leaves the unused ones empty.

Records reach the device with the plan: a group of a request carries the assignments the
device has not seen yet (`pending`), and `fresh` when the request's rows start over (a new
request, or a recompute after preemption), so the runner resets the cell first.
"""

from __future__ import annotations

import dataclasses

from specloop.scheduling.kv_manager import OutOfPages, PageAllocator

GROUP = 64  # rows of a record (the codec's group)


@dataclasses.dataclass
class _Tables:
    records: list[list[int]]  # [plane] -> record ids of groups 0..
    sent: int = 0  # groups (per plane) the device has
    fresh: bool = True  # the device state of the request's cell must be reset first
    truncate: int | None = None  # a rollback the device has not applied: drop rows at positions >= it


class ResidualRecords:
    """Record ids per request and plane, from a fixed pool (every plane grows alike)."""

    def __init__(self, num_planes: int, num_records: int, record_bytes: int) -> None:
        self.num_planes = num_planes
        self.record_bytes = record_bytes
        self.allocator = PageAllocator(num_records)
        self._requests: dict[str, _Tables] = {}

    @property
    def num_records(self) -> int:
        return self.allocator.num_pages

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def records_for(self, rid: str | None, num_tokens: int) -> int:
        """Records `ensure(rid, num_tokens)` would take (every plane; rid None: a new request)."""
        have = len(self._requests[rid].records[0]) if rid in self._requests else 0
        return max(0, -(-num_tokens // GROUP) - have) * self.num_planes

    def ensure(self, rid: str, num_tokens: int) -> None:
        """Records for groups covering [0, num_tokens) in every plane; all or nothing."""
        tables = self._requests.setdefault(rid, _Tables([[] for _ in range(self.num_planes)]))
        need = self.records_for(rid, num_tokens)
        if need == 0:
            return
        if need > self.allocator.num_free:
            raise OutOfPages(f"request {rid!r}: {need} residual records needed, {self.allocator.num_free} free")
        ids = self.allocator.allocate(need)
        grow = need // self.num_planes
        for plane, table in enumerate(tables.records):
            table.extend(ids[plane * grow: (plane + 1) * grow])

    def truncate(self, rid: str, frontier: int) -> list[int]:
        """Keep the groups that may hold rows of positions [0, frontier); free the rest."""
        tables = self._requests.get(rid)
        if tables is None:
            return []
        keep = -(-frontier // GROUP)
        dropped = [r for table in tables.records for r in table[keep:]]
        for table in tables.records:
            del table[keep:]
        tables.sent = min(tables.sent, keep)
        tables.truncate = frontier if tables.truncate is None else min(tables.truncate, frontier)
        return self.allocator.decref(dropped)

    def restart(self, rid: str) -> None:
        """The request's rows start over (recompute): the device forgets them."""
        if rid in self._requests:
            self._requests[rid].sent = 0
            self._requests[rid].fresh = True

    def free(self, rid: str) -> list[int]:
        tables = self._requests.pop(rid, None)
        if tables is None:
            return []
        return self.allocator.decref([r for table in tables.records for r in table])

    def pending(self, rid: str) -> tuple[bool, int, list[list[int]], int | None]:
        """(fresh, first group, [plane] -> record ids from it, truncate) the device has not
        seen; marks them sent (the plan that carries them runs before any later one)."""
        tables = self._requests[rid]
        fresh, first, truncate = tables.fresh, tables.sent, tables.truncate
        tables.fresh, tables.sent, tables.truncate = False, len(tables.records[0]), None
        return fresh, first, [table[first:] for table in tables.records], None if fresh else truncate

    def tables(self, rid: str) -> list[list[int]]:
        """A copy of the request's record ids, per plane, in group order."""
        return [list(t) for t in self._requests[rid].records]

    def adopt(self, rid: str) -> None:
        """The device already holds every record of the request (a restored snapshot wrote
        them): nothing to reset or send."""
        tables = self._requests[rid]
        tables.fresh, tables.sent, tables.truncate = False, len(tables.records[0]), None

    def held(self, rid: str) -> int:
        return sum(len(t) for t in self._requests[rid].records) if rid in self._requests else 0

    def bytes_used(self, rid: str) -> int:
        return self.held(rid) * self.record_bytes

    @property
    def total_bytes_used(self) -> int:
        return (self.num_records - self.num_free) * self.record_bytes
