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

With token-sparse prefill, a prompt window reaches a sparse loop only once all its tokens
finished the loop before (their change scores are computed together); it then runs the
tokens it keeps there, in one group or, when the plan's budget is short, in several
(`Request.window_rows` counts those planned), and the frontier passes the window with
the last one.
"""

from __future__ import annotations

from typing import Protocol

from specloop.flashloop.config import TokenSparsePrefill
from specloop.scheduling.controller import Commit, Controller, GroupBuilder, Rollback
from specloop.plan import Head, RowGroup, Sample
from specloop.scheduling.request import Request


class DenseController:
    def __init__(self, num_loops: int, handoff: Controller | None = None,
                 windows: TokenSparsePrefill | None = None) -> None:
        self.num_loops = num_loops
        self.handoff = handoff  # takes a request over after its first sample (speculation)
        self.windows = windows  # token-sparse prefill with some sparse loop, or None

    def start(self, req: Request, base: int, token: int | None = None) -> None:
        """Dense planning needs no state of its own: the KV frontiers say what is ready."""

    def plan(self, req: Request, budget: int, builder: "DenseBuilder") -> list[RowGroup]:
        frontiers = [builder.frontier(req, d) for d in range(self.num_loops)]
        num_tokens = req.num_tokens  # a token sampled in this plan enters depth 0 only in the next one
        groups: list[RowGroup] = []
        prompt = len(req.prompt_ids)
        for depth in range(self.num_loops - 1, 0, -1):
            start, ready = frontiers[depth], frontiers[depth - 1]
            while budget > 0 and start < ready:
                end = min(ready, start + budget)
                if self.windows is not None and depth >= 2 and start < prompt:
                    w_start, w_end = self.windows.bounds(start, prompt)
                    if self.windows.sparse(depth, w_end - w_start):
                        if ready < w_end:
                            break  # its scores need every token of the window at the previous depth
                        group = self._window(req, depth, w_start, w_end, budget, builder)
                        groups.append(group)
                        budget -= group.num_rows
                        if not group.completes:
                            break
                        start = w_end
                        continue
                    end = min(end, w_end)  # a window kept whole here: dense, up to its end
                groups.append(self.group(req, depth, start, end, builder))
                budget -= end - start
                start = end
        waiting = num_tokens - frontiers[0]
        if waiting > 0:
            builder.queue_entry(req, frontiers[0], waiting)
        return groups

    def _window(self, req: Request, depth: int, start: int, end: int, budget: int,
                builder: "DenseBuilder") -> RowGroup:
        """The next group of prompt window [start, end) at sparse `depth`: as many of the
        tokens it keeps as the budget allows."""
        keep = self.windows.budget(depth, end - start)
        first = req.window_rows.pop(depth, 0)
        rows = min(budget, keep - first)
        if first + rows < keep:
            req.window_rows[depth] = first + rows
            return builder.window_group(req, depth, start, end, keep, first, rows)
        return self.group(req, depth, start, end, builder, window=(keep, first, rows))

    def group(self, req: Request, depth: int, start: int, end: int, builder: GroupBuilder,
              loops: int = 1, window: tuple[int, int, int] | None = None) -> RowGroup:
        """Rows [start, end) through `loops` loops from `depth` (a prompt window's last group
        at a sparse depth: `window`); the request's last row at full depth samples."""
        head = None
        last = depth + loops == self.num_loops and end == req.num_tokens
        resume = last and req.resume_token is not None
        if last and not resume and req.wants_more_samples:
            head = Sample(req.params, req.produced)
        if window is not None:
            group = builder.window_group(req, depth, start, end, *window, head=head)
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

    def window_group(self, req: Request, depth: int, start: int, end: int, budget: int, first: int, rows: int,
                     head: Head = None) -> RowGroup:
        """Ranks [first, first + rows) of the `budget` tokens prompt window [start, end) keeps
        at `depth` (`SparseWindow`)."""
        ...
