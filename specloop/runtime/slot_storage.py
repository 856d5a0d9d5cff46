"""Device storage of token slots: what a live token carries from one loop to the next.

`TokenSlotPool` (plain Python) decides which slot a token owns; this module holds the
slots' contents on the device, one row per slot, allocated once at start-up so that
addresses never change (CUDA graphs and in-flight tickets may hold them):

- hidden: the token's final hidden state after the loops it has run;
- survival, exited: the Q-exit gate's running state;
- depth: loops the token has completed; candidate: the token id that entered loop 1
  (a draft candidate while speculating); incarnation: the request's incarnation when
  the token entered. The host plans from its own copies of these; the device copies
  are what a snapshot captures and what a plan can be checked against.

With token-sparse prefill a slot also keeps `previous`, its hidden state before the last
loop it ran (the change score compares the two), and `selected`, the depth whose sparse
loop picked it (-1: none yet).

With sparse decode attention the decode sub-pool's slots (the first ones, taken by
generated tokens) also own a loop-2 reference state (kept keys, mass, O_ref, C_ref per
layer and query head), held by that feature beside this storage (`DecodeReferences`) and
marked missing when a token enters.

A token keeps its slot from entering loop 1 until it leaves the last loop, so when a
token pipeline shifts (its oldest token finishes, a new one enters) the survivors'
state stays where it is: slot indices travel with the tokens in
the plan, and nothing is copied.
"""

from __future__ import annotations

import torch


class SlotStorage:
    # What a live token carries, and so what a request snapshot saves per live slot (the
    # incarnation is given anew on restore). State added here (the sparse-decode reference)
    # joins the list, and snapshots carry it.
    CARRIED = ("hidden", "previous", "selected", "survival", "exited", "depth", "candidate")

    def __init__(self, num_slots: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 keep_previous: bool = False) -> None:
        """`keep_previous`: keep each slot's hidden state before its last loop (token-sparse
        prefill's change score; else `previous` is [num_slots, 0])."""
        self.hidden = torch.zeros(num_slots, hidden_size, dtype=dtype, device=device)
        self.previous = torch.zeros(num_slots, hidden_size if keep_previous else 0, dtype=dtype, device=device)
        self.selected = torch.full((num_slots,), -1, dtype=torch.long, device=device)
        self.survival = torch.ones(num_slots, dtype=torch.float32, device=device)
        self.exited = torch.zeros(num_slots, dtype=torch.bool, device=device)
        self.depth = torch.zeros(num_slots, dtype=torch.long, device=device)  # the plan's dtype: no cast per call
        self.candidate = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.incarnation = torch.zeros(num_slots, dtype=torch.long, device=device)

    def enter(self, slots: torch.Tensor, token_ids: torch.Tensor, incarnations: torch.Tensor) -> None:
        """Tokens entering loop 1 take these slots: fresh exit state, depth 0."""
        self.survival.index_fill_(0, slots, 1.0)  # scalar fills: no host-to-device copy
        self.exited.index_fill_(0, slots, False)
        self.depth.index_fill_(0, slots, 0)
        self.selected.index_fill_(0, slots, -1)
        self.candidate[slots] = token_ids
        self.incarnation[slots] = incarnations

    def advance(self, slots: torch.Tensor, depths: torch.Tensor, hidden: torch.Tensor) -> None:
        """Rows that ran loop `depth + 1` store their new state (keeping the old one in
        `previous` when token-sparse prefill needs it)."""
        if self.previous.shape[1]:
            self.previous[slots] = self.hidden[slots]
        self.hidden[slots] = hidden
        self.depth[slots] = depths + 1
