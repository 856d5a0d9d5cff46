"""Forced verification outcomes, for benchmarks only: a `Verifier` injected into the
speculation heads in place of the acceptance rules.

Random weights accept no drafts, so speculation timed at a real model shape on random
weights would only measure rejections. `ReplayVerifier` makes every verification accept
the next count from a trace recorded on a trained model, so the timing follows that
model's acceptance pattern. Tokens produced under replay are meaningless and every
number measured with it must be labelled as replayed. Never used in serving.
"""

from __future__ import annotations

import torch

from specloop.runtime.sampler import SamplingBatch
from specloop.plan import RowGroup


class ReplayVerifier:
    def __init__(self, trace: list[int]) -> None:
        if not trace:
            raise ValueError("an acceptance trace needs at least one round")
        self.trace = list(trace)
        self._next = 0

    def rewind(self) -> None:
        self._next = 0

    def next_accepted(self, num_drafts: int) -> int:
        """The next recorded accepted count, cycling through the trace, capped at num_drafts."""
        value = self.trace[self._next % len(self.trace)]
        self._next += 1
        return min(value, num_drafts)

    def round(self, group: RowGroup, logits: torch.Tensor, candidates: torch.Tensor, draft_probs: torch.Tensor,
              sampling: SamplingBatch | None, generator: torch.Generator | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        k = candidates.shape[0]
        n = self.next_accepted(k)  # a host value: no sync
        forced = torch.cat([candidates[:n], logits[n].argmax().view(1), candidates.new_zeros(k - n)])
        return torch.full((), n + 1, dtype=torch.long, device=logits.device), forced

    def one(self, group: RowGroup, logits: torch.Tensor, candidate: torch.Tensor, draft_probs: torch.Tensor,
            sampling: SamplingBatch | None, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        ok = self.next_accepted(1)
        token = candidate if ok else logits.argmax()
        return torch.full((), ok, dtype=torch.long, device=logits.device), token
