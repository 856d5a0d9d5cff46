"""The INT4 residual planes' share of the forward batch (`BatchPart`).

Per pass, a `ResidualPass`: each row's request cell, and per request cell in the pass the
page-table offset of every plane it may encode groups of (-1: none; planes below the
cell's shallowest row in the pass cannot change), with `candidates` groups per (cell,
plane) to look at. Its columns sit in the pass block: the rows' cells [b], then the pass's
cells [C] and their planes' tables [C, P]; a pass a CUDA graph replays has the bucket's
fixed shape (C = min(bucket, max_seqs), padded with the pad cell, candidates
`residual_candidates(bucket)`, every plane). Per plan: the record assignments the call
brings (`ResidualUpdate`: resets, then rollbacks' truncates, then new records) and the
release scans (`ReleaseBatch`)."""

from __future__ import annotations

import dataclasses

import torch

from specloop.flashloop.kv_residual.chunks import CHUNK_ROWS, PromptChunk, PromptChunks
from specloop.plan import Plan, RowGroup
from specloop.runtime.forward_batch import ForwardBatch, LoopPass

RELEASE_SPAN = 4096  # the most tail positions one call checks per request and plane


@dataclasses.dataclass
class ResidualPass:
    """What one loop pass tells the INT4 residual planes (`planes.PackedResiduals`)."""

    cells: torch.Tensor  # [N_p] long: each row's request cell
    pass_cells: torch.Tensor  # [C] long
    plane_tables: torch.Tensor  # [C, P] long
    candidates: int
    depths: tuple[int, ...] = ()  # planes the pass has rows at (host: which planes may encode at all)


def residual_candidates(rows: int, planes: int, tail: int = 0) -> int:
    """Groups to look at per (cell, plane) of a pass for `rows` rows that may hold full
    groups not encoded yet: the groups they can fill, plus room for groups waiting on the
    plane before (at most one per plane) and, under the execution policy, for those still
    within `tail` of the pass's first query (docs/flashloop.md)."""
    return rows // 64 + tail // 64 + planes + 2


@dataclasses.dataclass
class ReleaseBatch:
    """The plan's `ReleaseScan`s on the device: positions [released * page, + span) of each
    (request, plane) are checked after the call."""

    cells: torch.Tensor  # [C] long
    frontiers: torch.Tensor  # [C, P] long: no query of plane p's depth will lie below frontiers[:, p]
    committed: torch.Tensor  # [C] long: rows at positions below it are committed
    released: torch.Tensor  # [C, P] long: leading pages given back so far
    span: int  # positions checked per (request, plane), a multiple of the page size (0: none)


@dataclasses.dataclass
class ResidualUpdate:
    """Record assignments the call brings: cells to reset first, then (cell, plane, group,
    record) rows."""

    resets: torch.Tensor  # [R] long
    assign: torch.Tensor  # [A, 4] long
    truncate: torch.Tensor  # [U, 2] long: (cell, keep): rows at positions >= keep leave every plane
    # cached prefixes (`RecordUpdate.adopt`): [D, 2 + P] long (cell, length, each plane's offset
    # into `adopt_tables`), the pages of every plane's prefix end to end, and the longest length
    adopt: torch.Tensor | None = None
    adopt_tables: torch.Tensor | None = None
    adopt_len: int = 0
    # prompt blocks the plan finishes for the prefix cache (`Plan.cached_blocks`): [B, 2 + P] long
    # (cell, first position, each plane's page); after the passes the planes note their rows
    cached: torch.Tensor | None = None


PassInfo = tuple[list[int], list[int], int, tuple[int, ...], PromptChunks]
# (cells, plane tables, candidates, depths, prompt chunks)


