"""The GRPO objective pieces against hand-worked numbers, one case per aggregation mode."""
import pytest
import torch
import torch.distributed as dist
from parallel.dist_utils import run_distributed

from megalign.algos import (aggregate_loss, informative_groups, loss_normalizer, overlong_mask, overlong_penalty,
                            response_advantages)
from megalign.ops.policy_loss import policy_loss

# Two responses of 3 and 1 valid tokens, and one fully masked response (e.g. cut as overlong).
LOSS = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
EXPECTED = {
    "token-mean": (1 + 2 + 3 + 4) / 4,                 # 4 valid tokens
    "seq-mean-token-mean": (6 / 3 + 4 / 1) / 2,        # 2 responses with a valid token
    "seq-mean-token-sum-norm": (6 / 4 + 4 / 4) / 2,    # token sums over the constant 4, 2 responses
}


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_aggregation_hand_worked(mode):
    value = aggregate_loss(LOSS, MASK, mode, loss_normalizer(MASK, mode), max_response_length=4)
    assert value.item() == pytest.approx(EXPECTED[mode], abs=1e-6)


def test_aggregation_all_masked_is_zero():
    mask = torch.zeros(2, 3)
    for mode in EXPECTED:
        assert aggregate_loss(torch.zeros(2, 3), mask, mode, loss_normalizer(mask, mode), 3).item() == 0.0


def test_aggregation_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown loss aggregation 'sum'"):
        loss_normalizer(MASK, "sum")
    with pytest.raises(ValueError, match="max_response_length"):
        aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", torch.tensor(2.0))


def _split_over_dp():
    # rank 0 holds response 0, rank 1 responses 1 and 2: the sum of the shares is the global value
    rows = [slice(0, 1), slice(1, 3)][dist.get_rank()]
    for mode, expected in EXPECTED.items():
        share = aggregate_loss(LOSS[rows], MASK[rows], mode, loss_normalizer(MASK[rows], mode, dist.group.WORLD), 4)
        dist.all_reduce(share)
        assert share.item() == pytest.approx(expected, abs=1e-6), mode


def test_aggregation_global_count_over_dp():
    run_distributed(_split_over_dp)


# Rewards [1, 0, 0, 0] in one group: mean 0.25, unbiased std 0.5 -> advantages [1.5, -0.5, -0.5, -0.5]
# (up to eps = 1e-6 in the std). Responses hold 2, 1, 3 and 1 tokens. With logp == old_logp every
# ratio is 1, nothing is clipped and the per-token loss is -A.
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0])
RESPONSE_MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]])
OBJECTIVE = {
    "token-mean": -(1.5 * 2 - 0.5 * 1 - 0.5 * 3 - 0.5 * 1) / 7,
    "seq-mean-token-mean": -(1.5 - 0.5 - 0.5 - 0.5) / 4,
    "seq-mean-token-sum-norm": -(1.5 * 2 / 3 - 0.5 / 3 - 0.5 * 3 / 3 - 0.5 / 3) / 4,
}


@pytest.mark.parametrize("mode", sorted(OBJECTIVE))
def test_grpo_objective_hand_worked(mode):
    adv = response_advantages(REWARDS, RESPONSE_MASK, group_size=4, mode="grpo")
    assert torch.allclose(adv[:, 0], torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-5)
    logp = torch.full((4, 3), -1.0, requires_grad=True)
    loss, stats = policy_loss(logp, logp.detach(), adv, RESPONSE_MASK)
    value = aggregate_loss(loss, RESPONSE_MASK, mode, loss_normalizer(RESPONSE_MASK, mode), max_response_length=3)
    assert value.item() == pytest.approx(OBJECTIVE[mode], abs=1e-5)
    assert stats.clip_frac.item() == 0.0
    value.backward()
    # d value / d logp = -A * weight: 1/7 per token (token-mean), 1/(4 n_i) (seq-mean), 1/(4*3) (sum-norm)
    n = RESPONSE_MASK.sum(-1, keepdim=True).float()
    weight = {"token-mean": torch.full_like(n, 1 / 7), "seq-mean-token-mean": 1 / (4 * n),
              "seq-mean-token-sum-norm": torch.full_like(n, 1 / 12)}[mode]
    assert torch.allclose(logp.grad, -adv * weight * RESPONSE_MASK, atol=1e-6)


def test_advantage_modes_hand_worked():
    mask = torch.ones(4, 2)
    assert torch.allclose(response_advantages(REWARDS, mask, 4, "dr_grpo")[:, 1], torch.tensor([0.75, -0.25, -0.25, -0.25]))
    # leave-one-out: 1 - 0 and 0 - 1/3
    assert torch.allclose(response_advantages(REWARDS, mask, 4, "rloo")[:, 1], torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))
    assert response_advantages(REWARDS, torch.zeros(4, 2), 4).abs().sum() == 0


def test_informative_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.5, 0.5, 0.0, 0.0, 0.0])
    assert informative_groups(rewards, 3).tolist() == [True, True, False]
    with pytest.raises(ValueError, match="group_size=2"):
        informative_groups(rewards, 2)


def test_overlong():
    mask = torch.ones(2, 3)
    assert overlong_mask(mask, torch.tensor([True, False])).tolist() == [[1, 1, 1], [0, 0, 0]]
    # limit 10, buffer 4: no penalty up to 6, then -1/4 per token, -1 at the limit
    got = overlong_penalty(torch.tensor([3, 6, 7, 8, 10]), max_length=10, buffer=4)
    assert got.tolist() == [0.0, 0.0, -0.25, -0.5, -1.0]
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(torch.tensor([1]), max_length=4, buffer=5)
