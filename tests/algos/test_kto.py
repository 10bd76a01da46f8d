"""KTO against hand-worked numbers and TRL's KTOTrainer.kto_loss written out here; z0 over 2 gloo ranks."""
import math
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from parallel.dist_utils import run_distributed

from megalign.algos import check_kto_weight_ratio, kto_loss, kto_reference_point, kto_weight_ratio


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def trl_kto_loss(policy_chosen_logps, policy_rejected_logps, policy_KL_logps, reference_chosen_logps,
                 reference_rejected_logps, reference_KL_logps, beta, desirable_weight, undesirable_weight):
    """TRL KTOTrainer.kto_loss on one process (gather_for_metrics(kl).mean() is kl itself)."""
    kl = (policy_KL_logps - reference_KL_logps).mean().detach()
    kl = kl.clamp(min=0)
    chosen_logratios = policy_chosen_logps - reference_chosen_logps
    chosen_losses = 1 - F.sigmoid(beta * (chosen_logratios - kl))
    chosen_rewards = beta * chosen_logratios.detach()
    rejected_logratios = policy_rejected_logps - reference_rejected_logps
    rejected_losses = 1 - F.sigmoid(beta * (kl - rejected_logratios))
    rejected_rewards = beta * rejected_logratios.detach()
    losses = torch.cat((desirable_weight * chosen_losses, undesirable_weight * rejected_losses), 0)
    return losses, chosen_rewards, rejected_rewards, kl


def test_kto_hand_worked():
    # desirable: r = -10 + 12 = 2; undesirable: r = -8 + 9 = 1; z0 = mean(0.2, 0.8) = 0.5; beta 0.1
    logp = torch.tensor([-10.0, -8.0], requires_grad=True)
    ref = torch.tensor([-12.0, -9.0])
    kl = torch.tensor([0.2, 0.8], requires_grad=True)
    losses, stats = kto_loss(logp, ref, torch.tensor([True, False]), kl, beta=0.1, undesirable_weight=1.5)
    assert losses.tolist() == pytest.approx([1 - sigmoid(0.15), 1.5 * (1 - sigmoid(-0.05))], rel=1e-6)
    assert stats.kl.item() == pytest.approx(0.5) and stats.rewards.tolist() == pytest.approx([0.2, 0.1])
    (g,) = torch.autograd.grad(losses.sum(), [logp])
    # d/dr w (1 - sigma(+-beta (r - z0))) = -+ w beta sigma (1 - sigma)
    expected = [-0.1 * sigmoid(0.15) * (1 - sigmoid(0.15)), 1.5 * 0.1 * sigmoid(-0.05) * (1 - sigmoid(-0.05))]
    assert g.tolist() == pytest.approx(expected, rel=1e-5)
    assert not stats.kl.requires_grad  # z0 is detached: no gradient reaches the mismatched pairs
    m = stats.metrics()
    assert (m["rewards/chosen"].total.item(), m["rewards/chosen"].count.item()) == (pytest.approx(0.2), 1.0)
    assert (m["logps/rejected"].total.item(), m["logps/rejected"].count.item()) == (-8.0, 1.0)
    assert m["kl"].total.item() == pytest.approx(0.5) and m["kl"].count.item() == 1.0


@pytest.mark.parametrize("batch", [1, 7])
def test_kto_matches_trl(batch):
    g = torch.Generator().manual_seed(batch)
    logp = -torch.rand(batch, generator=g) * 40
    ref = logp + torch.randn(batch, generator=g) * 3
    desirable = torch.rand(batch, generator=g) < 0.6
    kl_policy, kl_ref = -torch.rand(5, generator=g) * 40, -torch.rand(5, generator=g) * 40
    ours = logp.clone().requires_grad_()
    losses, stats = kto_loss(ours, ref, desirable, kl_policy - kl_ref, beta=0.3, desirable_weight=1.2,
                             undesirable_weight=0.8)
    theirs = logp.clone().requires_grad_()
    d, u = desirable, ~desirable
    expected, chosen_rewards, rejected_rewards, kl = trl_kto_loss(theirs[d], theirs[u], kl_policy, ref[d], ref[u],
                                                                  kl_ref, 0.3, 1.2, 0.8)
    torch.testing.assert_close(torch.cat([losses[d], losses[u]]), expected)
    torch.testing.assert_close(stats.kl, kl)
    torch.testing.assert_close(stats.rewards[d], chosen_rewards)
    torch.testing.assert_close(stats.rewards[u], rejected_rewards)
    (got,) = torch.autograd.grad(losses.sum(), [ours])
    (want,) = torch.autograd.grad(expected.sum(), [theirs])
    torch.testing.assert_close(got, want)


def test_kto_reference_point_clamped_and_empty():
    assert kto_reference_point(torch.tensor([-1.0, 0.4])).item() == 0.0  # mean -0.3 clamped at 0
    assert kto_reference_point(torch.tensor([])).item() == 0.0
    with pytest.raises(ValueError, match="kl_logratios must be a 1-d tensor"):
        kto_reference_point(torch.zeros(2, 2))


