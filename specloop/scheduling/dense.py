"""The dense controller: prompts as a wavefront through the depths, then one token at a time.

A request's rows at depth d >= 1 are ready up to the frontier of depth d - 1; they are
planned deepest first, so tokens finish as early as possible. Rows that enter depth 0
(prompt chunks, the next generated token) are queued with the builder, which orders them
across requests (single-token decodes before prompt chunks) and runs a generated token
through every loop in one call (a multi-loop group: one plan per token). The last row of
a request at full depth samples its next token; with speculation on, the speculation
controller takes the request over from that first output token. A request resumed after
a recompute preemption re-enters its prompt and committed tokens as a prompt; with
speculation the last committed token is left out and the controller resumes from it, as
after a rollback, so its rounds (and their keyed draws) fall where they would have.

Token-sparse prefill plans a prompt in windows at its sparse depths: its controller
(`specloop.flashloop.token_sparse_prefill.host`) overrides `_advance`, the planning of one
depth, and builds a window's groups through `DenseBuilder.window_group`.
"""

from __future__ import annotations

from typing import Protocol

from specloop.scheduling.controller import Commit, Controller, GroupBuilder, Rollback
from specloop.plan import Head, RowGroup, Sample, SparseWindow
from specloop.scheduling.request import Request


class DenseController:
    def __init__(self, num_loops: int, handoff: Controller | None = None) -> None:
        self.num_loops = num_loops
        self.handoff = handoff  # takes a request over after its first sample (speculation)

    def start(self, req: Request, base: int, token: int | None = None) -> None:
        """Dense planning needs no state of its own: the KV frontiers say what is ready."""

    def plan(self, req: Request, budget: int, builder: "DenseBuilder") -> list[RowGroup]:
        frontiers = [builder.frontier(req, d) for d in range(self.num_loops)]
        num_tokens = req.num_tokens  # a token sampled in this plan enters depth 0 only in the next one
        groups: list[RowGroup] = []
        for depth in range(self.num_loops - 1, 0, -1):
            budget = self._advance(req, depth, frontiers[depth], frontiers[depth - 1], budget, builder, groups)
        waiting = num_tokens - frontiers[0]
        if waiting > 0:
            builder.queue_entry(req, frontiers[0], waiting)
        return groups

    def _advance(self, req: Request, depth: int, start: int, ready: int, budget: int, builder: "DenseBuilder",
                 groups: list[RowGroup]) -> int:
        """Plan rows [start, ready) at `depth` (ready: the frontier of the depth before) as
        far as `budget` allows, into `groups`; returns the budget left."""
        if budget > 0 and start < ready:
            end = min(ready, start + budget)
            groups.append(self.group(req, depth, start, end, builder))
            budget -= end - start
        return budget

    def group(self, req: Request, depth: int, start: int, end: int, builder: GroupBuilder,
              loops: int = 1, window: SparseWindow | None = None) -> RowGroup:
        """Rows [start, end) through `loops` loops from `depth` (a prompt window's last group
        at a sparse depth: `window`); the request's last row at full depth samples."""
        head = None
        last = depth + loops == self.num_loops and end == req.num_tokens
        resume = last and req.resume_token is not None
        if last and not resume and req.wants_more_samples:
            head = Sample(req.params, req.produced)
        if window is not None:
            group = builder.window_group(req, depth, start, end, window, head=head)
        else:
            group = builder.group(req, depth, start, end, head=head, loops=loops)
        if resume:  # the replayed prefix is in: speculation resumes from the last committed token
            token, req.resume_token = req.resume_token, None
            req.speculating = True
            self.handoff.start(req, base=end, token=token)
        elif head is not None:
            req.produced += 1
            if self.handoff is not None:  # speculation takes over from the first output token
                req.speculating = True
                self.handoff.start(req, base=end)
            elif req.wants_more_samples:
                req.num_tokens += 1  # the sampled token's position exists from the next plan on
        return group

    def committed(self, req: Request, commit: Commit) -> Rollback:
        return Rollback()  # a dense sample never rolls anything back

    def held_slots(self, req: Request) -> list[int]:
        return []


class DenseBuilder(GroupBuilder, Protocol):
    """What the dense controller needs of the scheduler beyond building groups."""

    def frontier(self, req: Request, depth: int) -> int: ...

    def queue_entry(self, req: Request, start: int, rows: int) -> None: ...

    def window_group(self, req: Request, depth: int, start: int, end: int, window: SparseWindow,
                     head: Head = None) -> RowGroup:
        """The rows of `window` (`SparseWindow`: some of [start, end)) at `depth`."""
        ...

    def page_table(self, req: Request, plane: int, end: int) -> list[int]:
        """The pages of the request's plane covering positions [0, end)."""
        ...
