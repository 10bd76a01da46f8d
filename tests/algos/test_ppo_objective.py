"""PPO's pure pieces against hand-worked numbers and the published formulas (OpenRLHF's `compute_reward`,
the notes' / DeepSpeed-Chat's GAE loop, verl's `masked_whiten` and `compute_value_loss`, Ziegler et al.'s
controller), forward and gradients; whitening on dp=2 equals dp=1."""
import math

import pytest
import torch
from parallel.dist_utils import run_distributed

from megalign.algos.ppo import (AdaptiveKL, advantages_and_returns, last_token_rewards, normalize_scores,
                                sequence_mean_kl, token_rewards, value_loss, whiten)


def test_last_token_rewards_by_hand():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 0, 1, 0]])
    got = last_token_rewards(torch.tensor([1.5, -0.5, 7.0, 2.0]), mask)
    expected = torch.tensor([[0, 0, 1.5, 0], [-0.5, 0, 0, 0], [0, 0, 0, 0], [0, 0, 2.0, 0]])
    assert torch.equal(got, expected)  # an all-masked row gets no reward; a hole does not move the last token


def test_normalize_scores_by_hand():
    scores = torch.tensor([3.0, -1.0, 41.0])
    # (s - 1) / 2 = [1, -1, 20], clipped at 10
    assert torch.equal(normalize_scores(scores, mean=1.0, std=2.0, clip=10.0), torch.tensor([1.0, -1.0, 10.0]))
    assert torch.equal(normalize_scores(scores, clip=2.0), torch.tensor([2.0, -1.0, 2.0]))
    with pytest.raises(ValueError, match="both mean and std"):
        normalize_scores(scores, mean=1.0)
    with pytest.raises(ValueError, match="std must be > 0"):
        normalize_scores(scores, mean=1.0, std=0.0)


def _openrlhf_compute_reward(r, kl_coef, kl, action_mask):
    """OpenRLHF `models/utils.py::compute_reward` (tensor branch), its kl already masked."""
    kl_reward = -kl_coef * kl
    eos_indices = action_mask.size(1) - 1 - action_mask.long().fliplr().argmax(dim=1, keepdim=True)
    last_reward = torch.zeros_like(kl).scatter_(dim=1, index=eos_indices, src=r.unsqueeze(1).to(kl.dtype))
    return last_reward + kl_reward


def test_token_rewards_by_hand_and_against_openrlhf():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    logp = torch.tensor([[-1.0, -2.0, -0.5, -9.0], [-0.1, -0.3, -9.0, -9.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5, -1.0], [-0.2, -0.1, -1.0, -1.0]])
    scores = torch.tensor([1.5, -0.5])
    rewards, kl = token_rewards(scores, mask, logp, ref, beta=0.1, kind="k1")
    # k1 = logp - ref on valid tokens: [0.5, -1, 0], [0.1, -0.2]
    torch.testing.assert_close(kl, torch.tensor([[0.5, -1.0, 0.0, 0.0], [0.1, -0.2, 0.0, 0.0]]))
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.1, 1.5, 0.0], [-0.01, -0.5 + 0.02, 0.0, 0.0]]))
    torch.testing.assert_close(rewards, _openrlhf_compute_reward(scores, 0.1, kl, mask))
    _, kl_abs = token_rewards(scores, mask, logp, ref, beta=0.1, kind="abs")
    torch.testing.assert_close(kl_abs, kl.abs())
    _, kl3 = token_rewards(scores, mask, logp, ref, beta=0.1, kind="k3")
    d = (ref - logp) * mask
    torch.testing.assert_close(kl3, (torch.exp(d) - d - 1) * mask)
    plain, zero = token_rewards(scores, mask)
    assert torch.equal(zero, torch.zeros(2, 4)) and torch.equal(plain, last_token_rewards(scores, mask))
    with pytest.raises(ValueError, match="kind must be one of"):
        token_rewards(scores, mask, logp, ref, 0.1, kind="k2")


