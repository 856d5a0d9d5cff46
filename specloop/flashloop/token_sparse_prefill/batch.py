"""Token-sparse prefill's share of the forward batch (`BatchPart`): the plan's groups at a
sparse loop of a prompt window (`RowGroup.window`) hold placeholder positions and token
slots in their rows; the runner fills them in on the device from the window's selection
(`WindowBatch`: the windows' token slots and integers ride in the batch's upload)."""

from __future__ import annotations

import dataclasses

import torch

from specloop.plan import Plan, RowGroup
from specloop.runtime.forward_batch import ForwardBatch, LoopPass

WINDOW_INFO = 8


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
    """The call's sparse prefill groups, batched for the device (`select.run`): one padded
    row of window token slots per group, its integers, and one entry per batch row the
    groups run."""

    windows: list[WindowRows]
    slots: torch.Tensor  # [G, W] long, padded with the pad slot
    info: torch.Tensor  # [G, WINDOW_INFO] long: start, length, depth, budget, selects here, table, inherited
    # table, and the index of a token it always keeps (`keep_last`: the prompt's last; -1: none)
    rows: torch.Tensor  # [R] long: batch rows
    row_window: torch.Tensor  # [R] long: the group of each
    row_rank: torch.Tensor  # [R] long: the rank of the kept token each runs
    moved_window: torch.Tensor  # [M] long: per token a selecting group leaves out, its group
    moved_rank: torch.Tensor  # [M] long: and its rank (budget .. length - 1: the left-out come after the kept)


Windows = list[tuple[int, RowGroup, int, int]]  # (first row, group, its table, the inherited table)


class WindowBatchPart:
    variant = None

    def __init__(self, capacity: int, pad_slot: int, keep_last: bool = False) -> None:
        """`capacity`: the most integers one plan's window groups carry
        (`TokenSparsePrefillFeature.upload_ints`); `pad_slot`: the sink token slot;
        `keep_last`: the window ending the prompt always keeps the prompt's last token."""
        self.capacity, self.pad_slot, self.keep_last = capacity, pad_slot, keep_last

    def start(self, plan: Plan) -> None:
        pass

    def pass_info(self, ordered: list[RowGroup], firsts: list[int], p: int,
                  table_at: dict[tuple[int, int], int]) -> None:
        return None

    def left_out(self, info: None) -> list[int]:
        return []

    def columns(self, info: None, bucket: int) -> int:
        return 0

    def fits_graph(self, info: None, bucket: int) -> bool:
        return True

    def graph_columns(self, bucket: int) -> int:
        return 0

    def block_ints(self, info: None, n: int, cells: list[int], size: int, bucket: int) -> list[int]:
        return []

    def pad(self, size: int, bucket: int) -> torch.Tensor:
        return torch.zeros(size, dtype=torch.long)

    def pass_view(self, lp: LoopPass, columns: torch.Tensor, info: None, graphed: bool) -> None:
        pass

    def graph_view(self, lp: LoopPass, columns: torch.Tensor, variant: object) -> None:
        pass

    def tail_ints(self, info: None) -> list[int]:
        return []

    def tail_view(self, lp: LoopPass, ints: torch.Tensor, info: None) -> None:
        pass

    def plan_ints(self, plan: Plan, ordered: list[RowGroup], firsts: list[int],
                  table_at: dict[tuple[int, int], int]) -> tuple[list[int], Windows]:
        """`WindowBatch`'s integers: padded window slots, per-group info, per-row entries."""
        windows = [(first, g, table_at[g.cell, g.depth], table_at[g.cell, g.depth - 1])
                   for g, first in zip(ordered, firsts) if g.window is not None]
        if not windows:
            return [], windows
        width = max(len(g.token_slots) for _, g, _, _ in windows)
        out: list[int] = []
        for _, g, _, _ in windows:
            out += g.token_slots + [self.pad_slot] * (width - len(g.token_slots))
        for _, g, own, inherited in windows:
            n = len(g.token_slots)
            last = n - 1 if self.keep_last and g.start + n == g.decode_from else -1
            out += [g.start, n, g.depth, g.window.budget, int(g.window.first == 0), own, inherited, last]
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
        return out + rows + of + ranks + moved_of + moved_ranks, windows

    def plan_view(self, batch: ForwardBatch, ints: torch.Tensor, windows: Windows) -> None:
        if not windows:
            return
        g, width = len(windows), max(len(w.token_slots) for _, w, _, _ in windows)
        r = sum(w.window.rows for _, w, _, _ in windows)
        at = 0
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
        batch.notes[WindowBatch] = WindowBatch(host, slots, info, rows, of, ranks, moved_of, moved_ranks)
