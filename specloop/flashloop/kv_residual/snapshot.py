"""The INT4 residual planes' part of a request snapshot (`residual`).

Its cell's compact row maps, row and encoded counts per plane over the positions its pages
cover, and its records' contents (codes, FP16 parameters, row positions, seals) in
(plane, group) order. The records themselves are taken by the KV part's restore
(`KVManager.add_restored`, which covers the request's positions in every pool it keeps).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from specloop.errors import SnapshotError
from specloop.flashloop.kv_residual.batch import ResidualUpdate
from specloop.flashloop.kv_residual.planes import PackedResiduals
from specloop.scheduling.kv_manager import KVManager
from specloop.scheduling.request import Request
from specloop.flashloop.kv_residual.records import GROUP as RECORD_ROWS, ResidualRecords

RECORD_FIELDS = ("k_codes", "k_scale", "k_lo")  # indexed by record
ROW_FIELDS = ("v_codes", "v_scale", "v_lo")  # indexed by record * 64 + row


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A host copy that owns its storage: `.cpu()` of a CPU view shares the live planes'
    storage, which the engine rewrites while the snapshot waits (a swap), and torch.save
    would write all of it."""
    return t.to("cpu", copy=True)


def _record_rows(ids: torch.Tensor) -> torch.Tensor:
    return (ids[:, None] * RECORD_ROWS + torch.arange(RECORD_ROWS, device=ids.device)).flatten()


class ResidualPart:
    """`residual`; `forget_backlog(cell)`: the forward batch's note that the cell's planes
    were written outside the plans (it may hold full groups not encoded yet)."""

    key = "residual"

    def __init__(self, kv: KVManager, records: ResidualRecords, store: PackedResiduals,
                 forget_backlog: Callable[[int], None], adopt: Callable[[ResidualUpdate], None]) -> None:
        """`adopt`: the device half's, for a cached prefix no plan has brought yet."""
        self.kv, self.records, self.store, self.forget_backlog, self.adopt = kv, records, store, forget_backlog, adopt

    def capture(self, req: Request) -> dict[str, Any]:
        store = self.store
        key, cell = req.kv_key, req.cell
        self._flush(key, cell)
        tables = self.records.tables(key)
        ids = torch.tensor([r for t in tables for r in t], dtype=torch.long, device=store.seal.device)
        rows = _record_rows(ids)
        covered = self.kv.coverage(key)
        out = {name: getattr(store, name)[:, ids].cpu() for name in RECORD_FIELDS}
        out |= {name: getattr(store, name)[:, rows].cpu() for name in ROW_FIELDS}
        out |= {"groups_per_plane": [len(t) for t in tables], "covered": covered, "seal": store.seal[ids].cpu(),
                "row_pos": store.row_pos[ids].cpu(), "row_maps": host_copy(store.row_maps[cell, :, :covered]),
                "rows": host_copy(store.rows[cell]), "encoded": host_copy(store.encoded[cell])}
        return out

    def _flush(self, key: str, cell: int) -> None:
        """Apply to the device now what the request's next plan would bring its planes (a
        reset, a rollback's truncate, new records): a snapshot reads the device."""
        update = self.kv.pending_records(key)
        if update is None:
            return
        device = self.store.seal.device
        first, tables = update.first, update.tables
        assign = [[cell, plane, first[plane] + i, r] for plane, ids in enumerate(tables) for i, r in enumerate(ids)]
        truncate = update.truncate
        apply = ResidualUpdate(torch.tensor([cell] if update.fresh else [], dtype=torch.long, device=device),
                               torch.tensor(assign, dtype=torch.long, device=device).view(-1, 4),
                               torch.tensor([] if truncate is None else [cell, truncate], dtype=torch.long,
                                            device=device).view(-1, 2))
        self.store.apply(apply)
        if update.adopt:  # a cached prefix: its rows and groups, as its first plan would bring them
            offsets = [sum(len(t) for t in update.adopt_tables[:p]) for p in range(len(update.adopt_tables))]
            apply.adopt = torch.tensor([[cell, update.adopt, *offsets]], dtype=torch.long, device=device)
            apply.adopt_tables = torch.tensor([page for t in update.adopt_tables for page in t], dtype=torch.long,
                                              device=device)
            apply.adopt_len = update.adopt
            self.adopt(apply)
            self.forget_backlog(cell)  # (execution policy: its groups not sealed yet seal in its later passes)

    def check(self, data: dict[str, Any]) -> None:
        res, rid = data.get("residual"), data["request"]["request_id"]
        if res is None:
            raise SnapshotError(f"the snapshot of {rid!r} lacks INT4 residual planes and this engine has "
                                f"kv_residual_quantization on")
        need = self.records.records_for(None, data["kv"]["pages_per_plane"] * self.kv.block_size,
                                        len(data["request"]["prompt_ids"]))
        if need > self.records.num_free:
            raise SnapshotError(f"restoring {rid!r} needs {need} INT4 residual records; "
                                f"{self.records.num_free} are free")
        if res["covered"] > self.store.max_len:
            raise SnapshotError(f"restoring {rid!r} needs {res['covered']} positions; this engine's "
                                f"max_model_len is {self.store.max_len}")

    def restore(self, req: Request, data: dict[str, Any]) -> None:
        """Write the planes into the records the KV part's restore took and the request's
        cell (its given-back tail pages were never taken)."""
        res, store = data["residual"], self.store
        key, device = req.kv_key, store.seal.device
        tables = self.records.tables(key)
        assert [len(t) for t in tables] == res["groups_per_plane"], "the same coverage takes the same records"
        ids = torch.tensor([r for t in tables for r in t], dtype=torch.long, device=device)
        store.reset(torch.tensor([req.cell], device=device))
        for plane, records in enumerate(tables):
            store.group_tables[req.cell, plane, : len(records)] = torch.tensor(records, dtype=torch.int32,
                                                                                device=device)
        for name in RECORD_FIELDS:
            getattr(store, name)[:, ids] = res[name].to(device)
        rows = _record_rows(ids)
        for name in ROW_FIELDS:
            getattr(store, name)[:, rows] = res[name].to(device)
        store.seal[ids] = res["seal"].to(device)
        store.row_pos[ids] = res["row_pos"].to(device)
        store.row_maps[req.cell, :, : res["covered"]] = res["row_maps"].to(device)
        store.rows[req.cell] = res["rows"].to(device)
        store.encoded[req.cell] = res["encoded"].to(device)
        self.forget_backlog(req.cell)  # it may hold full groups not encoded yet
        self.records.adopt(key)
