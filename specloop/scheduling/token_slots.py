"""Token slots: where a live token's state waits between loops (plain Python, no torch).

A slot indexes the device storage of `slot_storage.SlotStorage` (hidden state, exit
state, depth, candidate, incarnation, reference room). Its lifecycle:

    empty --take--> source-ready --finish--> reusable --release--> empty
                         \\--retire--> retired --release--> empty

- source-ready: holds a live token; its stored state is the source of the token's next
  loop.
- reusable: the token reached full depth (or exited); nothing reads the slot again,
  but a submitted ticket may still be writing it.
- retired: the token was flushed (speculation rejection) or its request ended; its
  contents are stale and must never be read.
`release` runs once the last ticket that used the slot completed. Every other transition
is an error, which turns a double free or a use after free into an exception here
instead of silently corrupting another token's state. Taking is all-or-nothing, so a
caller that cannot get its slots queues its work instead of failing.
"""

from __future__ import annotations

import collections
import enum


class SlotState(enum.Enum):
    EMPTY = "empty"
    SOURCE_READY = "source-ready"
    REUSABLE = "reusable"
    RETIRED = "retired"


class TokenSlotPool:
    def __init__(self, size: int) -> None:
        self.size = size
        self._state = [SlotState.EMPTY] * size
        self._free = collections.deque(range(size))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def state(self, slot: int) -> SlotState:
        return self._state[slot]

    def take(self, n: int) -> list[int] | None:
        """n empty slots, now source-ready; None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        slots = [self._free.popleft() for _ in range(n)]
        for s in slots:
            self._state[s] = SlotState.SOURCE_READY
        return slots

    def finish(self, slots: list[int]) -> None:
        self._move(slots, (SlotState.SOURCE_READY,), SlotState.REUSABLE)

    def retire(self, slots: list[int]) -> None:
        self._move(slots, (SlotState.SOURCE_READY,), SlotState.RETIRED)

    def release(self, slots: list[int]) -> None:
        self._move(slots, (SlotState.REUSABLE, SlotState.RETIRED), SlotState.EMPTY)
        self._free.extend(slots)

    def _move(self, slots: list[int], allowed: tuple[SlotState, ...], to: SlotState) -> None:
        bad = [s for s in slots if self._state[s] not in allowed]
        if bad or len(set(slots)) != len(slots):
            state = self._state[bad[0]].value if bad else "listed twice"
            raise ValueError(f"token slot {bad[0] if bad else slots} cannot become {to.value} from {state}")
        for s in slots:
            self._state[s] = to
