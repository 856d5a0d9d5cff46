"""INT4 cross-loop KV residuals: packed group records, compact row maps and seals, on the device.

The packed half of the `int4-residual` KV format (the BF16 pages of `kv_format.PagedKV`
stay as the exact tail). For X in {K after RoPE, V} and every layer, plane 1 (0-based
plane 0) holds an INT4 base of X1 and plane p > 0 an INT4 residual of Xp against the
reconstruction of plane p - 1 (`specloop.kernels.int4_groups`, FP16 scale and minimum):

    X^0 = D(Q(X0)),  X^p = X^(p-1) + D(Q(Xp - X^(p-1)))   (in the model dtype)

Rows. A plane holds rows only for the tokens that computed K/V at that depth: every token
at plane 0, at deeper planes only the tokens token-sparse prefill kept and that had not
exited. `row_maps[cell, plane, position]` is a token's compact row in the plane, -1 when it
has none (an absent row means the token inherits its previous depth; it is never code 0).
Rows are appended in position order, so rows are nested across planes and compact row r of
a plane sits at the r-th position with a row.

Groups. Compact rows 64g..64g+63 of one plane of one request are group g, stored in one
*record* of the pool (every layer's K codes, K parameters, V codes and V parameters, plus
each row's position and the group's seal); `group_tables[cell, plane, g]` names it. K is
grouped per channel over the group's 64 rows, V per row over 64 channels.

Seals (the serial policy). A group seals at max(position of its last row + tail, the seal
of the group holding its last row at the plane before): a query at position q reads a key
reconstructed iff q >= the seal of the group holding the key's deepest row at a plane <=
the query's depth (exact from the BF16 tail otherwise). That depends only on positions,
so chunked prefill, rounds and pipelines read what serial decoding reads; it is the
FlashLoop reference's rule (`flashloop_reference.seal_positions`). A group is *encoded*
(its record written and its seal set) once it is full, its rows are committed and the
group its last row's predecessor lives in is encoded; until then its seal is NEVER.
Encoding happens inside a forward call, per layer, after the layer's K/V write and before
its attention, so a prompt chunk's later queries read groups sealed earlier in the chunk.

Seals (the execution policy). A group is encoded at a safe point of the actual execution:
at a pass holding queries of its (request, plane), once the pass's first such query lies at
least `tail` positions past the group's last row (and, as above, it is full and its
predecessor is encoded; its rows need not be committed). It seals at that first query
(or its predecessor's seal, if later): every query of the pass and after reads it
reconstructed. A chunk's queries therefore read the groups its own rows complete exact,
where serial decoding would read some sealed: what a query reads depends on chunking and
batching (decoding, one position a pass, reads what the serial policy reads). A group
holding candidates may seal; a rollback unseals it and every group whose residual was
encoded against it (`truncate`), so the accepted tokens read exact again until it
re-encodes. Their BF16 tail pages are still there: a page goes back only once its seals
lie at or below the committed length, and a seal lies past every row of its group and of
the groups below it that it was encoded against (each seal is at least its group's last
row + tail and at least its predecessor's seal), so a group that a rollback can unseal
never gives its pages back.

Everything here runs on the device without reading a value back: the host names candidate
groups (a superset of what may become ready; `EncodePlan`), the device decides which are
ready, and not-ready candidates write into a sink record nobody reads.
"""

from __future__ import annotations

import dataclasses

import torch

from specloop.kernels import packed_rows
from specloop.kernels.int4_groups import GROUP, KGroups, VGroups
from specloop.kernels.packed_keys import PackedKV
from specloop.kernels.packed_rows import NEVER  # seal of a group no query reads reconstructed (not encoded yet)
from specloop.kernels.residual_encode import check_encode, encode_groups_reference, encode_planes_triton, new_sync
from specloop.kernels.residual_plan import plan_groups
from specloop.kernels.seals import seals as seal_lookup
from specloop.flashloop.kv_residual.batch import ResidualUpdate


