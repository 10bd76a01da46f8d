"""The critic's diagnostics (`megalign.algos.ppo.critic_diagnostic_sums` / `critic_diagnostics`) against values
worked by hand on a fixed batch: explained variance 1 - Var(r - v) / Var(r), value error, advantages' mean / std."""
import math

import pytest
import torch

from megalign.algos.ppo import critic_diagnostic_sums, critic_diagnostics

# Two responses, 3 and 2 valid tokens; the masked entries hold 99 so that any leak shows.
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
RETURNS = torch.tensor([[1.0, 1.0, 1.0, 99.0], [0.0, 0.0, 99.0, 99.0]])
VALUES = torch.tensor([[0.5, 0.5, 1.0, 99.0], [0.0, 0.5, 99.0, 99.0]])
ADVANTAGES = torch.tensor([[1.0, -1.0, 2.0, 99.0], [0.0, 3.0, 99.0, 99.0]])


def totals(values=VALUES, returns=RETURNS, advantages=ADVANTAGES, mask=MASK):
    return {k: float(v) for k, v in critic_diagnostic_sums(values, returns, advantages, mask).items()}


def test_hand_worked_batch():
    # r = [1, 1, 1, 0, 0]: mean 0.6, Var 0.6 - 0.36 = 0.24.  e = r - v = [0.5, 0.5, 0, 0, -0.5]: mean 0.1,
    # mean e^2 = 0.75 / 5 = 0.15, Var 0.15 - 0.01 = 0.14.  EV = 1 - 0.14 / 0.24 = 5 / 12.
    # |e| mean 1.5 / 5 = 0.3.  A = [1, -1, 2, 0, 3]: mean 1, unbiased var (0 + 4 + 1 + 1 + 4) / 4 = 2.5.
    metrics = critic_diagnostics(totals())
    assert metrics["critic/vf_explained_var"] == pytest.approx(5 / 12)
    assert metrics["critic/vf_mse"] == pytest.approx(0.15)
    assert metrics["critic/vf_mae"] == pytest.approx(0.3)
    assert metrics["critic/advantages/mean"] == pytest.approx(1.0)
    assert metrics["critic/advantages/std"] == pytest.approx(math.sqrt(2.5))


def test_sums_over_ranks_give_the_whole_batch():
    # dp: each rank adds its rows' sums and MetricSums all-reduces them; two halves added = the hand values above
    halves = [totals(VALUES[i:i + 1], RETURNS[i:i + 1], ADVANTAGES[i:i + 1], MASK[i:i + 1]) for i in range(2)]
    metrics = critic_diagnostics({k: halves[0][k] + halves[1][k] for k in halves[0]})
    assert metrics["critic/vf_explained_var"] == pytest.approx(5 / 12)
    assert metrics["critic/advantages/std"] == pytest.approx(math.sqrt(2.5))


def test_perfect_critic_and_mean_critic():
    assert critic_diagnostics(totals(values=RETURNS))["critic/vf_explained_var"] == pytest.approx(1.0)
    assert critic_diagnostics(totals(values=RETURNS))["critic/vf_mse"] == 0.0
    # a constant value at the mean return (0.6) explains nothing: Var(r - 0.6) = Var(r)
    mean_critic = torch.full_like(VALUES, 0.6)
    assert critic_diagnostics(totals(values=mean_critic))["critic/vf_explained_var"] == pytest.approx(0.0, abs=1e-12)
    # a critic anticorrelated with the returns does worse than the mean: v = 1 - r gives e = 2r - 1, Var 4 * 0.24
    assert critic_diagnostics(totals(values=1 - RETURNS))["critic/vf_explained_var"] == pytest.approx(-3.0)


def test_degenerate_batches():
    empty = critic_diagnostics(totals(mask=torch.zeros_like(MASK)))
    assert all(v == 0.0 for v in empty.values())
    constant = critic_diagnostics(totals(returns=torch.ones_like(RETURNS)))
    assert constant["critic/vf_explained_var"] == 0.0


def test_shape_mismatch_names_the_argument():
    with pytest.raises(ValueError, match="advantages"):
        critic_diagnostic_sums(VALUES, RETURNS, ADVANTAGES[:, :3], MASK)
