"""Routing by load: each new request goes to the live replica with the least outstanding work.

Outstanding work is counted in the server process, at routing time, not read from the
replicas' published statistics: those lag by a step, so a burst of requests arriving
between two steps would all see the same numbers and land on one replica. A request
counts from the moment it is routed until its final output (or its replica's death):
first by requests, which bounds queueing, then by tokens still to go through the model
(its prompt, plus `max_tokens` minus what it generated), then by the lowest index, so
ties spread in a fixed order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass
class Load:
    """One replica's outstanding work as the router sees it."""

    alive: bool = True
    requests: int = 0
    tokens: int = 0

    def take(self, tokens: int) -> None:
        self.requests += 1
        self.tokens += tokens

    def progress(self, tokens: int) -> None:
        """A request generated `tokens` more."""
        self.tokens -= tokens

    def release(self, tokens_left: int) -> None:
        """A request ended with `tokens_left` of its counted work not done."""
        self.requests -= 1
        self.tokens -= tokens_left


def least_loaded(loads: Sequence[Load]) -> int | None:
    """The index of the live replica with the least outstanding work; None when none lives."""
    live = [(load.requests, load.tokens, index) for index, load in enumerate(loads) if load.alive]
    return min(live)[2] if live else None
