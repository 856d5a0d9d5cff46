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

With sparse decode attention the first `decode_size` slots form a sub-pool for generated
tokens (positions past the prompt): only those slots have room for a loop-2 reference
state on the device, which is far larger than a hidden state, so the pool of every token
cannot afford it. Generated tokens take from it and prompt tokens from the rest; without
the sub-pool (`decode_size` 0) every token takes from one pool.
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
    def __init__(self, size: int, decode_size: int = 0) -> None:
        if not 0 <= decode_size < size:
            raise ValueError(f"decode sub-pool of {decode_size} slots outside a pool of {size}")
        self.size = size
        self.decode_size = decode_size
        self._state = [SlotState.EMPTY] * size
        self._free = collections.deque(range(decode_size, size))
        self._free_decode = collections.deque(range(decode_size))

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._free_decode)

    def free_for(self, decode: bool) -> int:
        """Free slots for prompt tokens (`decode` False) or generated ones."""
        return len(self._pool(decode))

    def _pool(self, decode: bool) -> collections.deque:
        return self._free_decode if decode and self.decode_size else self._free

    def state(self, slot: int) -> SlotState:
        return self._state[slot]

    def take(self, n: int, decode: bool = False) -> list[int] | None:
        """n empty slots for prompt tokens (for generated ones with `decode`), now
        source-ready; None (nothing taken) when fewer are free."""
        pool = self._pool(decode)
        if n > len(pool):
            return None
        slots = [pool.popleft() for _ in range(n)]
        for s in slots:
            self._state[s] = SlotState.SOURCE_READY
        return slots

    def finish(self, slots: list[int]) -> None:
        self._move(slots, (SlotState.SOURCE_READY,), SlotState.REUSABLE)

    def retire(self, slots: list[int]) -> None:
        self._move(slots, (SlotState.SOURCE_READY,), SlotState.RETIRED)

    def release(self, slots: list[int]) -> None:
        self._move(slots, (SlotState.REUSABLE, SlotState.RETIRED), SlotState.EMPTY)
        for s in slots:
            (self._free_decode if s < self.decode_size else self._free).append(s)

    def _move(self, slots: list[int], allowed: tuple[SlotState, ...], to: SlotState) -> None:
        bad = [s for s in slots if self._state[s] not in allowed]
        if bad or len(set(slots)) != len(slots):
            state = self._state[bad[0]].value if bad else "listed twice"
            raise ValueError(f"token slot {bad[0] if bad else slots} cannot become {to.value} from {state}")
        for s in slots:
            self._state[s] = to
