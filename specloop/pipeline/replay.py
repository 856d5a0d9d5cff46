"""Forced verification outcomes, for benchmarks only.

Random weights accept no drafts, so speculation timed at a real model shape on random
weights would only measure rejections. `AcceptanceReplay` makes every verification
accept the next count from a trace recorded on a trained model, so the timing follows
that model's acceptance pattern. Tokens produced under replay are meaningless and every
number measured with it must be labelled as replayed. Never used in serving.
"""

from __future__ import annotations


class AcceptanceReplay:
    def __init__(self, trace: list[int]) -> None:
        if not trace:
            raise ValueError("an acceptance trace needs at least one round")
        self.trace = list(trace)
        self._next = 0

    def next_accepted(self, num_drafts: int) -> int:
        """The next recorded accepted count, cycling through the trace, capped at num_drafts."""
        value = self.trace[self._next % len(self.trace)]
        self._next += 1
        return min(value, num_drafts)
