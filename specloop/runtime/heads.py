"""Device heads: what runs after the loop for each head type of a plan.

The runner holds a registry {head type: device head} and calls each registered head with
its segment of the forward batch (`HeadSegment`: device columns of the heads of that type
and their groups); it knows no speculation mode. `SampleHead` (plain samples) lives here;
the speculation heads (drafts, verifications and their draft buffers) are registered by
`specloop.pipeline.heads`. Heads write their host-bound tokens into `HostResults` rows and
never read a device value back.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from specloop.model.ouro import OuroModel
from specloop.runtime.forward_batch import ForwardBatch, HeadSegment
from specloop.runtime.sampler import SamplingBatch, draw_generator, sample
from specloop.plan import RowGroup, Verify, VerifyCandidate


@dataclasses.dataclass
class HeadContext:
    """What every head may use: the model's head, the request cells' next tokens, keyed draws."""

    model: OuroModel
    next_token: torch.Tensor  # [cells] long: each request cell's next token
    engine_seed: int

    @property
    def device(self) -> torch.device:
        return self.next_token.device

    def generator(self, group: RowGroup, purpose: str) -> torch.Generator:
        """The generator of one draw, keyed by the request, a position and the purpose, so
        discarded speculative calls cannot shift the draws that count. Samples and drafts
        key by the sampled row; verifications by their first row (a round's base, which
        only grows, so no two verifications of a request share a key)."""
        verify = isinstance(group.head, (Verify, VerifyCandidate))
        position = group.start if verify else group.end - 1
        return draw_generator(group.head.params.seed, self.engine_seed, group.arrival, position, purpose, self.device)

    def sampling(self, segment: HeadSegment, purpose: str) -> SamplingBatch:
        """The segment's sampling parameters, one row per head."""
        params = [g.head.params for g in segment.groups]
        gens = [self.generator(g, purpose) for g in segment.groups]
        return SamplingBatch.of(params, gens, segment.temperature, segment.top_k, segment.top_p, segment.min_p,
                                segment.greedy)


@dataclasses.dataclass
class HostResults:
    """Row i: host result i of the plan: up to `width` emitted tokens, their logprobs, how many
    (`counts`) and how many candidates were accepted."""

    tokens: torch.Tensor  # [S, W] long
    logprobs: torch.Tensor  # [S, W] fp32 (fp64 for fp64 models)
    counts: torch.Tensor  # [S] long
    accepted: torch.Tensor  # [S] long

    @classmethod
    def zeros(cls, num: int, width: int, dtype: torch.dtype, device: torch.device) -> "HostResults":
        return cls(torch.zeros(num, width, dtype=torch.long, device=device),
                   torch.zeros(num, width, dtype=torch.promote_types(dtype, torch.float32), device=device),
                   torch.ones(num, dtype=torch.long, device=device),
                   torch.zeros(num, dtype=torch.long, device=device))


class DeviceHead(Protocol):
    def run(self, ctx: HeadContext, batch: ForwardBatch, segment: HeadSegment, hidden: torch.Tensor,
            results: HostResults) -> None: ...


class SampleHead:
    """Plain samples: one head call and one sampling call for every sample of the plan; the
    token goes to the request cell and to the host."""

    def run(self, ctx: HeadContext, batch: ForwardBatch, segment: HeadSegment, hidden: torch.Tensor,
            results: HostResults) -> None:
        logits = ctx.model.head(hidden[segment.row])
        chosen = sample(logits, ctx.sampling(segment, "sample")).token_ids
        ctx.next_token[segment.cell] = chosen
        results.tokens[segment.result, 0] = chosen
        results.logprobs[segment.result, 0] = torch.log_softmax(logits, dim=-1).gather(1, chosen[:, None]).squeeze(1)
