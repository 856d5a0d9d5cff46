"""Q-exit arithmetic of the Ouro exit gate, in fp32.

After loop t (1-based) the gate gives lambda_t = sigmoid(gate(h_t)). The exit distribution
is p_t = lambda_t * prod_{j<t}(1 - lambda_j) for t < R, and the last loop takes the
remaining mass. A token exits at the first loop whose cumulative probability
CDF_t = 1 - prod_{j<=t}(1 - lambda_j) reaches the threshold q. specloop accumulates in
fp32 (the official code uses the model dtype, which can round the remaining mass away)
and treats q >= 1.0 as "always run every loop".
"""

from __future__ import annotations

import torch


def exit_lambda(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """lambda = sigmoid(w . h + b) in fp32; hidden [N, H] -> [N]."""
    logit = torch.nn.functional.linear(hidden.float(), weight.float(), bias.float())
    return torch.sigmoid(logit.squeeze(-1))


def exit_step(
    survival: torch.Tensor, lam: torch.Tensor, loop: int | torch.Tensor, num_loops: int, threshold: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One loop of Q-exit for a set of tokens; no host sync.

    survival: prod_{j<t}(1 - lambda_j) per token (1.0 before loop 1), fp32 [N].
    lam: lambda_t per token, fp32 [N]. loop: t, 1-based, one for all tokens or [N].
    Returns (exits [N] bool, survival after this loop [N]).
    """
    new_survival = survival * (1.0 - lam)
    last = torch.as_tensor(loop, device=lam.device) >= num_loops
    if threshold >= 1.0:
        return last.expand(lam.shape).clone(), new_survival
    return last | (1.0 - new_survival >= threshold), new_survival


def exit_distribution(lambdas: torch.Tensor) -> torch.Tensor:
    """p_t for every loop from lambdas [R, N] (fp32); the last loop takes the rest."""
    num_loops = lambdas.shape[0]
    survival = torch.ones_like(lambdas[0])
    probs = []
    for t in range(num_loops):
        if t == num_loops - 1:
            probs.append(survival)
        else:
            probs.append(lambdas[t] * survival)
            survival = survival * (1.0 - lambdas[t])
    return torch.stack(probs)


def exit_loops(lambdas: torch.Tensor, threshold: float) -> torch.Tensor:
    """1-based exit loop per token from lambdas [R, N] under threshold q."""
    num_loops = lambdas.shape[0]
    if threshold >= 1.0:
        return torch.full(lambdas.shape[1:], num_loops, dtype=torch.long)
    # Same formula as exit_step (1 - running survival), so both agree bit for bit.
    cdf = 1.0 - torch.cumprod(1.0 - lambdas, dim=0)
    reached = cdf >= threshold
    reached[-1] = True
    return reached.float().argmax(dim=0) + 1
