"""Speculation counters: drafts, draft tokens, accepted tokens, per-position acceptance."""

from __future__ import annotations

import collections

from specloop.scheduling.request import Request

TRACE_ROUNDS = 100_000  # recent rounds' accepted counts kept for benchmarks (replay traces)


class SpeculationMetrics:
    def __init__(self, max_drafts: int) -> None:
        self.num_drafts = 0  # rounds
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * max_drafts  # rounds whose candidate i (0-based) was accepted
        self.drafted_per_position = [0] * max_drafts  # rounds that drafted a candidate i
        self.accepted_trace: collections.deque[int] = collections.deque(maxlen=TRACE_ROUNDS)

    def record_round(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        for m in (self, req):
            m.num_drafts += 1
            m.num_draft_tokens += num_drafts
            m.num_accepted_tokens += num_accepted
        self.accepted_trace.append(num_accepted)
        for i in range(num_drafts):
            self.drafted_per_position[i] += 1
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per round: accepted candidates plus the correction or bonus."""
        return (self.num_accepted_tokens + self.num_drafts) / self.num_drafts if self.num_drafts else 0.0
