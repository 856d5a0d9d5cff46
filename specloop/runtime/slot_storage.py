"""Device storage of token slots: what a live token carries from one loop to the next.

`TokenSlotPool` (plain Python) decides which slot a token owns; this module holds the
slots' contents on the device, one row per slot, allocated once at start-up so that
addresses never change (CUDA graphs and in-flight tickets may hold them):

- hidden: the token's final hidden state after the loops it has run;
- survival, exited: the Q-exit gate's running state;
- depth: loops the token has completed; candidate: the token id that entered loop 1
  (a draft candidate while speculating); incarnation: the request's incarnation when
  the token entered. The host plans from its own copies of these; the device copies
  are what a snapshot captures and what a plan can be checked against;
- reference (optional): room for sparse decode attention's loop-2 reference state
  per layer and query head: the selected key positions S, their mass m, the full
  loop-2 output O_ref and the selected part C_ref (see docs/speculation.md).

A token keeps its slot from entering loop 1 until it leaves the last loop, so when a
token pipeline shifts (its oldest token finishes, a new one enters) the survivors'
state, reference included, stays where it is: slot indices travel with the tokens in
the plan, and nothing is copied.
"""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass(frozen=True)
class ReferenceShape:
    num_layers: int
    num_heads: int  # query heads: selection is per query head
    head_dim: int
    budget: int  # most key positions one (layer, head) may select

    @staticmethod
    def budget_for(context_len: int, retention: float) -> int:
        """Selected keys for a context of `context_len` keys: min(n, max(1, ceil(retention * n)))."""
        if context_len < 1 or not 0.0 < retention <= 1.0:
            raise ValueError(f"need context_len >= 1 and retention in (0, 1], got {context_len}, {retention}")
        return min(context_len, max(1, math.ceil(retention * context_len)))

    @property
    def bytes_per_slot(self) -> int:
        heads = self.num_layers * self.num_heads
        return heads * (4 * self.budget + 4 + 4 + 2 * 4 * self.head_dim)


class ReferenceState:
    """Loop-2 reference state of every slot: positions [S, L, H, B] int32 (-1 past the
    selection), count [S, L, H] int32, mass [S, L, H] and O_ref, C_ref [S, L, H, D] in
    fp32 (O_ref - C_ref is a difference of close values; fp32 keeps it exact enough)."""

    def __init__(self, num_slots: int, shape: ReferenceShape, device: torch.device) -> None:
        s, l, h, d, b = num_slots, shape.num_layers, shape.num_heads, shape.head_dim, shape.budget
        self.shape = shape
        self.positions = torch.full((s, l, h, b), -1, dtype=torch.int32, device=device)
        self.count = torch.zeros(s, l, h, dtype=torch.int32, device=device)
        self.mass = torch.zeros(s, l, h, dtype=torch.float32, device=device)
        self.o_ref = torch.zeros(s, l, h, d, dtype=torch.float32, device=device)
        self.c_ref = torch.zeros(s, l, h, d, dtype=torch.float32, device=device)

    def write(self, slots: torch.Tensor, layer: int, positions: torch.Tensor, mass: torch.Tensor,
              o_ref: torch.Tensor, c_ref: torch.Tensor) -> None:
        """One layer's reference for N tokens: positions [N, H, W] (W <= budget; -1 pads a
        row that selected fewer), mass [N, H], o_ref and c_ref [N, H, D]."""
        n, h, w = positions.shape
        if h != self.shape.num_heads or w > self.shape.budget:
            raise ValueError(f"reference positions {tuple(positions.shape)} do not fit heads "
                             f"{self.shape.num_heads}, budget {self.shape.budget}")
        padded = torch.full((n, h, self.shape.budget), -1, dtype=torch.int32, device=positions.device)
        padded[:, :, :w] = positions.to(torch.int32)
        self.positions[slots, layer] = padded
        self.count[slots, layer] = (positions >= 0).sum(-1, dtype=torch.int32)
        self.mass[slots, layer] = mass.float()
        self.o_ref[slots, layer] = o_ref.float()
        self.c_ref[slots, layer] = c_ref.float()

    def read(self, slots: torch.Tensor, layer: int) -> tuple[torch.Tensor, ...]:
        """(positions [N, H, B], count [N, H], mass [N, H], o_ref [N, H, D], c_ref [N, H, D])."""
        return (self.positions[slots, layer], self.count[slots, layer], self.mass[slots, layer],
                self.o_ref[slots, layer], self.c_ref[slots, layer])

    def clear(self, slots: torch.Tensor) -> None:
        """A token entering a slot has no reference yet: an empty selection in every layer."""
        self.count.index_fill_(0, slots, 0)
        self.positions.index_fill_(0, slots, -1)


class SlotStorage:
    def __init__(self, num_slots: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 reference: ReferenceShape | None = None) -> None:
        self.hidden = torch.zeros(num_slots, hidden_size, dtype=dtype, device=device)
        self.survival = torch.ones(num_slots, dtype=torch.float32, device=device)
        self.exited = torch.zeros(num_slots, dtype=torch.bool, device=device)
        self.depth = torch.zeros(num_slots, dtype=torch.long, device=device)  # the plan's dtype: no cast per call
        self.candidate = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.incarnation = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.reference = ReferenceState(num_slots, reference, device) if reference is not None else None

    def enter(self, slots: torch.Tensor, token_ids: torch.Tensor, incarnations: torch.Tensor) -> None:
        """Tokens entering loop 1 take these slots: fresh exit state, depth 0, no reference."""
        self.survival.index_fill_(0, slots, 1.0)  # scalar fills: no host-to-device copy
        self.exited.index_fill_(0, slots, False)
        self.depth.index_fill_(0, slots, 0)
        self.candidate[slots] = token_ids
        self.incarnation[slots] = incarnations
        if self.reference is not None:
            self.reference.clear(slots)

    def advance(self, slots: torch.Tensor, depths: torch.Tensor, hidden: torch.Tensor) -> None:
        """Rows that ran loop `depth + 1` store their new state."""
        self.hidden[slots] = hidden
        self.depth[slots] = depths + 1