def _notes_compute_gae(rewards, values, mask, gamma=1.0, lam=0.95):
    """The background notes' Step 2 (DeepSpeed-Chat's `get_advantages_and_returns`, all tokens valid)."""
    advantages = torch.zeros_like(rewards)
    gae = torch.zeros(rewards.size(0), dtype=rewards.dtype)
    for t in reversed(range(rewards.size(1))):
        next_v = values[:, t + 1] if t + 1 < rewards.size(1) else torch.zeros_like(values[:, 0])
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        gae = delta + gamma * lam * gae
        advantages[:, t] = gae
    return advantages * mask, advantages * mask + values


def test_gae_by_hand_and_the_notes_example():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.2, 0.1]])
    adv, ret = advantages_and_returns(rewards, values, torch.ones(1, 3))  # gamma 1, lam 0.95
    # A2 = 1 - 0.1 = 0.9; A1 = (0.1 - 0.2) + 0.95 * 0.9 = 0.755; A0 = (0.2 - 0.5) + 0.95 * 0.755 = 0.41725
    torch.testing.assert_close(adv, torch.tensor([[0.41725, 0.755, 0.9]]))
    torch.testing.assert_close(ret, torch.tensor([[0.91725, 0.955, 1.0]]))
    # the notes' Step 1 tensors (seed 42, B=2, T=8, score only at the last token)
    torch.manual_seed(42)
    old = torch.randn(2, 8) * 0.1
    _ = old + torch.randn(2, 8) * 0.1
    mask = torch.ones(2, 8)
    values = torch.randn(2, 8) * 0.5
    rewards = torch.zeros(2, 8)
    rewards[:, -1] = torch.tensor([1.5, -0.5])
    adv, ret = advantages_and_returns(rewards, values, mask)
    ref_adv, ref_ret = _notes_compute_gae(rewards.double(), values.double(), mask.double())
    torch.testing.assert_close(adv.double(), ref_adv, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ret.double(), ref_ret, rtol=1e-6, atol=1e-6)
    # the last column: A = r - V (no bootstrap past the end)
    torch.testing.assert_close(adv[:, -1], rewards[:, -1] - values[:, -1])


