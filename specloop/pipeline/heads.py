"""The speculation controllers' device half: drafting, verification and the draft buffers.

`SpeculationHeads` owns each request cell's draft buffer (the drafted candidates and, for
sampled requests, the distributions they were drawn from) and registers three device heads
with the runner:

- `Draft`: the head samples a candidate from the draft depth's state; it goes to the
  request cell (the next row embeds it) and to the draft buffer entry the head names;
- `Verify` (block rounds): the k+1 full-depth rows check candidates 0..k-1 of the buffer;
  the accepted ones and a correction or bonus token go to the host and the last of them to
  the request cell;
- `VerifyCandidate` (token pipelines): one full-depth row checks one buffer entry; the
  cell keeps the newest draft when it passes and takes the correction when it fails.

Which tokens pass is the `Verifier`'s call: `AcceptanceVerifier` applies the acceptance
rules (greedy prefix, lossless speculative sampling); benchmarks inject
`specloop.pipeline.replay.ReplayVerifier` instead. Nothing reads a device value back.
"""

from __future__ import annotations

from typing import Protocol

import torch

from specloop.pipeline.acceptance import greedy_verify, speculative_sample, verify_single
from specloop.runtime.forward_batch import ForwardBatch, HeadSegment
from specloop.runtime.heads import HeadContext, HostResults
from specloop.runtime.sampler import SamplingBatch, probabilities, sample
from specloop.plan import Draft, RowGroup, Verify, VerifyCandidate


class Verifier(Protocol):
    """Decides which candidates pass. `sampling` and `generator` are None for greedy requests."""

    def round(self, group: RowGroup, logits: torch.Tensor, candidates: torch.Tensor, draft_probs: torch.Tensor,
              sampling: SamplingBatch | None, generator: torch.Generator | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(count = accepted + 1, tokens [k+1]) for a round's k candidates."""
        ...

    def one(self, group: RowGroup, logits: torch.Tensor, candidate: torch.Tensor, draft_probs: torch.Tensor,
            sampling: SamplingBatch | None, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted 0/1, the emitted token) for one candidate."""
        ...


class AcceptanceVerifier:
    """The acceptance rules of `specloop.pipeline.acceptance`, greedy or sampled per request."""

    def round(self, group: RowGroup, logits: torch.Tensor, candidates: torch.Tensor, draft_probs: torch.Tensor,
              sampling: SamplingBatch | None, generator: torch.Generator | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        if sampling is None:
            return greedy_verify(logits, candidates)
        return speculative_sample(probabilities(logits, sampling), draft_probs, candidates, generator)

    def one(self, group: RowGroup, logits: torch.Tensor, candidate: torch.Tensor, draft_probs: torch.Tensor,
            sampling: SamplingBatch | None, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        if sampling is None:
            return verify_single(logits, candidate)
        target = probabilities(logits[None], sampling)[0]
        return verify_single(logits, candidate, target, draft_probs, generator)


class SpeculationHeads:
    def __init__(self, num_cells: int, width: int, vocab_size: int, dtype: torch.dtype, device: torch.device,
                 verifier: Verifier | None = None) -> None:
        self.draft_tokens = torch.zeros(num_cells, max(width, 1), dtype=torch.long, device=device)
        self.draft_probs = torch.zeros(num_cells, max(width, 1), vocab_size, device=device,
                                       dtype=torch.promote_types(dtype, torch.float32))
        self.verifier: Verifier = verifier or AcceptanceVerifier()

    def registry(self) -> dict[type, "SpeculationHeads"]:
        """The head types this object runs, for the runner's registry."""
        return {Draft: self, Verify: self, VerifyCandidate: self}

    def run(self, ctx: HeadContext, batch: ForwardBatch, segment: HeadSegment, hidden: torch.Tensor,
            results: HostResults | None) -> None:
        kind = type(segment.groups[0].head)
        if kind is Draft:
            self._draft(ctx, segment, hidden)
            return
        for i, group in enumerate(segment.groups):
            rows = group.head.num_candidates + 1 if kind is Verify else 1
            first = segment.first_row[i]
            logits = ctx.model.head(hidden[first: first + rows])
            sampling, gen = _target_sampling(ctx, segment, i, rows)
            if kind is Verify:
                self._verify_round(ctx, group, logits, sampling, gen, segment.result_rows[i], results)
            else:
                self._verify_one(ctx, group, logits, sampling, gen, segment.result_rows[i], results)

    def _draft(self, ctx: HeadContext, segment: HeadSegment, hidden: torch.Tensor) -> None:
        """Every draft of the plan in one head and one sampling call."""
        logits = ctx.model.head(hidden[segment.row])
        batch = ctx.sampling(segment, "draft")
        drafted = sample(logits, batch).token_ids
        ctx.next_token[segment.cell] = drafted
        self.draft_tokens[segment.cell, segment.aux] = drafted
        if not batch.all_greedy:
            self.draft_probs[segment.cell, segment.aux] = probabilities(logits, batch)

    def _verify_round(self, ctx: HeadContext, group: RowGroup, logits: torch.Tensor, sampling: SamplingBatch | None,
                      gen: torch.Generator | None, result: int, results: HostResults) -> None:
        k, cell = group.head.num_candidates, group.cell
        count, emitted = self.verifier.round(group, logits, self.draft_tokens[cell, :k], self.draft_probs[cell, :k],
                                             sampling, gen)
        ctx.next_token[cell: cell + 1] = emitted.gather(0, (count - 1).view(1))
        results.tokens[result, : k + 1] = emitted
        results.counts[result] = count
        results.accepted[result] = count - 1
        results.logprobs[result, : k + 1] = torch.log_softmax(logits, dim=-1).gather(1, emitted[:, None]).squeeze(1)

    def _verify_one(self, ctx: HeadContext, group: RowGroup, logits: torch.Tensor, sampling: SamplingBatch | None,
                    gen: torch.Generator | None, result: int, results: HostResults) -> None:
        cell, entry = group.cell, group.head.position
        ok, emitted = self.verifier.one(group, logits[0], self.draft_tokens[cell, entry],
                                        self.draft_probs[cell, entry], sampling, gen)
        # accepted: the cell keeps the newest draft; rejected: restart from the correction
        ctx.next_token[cell: cell + 1] = torch.where(ok.bool(), ctx.next_token[cell], emitted).view(1)
        emitted = emitted.view(1)
        results.tokens[result, :1] = emitted
        results.accepted[result] = ok
        results.logprobs[result, :1] = torch.log_softmax(logits, dim=-1).gather(1, emitted[:, None]).squeeze(1)


def _target_sampling(ctx: HeadContext, segment: HeadSegment, i: int, rows: int
                     ) -> tuple[SamplingBatch | None, torch.Generator | None]:
    """Head i's parameters on `rows` rows (the target distribution), from the batch's columns."""
    params = segment.groups[i].head.params
    if params.is_greedy:
        return None, None
    gen = ctx.generator(segment.groups[i], "verify")
    one = slice(i, i + 1)
    cols = [c[one].expand(rows) for c in (segment.temperature, segment.top_k, segment.top_p, segment.min_p,
                                          segment.greedy)]
    return SamplingBatch.of([params] * rows, [gen] * rows, *cols), gen
