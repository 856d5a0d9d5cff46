"""Token-sparse prefill on the device: which of a prompt window's tokens run a sparse loop.

Before 0-based depth d >= 2, every token of the window that ran loop d (and has not
exited) is scored by how much its hidden state changed over that loop,

    score = ||h_d - h_(d-1)|| / max(||h_d||, eps)        (fp32, from the slot storage)

and the window keeps its `budget` highest scores, ties going to the lower position (a
stable sort of positions in order, so batching never changes the choice); with
`keep_last` the window ending the prompt ranks the prompt's last token first when
eligible. Exited tokens rank below every eligible one: they fill a budget the eligible
tokens cannot (their rows then run as kept rows and change nothing). The picks are marked in the slots
(`SlotStorage.selected`); every other token of the window inherits its previous-depth K/V
into this depth's plane, before any active row attends to it. A window split across
calls selects once, in its first group; later groups read the marks.

All groups of a call go together (`WindowBatch`: one padded row per group), so the cost
in launches does not grow with the number of windows, and nothing is read back to the
host: the budgets and row counts come from the plan.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specloop.flashloop.token_sparse_prefill.batch import WindowBatch, WindowRows
from specloop.runtime.forward_batch import LoopPass, kv_slots
from specloop.runtime.kv_format import PagedKV
from specloop.runtime.slot_storage import SlotStorage

Probe = Callable[[WindowRows, torch.Tensor], None]


def change_scores(slots: SlotStorage, window_slots: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 change score of each token (any shape of slot indices) over the last loop it ran."""
    h = slots.hidden[window_slots].float()
    before = slots.previous[window_slots].float()
    return torch.linalg.vector_norm(h - before, dim=-1) / torch.linalg.vector_norm(h, dim=-1).clamp_min(eps)


def select(slots: SlotStorage, wb: WindowBatch, eps: float) -> torch.Tensor:
    """Mark the tokens each group selecting here keeps (`SlotStorage.selected`); returns the
    [G, W] mask of every group's kept tokens (marked here or by an earlier call)."""
    start, length, depth, budget, fresh, _, _, last = wb.info.unbind(1)
    ws = wb.slots
    col = torch.arange(ws.shape[1], device=ws.device)
    valid = col[None, :] < length[:, None]
    d = depth[:, None]
    exited = slots.exited[ws]
    eligible = (slots.depth[ws] == d) & ~exited & valid  # ran the previous loop: nested sets
    key = torch.where(eligible, change_scores(slots, ws, eps), torch.where(exited & valid, -1.0, float("-inf")))
    key = torch.where(eligible & (col[None, :] == last[:, None]), float("inf"), key)  # keep_last's token first
    order = torch.sort(key, dim=1, descending=True, stable=True).indices
    kept = torch.zeros_like(valid).scatter_(1, order, col[None, :] < budget[:, None])
    marks = torch.where((fresh[:, None] == 1) & kept & valid, d, slots.selected[ws])
    slots.selected[ws.flatten()] = marks.flatten()  # padding writes the sink slot
    return (slots.selected[ws] == d) & valid


def by_rank(kept: torch.Tensor) -> torch.Tensor:
    """[G, W] each group's window indices, kept tokens first, each part in position order."""
    return torch.argsort((~kept).to(torch.uint8), dim=1, stable=True)


def inherit(kv: PagedKV, wb: WindowBatch, order: torch.Tensor, tables: torch.Tensor, page_size: int) -> None:
    """The tokens a selecting group leaves out (ranks budget .. length - 1 of `order`, listed
    by the plan) copy their previous-depth K/V into its depth's plane."""
    start, _, _, _, _, table, inherited, _ = wb.info.unbind(1)
    of = wb.moved_window
    positions = start[of] + order[of, wb.moved_rank]
    kv.copy(kv_slots(tables, inherited[of], positions, page_size), kv_slots(tables, table[of], positions, page_size))


def fill_rows(wb: WindowBatch, order: torch.Tensor, batch_slots: torch.Tensor, lp: LoopPass) -> None:
    """Write each group's rows, ranks [rank, rank + rows) of its kept tokens in position
    order, into the batch's token slots and the pass's positions and token slots."""
    start, *_ = wb.info.unbind(1)
    of = wb.row_window
    index = order[of, wb.row_rank]
    chosen = wb.slots[of, index]
    batch_slots[wb.rows] = chosen
    lp.token_slots[wb.rows] = chosen
    lp.positions[wb.rows] = start[of] + index


def run(slots: SlotStorage, kv: PagedKV, wb: WindowBatch, batch_slots: torch.Tensor, lp: LoopPass,
        tables: torch.Tensor, page_size: int, eps: float, probe: Probe | None = None) -> None:
    """Select, inherit and fill in the rows of every sparse prefill group of a call."""
    kept = select(slots, wb, eps)
    order = by_rank(kept)
    inherit(kv, wb, order, tables, page_size)
    if probe is not None:  # tests only: it reads the masks back
        for g, w in enumerate(wb.windows):
            if w.rank == 0:
                probe(w, kept[g, : w.window_slots.numel()])
    fill_rows(wb, order, batch_slots, lp)
