"""Exit-gate arithmetic on hand-computed cases."""

import pytest
import torch

from specloop.model.exit_gate import exit_distribution, exit_lambda, exit_loops, exit_step


def test_distribution_hand_computed():
    # lambdas 0.5, 0.5, 0.5 over R=4: p = 0.5, 0.25, 0.125, remaining 0.125.
    lambdas = torch.tensor([[0.5], [0.5], [0.5], [0.9]])
    p = exit_distribution(lambdas)[:, 0]
    assert p.tolist() == [0.5, 0.25, 0.125, 0.125]
    assert float(p.sum()) == 1.0


@pytest.mark.parametrize(
    "threshold, expected",
    [(0.5, 1), (0.6, 2), (0.75, 2), (0.8, 3), (0.875, 3), (0.9, 4), (1.0, 4), (0.0, 1)],
)
def test_exit_loops_thresholds(threshold, expected):
    # CDF after loops 1..3 = 0.5, 0.75, 0.875; the last loop takes the rest.
    lambdas = torch.tensor([[0.5], [0.5], [0.5], [0.5]])
    assert int(exit_loops(lambdas, threshold)[0]) == expected


def test_threshold_one_always_runs_every_loop_even_if_mass_rounds_away():
    # lambda = 1.0 at loop 1 puts all the mass there; q = 1.0 still runs every loop.
    lambdas = torch.tensor([[1.0], [0.2], [0.2], [0.2]])
    assert int(exit_loops(lambdas, 1.0)[0]) == 4
    assert int(exit_loops(lambdas, 0.999)[0]) == 1


def test_exit_step_matches_exit_loops():
    gen = torch.Generator().manual_seed(0)
    lambdas = torch.rand(4, 1000, generator=gen)
    for q in (0.3, 0.5, 0.7, 0.9, 1.0):
        survival = torch.ones(1000)
        exited = torch.zeros(1000, dtype=torch.bool)
        loops = torch.zeros(1000, dtype=torch.long)
        for t in range(1, 5):
            exits, survival = exit_step(survival, lambdas[t - 1], t, 4, q)
            loops = torch.where(exits & ~exited, t, loops)
            exited |= exits
        assert torch.equal(loops, exit_loops(lambdas, q))


def test_exit_lambda_is_fp32_sigmoid():
    h = torch.tensor([[1.0, -2.0]], dtype=torch.bfloat16)
    w = torch.tensor([[0.5, 0.25]], dtype=torch.bfloat16)
    b = torch.tensor([0.1], dtype=torch.bfloat16)
    lam = exit_lambda(h, w, b)
    assert lam.dtype == torch.float32
    expected = torch.sigmoid(torch.tensor(0.5 - 0.5 + float(torch.tensor(0.1, dtype=torch.bfloat16))))
    assert torch.allclose(lam, expected[None], atol=1e-7)
