"""The forward batch: one call's device metadata, built from a plan by its one writer.

Everything a forward call reads about its rows lives here, in buffers allocated once at
start-up (pinned staging on the host, a mirror on the device), so a call costs one
host-to-device copy of integers and one of floats, and the addresses never change (what a
CUDA graph needs).

Rows are ordered by group: groups running more loops first (so the rows of loop pass p,
the groups with loops > p, are a prefix [0, N_p)), then within that single-row groups
first, each in plan order. A `LoopPass` per pass holds what attention reads for it: the
rows' positions, depths and page-table offsets at that pass, their KV slots, the group
shapes and query tiles. Views into the device buffer, by segment:

- rows [N]: request cell, token slot, token id (-1: take it from the request cell);
- entering rows [E]: rows at depth 0 and the incarnation of their request;
- heads [H], grouped by head type in plan order: the row the head reads (a sample's or
  draft's last row, a verification's first), the request cell, the result row it fills
  on the host (-1: none), one integer of its own (draft buffer entry, k, candidate entry),
  and the sampling parameters (top_k; temperature, top_p, min_p as fp32);
- tables [T]: page tables, one per (request cell, plane) in the plan;
- one block per loop pass (`PassLayout`, padded up to a graph bucket when graphs are on):
  the pass's rows' absolute positions (any order; nonconsecutive allowed), depths, token
  slots and page-table offsets at that pass, its query tiles when the backend asks for
  them ((first row, rows, table offset) for runs of at most `tile_rows` rows of one group:
  the backend's small size when every group fits in it, its large size otherwise), with
  adaptive exit every plane's page-table offset (-1 where none), and with INT4 residuals
  the rows' request cells and the pass's `ResidualPass` columns (request cells and their
  planes' page-table offsets; padded with the pad cell in a pass a graph replays).

A group at a sparse loop of token-sparse prefill (`RowGroup.window`) holds placeholder
positions and token slots in its rows; the runner fills them in on the device from the
window's selection (`WindowRows`: the window's token slots ride in the integer upload).

KV slots are computed on the device from page tables and positions: slot = page *
page_size + position % page_size. Host-side summaries (row counts, group shapes, head
lists) travel beside the device views as plain Python, for shapes and Python flags.
"""

from __future__ import annotations

import array
import bisect
import dataclasses
import functools
from typing import Any

import torch

from specloop.kernels.paged_attention import TILE_COLUMNS, query_tiles
from specloop.plan import Draft, Plan, RowGroup, Sample, Verify, VerifyCandidate

HEAD_TYPES = (Sample, Draft, Verify, VerifyCandidate)  # the order heads run in: drafts before the
# verifications that may read the request cell they write (token pipelines)
HEAD_COLUMNS = 6  # row, cell, result, aux, top_k, greedy
STAGING_RING = 4  # host staging buffers in turn (more than the tickets that may be in flight)
NO_TOP_K = 2**31 - 1  # top_k of rows without top-k; clamped to the vocabulary in the sampler


@dataclasses.dataclass(frozen=True)
class GroupShape:
    """Host-side shape of one row group: its rows [first, first + rows), its keys [0, context)."""

    first: int
    rows: int
    context: int
    table: int  # offset of its plane's page table in `tables`


@dataclasses.dataclass
class HeadSegment:
    """The heads of one type: device columns and the groups they belong to (plan order)."""

    groups: list[RowGroup]
    row: torch.Tensor  # [H] long
    cell: torch.Tensor  # [H] long
    result: torch.Tensor  # [H] long: host result row, -1 for drafts
    aux: torch.Tensor  # [H] long: draft entry, k, or candidate entry
    top_k: torch.Tensor  # [H] long
    greedy: torch.Tensor  # [H] bool
    temperature: torch.Tensor  # [H] fp32
    top_p: torch.Tensor  # [H] fp32
    min_p: torch.Tensor  # [H] fp32
    first_row: list[int]  # host copy of `row`
    result_rows: list[int]  # host copy of `result`

    def __len__(self) -> int:
        return len(self.groups)


