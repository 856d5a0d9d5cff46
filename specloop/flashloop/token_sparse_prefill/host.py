"""Token-sparse prefill on the host: a prompt planned in windows.

A prompt window reaches a sparse loop only once all its tokens finished the loop before
(their change scores are computed together); it then runs the tokens it keeps there, in
one group or, when the plan's budget is short, in several (`Request.window_rows` counts
those planned), and the frontier passes the window with the last one. A window takes the
token slots of all its tokens when its first one enters (all or nothing): its tokens wait
for each other before the sparse loops, so a window entered half-way could hold slots no
one can free.
"""

from __future__ import annotations

from specloop.flashloop.config import TokenSparsePrefill
from specloop.plan import RowGroup, SparseWindow
from specloop.scheduling.controller import Controller
from specloop.scheduling.dense import DenseBuilder, DenseController
from specloop.scheduling.request import Request
from specloop.scheduling.token_slots import TokenSlotPool


class WindowedController(DenseController):
    """The dense controller with prompt windows at the sparse depths."""

    def __init__(self, num_loops: int, handoff: Controller | None, windows: TokenSparsePrefill) -> None:
        super().__init__(num_loops, handoff)
        self.windows = windows
        self.rows_skipped = 0  # prompt token-loops planned to be left out (a recomputed window counts again)

    def _advance(self, req: Request, depth: int, start: int, ready: int, budget: int, builder: DenseBuilder,
                 groups: list[RowGroup]) -> int:
        prompt = len(req.prompt_ids)
        while budget > 0 and start < ready:
            end = min(ready, start + budget)
            if depth >= 2 and start < prompt:
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
        return budget

    def _window(self, req: Request, depth: int, start: int, end: int, budget: int,
                builder: DenseBuilder) -> RowGroup:
        """The next group of prompt window [start, end) at sparse `depth`: as many of the
        tokens it keeps as the budget allows."""
        keep = self.windows.budget(depth, end - start)
        first = req.window_rows.pop(depth, 0)
        rows = min(budget, keep - first)
        window = SparseWindow(keep, first, rows, inherit_table=builder.page_table(req, depth - 1, end))
        if first == 0:
            self.rows_skipped += end - start - keep
        if not window.completes:
            req.window_rows[depth] = first + rows
            return builder.window_group(req, depth, start, end, window)
        return self.group(req, depth, start, end, builder, window=window)


class WindowedPrompts:
    """`PromptPlanning` with token-sparse prefill on (some loop sparse)."""

    def __init__(self, windows: TokenSparsePrefill) -> None:
        assert windows.active, "a windowed plan needs a sparse loop"
        self.windows = windows
        self._controller: WindowedController | None = None

    def controller(self, num_loops: int, handoff: Controller | None) -> DenseController:
        self._controller = WindowedController(num_loops, handoff, self.windows)
        return self._controller

    def stats(self) -> dict[str, int]:
        return {"prefill_rows_skipped": self._controller.rows_skipped if self._controller is not None else 0}

    def entry_rows(self, pool: TokenSlotPool, req: Request, start: int, rows: int, may_start: bool) -> int:
        """A window's first token takes the slots of the whole window; positions past the
        prompt (a replay) take a fresh slot each."""
        prompt = len(req.prompt_ids)
        pos, end = start, start + rows
        while pos < min(end, prompt):
            w_start, w_end = self.windows.bounds(pos, prompt)
            if pos not in req.token_slots:  # the window's first token: take them all
                slots = pool.take(w_end - w_start) if may_start else None
                if slots is None:
                    return pos - start
                req.token_slots.update(zip(range(w_start, w_end), slots))
            pos = w_end
        tail = max(start, prompt)
        if end > tail:
            end = min(end, tail + pool.free_for(True))
        return end - start

    def single_loop(self, req: Request, start: int) -> bool:
        """A window with a sparse loop waits for all its tokens."""
        prompt = len(req.prompt_ids)
        if start >= prompt:
            return False
        w_start, w_end = self.windows.bounds(start, prompt)
        return any(self.windows.sparse(d, w_end - w_start) for d in range(len(self.windows.retention)))

    def shared_prefix(self, req: Request, tokens: int) -> int:
        """Whole windows only: a window's selection depends on every token of it, so a
        window cut short by the prompt's end, or one a later suffix completes, differs
        between the prompts. With `keep_last` the window ending the prompt is not shared
        either (its selection keeps the prompt's last token)."""
        prompt, window = len(req.prompt_ids), self.windows.window
        end = tokens - tokens % window
        if self.windows.keep_last and end == prompt:
            end -= window
        return max(end, 0)

    def release_frontiers(self, frontiers: list[int]) -> list[int]:
        """A sparse window copies the plane's exact values into the next plane for the tokens
        it leaves out, so a plane's tail is read until the next plane passed it too."""
        return [min(f, g) for f, g in zip(frontiers, frontiers[1:] + frontiers[-1:])]
