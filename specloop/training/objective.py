"""The training objective: next-token loss at every loop's exit, plus the exit gate's.

    loss = sum_t w_t * CE_t                       (language modelling, w averages to 1)
         + sum_t p_t * stopgrad(CE_t) - beta * H(p)   (exit gate)

CE_t is the mean next-token cross-entropy of loop t's logits. Putting a loss at every
loop makes loops 1-3 useful drafts of loop 4 (self-speculation needs that). The gate term
is Ouro's expected loss under the exit distribution p_t = lambda_t * prod_{j<t}(1 - lambda_j)
(the last loop takes the rest) with an entropy bonus, computed per token; the per-token
CE is detached there so the gate learns *where* each token may exit without re-weighting
the language-modelling loss (which the first term already sets). Its minimiser per token
is p_t proportional to exp(-CE_t / beta): tokens whose shallow loops are already as good
as the deep ones get their exit mass early.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.nn import functional as F


@dataclasses.dataclass
class LossParts:
    total: torch.Tensor
    loop_ce: torch.Tensor  # [R] mean CE per loop (detached)
    gate: torch.Tensor  # gate objective (detached)
    exit_entropy: torch.Tensor  # mean entropy of the exit distribution (detached)
    mean_exit: torch.Tensor  # expected exit loop (1-based) under p (detached)


def exit_log_probs(gate_logits: torch.Tensor) -> torch.Tensor:
    """log p_t [R, ...] from pre-sigmoid gate values [R, ...], stable in fp32."""
    z = gate_logits.float()
    log_lam = F.logsigmoid(z)
    log_stay = F.logsigmoid(-z)
    survive = torch.cumsum(log_stay, dim=0) - log_stay  # sum_{j<t} log(1 - lambda_j)
    log_p = log_lam + survive
    return torch.cat([log_p[:-1], survive[-1:]], dim=0)  # the last loop takes the remaining mass


def per_token_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits [..., V], targets [...] -> CE per token [...] in fp32."""
    flat = logits.reshape(-1, logits.shape[-1]).float()
    return F.cross_entropy(flat, targets.reshape(-1), reduction="none").view(targets.shape)


def looped_loss(
    ce: torch.Tensor, gate_logits: torch.Tensor, beta: float, loop_weights: torch.Tensor | None = None,
) -> LossParts:
    """ce: [R, ...] per-token CE at each loop; gate_logits: [R, ...] matching."""
    num_loops = ce.shape[0]
    if loop_weights is None:
        loop_weights = torch.full((num_loops,), 1.0 / num_loops, device=ce.device)
    flat_ce = ce.reshape(num_loops, -1)
    loop_ce = flat_ce.mean(dim=1)
    lm = (loop_weights.to(ce.device) * loop_ce).sum()
    log_p = exit_log_probs(gate_logits.reshape(num_loops, -1))
    p = log_p.exp()
    expected = (p * flat_ce.detach()).sum(0).mean()
    entropy = -(p * log_p).sum(0).mean()
    gate = expected - beta * entropy
    depth = torch.arange(1, num_loops + 1, device=ce.device, dtype=p.dtype)[:, None]
    return LossParts(
        total=lm + gate,
        loop_ce=loop_ce.detach(),
        gate=gate.detach(),
        exit_entropy=entropy.detach(),
        mean_exit=(p * depth).sum(0).mean().detach(),
    )
