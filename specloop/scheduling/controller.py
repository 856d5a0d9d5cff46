"""The protocol every controller implements (plain Python, no torch).

A controller owns how some requests' rows are planned and what their commits do: the
dense controller (prompt chunks as a wavefront through the depths, then one token at a
time), block rounds and token pipelines (`specloop.pipeline`). Each one

- plans: describes the groups it wants this plan through a `GroupBuilder`, which the
  scheduler implements; the scheduler alone writes the groups (KV frontiers, page tables,
  token slots), and a group's head is given when it is built, never patched afterwards;
- has a device head: the head types it plans (`Sample`, `Draft`, `Verify`,
  `VerifyCandidate`) are run by device heads registered with the runner;
- commits: turns a committed result into a `Rollback` (which positions to keep in every
  plane, which live tokens to flush), which the scheduler applies.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from specloop.plan import Head, RowGroup
from specloop.scheduling.request import Request


class GroupBuilder(Protocol):
    max_loops: int  # the most loops one group may run in this plan (1: a loop per call)
    def group(self, req: Request, depth: int, start: int, end: int, *, head: Head = None,
              slots: list[int] | None = None, token_ids: list[int] | None = None, loops: int = 1) -> RowGroup:
        """Rows [start, end) of `req` running `loops` loops from `depth`. Depth-0 rows take
        token slots (`slots` when the controller took them already) and `token_ids` when the
        host knows them. A multi-loop group is legal when every earlier position of the
        request has finished (or is planned before it) each depth the group runs."""
        ...

    def take_slots(self, n: int) -> list[int] | None:
        """n token slots at once, or None (nothing taken) when fewer are free."""
        ...


@dataclasses.dataclass(frozen=True)
class Commit:
    accepted: int  # candidates accepted (0 for a plain sample)
    index: int  # output index of the first emitted token
    token: int  # the last emitted token, now known on the host


@dataclasses.dataclass(frozen=True)
class Rollback:
    keep: int | None = None  # positions [0, keep) stay in every plane; None: nothing rolls back
    flushed: tuple[int, ...] = ()  # positions whose live tokens are flushed (their slots retire)
    dropped_slots: tuple[int, ...] = ()  # token slots the controller held for rows it will never plan


class Controller(Protocol):
    def start(self, req: Request, base: int, token: int | None = None) -> None:
        """Take over a request whose next token sits at position `base`: in its request cell,
        or `token` when the host knows it (a request resumed after preemption)."""
        ...

    def plan(self, req: Request, budget: int, builder: GroupBuilder) -> list[RowGroup]:
        """This plan's groups for `req`, at most `budget` row-loops (`RowGroup.cost`)."""
        ...

    def committed(self, req: Request, commit: Commit) -> Rollback:
        """A result of this controller's head committed (only those whose request lives on)."""
        ...

    def held_slots(self, req: Request) -> list[int]:
        """Token slots taken for rows not planned yet (returned when the request ends)."""
        ...
