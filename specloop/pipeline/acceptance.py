"""Verification of a speculation round on the device: which candidates to accept.

Both rules return (count, tokens): tokens [k+1] holds the accepted candidates c1..cn
followed by one more token at index n (the correction of the first rejected candidate,
or a bonus token when all k passed); count = n + 1 is how many of them are emitted.
Entries after index n are meaningless. Neither function reads a device value back.
"""

from __future__ import annotations

import torch


def greedy_verify(target_logits: torch.Tensor, candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept the longest prefix of candidates [k] that equals the target's argmax.

    target_logits [k+1, V]: row i is the full-depth prediction after candidate i (row 0:
    after t0), so row i checks candidate i+1 and row n gives the correction.
    """
    k = candidates.shape[0]
    predicted = target_logits.argmax(dim=-1)  # [k+1]
    matches = (predicted[:k] == candidates).long()
    accepted = matches.cumprod(dim=0).sum()  # n: longest matching prefix
    index = torch.arange(k + 1, device=candidates.device)
    padded = torch.cat([candidates, candidates.new_zeros(1)])
    tokens = torch.where(index < accepted, padded, predicted.gather(0, accepted[None]))
    return accepted + 1, tokens


def speculative_sample(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, candidates: torch.Tensor, generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling: the emitted tokens follow the target distribution.

    target_probs p [k+1, V], draft_probs q [k, V] (the distributions the candidates [k]
    were drawn from). Candidate i is accepted with probability min(1, p_i(c) / q_i(c)); the
    first rejection is replaced by a draw from norm(max(0, p_i - q_i)); when every
    candidate passes, a bonus token is drawn from p_k. Uses `generator` for every draw, a
    fixed number of draws per round, so a seeded request is reproducible.
    """
    k = candidates.shape[0]
    device = candidates.device
    u = torch.rand(k, generator=generator, device=device)
    p_c = target_probs[:k].gather(1, candidates[:, None]).squeeze(1)
    q_c = draft_probs.gather(1, candidates[:, None]).squeeze(1)
    passed = (u * q_c <= p_c).long()  # u < p/q without dividing; q_c > 0 for drawn tokens
    accepted = passed.cumprod(dim=0).sum()
    residual = torch.cat([(target_probs[:k] - draft_probs).clamp(min=0.0), target_probs[k:]])  # [k+1, V]
    row = residual.index_select(0, accepted[None])[0]
    mass = row.sum()
    fallback = target_probs.index_select(0, accepted[None])[0]  # p == q: no rejection mass
    dist = torch.where(mass > 0, row / mass.clamp(min=1e-30), fallback)
    noise = torch.rand(dist.shape[0], generator=generator, device=device).clamp_(min=torch.finfo(torch.float32).tiny)
    extra = (dist.log() - torch.log(-torch.log(noise))).argmax()
    index = torch.arange(k + 1, device=device)
    padded = torch.cat([candidates, candidates.new_zeros(1)])
    tokens = torch.where(index < accepted, padded, extra)
    return accepted + 1, tokens


def verify_single(
    target_logits: torch.Tensor, candidate: torch.Tensor, target_probs: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None, generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check one candidate (a token pipeline's oldest live token verifies the next).

    target_logits [V] is the full-depth prediction for the candidate's position. Greedy
    (no `target_probs`): accept when the argmax equals the candidate. Sampled: accept with
    probability min(1, p(c)/q(c)), else draw from norm(max(0, p - q)). Returns
    (accepted 0/1, token): the candidate when accepted, else the correction.
    """
    if target_probs is None:
        predicted = target_logits.argmax()
        accepted = (predicted == candidate).long()
        return accepted, torch.where(accepted.bool(), candidate, predicted)
    p, q = target_probs, draft_probs
    u = torch.rand((), generator=generator, device=p.device)
    at = candidate.view(1)  # gather, not p[candidate]: a tensor index would read it back to the host
    accepted = (u * q.gather(0, at)[0] <= p.gather(0, at)[0]).long()
    residual = (p - q).clamp(min=0.0)
    mass = residual.sum()
    dist = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p)
    noise = torch.rand(dist.shape[0], generator=generator, device=p.device).clamp_(min=torch.finfo(torch.float32).tiny)
    correction = (dist.log() - torch.log(-torch.log(noise))).argmax()
    return accepted, torch.where(accepted.bool(), candidate, correction)
