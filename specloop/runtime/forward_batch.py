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
  adaptive exit every plane's page-table offset (-1 where none), then each batch part's
  columns.

A FlashLoop feature adds its own integers through a `BatchPart` (the composition root
lists them): per-pass columns inside each pass block (INT4 residuals: the rows' request
cells and the pass's planes' tables; sparse decode attention: each row's role), rows the
dense query tiles leave out (sparse decode corrections), per-pass lists after the blocks
and plan-level data (prompt windows, record updates, release scans); its views land in
`ForwardBatch.notes` and `LoopPass.notes` under types of its own, so this module names no
feature.

KV slots are computed on the device from page tables and positions: slot = page *
page_size + position % page_size. Host-side summaries (row counts, group shapes, head
lists) travel beside the device views as plain Python, for shapes and Python flags.
"""

from __future__ import annotations

import array
import bisect
import dataclasses
import functools
from collections.abc import Hashable, Sequence
from typing import Any, Protocol

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
    contiguous: tuple[GroupShape, ...] = ()  # groups the tiles leave out: consecutive prompt rows ending at
    # their context, which the backend attends over contiguous keys (`contiguous_min_rows`)
    token_slots: torch.Tensor | None = None  # [N_p] long: the rows' token slots
    block: torch.Tensor | None = None  # the pass's padded block in the device buffer (`PassLayout`)
    bucket: int = 0  # rows of the block (N_p padded up to a graph bucket, or N_p)
    num_splits: int | None = None  # split-KV fixed by the caller (a CUDA graph); None: the backend picks
    max_context: int | None = None  # a bound on every row's position + 1 fixed by the caller (a CUDA graph)
    notes: dict[type, Any] = dataclasses.field(default_factory=dict)  # the batch parts' views, by their type
    # (and what the features' device halves derive per pass)

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
    with adaptive exit every plane's page-table offset ([R, b]), then each batch part's
    columns (`parts`: their sizes, in the builder's order of parts). Rows past the pass's own
    are padding: position 0, depth 0, the pad token slot, the pad table entry (whose page is
    a sink nobody reads), tiles of 0 rows, no planes (-1); each part pads its own. A CUDA
    graph captured for a bucket reads a block of this layout at a fixed address."""

    bucket: int
    planes: int  # R with adaptive exit, else 0
    parts: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        return (4 + TILE_COLUMNS + self.planes) * self.bucket + sum(self.parts)

    def views(self, block: torch.Tensor) -> dict[str, Any]:
        b = self.bucket
        out: dict[str, Any] = {"positions": block[:b], "depths": block[b: 2 * b], "token_slots": block[2 * b: 3 * b],
                               "table_offsets": block[3 * b: 4 * b],
                               "tiles": block[4 * b: (4 + TILE_COLUMNS) * b].view(b, TILE_COLUMNS)}
        at = (4 + TILE_COLUMNS + self.planes) * b
        if self.planes:
            out["planes"] = block[(4 + TILE_COLUMNS) * b: at].view(self.planes, b).t()
        out["parts"] = []
        for n in self.parts:
            out["parts"].append(block[at: at + n])
            at += n
        return out


class BatchPart(Protocol):
    """A FlashLoop feature's share of the forward batch: integers in the batch's one upload,
    read back as views it files under types of its own (`ForwardBatch.notes`,
    `LoopPass.notes`). The builder calls it in this order for a plan: `start`; per pass
    `pass_info` (host), `left_out`, the layout's `columns`, `block_ints`; after the blocks
    `tail_ints` per pass and `plan_ints`; after the upload `pass_view` / `tail_view` per pass
    and `plan_view`. A CUDA graph's pass has the part's `graph_columns` and its
    `graph_view`."""

    capacity: int  # the most integers `tail_ints` and `plan_ints` add to one plan's upload
    variant: type | None  # a note type whose presence selects a pass's own graphs (None: no variant)
    variant_keys: tuple[Hashable, ...]  # only with `variant`: the graphs captured per bucket, one a key (not None)

    def variant_key(self, note: Any) -> Hashable:
        """Only with `variant`: which of `variant_keys` a pass holding `note` replays (host
        values only: no sync)."""

    def start(self, plan: Plan) -> None: ...

    def pass_info(self, ordered: list[RowGroup], firsts: list[int], p: int,
                  table_at: dict[tuple[int, int], int]) -> Any:
        """Pass p's host information (`ordered` groups, their first rows, the batch's table offsets)."""

    def left_out(self, info: Any) -> list[int]:
        """Rows the dense query tiles leave out (ascending, a tail of their groups' rows)."""

    def columns(self, info: Any, bucket: int) -> int:
        """Integers of its columns in an eager pass block of `bucket` rows (0: none)."""

    def fits_graph(self, info: Any, bucket: int) -> bool:
        """Whether the pass fits the graph's fixed columns (else it runs eager)."""

    def graph_columns(self, bucket: int) -> int: ...

    def block_ints(self, info: Any, n: int, cells: list[int], size: int, bucket: int) -> list[int]:
        """Its columns of a pass of `n` rows (`cells`: every batch row's request cell), padded to `size`."""

    def pad(self, size: int, bucket: int) -> torch.Tensor:
        """Its columns for a block of padding rows only (a graph's capture)."""

    def pass_view(self, lp: LoopPass, columns: torch.Tensor, info: Any, graphed: bool) -> None: ...

    def graph_view(self, lp: LoopPass, columns: torch.Tensor, variant: Hashable | None) -> None:
        """Its fixed view of a graph's pass (`variant`: the part's key of the graph, None for
        the graph of passes without a variant note)."""

    def tail_ints(self, info: Any) -> list[int]: ...

    def tail_view(self, lp: LoopPass, ints: torch.Tensor, info: Any) -> None: ...

    def plan_ints(self, plan: Plan, ordered: list[RowGroup], firsts: list[int],
                  table_at: dict[tuple[int, int], int]) -> tuple[list[int], Any]: ...

    def plan_view(self, batch: "ForwardBatch", ints: torch.Tensor, sizes: Any) -> None: ...


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
    notes: dict[type, Any] = dataclasses.field(default_factory=dict)  # the batch parts' plan-level views

    def segment(self, kind: type) -> HeadSegment | None:
        return self.heads.get(kind)



class ForwardBatchBuilder:
    """Owns the staging and device buffers; `build(plan)` is the batch's only writer."""

    ROW_COLUMNS = 3  # cell, slot, token (batch level; the rest is per pass)

    def __init__(self, max_rows: int, max_seqs: int, num_loops: int, max_pages_per_seq: int, page_size: int,
                 device: torch.device, tile_rows: tuple[int, int] | None = None,
                 buckets: tuple[int, ...] = (), pad_slot: int = 0, parts: Sequence[BatchPart] = (),
                 contiguous_min_rows: int | None = None) -> None:
        """`tile_rows`: (small, large) query-tile sizes, or None for a backend without tiles;
        `buckets`: row counts a pass is padded up to (CUDA graph sizes; empty: no padding);
        `pad_slot`: the token slot padding rows name (a sink row of the slot storage);
        `parts`: the FlashLoop features' shares of the batch (`BatchPart`), in order;
        `contiguous_min_rows`: groups of at least this many consecutive rows ending at their
        context (prompt chunks) get no tiles and are listed in `LoopPass.contiguous` (None: none)."""
        self.num_loops = num_loops
        self.tile_rows = tile_rows
        self.contiguous_min_rows = contiguous_min_rows
        self.page_size = page_size
        self.device = device
        self.max_rows = max_rows
        self.buckets = tuple(sorted(b for b in buckets if b <= max_rows))
        self.pad_slot = pad_slot
        self.max_tables = max_seqs * num_loops * max_pages_per_seq
        self.pad_table = self.max_tables  # the sink entry a graph's table buffer holds past every real one
        self.parts = list(parts)
        self.max_seqs = max_seqs
        block = max(max(self._layout(b, num_loops, None).size, self.graph_layout(b, True).size)
                    for b in (max_rows, *self.buckets))
        ints = self.ROW_COLUMNS * max_rows + 2 * max_rows + HEAD_COLUMNS * max_rows + self.max_tables + num_loops * block
        ints += sum(part.capacity for part in self.parts)
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

    @property
    def variants(self) -> tuple[Hashable | None, ...]:
        """The graphs captured per bucket: None (passes holding no part's variant note) and
        each key of the part that has a variant (at most one part has)."""
        parts = [part for part in self.parts if part.variant is not None]
        assert len(parts) <= 1, "graph variants of two batch parts would need their keys combined"
        keys = parts[0].variant_keys if parts else ()
        assert None not in keys, "None is the graph of passes without a variant note"
        return (None,) + keys

    def variant_of(self, lp: LoopPass) -> Hashable | None:
        """The graph variant pass `lp` replays (`variants`)."""
        for part in self.parts:
            if part.variant is not None and part.variant in lp.notes:
                return part.variant_key(lp.notes[part.variant])
        return None

    def bucket(self, rows: int) -> int:
        """The graph bucket a pass of `rows` rows is padded to, or `rows` past the largest."""
        for b in self.buckets:
            if rows <= b:
                return b
        return rows

    def graphed(self, bucket: int, tile_rows: int) -> bool:
        """Whether a pass of this bucket and tile size has a graph's shape (`LoopGraphs.fits`)."""
        return bucket in self.buckets and (self.tile_rows is None or tile_rows == self.tile_rows[0])

    def _layout(self, bucket: int, planes: int, infos: list[Any] | None) -> PassLayout:
        """An eager pass's layout (`infos`: each part's pass information; None: the largest
        block any pass of `bucket` rows may need, for the upload buffer's size)."""
        if infos is None:
            return PassLayout(bucket, planes, tuple(part.columns(None, bucket) for part in self.parts))
        return PassLayout(bucket, planes, tuple(part.columns(i, bucket) for part, i in zip(self.parts, infos)))

    def graph_layout(self, bucket: int, adaptive_exit: bool) -> PassLayout:
        """The block layout of the graph of `bucket` rows (every part's fixed columns)."""
        return PassLayout(bucket, self.num_loops if adaptive_exit else 0,
                          tuple(part.graph_columns(bucket) for part in self.parts))

    def pad_block(self, layout: PassLayout) -> torch.Tensor:
        """A block of padding rows only (what a CUDA graph is captured on)."""
        return pad_block(layout, self.pad_slot, self.pad_table, self.device, self.parts)

    def graph_view(self, layout: PassLayout, block: torch.Tensor, tables: torch.Tensor, variant: Hashable | None,
                   num_splits: int, max_context: int | None = None) -> LoopPass:
        """The `LoopPass` a CUDA graph captures: every row of its bucket, each part's fixed
        view (`variant`: one of `variants`, the graph's)."""
        b = layout.bucket
        lp = pass_view(layout, block, tables, self.page_size, b, [], self.tile_rows[0] if self.tile_rows else 0,
                       b if self.tile_rows is not None else None, num_splits=num_splits, max_context=max_context)
        for part, columns in zip(self.parts, layout.views(block)["parts"]):
            part.graph_view(lp, columns, variant)
        return lp

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
        host_groups = plan.host_groups  # results in plan order
        first = 0
        # More loops first (each pass's rows are a prefix), then single-row groups first.
        ordered = sorted(plan.groups, key=lambda g: (-g.loops, g.num_rows > 1))
        num_passes = ordered[0].loops if ordered else 1
        shapes: list[list[GroupShape]] = [[] for _ in range(num_passes)]  # per pass
        plane_columns: list[list[int]] = [[] for _ in range(self.num_loops if plan.adaptive_exit else 0)]
        longest = _longest_tables(ordered)  # one table per (cell, plane): shorter ones are its prefixes
        firsts: list[int] = []  # each ordered group's first row
        prompt_runs: set[int] = set()  # first rows of groups running prompt positions [start, end) whole
        for group in ordered:
            n = group.num_rows
            firsts.append(first)
            if group.window is None and n == group.end - group.start and group.end <= group.decode_from:
                prompt_runs.add(first)
            own = _table_offset(table_at, tables, longest, group.cell, group.depth)
            planes = [own] + [_table_offset(table_at, tables, longest, group.cell, plane)
                              for plane in range(group.depth + 1, group.depth + 1 + len(group.deeper_tables))]
            for p in range(group.loops):
                shapes[p].append(GroupShape(first, n, group.end, planes[p]))
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
        for cell, plane in longest:  # tables a group reads beyond its own planes' (a prompt window's inherited)
            _table_offset(table_at, tables, longest, cell, plane)
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
        blocks = []  # (at, layout, rows, tile_rows, tiles, graphed, infos, contiguous groups) per pass
        for part in self.parts:
            part.start(plan)
        for p, pass_shapes in enumerate(shapes):
            n = sum(s.rows for s in pass_shapes)
            infos = [part.pass_info(ordered, firsts, p, table_at) for part in self.parts]
            left_out = sorted(r for part, info in zip(self.parts, infos) for r in part.left_out(info))
            contiguous = self._contiguous(pass_shapes, left_out, prompt_runs)
            tiles, tile_rows = self._tiles(pass_shapes, left_out, contiguous)
            bucket = self.bucket(n)
            graphed = not contiguous and self.graphed(bucket, tile_rows) and all(
                part.fits_graph(info, bucket) for part, info in zip(self.parts, infos))
            if graphed:
                layout = self.graph_layout(bucket, bool(plane_columns))  # the graph's shape
            else:
                layout = self._layout(bucket, len(plane_columns), infos)
            blocks.append((len(ints), layout, n, tile_rows, len(tiles) // TILE_COLUMNS, graphed, infos, contiguous))
            ints.extend(self._block(layout, n, p, positions, depths, slots, pass_shapes, tiles, plane_columns))
            for part, info, size in zip(self.parts, infos, layout.parts):
                ints.extend(part.block_ints(info, n, cells, size, bucket))
        tails = []  # per pass and part: where its list starts in the upload
        for *_, infos, _ in blocks:
            tails.append([])
            for part, info in zip(self.parts, infos):
                tails[-1].append(len(ints))
                ints.extend(part.tail_ints(info))
        plan_at = []
        for part in self.parts:
            at = len(ints)
            part_ints, sizes = part.plan_ints(plan, ordered, firsts, table_at)
            plan_at.append((at, sizes))
            ints.extend(part_ints)
        if len(ints) > self._ints.numel():
            raise ValueError(f"a plan's {len(ints)} integers exceed the forward batch's upload buffer "
                             f"({self._ints.numel()})")
        host_ints, host_floats = self._take_staging()
        dev_ints = self._upload(host_ints, self._ints, array.array("q", ints))
        dev_floats = self._upload(host_floats, self._floats, array.array("f", head_floats))
        self._release_staging()
        batch = self._views(plan, first, len(enter), heads, len(tables), dev_ints, dev_floats, shapes, blocks,
                            host_groups, results)
        for lp, (_, layout, _, _, _, graphed, infos, _), starts in zip(batch.passes, blocks, tails):
            if not self.parts:  # (no views to cut: a dense engine's host time per call)
                break
            for part, info, columns, at in zip(self.parts, infos, layout.views(lp.block)["parts"], starts):
                part.pass_view(lp, columns, info, graphed)
                part.tail_view(lp, dev_ints[at:], info)
        for part, (at, sizes) in zip(self.parts, plan_at):
            part.plan_view(batch, dev_ints[at:], sizes)
        return batch

    def _block(self, layout: PassLayout, n: int, p: int, positions: list[int], depths: list[int],
               slots: list[int], shapes: list[GroupShape], tiles: list[int], plane_columns: list[list[int]]
               ) -> list[int]:
        """Pass p's block (`PassLayout`) up to the parts' columns: its n rows' columns, then
        padding up to the bucket."""
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
        return out

    def _contiguous(self, shapes: list[GroupShape], left_out: list[int], prompt_runs: set[int]
                    ) -> tuple[GroupShape, ...]:
        """The pass's groups the backend attends over contiguous keys: prompt chunks (every
        position [start, end) in order, no generated token, not a token-sparse window's
        selection) of at least `contiguous_min_rows` rows, none of them left out by a part."""
        least = self.contiguous_min_rows
        if least is None:
            return ()
        return tuple(s for s in shapes if s.rows >= least and s.first in prompt_runs
                     and bisect.bisect_left(left_out, s.first) == bisect.bisect_left(left_out, s.first + s.rows))

    def _tiles(self, shapes: list[GroupShape], left_out: list[int], contiguous: tuple[GroupShape, ...] = ()
               ) -> tuple[list[int], int]:
        """(tiles, tile rows): the pass's query tiles without the rows a part leaves out (a
        tail of their groups: sparse decode's corrections, which its own step computes) and
        without the `contiguous` groups, whose rows then do not decide the tile size (decodes
        beside a prompt chunk keep small tiles; such a pass runs eager all the same)."""
        if self.tile_rows is None:
            return [], 0
        small, large = self.tile_rows
        skip = {s.first for s in contiguous}
        tiled = [s for s in shapes if s.first not in skip]
        size = small if max((s.rows for s in tiled), default=0) <= small else large
        dense = []
        for s in tiled:  # rows left out ascend, a tail of each group's rows
            c = bisect.bisect_left(left_out, s.first + s.rows) - bisect.bisect_left(left_out, s.first)
            assert c == 0 or left_out[bisect.bisect_left(left_out, s.first)] == s.first + s.rows - c
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
        for pass_shapes, (start, layout, rows, tile_rows, num_tiles, _, _, contiguous) in zip(shapes, blocks):
            tiled = self.tile_rows is not None
            lp = pass_view(layout, ints[start: start + layout.size], tables, bs, rows, pass_shapes,
                           tile_rows, num_tiles if tiled else None)
            lp.contiguous = contiguous
            passes.append(lp)
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
              num_splits: int | None = None, max_context: int | None = None) -> LoopPass:
    """The `LoopPass` of a block: views of its first `rows` rows (a CUDA graph calls this
    inside its capture, with every row of the bucket); the batch parts add their notes."""
    v = layout.views(block)
    return LoopPass(rows, v["positions"][:rows], v["depths"][:rows], tables, v["table_offsets"][:rows],
                    v["planes"][:rows] if layout.planes else None, shapes, page_size,
                    tiles=v["tiles"][:num_tiles] if num_tiles is not None else None, tile_rows=tile_rows,
                    token_slots=v["token_slots"][:rows], block=block, bucket=layout.bucket, num_splits=num_splits,
                    max_context=max_context)


def pad_block(layout: PassLayout, pad_slot: int, pad_table: int, device: torch.device,
              parts: Sequence[BatchPart] = ()) -> torch.Tensor:
    """A block of padding rows only (what a CUDA graph is captured on)."""
    block = torch.zeros(layout.size, dtype=torch.long, device=device)
    b = layout.bucket
    block[2 * b: 3 * b] = pad_slot
    block[3 * b: 4 * b] = pad_table
    at = (4 + TILE_COLUMNS + layout.planes) * b
    block[(4 + TILE_COLUMNS) * b: at] = -1
    for part, n in zip(parts, layout.parts):
        block[at: at + n] = part.pad(n, b).to(device)
        at += n
    return block


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
