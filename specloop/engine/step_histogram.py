"""Tokens per engine step as a cumulative histogram (the server exposes it as vLLM's
`vllm:iteration_tokens_total`). Plain Python: the core observes one integer per plan."""

from __future__ import annotations

import bisect


def step_token_bounds(limit: int) -> tuple[int, ...]:
    """Bucket bounds 1, 8, 16, 32, ... up to `limit` (a plan's token budget), which closes them."""
    bounds, bound = [1], 8
    while bound < limit:
        bounds.append(bound)
        bound *= 2
    if limit > 1:
        bounds.append(limit)
    return tuple(bounds)


class StepHistogram:
    """Counts of observed values per bucket `(previous bound, bound]`, the last bucket unbounded."""

    def __init__(self, bounds: tuple[int, ...]) -> None:
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self.total = 0  # sum of the observed values

    def observe(self, value: int) -> None:
        self._counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> tuple[tuple[float, int], ...]:
        """(upper bound, observations <= it) per bucket, ending with (inf, all of them)."""
        out, seen = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self._counts):
            seen += count
            out.append((float(bound), seen))
        return tuple(out)
