"""REINFORCE++ and REINFORCE++-baseline (`megalign.algos.advantages`) against hand-worked numbers, the registry, and
dp=2 whitening equal to the single-rank whitening of the concatenated batch."""
import math

import pytest
import torch
import torch.distributed as dist
from parallel.dist_utils import run_distributed

from megalign.algos import ADVANTAGE_ESTIMATORS, discounted_returns, estimator, reinforce_plus_plus
from megalign.algos.grpo import response_advantages

# One group of two responses of uneven lengths (3 and 2 tokens, R = 3); scores 1 and 0; the k1 KL
# log pi_old - log pi_ref per token is [0.1, 0.2, -0.1] and [0.3, 0.0] (the masked third token of row 1
# has a KL of 5 that must be ignored).
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
REF = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.5, -3.0]])
LOGP = REF + torch.tensor([[0.1, 0.2, -0.1], [0.3, 0.0, 5.0]])
SCORES = torch.tensor([1.0, 0.0])


def _valid(x):
    return x[MASK != 0]


def test_discounted_returns_hand_worked():
    # per-token rewards with kl_coef 0.5: [-0.05, -0.1, -(-0.05) + 1] and [-0.15, 0 + 0]
    rewards = torch.tensor([[-0.05, -0.1, 1.05], [-0.15, 0.0, 9.0]])  # 9 sits on a masked token: dropped
    torch.testing.assert_close(_valid(discounted_returns(rewards, MASK, 1.0)), torch.tensor([0.9, 0.95, 1.05, -0.15, 0.0]))
    # gamma 0.5: 1.05; -0.1 + 0.5 * 1.05 = 0.425; -0.05 + 0.5 * 0.425 = 0.1625
    torch.testing.assert_close(_valid(discounted_returns(rewards, MASK, 0.5)),
                               torch.tensor([0.1625, 0.425, 1.05, -0.15, 0.0]))


def test_reinforce_plus_plus_hand_worked():
    adv = reinforce_plus_plus(SCORES, MASK, 2, logp=LOGP, ref_logp=REF, kl_coef=0.5, kl_estimator="k1", gamma=1.0)
    # returns [0.9, 0.95, 1.05, -0.15, 0.0]: mean 2.75 / 5 = 0.55, deviations [0.35, 0.4, 0.5, -0.7, -0.55],
    # squares sum 1.325, unbiased variance 1.325 / 4 (verl's masked_whiten), eps 1e-8 under the root
    std = math.sqrt(1.325 / 4 + 1e-8)
    torch.testing.assert_close(_valid(adv), torch.tensor([0.35, 0.4, 0.5, -0.7, -0.55]) / std)
    assert adv[1, 2] == 0
    # the baseline variant of one group shifts every return of the group by the same -0.5: same whitened values
    base = ADVANTAGE_ESTIMATORS["reinforce_plus_plus_baseline"].fn(
        SCORES, MASK, 2, eps=1e-6, logp=LOGP, ref_logp=REF, kl_coef=0.5, kl_estimator="k1", gamma=1.0)
    torch.testing.assert_close(base, adv)


def test_reinforce_plus_plus_baseline_hand_worked():
    # two groups of two: scores [1, 0 | 3, 3] -> minus the group means [0.5, -0.5 | 0, 0]; no KL; row 3 has one
    # token. Returns (gamma 1) equal the shifted score on every valid token: [.5, .5, -.5, -.5, 0, 0, 0], mean 0,
    # squares 1, unbiased variance 1/6.
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    scores = torch.tensor([1.0, 0.0, 3.0, 3.0])
    adv = estimator("reinforce_plus_plus_baseline").fn(scores, mask, 2, eps=1e-6, kl_coef=0.01)
    std = math.sqrt(1 / 6 + 1e-8)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5], [-0.5, -0.5], [0.0, 0.0], [0.0, 0.0]]) / std)
    # without the baseline: returns [1, 1, 0, 0, 3, 3, 3], mean 11/7, whitened over the whole batch
    plain = estimator("reinforce_plus_plus").fn(scores, mask, 2, eps=1e-6, kl_coef=0.01)
    values = torch.tensor([1.0, 1, 0, 0, 3, 3, 3])
    dev = values - 11 / 7
    torch.testing.assert_close(plain[mask != 0], dev / math.sqrt((dev ** 2).sum() / 6 + 1e-8))


def test_registry_holds_the_group_modes_and_names_bad_values():
    assert list(ADVANTAGE_ESTIMATORS) == ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0])
    mask = torch.ones(4, 3)
    for mode in ("grpo", "dr_grpo", "rloo"):
        assert not ADVANTAGE_ESTIMATORS[mode].token_kl
        got = ADVANTAGE_ESTIMATORS[mode].fn(rewards, mask, 2, eps=1e-6, logp=LOGP, ref_logp=REF, kl_coef=1.0)
        torch.testing.assert_close(got, response_advantages(rewards, mask, 2, mode, 1e-6))
    assert ADVANTAGE_ESTIMATORS["reinforce_plus_plus"].token_kl
    with pytest.raises(ValueError, match="'reinforce'"):
        estimator("reinforce")
    with pytest.raises(ValueError, match="kind"):
        reinforce_plus_plus(SCORES, MASK, 2, logp=LOGP, ref_logp=REF, kl_estimator="k2")


def _dp_batch():
    torch.manual_seed(0)
    n, r = 8, 6
    lengths = torch.tensor([6, 2, 4, 1, 5, 6, 3, 2])
    mask = (torch.arange(r)[None] < lengths[:, None]).float()
    ref = -torch.rand(n, r) * 2
    return torch.rand(n), mask, ref + 0.3 * torch.randn(n, r), ref


def _check_dp_whitening(name):
    rank = dist.get_rank()
    scores, mask, logp, ref = _dp_batch()
    kw = dict(eps=1e-6, logp=logp, ref_logp=ref, kl_coef=0.1, kl_estimator="k1", gamma=0.9)
    whole = ADVANTAGE_ESTIMATORS[name].fn(scores, mask, 2, **kw)
    rows = slice(0, 2) if rank == 0 else slice(2, 8)  # uneven split: one group here, three there
    part = ADVANTAGE_ESTIMATORS[name].fn(scores[rows], mask[rows], 2, **dict(kw, logp=logp[rows], ref_logp=ref[rows]),
                                         group=dist.group.WORLD)
    torch.testing.assert_close(part, whole[rows], rtol=1e-6, atol=1e-6)
    # and it is not what this rank alone would give
    alone = ADVANTAGE_ESTIMATORS[name].fn(scores[rows], mask[rows], 2, **dict(kw, logp=logp[rows], ref_logp=ref[rows]))
    assert not torch.allclose(alone, whole[rows], atol=1e-3)


def _dp_both():
    for name in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        _check_dp_whitening(name)


def test_dp2_whitening_equals_single_rank():
    run_distributed(_dp_both)