def test_kto_gradcheck_float64_and_half_inputs():
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(5, generator=g, dtype=torch.float64) * 20).requires_grad_()
    ref = (-torch.rand(5, generator=g, dtype=torch.float64) * 20).requires_grad_()
    desirable = torch.tensor([True, False, True, True, False])
    kl = torch.randn(4, generator=g, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: kto_loss(a, b, desirable, kl, beta=0.5)[0], [logp, ref])
    for dtype in (torch.bfloat16, torch.float16):
        losses, stats = kto_loss(logp.to(dtype), ref.to(dtype), desirable, kl.to(dtype))
        want, _ = kto_loss(logp.to(dtype).float(), ref.to(dtype).float(), desirable, kl.to(dtype).float())
        assert losses.dtype == stats.kl.dtype == torch.float32
        torch.testing.assert_close(losses, want, rtol=1e-6, atol=1e-7)


def test_kto_extreme_log_probs_stay_finite():
    logp = torch.tensor([-1e5, -1.0, -3e4], requires_grad=True)
    losses, _ = kto_loss(logp, torch.tensor([-1.0, -1e5, -3e4]), torch.tensor([True, False, False]),
                         torch.tensor([1e4, -2e4]))
    (g,) = torch.autograd.grad(losses.sum(), [logp])
    assert torch.isfinite(losses).all() and torch.isfinite(g).all()
    # r = -1e5 (desirable) and +1e5 (undesirable) saturate at loss 1; z0 = max(0, -5e3) = 0 and r = 0 give 1/2
    assert losses.tolist() == pytest.approx([1.0, 1.0, 0.5], abs=1e-6)

def test_kto_argument_errors():
    x, kl = torch.zeros(3), torch.zeros(2)
    d = torch.tensor([True, False, True])
    for call, message in [
        (lambda: kto_loss(x, x, d, kl, beta=0.0), "beta"),
        (lambda: kto_loss(x, x, d, kl, desirable_weight=-1.0), "desirable_weight"),
        (lambda: kto_loss(x, x, d, kl, undesirable_weight=0.0), "undesirable_weight"),
        (lambda: kto_loss(x, x, d.float(), kl), "desirable must be a bool tensor"),
        (lambda: kto_loss(x, x, d[:2], kl), "desirable must have the shape of policy_logps"),
        (lambda: kto_loss(x, torch.zeros(4), d, kl), "ref_logps must have the shape"),
        (lambda: kto_weight_ratio(0, 0), "not both 0"),
        (lambda: kto_weight_ratio(-1, 3), "must be >= 0"),
        (lambda: kto_weight_ratio(1, 3, undesirable_weight=0.0), "undesirable_weight"),
    ]:
        with pytest.raises(ValueError, match=message):
            call()


def test_kto_weight_ratio_and_warning():
    assert kto_weight_ratio(300, 100, 1.0, 3.0) == 1.0
    assert kto_weight_ratio(10, 0) == float("inf")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_kto_weight_ratio(100, 100) == 1.0
        assert check_kto_weight_ratio(100, 80) == 1.25
        assert check_kto_weight_ratio(4, 3) == pytest.approx(4 / 3)
    for args, ratio in [((50, 100), 0.5), ((100, 50), 2.0), ((1, 9, 4.0, 1.0), 4 / 9), ((5, 0), float("inf"))]:
        with pytest.warns(UserWarning, match=r"outside \[1.0, 1.333\]"):
            assert check_kto_weight_ratio(*args) == pytest.approx(ratio)


def _reference_point_over_dp():
    rank, world = dist.get_rank(), dist.group.WORLD
    # rank 0 holds 2 mismatched pairs, rank 1 holds 3: the mean is over all 5 (2.5 / 5 = 0.5);
    # TRL / OpenRLHF's mean of the per-rank means would be (0.2 + 0.7) / 2 = 0.45
    kl = [torch.tensor([0.1, 0.3]), torch.tensor([0.5, 0.7, 0.9])][rank].requires_grad_()
    z0 = kto_reference_point(kl, world)
    assert z0.item() == pytest.approx(0.5) and not z0.requires_grad
    logp = torch.tensor([-3.0], requires_grad=True)
    losses, stats = kto_loss(logp, torch.tensor([-5.0]), torch.tensor([True]), kl, beta=0.1, group=world)
    assert losses.item() == pytest.approx(1 - 1 / (1 + math.exp(-0.1 * (2.0 - 0.5))), rel=1e-6)
    assert stats.kl.item() == pytest.approx(0.5)
    losses.sum().backward()
    assert kl.grad is None and logp.grad is not None
    # a negative global mean is clamped at 0 on every rank: (-1.0 + 0.2 + 0.4) / 3 < 0
    assert kto_reference_point([torch.tensor([-1.0]), torch.tensor([0.2, 0.4])][rank], world).item() == 0.0
    # a rank without mismatched pairs takes the others' mean
    assert kto_reference_point([torch.tensor([]), torch.tensor([0.6, 1.0])][rank], world).item() == pytest.approx(0.8)


def test_kto_reference_point_over_two_ranks():
    run_distributed(_reference_point_over_dp)
