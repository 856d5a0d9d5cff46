"""The INT4 residual planes' device half of a forward call (`DeviceFeature`): the plan's
record updates and committed lengths before anything appends rows, each pass's appends and
encoding plan, and after the passes the tail pages no query reads exact any more."""

from __future__ import annotations

from typing import Any

import torch

from specloop.flashloop.kv_residual.batch import ReleaseBatch, ResidualPass, ResidualUpdate
from specloop.runtime.forward_batch import ForwardBatch, LoopPass
from specloop.flashloop.kv_residual.planes import NEVER, EncodePlan, PackedResiduals


class ResidualDevice:
    def __init__(self, store: PackedResiduals, max_cells: int, page_size: int, device: torch.device,
                 pages: Any = None) -> None:
        """`pages`: the KV format whose BF16 pages (`k`, `v` per layer) a cached prefix's
        groups encode from (`adopt`)."""
        self.store = store
        self.page_size = page_size
        self.pages = pages
        # Per request cell and the pad cell: rows at positions below it are committed (set by
        # every call's plan).
        self.committed = torch.full((max_cells + 1,), 2**62, dtype=torch.long, device=device)

    def prepare(self, batch: ForwardBatch) -> None:
        update, release = batch.notes.get(ResidualUpdate), batch.notes.get(ReleaseBatch)
        if update is not None:  # before anything appends rows
            self.store.apply(update)
        if release is not None:
            self.committed[release.cells] = release.committed
        if update is not None and update.adopt is not None:
            self.adopt(update)

    def adopt(self, update: ResidualUpdate) -> None:
        """Cached prefixes' rows and groups (`PackedResiduals.adopt`), after the update's
        records are assigned and the committed lengths set."""
        self.store.adopt(update, self.pages.k, self.pages.v, self.page_size, self.committed)

    def start_pass(self, lp: LoopPass, keep: torch.Tensor | None) -> None:
        if ResidualPass in lp.notes:  # the pass's rows join their planes; groups that turn ready seal
            lp.notes[EncodePlan] = self._plan(lp, keep)

    def _plan(self, lp: LoopPass, keep: torch.Tensor | None) -> EncodePlan:
        """Append the pass's rows that write K/V (not exited; padding rows of a graph's bucket
        append nothing) and plan which groups encode."""
        store, info = self.store, lp.notes[ResidualPass]
        active = info.cells != store.pad_cell
        if keep is not None:
            active &= ~keep
        store.append(info.cells, lp.depths, lp.positions, active)
        k = info.candidates
        cells = info.pass_cells.repeat_interleave(k)
        span = torch.arange(k, device=cells.device).repeat(info.pass_cells.numel())
        # Planes that cannot change are left out (no launches): below the pass's shallowest
        # row nothing was appended and no predecessor moved (a committed length advances only
        # for a speculating request, whose every plan has a depth-0 row); under the execution
        # policy a group seals only in a pass with queries at its plane.
        if store.policy == "execution":
            planes = set(info.depths)
        else:
            planes = set(range(min(info.depths, default=store.num_planes), store.num_planes))
        plan = EncodePlan([], [], [], [])
        none = cells[:0]
        for p in range(store.num_planes):
            if p not in planes:
                for field in (plan.cells, plan.groups, plan.table_offsets):
                    field.append(none)
                plan.valid.append(none.bool())
                continue
            offsets = info.plane_tables[:, p].repeat_interleave(k)
            plan.cells.append(cells)
            plan.groups.append(store.encoded[cells, p] + span)
            plan.table_offsets.append(offsets)
            plan.valid.append(offsets >= 0)
        first = None
        if store.policy == "execution":  # the pass's first query per (cell, plane): its safe point
            first = torch.full((store.rows.shape[0] * store.num_planes,), NEVER, dtype=torch.long,
                               device=cells.device)
            first.scatter_reduce_(0, info.cells * store.num_planes + lp.depths, lp.positions.long(), reduce="amin")
            first = first.view(-1, store.num_planes)
        return store.plan_encode(plan, self.committed, first)

    def finish(self, batch: ForwardBatch, final: torch.Tensor) -> torch.Tensor | None:
        update = batch.notes.get(ResidualUpdate)
        if update is not None and update.cached is not None:  # before a release scan can free a page
            self.store.note_rows(update.cached, self.page_size)
        release = batch.notes.get(ReleaseBatch)
        if release is not None and release.span > 0:
            return self._releasable(release)
        return None

    def _releasable(self, scan: ReleaseBatch) -> torch.Tensor:
        """[C, P]: leading pages of each scanned (request, plane) whose every position reads
        its packed groups from the plane's frontier on (so no query will read it exact, and
        no copy or encoding reads it)."""
        store, bs = self.store, self.page_size
        cells, planes = scan.cells.shape[0], store.num_planes
        span = torch.arange(scan.span, device=scan.cells.device)
        # every (request, plane) in one seals call: row c * P + p reads at depth p
        depths = torch.arange(planes, device=span.device).repeat(cells)
        positions = (scan.released.reshape(-1, 1) * bs + span).clamp(max=store.max_len - 1)  # [C * P, span]
        ok = store.seals(scan.cells.repeat_interleave(planes), depths, positions) <= scan.frontiers.reshape(-1, 1)
        whole = ok.view(cells, planes, -1, bs).all(-1).long()  # [C, P, span / bs] pages
        return scan.released + whole.cumprod(-1).sum(-1)

    def stats(self) -> dict[str, int]:
        return {}
