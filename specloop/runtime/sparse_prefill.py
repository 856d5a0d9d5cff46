"""Token-sparse prefill on the device: which of a prompt window's tokens run a sparse loop.

Before 0-based depth d >= 2, every token of the window that ran loop d (and has not
exited) is scored by how much its hidden state changed over that loop,

    score = ||h_d - h_(d-1)|| / max(||h_d||, eps)        (fp32, from the slot storage)

and the window keeps its `budget` highest scores, ties going to the lower position (a
stable sort of positions in order, so batching never changes the choice). Exited tokens
rank below every eligible one: they fill a budget the eligible tokens cannot (their rows
then run as kept rows and change nothing). The picks are marked in the slots
(`SlotStorage.selected`); every other token of the window inherits its previous-depth K/V
into this depth's plane, before any active row attends to it. A window split across
calls selects once, in its first group; later groups read the marks.

Nothing here reads a device value back to the host: the budget and row counts come from
the plan.
"""

from __future__ import annotations

import torch

from specloop.runtime.forward_batch import LoopPass, WindowRows, kv_slots
from specloop.runtime.kv_format import PagedKV
from specloop.runtime.slot_storage import SlotStorage


def change_scores(slots: SlotStorage, window_slots: torch.Tensor, eps: float) -> torch.Tensor:
    """[n] fp32 change score of each window token over the last loop it ran."""
    h = slots.hidden[window_slots].float()
    before = slots.previous[window_slots].float()
    return torch.linalg.vector_norm(h - before, dim=-1) / torch.linalg.vector_norm(h, dim=-1).clamp_min(eps)


def select(slots: SlotStorage, w: WindowRows, eps: float) -> None:
    """Mark the `w.budget` tokens the window keeps at `w.depth` (`SlotStorage.selected`)."""
    ws = w.window_slots
    exited = slots.exited[ws]
    eligible = (slots.depth[ws] == w.depth) & ~exited  # ran the previous loop: nested sets
    score = change_scores(slots, ws, eps)
    key = torch.where(eligible, score, torch.where(exited, -1.0, float("-inf")))
    order = torch.sort(key, descending=True, stable=True).indices[: w.budget]
    slots.selected[ws[order]] = w.depth


def inherit(kv: PagedKV, slots: SlotStorage, w: WindowRows, tables: torch.Tensor, page_size: int) -> None:
    """The window's tokens not kept at `w.depth` expose their previous-depth K/V there."""
    ws = w.window_slots
    positions = w.start + torch.arange(ws.numel(), device=ws.device)
    src = kv_slots(tables, w.inherit_table, positions, page_size)
    dst = kv_slots(tables, w.table, positions, page_size)
    kv.inherit(src, dst, slots.selected[ws] != w.depth)


def fill_rows(slots: SlotStorage, w: WindowRows, batch_slots: torch.Tensor, lp: LoopPass) -> None:
    """Write the group's rows: ranks [w.rank, w.rank + w.rows) of the kept tokens, in position
    order, into the batch's token slots and the pass's positions and token slots."""
    ws = w.window_slots
    kept_first = torch.argsort((slots.selected[ws] != w.depth).to(torch.uint8), stable=True)
    index = kept_first[w.rank: w.rank + w.rows]
    rows = slice(w.first, w.first + w.rows)
    chosen = ws[index]
    batch_slots[rows] = chosen
    lp.token_slots[rows] = chosen
    lp.positions[rows] = w.start + index