class ResidualBatch:
    variant = None

    def __init__(self, capacity: int, num_loops: int, max_seqs: int, page_size: int, max_len: int,
                 tail: int | None) -> None:
        """`capacity`: the most integers one plan's updates and scans add
        (`KVResidualFeature.attach_kv`); request cell `max_seqs` is the pad cell; `max_len`: the
        positions a request's tables cover at most; `tail`: the execution policy's (None:
        the serial policy), whose passes also look at the groups earlier passes left full
        (the backlog)."""
        self.capacity, self.num_loops, self.page_size, self.max_len, self.tail = (
            capacity, num_loops, page_size, max_len, tail)
        self.max_seqs = max_seqs
        self.pad_cell = max_seqs  # what padding rows and cells of a pass name
        # execution policy: per request cell, each plane's rows in the last pass that ran there
        # (groups they filled seal at a later pass, not their own)
        self._backlog: dict[int, list[int]] = {}

    # ---- per pass ----------------------------------------------------------------------
    def start(self, plan: Plan) -> None:
        """Before a plan's passes (execution policy): a cell whose request starts over has
        no rows; one the builder has no history of (`forget_backlog`: restored from a
        snapshot) may hold any number of full groups not encoded yet."""
        if self.tail is None:
            return
        for g in plan.groups:
            if g.records is not None and g.records.adopt:  # its adopted groups seal in later passes
                self._backlog[g.cell] = [self.max_len] * self.num_loops
            elif g.records is not None and g.records.fresh:
                self._backlog[g.cell] = [0] * self.num_loops
            elif g.cell not in self._backlog:
                self._backlog[g.cell] = [self.max_len] * self.num_loops

    def forget_backlog(self, cell: int) -> None:
        """The cell's planes were written outside the plans (a snapshot restored into it):
        its next pass at each plane looks at every group it may hold."""
        self._backlog.pop(cell, None)

    def pass_info(self, ordered: list[RowGroup], firsts: list[int], p: int,
                  table_at: dict[tuple[int, int], int]) -> PassInfo:
        """Pass p's `ResidualPass` on the host: its request cells, their planes' page-table
        offsets (row-major, -1 below the cell's shallowest row in the pass), candidates and
        the planes it has rows at."""
        shallowest: dict[int, int] = {}
        rows: dict[tuple[int, int], int] = {}  # per (cell, plane)
        for g in ordered:
            if g.loops > p:
                shallowest[g.cell] = min(shallowest.get(g.cell, self.num_loops), g.depth + p)
                rows[g.cell, g.depth + p] = rows.get((g.cell, g.depth + p), 0) + g.num_rows
        cells = list(shallowest)
        plane_tables = [table_at.get((c, plane), -1) if plane >= shallowest[c] else -1
                        for c in cells for plane in range(self.num_loops)]
        depths = tuple(sorted({q for _, q in rows}))
        chunks = PromptChunks(PromptChunk(first, g.num_rows, g.cell, g.depth + p, g.end, table_at[g.cell, g.depth + p])
                              for g, first in zip(ordered, firsts)
                              if g.loops > p and g.num_rows >= CHUNK_ROWS and g.end <= g.decode_from)
        if self.tail is None:  # serial: a cell's rows in the pass, whatever their planes
            per_cell: dict[int, int] = {}
            for (c, _), n in rows.items():
                per_cell[c] = per_cell.get(c, 0) + n
            return (cells, plane_tables, residual_candidates(max(per_cell.values(), default=0), self.num_loops),
                    depths, chunks)
        # execution: the groups the previous pass at each plane left full may seal here
        most = max((self._backlog[c][q] + n for (c, q), n in rows.items()), default=0)
        for (c, q), n in rows.items():
            self._backlog[c][q] = n
        return cells, plane_tables, residual_candidates(most, self.num_loops, self.tail), depths, chunks

    def graph_shape(self, bucket: int) -> tuple[int, tuple[int, ...]]:
        """(candidates, planes) of a graphed pass's `ResidualPass`: fixed by the bucket (a
        pass that needs more runs eager)."""
        return residual_candidates(bucket, self.num_loops, self.tail or 0), tuple(range(self.num_loops))

    def left_out(self, info: PassInfo) -> list[int]:
        """The prompt chunks' rows: they attend dequantized once (`chunks`), not in the reader."""
        return [r for c in info[4] for r in range(c.first, c.first + c.rows)]

    def _size(self, bucket: int, cells: int) -> int:
        return bucket + cells * (1 + self.num_loops)

    def columns(self, info: PassInfo | None, bucket: int) -> int:
        return self._size(bucket, min(bucket, self.max_seqs) if info is None else len(info[0]))

    def fits_graph(self, info: PassInfo, bucket: int) -> bool:
        return info[2] <= self.graph_shape(bucket)[0] and not info[4]  # (chunks run eager)

    def graph_columns(self, bucket: int) -> int:
        return self._size(bucket, min(bucket, self.max_seqs))

    def block_ints(self, info: PassInfo, n: int, cells: list[int], size: int, bucket: int) -> list[int]:
        """The rows' cells, the pass's cells and their plane tables, padded up to the
        layout's cells."""
        pass_cells, plane_tables = info[:2]
        more = (size - bucket) // (1 + self.num_loops) - len(pass_cells)
        return (cells[:n] + [self.pad_cell] * (bucket - n) + pass_cells + [self.pad_cell] * more
                + plane_tables + [-1] * (more * self.num_loops))

    def pad(self, size: int, bucket: int) -> torch.Tensor:
        cells = (size - bucket) // (1 + self.num_loops)
        out = torch.full((size,), -1, dtype=torch.long)
        out[: bucket + cells] = self.pad_cell
        return out

    def _view(self, lp: LoopPass, columns: torch.Tensor, shape: tuple[int, tuple[int, ...]]) -> None:
        b, p = lp.bucket, self.num_loops
        c = (columns.numel() - b) // (1 + p)
        lp.notes[ResidualPass] = ResidualPass(columns[:b][: lp.num_rows], columns[b: b + c],
                                              columns[b + c: b + c * (1 + p)].view(c, p), *shape)

    def pass_view(self, lp: LoopPass, columns: torch.Tensor, info: PassInfo, graphed: bool) -> None:
        self._view(lp, columns, self.graph_shape(lp.bucket) if graphed else info[2:4])
        if info[4]:
            lp.notes[PromptChunks] = info[4]

    def graph_view(self, lp: LoopPass, columns: torch.Tensor, variant: object) -> None:
        self._view(lp, columns, self.graph_shape(lp.bucket))

    def tail_ints(self, info: PassInfo) -> list[int]:
        return []

    def tail_view(self, lp: LoopPass, ints: torch.Tensor, info: PassInfo) -> None:
        pass

    # ---- per plan ----------------------------------------------------------------------
    def plan_ints(self, plan: Plan, ordered: list[RowGroup], firsts: list[int],
                  table_at: dict[tuple[int, int], int]) -> tuple[list[int], tuple]:
        """`ResidualUpdate` and the `ReleaseBatch` as integers, and their sizes."""
        resets: list[int] = []
        assign: list[int] = []
        truncate: list[int] = []
        for g in plan.groups:
            if g.records is None:
                continue
            if g.records.fresh:
                resets.append(g.cell)
            if g.records.truncate is not None:
                truncate += [g.cell, g.records.truncate]
            for plane, records in enumerate(g.records.tables):
                for i, record in enumerate(records):
                    assign += [g.cell, plane, g.records.first[plane] + i, record]
        adopt: list[int] = []  # (cell, length, offsets per plane) per cached prefix, then the pages
        adopt_pages: list[int] = []
        for g in plan.groups:
            if g.records is not None and g.records.adopt:
                adopt += [g.cell, g.records.adopt]
                for table in g.records.adopt_tables:
                    adopt.append(len(adopt_pages))
                    adopt_pages += table
        longest = max((g.records.adopt for g in plan.groups if g.records is not None), default=0)
        cached = [x for cell, start, pages in plan.cached_blocks for x in (cell, start, *pages)]
        out = resets + assign + truncate + adopt + adopt_pages + cached
        bs = self.page_size
        span = max((f - r * bs for scan in plan.releases for f, r in zip(scan.frontiers, scan.released)), default=0)
        span = max(0, min(RELEASE_SPAN, -(-span // bs) * bs))
        for scan in plan.releases:
            out += [scan.cell, scan.committed, *scan.frontiers, *scan.released]
        num_adopt = len(adopt) // (2 + self.num_loops)
        return out, (len(resets), len(assign) // 4, len(truncate) // 2, num_adopt, len(adopt_pages), longest,
                     len(plan.cached_blocks), len(plan.releases), span)

    def plan_view(self, batch: ForwardBatch, ints: torch.Tensor, sizes: tuple) -> None:
        num_resets, num_assign, num_truncate, num_adopt, num_pages, longest, num_cached, num_scans, span = sizes
        at = 0
        resets = ints[at: at + num_resets]
        at += num_resets
        assign = ints[at: at + 4 * num_assign].view(num_assign, 4)
        at += 4 * num_assign
        truncate = ints[at: at + 2 * num_truncate].view(num_truncate, 2)
        at += 2 * num_truncate
        update = ResidualUpdate(resets, assign, truncate)
        if num_adopt:
            width = 2 + self.num_loops
            update.adopt = ints[at: at + width * num_adopt].view(num_adopt, width)
            at += width * num_adopt
            update.adopt_tables, update.adopt_len = ints[at: at + num_pages], longest
            at += num_pages
        if num_cached:
            width = 2 + self.num_loops
            update.cached = ints[at: at + width * num_cached].view(num_cached, width)
            at += width * num_cached
        batch.notes[ResidualUpdate] = update
        if num_scans:
            p = self.num_loops
            scans = ints[at: at + num_scans * (2 + 2 * p)].view(num_scans, 2 + 2 * p)
            batch.notes[ReleaseBatch] = ReleaseBatch(scans[:, 0], scans[:, 2: 2 + p], scans[:, 1], scans[:, 2 + p:],
                                                     span)
