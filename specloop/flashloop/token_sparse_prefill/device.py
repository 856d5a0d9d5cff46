"""Token-sparse prefill's device half of a forward call (`DeviceFeature`): before the call,
each window group at a sparse loop selects its tokens, the left-out ones inherit their
previous depth's K/V, and the group's rows are filled in (`select.run`); after the passes,
a window whose group samples hands the head the prompt's last token, run or not."""

from __future__ import annotations

import torch

from specloop.flashloop.config import SCORE_EPS
from specloop.flashloop.token_sparse_prefill import select
from specloop.flashloop.token_sparse_prefill.batch import WindowBatch
from specloop.runtime.forward_batch import ForwardBatch, LoopPass
from specloop.runtime.kv_format import PagedKV
from specloop.runtime.slot_storage import SlotStorage


class WindowDevice:
    def __init__(self, slots: SlotStorage, kv: PagedKV) -> None:
        assert slots.previous.shape[1], "the change score needs each slot's previous hidden state"
        self.slots, self.kv = slots, kv
        # Tests only: called with (window rows, the window's kept mask) after each selection.
        self.probe: select.Probe | None = None

    def prepare(self, batch: ForwardBatch) -> None:
        windows = batch.notes.get(WindowBatch)
        if windows is not None:  # before anything reads the rows' slots or positions
            select.run(self.slots, self.kv, windows, batch.token_slots, batch.passes[0], batch.tables,
                       batch.page_size, SCORE_EPS, self.probe)

    def start_pass(self, lp: LoopPass, keep: torch.Tensor | None) -> None:
        pass

    def finish(self, batch: ForwardBatch, final: torch.Tensor) -> None:
        windows = batch.notes.get(WindowBatch)
        for w in windows.windows if windows is not None else ():  # the prompt's last token
            if w.head:  # samples from its state, run here or not (slices: a 0-d device index reads back)
                last = w.first + w.rows
                final[last - 1: last] = self.slots.hidden[w.window_slots[-1:]]

    def stats(self) -> dict[str, int]:
        return {}