@dataclasses.dataclass
class SparseRows:
    """A loop pass's generated-token rows: `source` (depth 1) and `correction` (depth >= 2)
    batch rows, [Ns] and [Nc] long on the device. A CUDA graph lists every row of its
    bucket in both (`every`: then a gather by them is the tensor itself) and says which rows
    play each part in `source_ok` / `correction_ok` ([b] bool, from the pass block: values,
    never constants of the graph). `memo` holds what the pass's layer 0 derived from the
    rows (slots, masks, the missing states), which its later layers reuse (layer 0 derives it
    afresh, so a list reused for another pass is never stale)."""

    source: torch.Tensor
    correction: torch.Tensor
    source_ok: torch.Tensor | None = None
    correction_ok: torch.Tensor | None = None
    every: bool = False
    memo: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def pick(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """x[r] for one of the row lists r (x itself when r is every row)."""
        return x if self.every else x[r]


@dataclasses.dataclass
class LoopPass:
    """One loop over rows [0, num_rows) of the batch: what the attention backend reads.

    KV slots are computed on the device when first read: a pass a CUDA graph replays never
    reads them here (the graph computes its own), which saves the ops on the host."""

    num_rows: int
    positions: torch.Tensor  # [N_p] long
    depths: torch.Tensor  # [N_p] long: each row's depth at this pass
    tables: torch.Tensor  # [T] long: page ids (the batch's)
    table_offsets: torch.Tensor  # [N_p] long: where each row's page table at this depth starts in `tables`
    planes: torch.Tensor | None  # [N_p, R] long: each plane's page-table offset, -1 where none (adaptive exit)
    groups: list[GroupShape]  # the pass's groups, in row order
    page_size: int
    tiles: torch.Tensor | None = None  # [M, 3] long: query tiles, when the builder cuts them
    tile_rows: int = 0  # the most rows of any tile
    token_slots: torch.Tensor | None = None  # [N_p] long: the rows' token slots
    block: torch.Tensor | None = None  # the pass's padded block in the device buffer (`PassLayout`)
    bucket: int = 0  # rows of the block (N_p padded up to a graph bucket, or N_p)
    num_splits: int | None = None  # split-KV fixed by the caller (a CUDA graph); None: the backend picks
    residual: ResidualPass | None = None  # INT4 residual planes on: what the pass may encode
    encode_plan: Any = None  # set by the runner before the backend builds (kv_residual.EncodePlan)
    sparse: SparseRows | None = None  # sparse decode attention on: the pass's generated-token rows
    max_context: int | None = None  # a bound on every row's position + 1 fixed by the caller (a CUDA graph)

    @functools.cached_property
    def write_slots(self) -> torch.Tensor:
        """[N_p] long: each row's KV slot at this depth."""
        return kv_slots(self.tables, self.table_offsets, self.positions, self.page_size)

    @functools.cached_property
    def deeper_slots(self) -> torch.Tensor | None:
        """[N_p, R] long: each row's KV slot in every plane, -1 where none (adaptive exit)."""
        if self.planes is None:
            return None
        slots = kv_slots(self.tables, self.planes.clamp(min=0), self.positions[:, None], self.page_size)
        return torch.where(self.planes >= 0, slots, torch.full_like(slots, -1))


@dataclasses.dataclass(frozen=True)
class PassLayout:
    """Where each column of one pass sits in its block of `bucket` rows: positions, depths,
    token slots and page-table offsets ([b] each), query tiles ([b, 3]: at most one per row),
    with adaptive exit every plane's page-table offset ([R, b]), and with INT4 residuals
    (`residual_planes` P) the rows' request cells ([b]), then `residual_cells` C request
    cells and their planes' page-table offsets ([C, P]). Rows past the pass's own are
    padding: position 0, depth 0, the pad token slot, the pad table entry (whose page is a
    sink nobody reads), tiles of 0 rows, no planes (-1), the pad cell; cells past the
    pass's own are the pad cell with no planes (-1). With sparse decode attention each row's
    role ([b]: 1 a source, 2 a correction, 0 neither) follows, padding roles 0 (the
    correction rows are not in `tiles`: the correction step computes them). A CUDA graph
    captured for a bucket reads a block of this layout at a fixed address."""

    bucket: int
    planes: int  # R with adaptive exit, else 0
    residual_planes: int = 0  # P with INT4 residuals, else 0
    residual_cells: int = 0  # C: request cells of the residual columns
    sparse: bool = False  # sparse decode attention: row roles [b]

    @property
    def size(self) -> int:
        residual = self.bucket + self.residual_cells * (1 + self.residual_planes) if self.residual_planes else 0
        sparse = self.bucket if self.sparse else 0
        return (4 + TILE_COLUMNS + self.planes) * self.bucket + residual + sparse

    def views(self, block: torch.Tensor) -> dict[str, torch.Tensor]:
        b = self.bucket
        out = {"positions": block[:b], "depths": block[b: 2 * b], "token_slots": block[2 * b: 3 * b],
               "table_offsets": block[3 * b: 4 * b],
               "tiles": block[4 * b: (4 + TILE_COLUMNS) * b].view(b, TILE_COLUMNS)}
        at = (4 + TILE_COLUMNS + self.planes) * b
        if self.planes:
            out["planes"] = block[(4 + TILE_COLUMNS) * b: at].view(self.planes, b).t()
        if self.residual_planes:
            c, p = self.residual_cells, self.residual_planes
            out["cells"] = block[at: at + b]
            out["pass_cells"] = block[at + b: at + b + c]
            out["plane_tables"] = block[at + b + c: at + b + c * (1 + p)].view(c, p)
            at += b + c * (1 + p)
        if self.sparse:
            out["roles"] = block[at: at + b]
        return out


@dataclasses.dataclass
class WindowRows:
    """A prompt window's group at a sparse loop (host side): batch rows [first, first + rows)
    run ranks [rank, rank + rows) of the `budget` tokens it keeps at `depth` (selected in this
    call when rank == 0)."""

    request_id: str
    first: int
    rows: int
    window_slots: torch.Tensor  # [n] long: token slots of the window's tokens, in position order (a view)
    start: int  # the window's first absolute position
    depth: int
    budget: int
    rank: int
    head: bool  # the group samples: its head reads the prompt's last token, selected or not


@dataclasses.dataclass
class WindowBatch:
    """The call's sparse prefill groups, batched for the device (`sparse_prefill.run`): one
    padded row of window token slots per group, its integers, and one entry per batch row
    the groups run."""

    windows: list[WindowRows]
    slots: torch.Tensor  # [G, W] long, padded with the pad slot
    info: torch.Tensor  # [G, WINDOW_INFO] long: start, length, depth, budget, selects here, table, inherited table
    rows: torch.Tensor  # [R] long: batch rows
    row_window: torch.Tensor  # [R] long: the group of each
    row_rank: torch.Tensor  # [R] long: the rank of the kept token each runs
    moved_window: torch.Tensor  # [M] long: per token a selecting group leaves out, its group
    moved_rank: torch.Tensor  # [M] long: and its rank (budget .. length - 1: the left-out come after the kept)


WINDOW_INFO = 7


@dataclasses.dataclass
class ResidualPass:
    """What one loop pass tells the INT4 residual planes (`specloop.flashloop.kv_residual.planes`):
    each row's request cell, and per request cell in the pass the page-table offset of every
    plane it may encode groups of (-1: none; planes below the cell's shallowest row in the
    pass cannot change), with `candidates` groups per (cell, plane) to look at. A pass a
    CUDA graph replays has the bucket's fixed shape (`residual_shape`): its cells padded
    with the pad cell, and every plane in `depths`."""

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


RELEASE_SPAN = 4096  # the most tail positions one call checks per request and plane


@dataclasses.dataclass
class ResidualUpdate:
    """Record assignments the call brings: cells to reset first, then (cell, plane, group,
    record) rows."""

    resets: torch.Tensor  # [R] long
    assign: torch.Tensor  # [A, 4] long
    truncate: torch.Tensor  # [U, 2] long: (cell, keep): rows at positions >= keep leave every plane


@dataclasses.dataclass
class ForwardBatch:
    plan: Plan
    num_rows: int
    cells: torch.Tensor  # [N] long
    token_slots: torch.Tensor  # [N] long
    token_ids: torch.Tensor  # [N] long, -1: from the request cell
    enter_rows: torch.Tensor | None  # [E] long
    enter_incarnations: torch.Tensor | None  # [E] long
    passes: list[LoopPass]  # pass p runs the groups with loops > p
    heads: dict[type, HeadSegment]
    host_groups: list[RowGroup]  # groups with a host result, in result order
    page_size: int
    tables: torch.Tensor | None = None  # [T] long: the page tables every pass reads
    windows: WindowBatch | None = None  # sparse prefill groups
    residual_update: ResidualUpdate | None = None  # INT4 residual records the call brings
    release: ReleaseBatch | None = None  # INT4 residual tail pages to check after the call

    def segment(self, kind: type) -> HeadSegment | None:
        return self.heads.get(kind)


class ForwardBatchBuilder:
    """Owns the staging and device buffers; `build(plan)` is the batch's only writer."""

    ROW_COLUMNS = 3  # cell, slot, token (batch level; the rest is per pass)

    def __init__(self, max_rows: int, max_seqs: int, num_loops: int, max_pages_per_seq: int, page_size: int,
                 device: torch.device, tile_rows: tuple[int, int] | None = None,
                 buckets: tuple[int, ...] = (), pad_slot: int = 0, window_slots: int = 0,
                 residual_ints: int = 0, residual_tail: int | None = None, sparse_decode: bool = False) -> None:
        """`tile_rows`: (small, large) query-tile sizes, or None for a backend without tiles;
        `buckets`: row counts a pass is padded up to (CUDA graph sizes; empty: no padding);
        `pad_slot`: the token slot padding rows name (a sink row of the slot storage);
        `window_slots`: the most window token slots one plan's sparse prefill groups carry;
        `residual_ints`: the most integers one plan's INT4 residual records and release scans
        add (0: the format is off; on, each pass block holds its residual columns, and
        request cell `max_seqs` is the pad cell); `residual_tail`: the execution policy's
        tail (None: the serial policy), whose passes also look at the groups earlier passes
        left full (`_backlog`); `sparse_decode`: each pass lists its generated-token rows
        (`SparseRows`: sources at depth 1, corrections deeper)."""
        self.num_loops = num_loops
        self.tile_rows = tile_rows
        self.page_size = page_size
        self.device = device
        self.max_rows = max_rows
        self.buckets = tuple(sorted(b for b in buckets if b <= max_rows))
        self.pad_slot = pad_slot
        self.max_tables = max_seqs * num_loops * max_pages_per_seq
        self.pad_table = self.max_tables  # the sink entry a graph's table buffer holds past every real one
        self.residual = residual_ints > 0
        self.residual_tail = residual_tail
        self.sparse_decode = sparse_decode
        self.max_len = max_pages_per_seq * page_size
        # execution policy: per request cell, each plane's rows in the last pass that ran there
        # (groups they filled seal at a later pass, not their own)
        self._backlog: dict[int, list[int]] = {}
        self.max_seqs = max_seqs
        self.pad_cell = max_seqs  # what padding rows and cells of a pass name (INT4 residuals)
        block = max(self._layout(b, num_loops, min(b, max_seqs)).size for b in (max_rows, *self.buckets))
        ints = self.ROW_COLUMNS * max_rows + 2 * max_rows + HEAD_COLUMNS * max_rows + self.max_tables + num_loops * block
        ints += window_slots + residual_ints + (num_loops * max_rows if sparse_decode else 0)
        floats = 3 * max_rows
        pin = device.type == "cuda"
        # Staging in a ring: the copy of call N reads its staging buffer asynchronously, so
        # call N+1 writes the next one; a buffer is reused only once its copy completed.
        self._staging = [(torch.zeros(ints, dtype=torch.long, pin_memory=pin),
                          torch.zeros(floats, dtype=torch.float32, pin_memory=pin)) for _ in range(STAGING_RING)]
        self._copied: list[torch.cuda.Event | None] = [None] * STAGING_RING
        self._turn = 0
        self._ints = torch.zeros(ints, dtype=torch.long, device=device)
        self._floats = torch.zeros(floats, dtype=torch.float32, device=device)
        self.uploads = 0  # host-to-device copies so far (a test counts them per call)

    def bucket(self, rows: int) -> int:
        """The graph bucket a pass of `rows` rows is padded to, or `rows` past the largest."""
        for b in self.buckets:
            if rows <= b:
                return b
        return rows

    def graphed(self, bucket: int, tile_rows: int) -> bool:
        """Whether a pass of this bucket and tile size has a graph's shape (`LoopGraphs.fits`)."""
        return bucket in self.buckets and (self.tile_rows is None or tile_rows == self.tile_rows[0])

    def _layout(self, bucket: int, planes: int, cells: int) -> PassLayout:
        return PassLayout(bucket, planes, self.num_loops if self.residual else 0, cells if self.residual else 0,
                          self.sparse_decode)

    def graph_layout(self, bucket: int, adaptive_exit: bool) -> PassLayout:
        """The block layout of the graph of `bucket` rows (every request cell column padded)."""
        return self._layout(bucket, self.num_loops if adaptive_exit else 0, min(bucket, self.max_seqs))

    def graph_residual(self, bucket: int) -> tuple[int, tuple[int, ...]] | None:
        """(candidates, planes) of a graphed pass's `ResidualPass`: fixed by the bucket (a
        pass that needs more runs eager)."""
        if not self.residual:
            return None
        return residual_candidates(bucket, self.num_loops, self.residual_tail or 0), tuple(range(self.num_loops))

    def pad_block(self, layout: PassLayout) -> torch.Tensor:
        """A block of padding rows only (what a CUDA graph is captured on)."""
        return pad_block(layout, self.pad_slot, self.pad_table, self.device, self.pad_cell)

    def build(self, plan: Plan) -> ForwardBatch:
        cells: list[int] = []
        slots: list[int] = []
        tokens: list[int] = []
        positions: list[int] = []
        depths: list[int] = []
        tables: list[int] = []
        table_at: dict[tuple[int, int], int] = {}
        enter: list[int] = []
        enter_inc: list[int] = []
        by_kind: dict[type, list[tuple[int, RowGroup]]] = {}
        windows: list[tuple[int, RowGroup, int, int]] = []  # (first row, group, table, inherited table)
        host_groups = plan.host_groups  # results in plan order
        first = 0
        # More loops first (each pass's rows are a prefix), then single-row groups first.
        ordered = sorted(plan.groups, key=lambda g: (-g.loops, g.num_rows > 1))
        num_passes = ordered[0].loops if ordered else 1
        shapes: list[list[GroupShape]] = [[] for _ in range(num_passes)]  # per pass
        plane_columns: list[list[int]] = [[] for _ in range(self.num_loops if plan.adaptive_exit else 0)]
        longest = _longest_tables(ordered)  # one table per (cell, plane): shorter ones are its prefixes
        firsts: list[int] = []  # each ordered group's first row
        for group in ordered:
            n = group.num_rows
            firsts.append(first)
            own = _table_offset(table_at, tables, longest, group.cell, group.depth)
            planes = [own] + [_table_offset(table_at, tables, longest, group.cell, plane)
                              for plane in range(group.depth + 1, group.depth + 1 + len(group.deeper_tables))]
            for p in range(group.loops):
                shapes[p].append(GroupShape(first, n, group.end, planes[p]))
            if group.window is not None:  # placeholders: the runner selects the rows
                windows.append((first, group, own, _table_offset(table_at, tables, longest, group.cell,
                                                                 group.depth - 1)))
            cells.extend([group.cell] * n)
            slots.extend(group.token_slots[:n])
            tokens.extend(group.token_ids if group.token_ids is not None else [-1] * n)
            positions.extend(range(group.start, group.start + n))
            depths.extend([group.depth] * n)
            if plan.adaptive_exit:
                for column, offset in zip(plane_columns, [-1] * (group.depth + 1) + planes[1:]):
                    column.extend([offset] * n)
            if group.depth == 0:
                enter.extend(range(first, first + n))
                enter_inc.extend([group.incarnation] * n)
            if group.head is not None:
                head_row = first if isinstance(group.head, Verify) else first + n - 1
                by_kind.setdefault(type(group.head), []).append((head_row, group))
            first += n
        if first > self.max_rows or len(tables) > self.max_tables:
            raise ValueError(f"a plan of {first} rows and {len(tables)} table entries exceeds the forward "
                             f"batch ({self.max_rows} rows, {self.max_tables} table entries)")
        results = {id(g): i for i, g in enumerate(host_groups)}
        heads, head_ints, head_floats = [], [], []
        for kind in HEAD_TYPES:
            for row, group in by_kind.get(kind, ()):
                heads.append((kind, row, group))
                head_ints.extend(_head_ints(row, group, results.get(id(group), -1)))
                head_floats.extend(_head_floats(group))
        ints = cells + slots + tokens + enter + enter_inc + head_ints + tables
        blocks = []  # (at, layout, rows, tile_rows, tiles, residual) per pass
        if self.residual_tail is not None:
            self._start_backlog(plan)
        # sparse decode attention: each pass's (sources, corrections); corrections leave the dense tiles
        sparse = [_sparse_rows(ordered, firsts, p) if self.sparse_decode else ([], []) for p in range(num_passes)]
        for p, pass_shapes in enumerate(shapes):
            n = sum(s.rows for s in pass_shapes)
            tiles, tile_rows = self._tiles(pass_shapes, sparse[p][1])
            bucket = self.bucket(n)
            rp = self._residual_pass(ordered, p, table_at) if self.residual else None
            if rp is None:
                layout = self._layout(bucket, len(plane_columns), 0)
            elif self.graphed(bucket, tile_rows) and rp[2] <= (fixed := self.graph_residual(bucket))[0]:
                layout = self.graph_layout(bucket, bool(plane_columns))  # the graph's shape
                rp = rp[:2] + fixed
            else:
                layout = self._layout(bucket, len(plane_columns), len(rp[0]))
            blocks.append((len(ints), layout, n, tile_rows, len(tiles) // TILE_COLUMNS, rp and rp[2:]))
            ints.extend(self._block(layout, n, p, positions, depths, slots, pass_shapes, tiles, plane_columns,
                                    cells, rp, sparse[p]))
        sparse_at = []  # per pass: (where its rows start in the upload, sources, corrections)
        for source, correction in sparse:
            sparse_at.append((len(ints), len(source), len(correction)))
            ints.extend(source + correction)
        window_at = len(ints)
        if windows:
            ints.extend(self._window_ints(windows))
        residual_at = len(ints)
        if self.residual:
            residual = self._residual_ints(plan)
            ints.extend(residual[0])
        if len(ints) > self._ints.numel():
            raise ValueError(f"a plan's {len(ints)} integers exceed the forward batch's upload buffer "
                             f"({self._ints.numel()})")
        host_ints, host_floats = self._take_staging()
        dev_ints = self._upload(host_ints, self._ints, array.array("q", ints))
        dev_floats = self._upload(host_floats, self._floats, array.array("f", head_floats))
        self._release_staging()
        batch = self._views(plan, first, len(enter), heads, len(tables), dev_ints, dev_floats, shapes, blocks,
                            host_groups, results)
        for lp, (at, ns, nc) in zip(batch.passes, sparse_at):
            if ns + nc:  # a pass of prompt rows alone has none
                lp.sparse = SparseRows(dev_ints[at: at + ns], dev_ints[at + ns: at + ns + nc])
        if windows:
            batch.windows = self._window_views(windows, dev_ints, window_at)
        if self.residual:
            self._residual_views(batch, residual[1], dev_ints, residual_at)
        return batch

    def _residual_ints(self, plan: Plan) -> tuple[list[int], tuple]:
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
        out = resets + assign + truncate
        bs = self.page_size
        span = max((f - r * bs for scan in plan.releases for f, r in zip(scan.frontiers, scan.released)), default=0)
        span = max(0, min(RELEASE_SPAN, -(-span // bs) * bs))
        for scan in plan.releases:
            out += [scan.cell, scan.committed, *scan.frontiers, *scan.released]
        return out, (len(resets), len(assign) // 4, len(truncate) // 2, len(plan.releases), span)

    def _residual_pass(self, ordered: list[RowGroup], p: int, table_at: dict[tuple[int, int], int]
                       ) -> tuple[list[int], list[int], int, tuple[int, ...]]:
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
        if self.residual_tail is None:  # serial: a cell's rows in the pass, whatever their planes
            per_cell: dict[int, int] = {}
            for (c, _), n in rows.items():
                per_cell[c] = per_cell.get(c, 0) + n
            return cells, plane_tables, residual_candidates(max(per_cell.values(), default=0), self.num_loops), depths
        # execution: the groups the previous pass at each plane left full may seal here
        most = max((self._backlog[c][q] + n for (c, q), n in rows.items()), default=0)
        for (c, q), n in rows.items():
            self._backlog[c][q] = n
        return cells, plane_tables, residual_candidates(most, self.num_loops, self.residual_tail), depths

    def _start_backlog(self, plan: Plan) -> None:
        """Before a plan's passes (execution policy): a cell whose request starts over has
        no rows; one the builder has no history of (`forget_backlog`: restored from a
        snapshot) may hold any number of full groups not encoded yet."""
        for g in plan.groups:
            if g.records is not None and g.records.fresh:
                self._backlog[g.cell] = [0] * self.num_loops
            elif g.cell not in self._backlog:
                self._backlog[g.cell] = [self.max_len] * self.num_loops

    def forget_backlog(self, cell: int) -> None:
        """The cell's planes were written outside the plans (a snapshot restored into it):
        its next pass at each plane looks at every group it may hold."""
        self._backlog.pop(cell, None)

    def _residual_views(self, batch: ForwardBatch, sizes: tuple, ints: torch.Tensor, at: int) -> None:
        num_resets, num_assign, num_truncate, num_scans, span = sizes
        resets = ints[at: at + num_resets]
        at += num_resets
        assign = ints[at: at + 4 * num_assign].view(num_assign, 4)
        at += 4 * num_assign
        truncate = ints[at: at + 2 * num_truncate].view(num_truncate, 2)
        at += 2 * num_truncate
        batch.residual_update = ResidualUpdate(resets, assign, truncate)
        if num_scans:
            p = self.num_loops
            scans = ints[at: at + num_scans * (2 + 2 * p)].view(num_scans, 2 + 2 * p)
            batch.release = ReleaseBatch(scans[:, 0], scans[:, 2: 2 + p], scans[:, 1], scans[:, 2 + p:], span)

    def _window_ints(self, windows: list[tuple[int, RowGroup, int, int]]) -> list[int]:
        """`WindowBatch`'s integers: padded window slots, per-group info, per-row entries."""
        width = max(len(g.token_slots) for _, g, _, _ in windows)
        out: list[int] = []
        for _, g, _, _ in windows:
            out += g.token_slots + [self.pad_slot] * (width - len(g.token_slots))
        for _, g, own, inherited in windows:
            out += [g.start, len(g.token_slots), g.depth, g.window.budget, int(g.window.first == 0), own, inherited]
        rows, of, ranks = [], [], []
        moved_of, moved_ranks = [], []
        for i, (row, g, _, _) in enumerate(windows):
            w = g.window
            rows += range(row, row + w.rows)
            of += [i] * w.rows
            ranks += range(w.first, w.first + w.rows)
            if w.first == 0:
                moved_of += [i] * (len(g.token_slots) - w.budget)
                moved_ranks += range(w.budget, len(g.token_slots))
        return out + rows + of + ranks + moved_of + moved_ranks

    def _window_views(self, windows: list[tuple[int, RowGroup, int, int]], ints: torch.Tensor,
                      at: int) -> WindowBatch:
        g, width = len(windows), max(len(w.token_slots) for _, w, _, _ in windows)
        r = sum(w.window.rows for _, w, _, _ in windows)
        slots = ints[at: at + g * width].view(g, width)
        at += g * width
        info = ints[at: at + g * WINDOW_INFO].view(g, WINDOW_INFO)
        at += g * WINDOW_INFO
        rows, of, ranks = ints[at: at + r], ints[at + r: at + 2 * r], ints[at + 2 * r: at + 3 * r]
        at += 3 * r
        m = sum(len(w.token_slots) - w.window.budget for _, w, _, _ in windows if w.window.first == 0)
        moved_of, moved_ranks = ints[at: at + m], ints[at + m: at + 2 * m]
        host = [WindowRows(grp.request_id, row, grp.window.rows, slots[i, : len(grp.token_slots)], grp.start,
                           grp.depth, grp.window.budget, grp.window.first, grp.head is not None)
                for i, (row, grp, _, _) in enumerate(windows)]
        return WindowBatch(host, slots, info, rows, of, ranks, moved_of, moved_ranks)

    def _block(self, layout: PassLayout, n: int, p: int, positions: list[int], depths: list[int],
               slots: list[int], shapes: list[GroupShape], tiles: list[int], plane_columns: list[list[int]],
               cells: list[int], residual: tuple | None, sparse: tuple[list[int], list[int]]) -> list[int]:
        """Pass p's block (`PassLayout`): its n rows' columns, then padding up to the bucket;
        with INT4 residuals the rows' cells and the pass's (cells, plane tables), padded up
        to the layout's cells; with sparse decode attention the rows' roles."""
        pad = layout.bucket - n
        out = positions[:n] + [0] * pad
        out += [d + p for d in depths[:n]] + [0] * pad
        out += slots[:n] + [self.pad_slot] * pad
        for shape in shapes:
            out.extend([shape.table] * shape.rows)
        out += [self.pad_table] * pad
        out += tiles + [0] * (TILE_COLUMNS * layout.bucket - len(tiles))
        for column in plane_columns:
            out += column[:n] + [-1] * pad
        if residual is not None:
            pass_cells, plane_tables = residual[:2]
            more = layout.residual_cells - len(pass_cells)
            out += cells[:n] + [self.pad_cell] * pad
            out += pass_cells + [self.pad_cell] * more
            out += plane_tables + [-1] * (more * layout.residual_planes)
        if layout.sparse:
            roles = [0] * layout.bucket
            for row in sparse[0]:
                roles[row] = 1
            for row in sparse[1]:
                roles[row] = 2
            out += roles
        return out

    def _tiles(self, shapes: list[GroupShape], corrections: list[int]) -> tuple[list[int], int]:
        """(tiles, tile rows): the pass's query tiles without its sparse decode correction
        rows (a tail of their groups; the correction step computes them)."""
        if self.tile_rows is None:
            return [], 0
        small, large = self.tile_rows
        size = small if max((s.rows for s in shapes), default=0) <= small else large
        dense = []
        for s in shapes:  # corrections ascend, a tail of each group's rows (`_sparse_rows`)
            c = bisect.bisect_left(corrections, s.first + s.rows) - bisect.bisect_left(corrections, s.first)
            assert c == 0 or corrections[bisect.bisect_left(corrections, s.first)] == s.first + s.rows - c
            dense.append((s.first, s.rows - c, s.table))
        return query_tiles(dense, size), size

    def _take_staging(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next staging pair, once the copy that last read it has completed (on CUDA that
        copy was enqueued STAGING_RING calls ago, so this wait is normally already over)."""
        copied = self._copied[self._turn]
        if copied is not None:
            copied.synchronize()
        return self._staging[self._turn]

    def _release_staging(self) -> None:
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._copied[self._turn] = event
        self._turn = (self._turn + 1) % STAGING_RING

    def _upload(self, host: torch.Tensor, device: torch.Tensor, values: array.array) -> torch.Tensor:
        n = len(values)
        if n:
            host[:n].copy_(torch.frombuffer(values, dtype=host.dtype))
            device[:n].copy_(host[:n], non_blocking=True)
            self.uploads += 1
        return device

    def _views(self, plan: Plan, n: int, e: int, heads: list, t: int, ints: torch.Tensor, floats: torch.Tensor,
               shapes: list[list[GroupShape]], blocks: list, host_groups: list[RowGroup],
               results: dict[int, int]) -> ForwardBatch:
        cols = ints[: n * self.ROW_COLUMNS].view(self.ROW_COLUMNS, n) if n else ints[:0].view(self.ROW_COLUMNS, 0)
        at = n * self.ROW_COLUMNS
        enter_rows, enter_inc = ints[at: at + e], ints[at + e: at + 2 * e]
        at += 2 * e
        h = len(heads)
        head_cols = ints[at: at + HEAD_COLUMNS * h].view(h, HEAD_COLUMNS) if h else ints[:0].view(0, HEAD_COLUMNS)
        at += HEAD_COLUMNS * h
        tables = ints[at: at + t]
        head_floats = floats[: 3 * h].view(h, 3) if h else floats[:0].view(0, 3)
        bs = self.page_size
        passes = []
        for pass_shapes, (start, layout, rows, tile_rows, num_tiles, residual) in zip(shapes, blocks):
            tiled = self.tile_rows is not None
            passes.append(pass_view(layout, ints[start: start + layout.size], tables, bs, rows, pass_shapes,
                                    tile_rows, num_tiles if tiled else None, residual=residual))
        segments: dict[type, HeadSegment] = {}
        start = 0
        for kind in HEAD_TYPES:
            members = [(row, g) for k, row, g in heads if k is kind]
            if members:
                c = head_cols[start: start + len(members)]
                f = head_floats[start: start + len(members)]
                segments[kind] = HeadSegment([g for _, g in members], c[:, 0], c[:, 1], c[:, 2], c[:, 3], c[:, 4],
                                             c[:, 5].bool(), f[:, 0], f[:, 1], f[:, 2], [row for row, _ in members],
                                             [results.get(id(g), -1) for _, g in members])
                start += len(members)
        return ForwardBatch(plan, n, cols[0], cols[1], cols[2], enter_rows if e else None, enter_inc if e else None,
                            passes, segments, host_groups, bs, tables)


def pass_view(layout: PassLayout, block: torch.Tensor, tables: torch.Tensor, page_size: int, rows: int,
              shapes: list[GroupShape], tile_rows: int, num_tiles: int | None,
              num_splits: int | None = None, residual: tuple[int, tuple[int, ...]] | None = None,
              sparse_roles: bool = False, max_context: int | None = None) -> LoopPass:
    """The `LoopPass` of a block: views of its first `rows` rows (a CUDA graph calls this
    inside its capture, with every row of the bucket); `residual` (candidates, planes with
    rows) where the layout holds residual columns; `sparse_roles`: the pass's `SparseRows`
    are every row, with the roles column saying which play a part (a CUDA graph's)."""
    v = layout.views(block)
    lp = LoopPass(rows, v["positions"][:rows], v["depths"][:rows], tables, v["table_offsets"][:rows],
                  v["planes"][:rows] if layout.planes else None, shapes, page_size,
                  tiles=v["tiles"][:num_tiles] if num_tiles is not None else None, tile_rows=tile_rows,
                  token_slots=v["token_slots"][:rows], block=block, bucket=layout.bucket, num_splits=num_splits,
                  max_context=max_context)
    if sparse_roles:
        roles = v["roles"][:rows]
        every = torch.arange(rows, device=block.device)
        lp.sparse = SparseRows(every, every, roles == 1, roles == 2, every=True)
    if layout.residual_planes:
        assert residual is not None, "a block with residual columns needs its candidates"
        lp.residual = ResidualPass(v["cells"][:rows], v["pass_cells"], v["plane_tables"], *residual)
    return lp


def pad_block(layout: PassLayout, pad_slot: int, pad_table: int, device: torch.device, pad_cell: int = 0
              ) -> torch.Tensor:
    """A block of padding rows only (what a CUDA graph is captured on)."""
    block = torch.zeros(layout.size, dtype=torch.long, device=device)
    b = layout.bucket
    block[2 * b: 3 * b] = pad_slot
    block[3 * b: 4 * b] = pad_table
    at = (4 + TILE_COLUMNS + layout.planes) * b
    block[(4 + TILE_COLUMNS) * b: at] = -1
    if layout.residual_planes:
        c = layout.residual_cells
        block[at: at + b + c] = pad_cell
        block[at + b + c: at + b + c * (1 + layout.residual_planes)] = -1  # (then roles 0)
    return block


def _sparse_rows(ordered: list[RowGroup], firsts: list[int], p: int) -> tuple[list[int], list[int]]:
    """Pass p's generated-token rows (positions at or past their group's `decode_from`):
    those at depth 1 (sparse decode sources) and those deeper (corrections). A sparse
    prefill window's rows are prompt rows."""
    source: list[int] = []
    correction: list[int] = []
    for group, first in zip(ordered, firsts):
        depth = group.depth + p
        if group.loops <= p or depth < 1 or group.window is not None or group.end <= group.decode_from:
            continue
        skip = max(0, group.decode_from - group.start)
        (source if depth == 1 else correction).extend(range(first + skip, first + group.num_rows))
    return source, correction


def _longest_tables(groups: list[RowGroup]) -> dict[tuple[int, int], list[int]]:
    """The longest page table the plan's groups give each (cell, plane). Every group's table
    of a plane is a prefix of the plane's table when the plan was built, so the longest one
    serves them all, and the batch holds at most one table per request and plane."""
    longest: dict[tuple[int, int], list[int]] = {}
    for g in groups:
        given = [(g.depth, g.page_table), *enumerate(g.deeper_tables, start=g.depth + 1)]
        if g.window is not None:
            given.append((g.depth - 1, g.window.inherit_table))
        for plane, pages in given:
            if len(pages) > len(longest.get((g.cell, plane), ())):
                longest[(g.cell, plane)] = pages
    return longest


def _table_offset(table_at: dict[tuple[int, int], int], tables: list[int],
                  longest: dict[tuple[int, int], list[int]], cell: int, plane: int) -> int:
    """Where (cell, plane)'s page table sits in `tables` (stored on first use)."""
    key = (cell, plane)
    if key not in table_at:
        table_at[key] = len(tables)
        tables.extend(longest[key])
    return table_at[key]


def _head_ints(row: int, group: RowGroup, result: int) -> list[int]:
    head = group.head
    aux = head.position if isinstance(head, (Draft, VerifyCandidate)) else getattr(head, "num_candidates", 0)
    p = head.params
    top_k = p.top_k if not p.is_greedy and p.top_k > 0 else NO_TOP_K
    return [row, group.cell, result, aux, top_k, int(p.is_greedy)]


def _head_floats(group: RowGroup) -> list[float]:
    """Greedy heads carry neutral values (temperature 1, no filters): they take the argmax."""
    p = group.head.params
    if p.is_greedy:
        return [1.0, 1.0, 0.0]
    return [p.temperature, p.top_p, p.min_p]


def kv_slots(tables: torch.Tensor, offsets: torch.Tensor | int, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """KV slots of `positions` through the page tables starting at `offsets` (broadcasting)."""
    if tables.numel() == 0:
        return torch.zeros_like(positions + offsets)
    index = (offsets + torch.div(positions, page_size, rounding_mode="floor")).clamp(max=tables.numel() - 1)
    return tables[index] * page_size + positions % page_size