@dataclasses.dataclass
class EncodePlan:
    """The candidate groups of one pass, per plane: `cells`, `groups` (compact group index)
    and `table_offsets` (where the candidate's plane page table starts in the call's tables)
    [M_p] long; after `plan_encode`, `ready` [M_p] bool and `records` [M_p] long (the sink
    where not ready) and `positions` [M_p, 64] long (0 where not ready)."""

    cells: list[torch.Tensor]
    groups: list[torch.Tensor]
    table_offsets: list[torch.Tensor]
    valid: list[torch.Tensor] | None = None  # [M_p] bool: candidates that may encode (None: all)
    ready: list[torch.Tensor] = dataclasses.field(default_factory=list)
    records: list[torch.Tensor] = dataclasses.field(default_factory=list)
    positions: list[torch.Tensor] = dataclasses.field(default_factory=list)
    # (starts, cells, positions, records, ready, table_offsets) of every plane end to end (the
    # Triton plan's output, or built at the first Triton encode): plane p's are [starts[p], starts[p + 1])
    launch: tuple | None = None
    checked: bool = False  # the encoder's launch checked (at the pass's first layer)


class PackedResiduals:
    """The device state of the packed planes: a pool of group records and per-cell maps."""

    def __init__(self, num_layers: int, num_records: int, num_cells: int, num_planes: int, max_len: int,
                 num_kv_heads: int, head_dim: int, tail: int, dtype: torch.dtype, device: torch.device,
                 policy: str = "serial", num_pages: int = 0, page_size: int = 1) -> None:
        """`num_pages`, `page_size`: the BF16 pages whose rows a cached prompt block notes
        (`note_rows`; 0: no prefix caching)."""
        assert head_dim % 2 == 0, "V codes pack two channels a byte"
        assert policy in ("serial", "execution"), policy
        self.policy = policy
        n = num_records + 1  # record `num_records` is the sink: not-ready candidates write there
        vg = -(-head_dim // GROUP)
        u8, f16, i32 = torch.uint8, torch.float16, torch.int32
        self.k_codes = torch.zeros(num_layers, n, GROUP // 2, num_kv_heads, head_dim, dtype=u8, device=device)
        self.k_scale = torch.ones(num_layers, n, num_kv_heads, head_dim, dtype=f16, device=device)
        self.k_lo = torch.zeros(num_layers, n, num_kv_heads, head_dim, dtype=f16, device=device)
        self.v_codes = torch.zeros(num_layers, n * GROUP, num_kv_heads, head_dim // 2, dtype=u8, device=device)
        self.v_scale = torch.ones(num_layers, n * GROUP, num_kv_heads, vg, dtype=f16, device=device)
        self.v_lo = torch.zeros(num_layers, n * GROUP, num_kv_heads, vg, dtype=f16, device=device)
        self.seal = torch.full((n,), NEVER, dtype=i32, device=device)
        self.row_pos = torch.zeros(n, GROUP, dtype=i32, device=device)
        max_groups = -(-max_len // GROUP)
        cells = num_cells + 1  # cell `num_cells` is the pad cell: a CUDA graph's padding rows and cells name it
        self.group_tables = torch.full((cells, num_planes, max_groups), num_records, dtype=i32, device=device)
        self.row_maps = torch.full((cells, num_planes, max_len), -1, dtype=i32, device=device)
        self.rows = torch.zeros(cells, num_planes, dtype=torch.long, device=device)
        self.encoded = torch.zeros(cells, num_planes, dtype=torch.long, device=device)
        self.sink = num_records
        # per BF16 page slot: whether the token there has a row in the page's plane (noted for
        # prompt blocks the prefix cache takes, read by a request that adopts them)
        self.page_rows = torch.zeros(num_pages, page_size, dtype=torch.bool, device=device)
        self.pad_cell = num_cells  # holds no rows and no records: its candidates are never ready
        self.num_planes, self.max_len, self.tail, self.dtype = num_planes, max_len, tail, dtype
        # the encoder's and the seal lookups' Triton launches (else their torch references)
        self.encode_triton = torch.device(device).type == "cuda"
        self.encode_sync = new_sync(device)  # the encoder's plane-order counts (`encode_planes_triton`)
        # every layer's view, made once: a prefill layer call asks for it several times, and
        # its six slices cost host time at each (the tensors are never reassigned)
        self._views = [PackedKV(KGroups(self.k_codes[i], self.k_scale[i], self.k_lo[i]),
                                VGroups(self.v_codes[i], self.v_scale[i], self.v_lo[i]),
                                self.seal, self.group_tables, self.row_maps) for i in range(num_layers)]

    def layer_view(self, layer: int) -> PackedKV:
        """One layer's records, seals and tables, as the packed attention kernel reads them."""
        return self._views[layer]

    # --- cost ---------------------------------------------------------------------------

    @staticmethod
    def record_bytes(num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """One record: 64 rows of one plane at every layer (codes and FP16 parameters of K and
        V), the rows' positions and the seal."""
        per_layer = (GROUP // 2) * num_kv_heads * head_dim * 2  # K and V codes, two a byte
        per_layer += 2 * 2 * num_kv_heads * head_dim  # K scale and lo per channel
        per_layer += GROUP * num_kv_heads * -(-head_dim // GROUP) * 2 * 2  # V scale and lo per row group
        return num_layers * per_layer + 4 * GROUP + 4

    # --- request lifecycle --------------------------------------------------------------

    def reset(self, cells: torch.Tensor) -> None:
        """A fresh request in `cells` [n] long: no rows, nothing encoded, no records (index
        fills: an indexed assignment of a Python scalar would synchronise)."""
        self.row_maps.index_fill_(0, cells, -1)
        self.rows.index_fill_(0, cells, 0)
        self.encoded.index_fill_(0, cells, 0)
        self.group_tables.index_fill_(0, cells, self.sink)

    def assign(self, cells: torch.Tensor | int, planes: torch.Tensor | int, groups: torch.Tensor,
               records: torch.Tensor) -> None:
        """Record `records[i]` holds group `groups[i]` of plane `planes[i]` of cell `cells[i]`
        (ints broadcast); the records' seals reset to NEVER (a recycled record keeps none of
        its past)."""
        self.group_tables[cells, planes, groups] = records.to(torch.int32)
        self.seal.index_fill_(0, records.long(), NEVER)

    def apply(self, update: ResidualUpdate) -> None:
        """What a plan brings the planes, before any row is appended: resets of cells that
        start over, then rollbacks' truncates, then new records."""
        if update.resets.numel():
            self.reset(update.resets)
        if update.truncate.numel():
            self.truncate(update.truncate[:, 0], update.truncate[:, 1])
        if update.assign.numel():
            self.assign(*update.assign.unbind(1))

    def truncate(self, cells: torch.Tensor, keep: torch.Tensor) -> None:
        """Speculation rolled back: rows at positions >= keep [n] leave every plane of `cells`
        [n] (the next appends reuse their compact indices). A group that loses rows is
        unsealed, and so is every later group of its plane and every group of the next
        plane whose residual read it (its reconstruction changes when it re-encodes). Under
        the serial policy none of them was encoded (only committed rows seal)."""
        beyond = torch.arange(self.max_len, device=cells.device)[None, None, :] >= keep[:, None, None]
        maps = self.row_maps[cells]  # [n, P, L]
        rows = ((maps >= 0) & ~beyond).sum(-1)  # [n, P]
        self.rows[cells] = rows
        maps = torch.where(beyond, torch.full_like(maps, -1), maps)
        self.row_maps[cells] = maps
        tables = self.group_tables[cells].long()  # [n, P, G]
        g = torch.arange(tables.shape[2], device=cells.device)
        last = self.row_pos[tables, GROUP - 1].long().clamp(max=self.max_len - 1)  # [n, P, G]
        old = self.encoded[cells]
        encoded = torch.minimum(old, rows // GROUP)
        kept = [encoded[:, 0]]
        for p in range(1, self.num_planes):
            # plane p's group g stays encoded iff its last row's plane p - 1 group still is
            pred = maps[:, p - 1].gather(1, last[:, p])  # [n, G] compact rows at plane p - 1
            ok = (pred >= 0) & (pred // GROUP < kept[-1][:, None]) & (g[None, :] < encoded[:, p, None])
            kept.append(ok.long().cumprod(1).sum(1))
        encoded = torch.stack(kept, 1)
        self.encoded[cells] = encoded
        drop = (g >= encoded[..., None]) & (g < old[..., None])  # [n, P, G]: unsealed
        record = torch.where(drop, tables, torch.full_like(tables, self.sink))
        self.seal.index_fill_(0, record.flatten(), NEVER)  # the sink's seal stays NEVER

    def adopt(self, update: ResidualUpdate, k: list[torch.Tensor] | torch.Tensor, v: list[torch.Tensor] | torch.Tensor,
              page_size: int, committed: torch.Tensor) -> None:
        """Cached prefixes (prefix caching): each adopting cell (`update.adopt`: cell, length,
        its planes' offsets into `update.adopt_tables`) gets, at every plane, a row for each
        position below its length that had one at the publisher's plane (`note_rows`: a
        token-sparse plane's kept tokens, tokens that had not exited), and its full groups
        encode, every layer (k, v: each layer's BF16 pages), from the shared pages into the
        cell's own records, the records just assigned. Those are the rows, codes and seals its planes
        would hold had it computed the prefix itself (the same exact values; under the serial
        policy seals depend on positions only), so it reads what an uncached request reads.
        Under the execution policy the groups `tail` before the length seal at it (the
        request's first query), the rest in its later passes (its backlog is every group)."""
        cells, lens, offsets = update.adopt[:, 0], update.adopt[:, 1], update.adopt[:, 2:]
        n, planes, longest = cells.numel(), self.num_planes, update.adopt_len
        if n == 0 or longest == 0:
            return
        shape = (n, planes, longest)
        pos = torch.arange(longest, device=cells.device)
        depth = torch.arange(planes, device=cells.device)
        # a row where the publisher's plane had one (token-sparse planes and exits leave some out)
        pages = update.adopt_tables[(offsets[:, :, None] + pos // page_size).clamp(max=update.adopt_tables.numel() - 1)]
        active = (pos < lens[:, None, None]) & self.page_rows[pages, pos % page_size]
        self.append(cells[:, None, None].expand(shape).flatten(), depth[None, :, None].expand(shape).flatten(),
                    pos[None, None, :].expand(shape).flatten(), active.flatten())
        groups = -(-longest // GROUP)  # groups the rows may fill (`plan_encode` takes the full ones)
        g = torch.arange(groups, device=cells.device).repeat(n)
        cand = cells.repeat_interleave(groups)
        tables = [offsets[:, p].repeat_interleave(groups) for p in range(planes)]
        plan = EncodePlan([cand] * planes, [g] * planes, tables)
        committed = committed.clone()  # a prefix is committed whatever the cell last held
        committed[cells] = torch.maximum(committed[cells], lens)
        first = None
        if self.policy == "execution":
            first = torch.full((self.rows.shape[0], planes), NEVER, dtype=torch.long, device=cells.device)
            first[cells] = lens[:, None].expand(n, planes)
        self.plan_encode(plan, committed, first)
        for layer in range(len(self._views)):
            self.encode(layer, plan, k[layer], v[layer], update.adopt_tables, page_size)

    def note_rows(self, cached: torch.Tensor, page_size: int) -> None:
        """Prompt blocks a plan finished, for the prefix cache (`cached` [B, 2 + P]: cell,
        first position, each plane's page): note in each page which of its tokens have a row
        at its plane (every plane's rows there are final), for a request that adopts it."""
        cells, start, pages = cached[:, 0], cached[:, 1], cached[:, 2:]
        pos = (start[:, None] + torch.arange(page_size, device=cells.device)).clamp(max=self.max_len - 1)  # [B, bs]
        planes = torch.arange(self.num_planes, device=cells.device)
        rows = self.row_maps[cells[:, None, None], planes[None, :, None], pos[:, None, :]]  # [B, P, bs]
        self.page_rows[pages] = rows >= 0

    # --- rows ---------------------------------------------------------------------------

    def append(self, cells: torch.Tensor, depths: torch.Tensor, positions: torch.Tensor,
               active: torch.Tensor) -> None:
        """A pass's rows [N] at plane `depths` (0-based): those `active` (they computed and
        wrote K/V: not exited, not left out) get the next compact rows of their (cell,
        plane), in position order. Every active row's group must have a record."""
        if cells.numel() == 0:
            return
        planes = self.num_planes
        segment = cells * planes + depths
        order = torch.argsort(segment * self.max_len + positions)
        seg, act = segment[order], active[order].long()
        pos, cell, plane = positions[order], cells[order], depths[order]
        before = act.cumsum(0) - act  # active rows before each row in the call
        first = torch.ones_like(seg, dtype=torch.bool)
        first[1:] = seg[1:] != seg[:-1]
        base = torch.where(first, before, torch.zeros_like(before)).cummax(0).values
        compact = self.rows[cell, plane] + before - base
        keep = act.bool()
        row = torch.where(keep, compact, torch.full_like(compact, -1))
        # an inactive row writes its own map entry back unchanged
        old = self.row_maps[cell, plane, pos]
        self.row_maps[cell, plane, pos] = torch.where(keep, row, old.long()).to(torch.int32)
        record = self.group_tables[cell, plane, (compact // GROUP).clamp(max=self.group_tables.shape[2] - 1)].long()
        record = torch.where(keep, record, torch.full_like(record, self.sink))
        self.row_pos[record, compact % GROUP] = pos.to(torch.int32)
        self.rows.view(-1).index_add_(0, seg, act)

    # --- encoding -----------------------------------------------------------------------

    def plan_encode(self, plan: EncodePlan, committed: torch.Tensor, first: torch.Tensor | None = None
                    ) -> EncodePlan:
        """Decide which candidates encode in this pass (full, predecessor encoded and, serial
        policy, committed; execution policy, `tail` before the pass's first query), set their
        seals and advance `encoded`; fills plan.ready / records / positions.
        `committed` [cells] long: each cell's committed length (rows at positions >= it are
        candidates that may still be rejected). `first` [cells, P] long (execution policy):
        the pass's first query position per (cell, plane), NEVER where it has none. Where the
        encoder takes Triton, one launch decides every plane (`residual_plan.plan_groups`) and
        the plan's launch is its output, the per-plane fields views of it."""
        if self.encode_triton:
            return self._plan_encode_triton(plan, committed, first)
        plan.ready, plan.records, plan.positions, plan.launch, plan.checked = [], [], [], None, False
        for p, (cells, groups) in enumerate(zip(plan.cells, plan.groups)):
            if cells.numel() == 0:  # a plane without candidates (a host-known size: no sync)
                plan.ready.append(cells.bool())
                plan.records.append(cells.long())
                plan.positions.append(cells.long().view(0, GROUP))
                continue
            groups = groups.long()
            record = self.group_tables[cells, p, groups.clamp(max=self.group_tables.shape[2] - 1)].long()
            last = self.row_pos[record, GROUP - 1].long()
            ready = (groups >= self.encoded[cells, p]) & (self.rows[cells, p] >= GROUP * (groups + 1))
            ready &= record != self.sink
            if self.policy == "serial":
                ready &= last < committed[cells]
                seal = last + self.tail
            else:
                assert first is not None, "the execution policy seals at the pass's first query"
                seal = first[cells, p]
                ready &= (seal < NEVER) & (last + self.tail <= seal)
            if plan.valid is not None:
                ready &= plan.valid[p]
            if p > 0:
                pred_row = self.row_maps[cells, p - 1, last.clamp(max=self.max_len - 1)].long()
                pred_group = pred_row.clamp(min=0) // GROUP
                ready &= (pred_row >= 0) & (pred_group < self.encoded[cells, p - 1])
                pred_record = self.group_tables[cells, p - 1, pred_group].long()
                seal = torch.maximum(seal, self.seal[pred_record].long())
            record = torch.where(ready, record, torch.full_like(record, self.sink))
            self.seal[record] = torch.where(ready, seal, torch.full_like(seal, NEVER)).to(torch.int32)
            done = torch.where(ready, groups + 1, torch.zeros_like(groups))
            self.encoded[:, p].scatter_reduce_(0, cells, done, reduce="amax")
            plan.ready.append(ready)
            plan.records.append(record)
            plan.positions.append(torch.where(ready[:, None], self.row_pos[record].long(), 0))
        return plan

    def _plan_encode_triton(self, plan: EncodePlan, committed: torch.Tensor, first: torch.Tensor | None
                            ) -> EncodePlan:
        """`plan_encode` in one launch over every plane's candidates end to end."""
        counts = [c.numel() for c in plan.cells]
        starts = tuple(sum(counts[:p]) for p in range(len(counts) + 1))
        cat = lambda parts: parts[0] if len(parts) == 1 else torch.cat(parts)  # noqa: E731
        cells, groups = cat(plan.cells), cat(plan.groups)
        if plan.valid is None:
            valid = torch.ones(starts[-1], dtype=torch.bool, device=cells.device)
        else:
            valid = cat(plan.valid)
        assert self.policy == "serial" or first is not None, "the execution policy seals at the pass's first query"
        ready, records, positions = plan_groups(
            cells.long().contiguous(), groups.long().contiguous(), valid.contiguous(), starts, self.group_tables,
            self.row_pos, self.encoded, self.rows, committed, None if first is None else first.contiguous(),
            self.row_maps, self.seal, sink=self.sink, tail=self.tail, serial=self.policy == "serial")
        cut = lambda x: [x[starts[p]:starts[p + 1]] for p in range(len(counts))]  # noqa: E731
        plan.ready, plan.records, plan.positions = cut(ready), cut(records), cut(positions)
        plan.launch = (starts, cells, positions, records, ready, cat(plan.table_offsets))
        plan.checked = False
        return plan

    def encode(self, layer: int, plan: EncodePlan, k_tail: torch.Tensor, v_tail: torch.Tensor,
               tables: torch.Tensor, page_size: int) -> None:
        """Write layer `layer` of the plan's ready groups from the exact values in the BF16
        tail (k_tail, v_tail [S, Hkv, D]: this layer of the pool; each candidate's rows at
        their plane's page table). Triton (`encode_triton`, on CUDA): one launch for every
        plane (`residual_encode.encode_planes_triton`), whose programs of plane p wait for
        plane p - 1's, since a residual reads the reconstruction of the plane before; the
        candidates of all planes are put end to end and checked at the plan's first encode
        only (the other layers' arguments are the same shapes). Elsewhere the torch
        reference, plane by plane in plane order."""
        records = self._record_args(layer)
        if not self.encode_triton:
            for p in range(len(plan.cells)):
                if plan.cells[p].numel():
                    encode_groups_reference(k_tail, v_tail, tables, page_size, p, plan.cells[p], plan.positions[p],
                                            plan.records[p], plan.ready[p], plan.table_offsets[p], *records,
                                            self.group_tables, self.row_maps, sink=self.sink)
            return
        if plan.launch is None:  # a plan from the torch path: every plane's fields end to end
            counts = [plan.cells[p].numel() for p in range(len(plan.cells))]
            starts = tuple(sum(counts[:p]) for p in range(len(counts) + 1))
            fields = (plan.cells, plan.positions, plan.records, plan.ready, plan.table_offsets)
            plan.launch = (starts, *(torch.cat(f) for f in fields))
        starts = plan.launch[0]
        if not plan.checked and starts[-1]:  # the pass's first layer (the others' shapes are alike)
            check_encode(k_tail, v_tail, tables, 0, *(x.contiguous() for x in plan.launch[1:]), *records,
                         self.group_tables, self.row_maps)
            plan.checked = True
        if starts[-1]:
            encode_planes_triton(k_tail, v_tail, tables, page_size, starts, *plan.launch[1:], *records,
                                 self.group_tables, self.row_maps, self.encode_sync, sink=self.sink)

    def _record_args(self, layer: int) -> tuple[torch.Tensor, ...]:
        """Layer `layer`'s K codes, scale and lo, then V's (views made once)."""
        view = self._views[layer]
        return (view.k.codes, view.k.scale, view.k.lo, view.v.codes, view.v.scale, view.v.lo)

    # --- reads --------------------------------------------------------------------------

    def reconstruct(self, layer: int, cells: torch.Tensor, depth: int | torch.Tensor, positions: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [M, ..., Hkv, D] of the tokens at `positions` [M, ...] of `cells` [M], as
        reconstructed at plane `depth` (an int, or [M] per cell): the base plus every
        residual row they have up to that plane (`packed_rows.reconstruct`)."""
        view = self.layer_view(layer)
        return packed_rows.reconstruct(view.k, view.v, self.group_tables, self.row_maps, cells, depth, positions,
                                       self.dtype, absent=self.sink)

    def seals(self, cells: torch.Tensor, depth: int | torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[M, ...] long: from which query position each token's K/V at plane `depth` (int or
        [M]) reads reconstructed (the seal of the group of its deepest row at a plane <= depth);
        one Triton launch where the encoder takes Triton (`kernels.seals`), else its torch
        reference."""
        return seal_lookup(self.seal, self.group_tables, self.row_maps, cells, depth, positions,
                           use_triton=self.encode_triton)