def _verl_masked_whiten(values, mask, shift_mean=True):
    """verl `utils/torch_functional.py::masked_whiten` (masked_mean / masked_var(unbiased=True))."""
    mean = (values * mask).sum() / mask.sum()
    centered = values - mean
    variance = (centered ** 2 * mask).sum() / mask.sum()
    variance = variance * mask.sum() / (mask.sum() - 1)
    whitened = (values - mean) * torch.rsqrt(variance + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


def test_whiten_by_hand_and_against_verl():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    # mean 2.5, unbiased var (2.25 + 0.25 + 0.25 + 2.25) / 3 = 5/3
    s = math.sqrt(5 / 3 + 1e-8)
    torch.testing.assert_close(whiten(x, torch.ones(2, 2)), torch.tensor([[-1.5 / s, -0.5 / s], [0.5 / s, 1.5 / s]]))
    torch.manual_seed(0)
    values = torch.randn(5, 7) * 3 + 1
    mask = (torch.rand(5, 7) > 0.3).float()
    for shift in (True, False):
        torch.testing.assert_close(whiten(values, mask, shift_mean=shift),
                                   _verl_masked_whiten(values.double(), mask.double(), shift).float() * mask)
    assert torch.equal(whiten(values, torch.zeros(5, 7)), torch.zeros(5, 7))  # nothing valid: zeros, no NaN


def _whiten_two_ranks(values, mask, expected):
    import torch.distributed as dist
    rank = dist.get_rank()
    rows = slice(0, 2) if rank == 0 else slice(2, 5)  # unequal parts
    got = whiten(values[rows], mask[rows], dist.group.WORLD)
    torch.testing.assert_close(got, expected[rows], rtol=1e-6, atol=1e-6)
    kl = sequence_mean_kl(values[rows], mask[rows], dist.group.WORLD)
    torch.testing.assert_close(kl, sequence_mean_kl(values, mask), rtol=1e-12, atol=1e-12)


def test_whiten_over_two_ranks_equals_one():
    torch.manual_seed(3)
    values = torch.randn(5, 6) * 2 - 1
    mask = (torch.rand(5, 6) > 0.4).float()
    mask[3] = 0  # a response with no valid token
    run_distributed(_whiten_two_ranks, values, mask, whiten(values, mask))


def _verl_compute_value_loss(vpreds, returns, values, response_mask, cliprange_value):
    """verl `core_algos.compute_value_loss` with loss_agg_mode token-mean."""
    vpredclipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    clipped_vf_losses = torch.max(vf_losses1, vf_losses2)
    vf_loss = 0.5 * (clipped_vf_losses * response_mask).sum() / response_mask.sum()
    vf_clipfrac = (torch.gt(vf_losses2, vf_losses1).float() * response_mask).sum() / response_mask.sum()
    return vf_loss, vf_clipfrac


def test_value_loss_by_hand():
    v = torch.tensor([[1.0, 0.0, 1.1, 5.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 1.0, 0.0]])
    ret = torch.tensor([[2.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, stats = value_loss(v, old, ret, mask, cliprange_value=0.2)
    # token 0: (1-2)^2 = 1 vs V_clip 0.7: 1.69 -> 0.845 (clipped branch); token 1: 0 vs V_clip 0.3: 0.09 -> 0.045;
    # token 2: V - V_old = 0.1 inside the range: 1.21 both -> 0.605 (not clipped); token 3 masked
    torch.testing.assert_close(loss, torch.tensor([[0.845, 0.045, 0.605, 0.0]]))
    assert stats.clipped.item() == 2 and stats.count.item() == 3
    loss.sum().backward()
    # the clipped branch is flat in V (V_clip is clamped), the unclipped one has gradient V - R
    torch.testing.assert_close(v.grad, torch.tensor([[0.0, 0.0, 1.1, 0.0]]))
    plain, _ = value_loss(v.detach(), old, ret, mask, cliprange_value=None)
    torch.testing.assert_close(plain, torch.tensor([[0.5, 0.0, 0.605, 0.0]]))


def test_value_loss_against_verl_with_gradients():
    torch.manual_seed(1)
    v = torch.randn(4, 9, dtype=torch.float64)
    old = v + torch.randn(4, 9, dtype=torch.float64) * 0.3
    ret = torch.randn(4, 9, dtype=torch.float64)
    mask = (torch.rand(4, 9) > 0.2).double()
    mine = v.clone().requires_grad_()
    loss, stats = value_loss(mine, old, ret, mask, 0.2)
    (loss.sum() / mask.sum()).backward()
    theirs = v.clone().requires_grad_()
    ref_loss, ref_clipfrac = _verl_compute_value_loss(theirs, ret, old, mask, 0.2)
    ref_loss.backward()
    torch.testing.assert_close(loss.sum().double() / mask.sum(), ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stats.clipped.double() / stats.count, ref_clipfrac)
    torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-6, atol=1e-6)


def test_adaptive_kl_trajectory():
    ctl = AdaptiveKL(0.1, target=6.0, horizon=10000)
    # KL 12 -> e = +0.2 (clipped from 1); 3 -> -0.2 (from -0.5); 6.6 -> +0.1; 0 -> -0.2; n = 256
    betas = [ctl.update(kl, 256) for kl in (12.0, 3.0, 6.6, 0.0)]
    expected, beta = [], 0.1
    for e in (0.2, -0.2, 0.1, -0.2):
        beta = beta * (1 + e * 256 / 10000)
        expected.append(beta)
    assert betas == pytest.approx(expected, rel=1e-12)
    assert betas[0] == pytest.approx(0.100512, rel=1e-12)
    assert ctl.state == {"beta": betas[-1]}
    fixed = AdaptiveKL(0.05)
    assert [fixed.update(kl, 256) for kl in (12.0, 0.0)] == [0.05, 0.05]
    with pytest.raises(ValueError, match="target must be > 0"):
        AdaptiveKL(0.1, target=0.0)


def test_sequence_mean_kl_by_hand():
    kl = torch.tensor([[1.0, 3.0, 9.0], [4.0, 0.0, 0.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    # per response 2 and 4; the empty one is left out
    assert sequence_mean_kl(kl, mask).item() == pytest.approx(3.0)
