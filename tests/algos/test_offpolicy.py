"""Off-policy correction (`megalign.algos.offpolicy`): each mode's weights, kept tokens and metrics on constructed
ratios (hand-worked), each mode's loss and gradient against a float64 reference written from the formulas (TIS, MIS,
sequence masking, AReaL's decoupled PPO; the KL term unweighted), mode none / weight 1 giving today's loss bit for
bit, and the config checks."""
import math

import pytest
import torch

from megalign.algos.offpolicy import (OffPolicyConfig, check_off_policy, off_policy_metrics, off_policy_weights,
                                      weighted_policy_loss)
from megalign.algos.policy_loss_options import PolicyLossOptions
from megalign.algos.policy_losses import POLICY_LOSSES

LN = math.log


def _ratios():
    """proximal, behaviour log-probs [2, 5] whose token ratios are w = [[0.5, 1, 1.5, 2.5, masked], [3, 1, masked x3]]
    (the masked tokens hold absurd differences that must change nothing)."""
    behaviour = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -1.0], [-0.7, -0.2, 0.0, -4.0, -1.0]])
    log_w = torch.tensor([[LN(0.5), 0.0, LN(1.5), LN(2.5), 40.0], [LN(3.0), 0.0, -60.0, 9.0, 5.0]])
    mask = torch.tensor([[1.0, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    return behaviour + log_w, behaviour, mask


def _weights(mode, **kw):
    proximal, behaviour, mask = _ratios()
    return off_policy_weights(proximal, behaviour, mask, OffPolicyConfig(mode=mode, **kw))


def _close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=1e-6, atol=1e-6)


def test_tis_truncates_at_the_cap():
    out = _weights("tis", cap=2.0)
    _close(out.weight, [[0.5, 1, 1.5, 2.0, 0], [2.0, 1, 0, 0, 0]])
    _close(out.mask, [[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])  # nothing leaves the loss
    metrics = off_policy_metrics(out.sums)
    assert metrics["offpolicy/weight_mean"] == pytest.approx((0.5 + 1 + 1.5 + 2.5 + 3 + 1) / 6, rel=1e-6)
    assert metrics["offpolicy/weight_max"] == pytest.approx(3.0, rel=1e-6)
    assert metrics["offpolicy/truncated_frac"] == pytest.approx(2 / 6)
    assert metrics["offpolicy/masked_frac"] == 0


def test_mis_masks_above_the_cap_out_of_the_denominator():
    out = _weights("mis", cap=2.0)
    _close(out.weight, [[0.5, 1, 1.5, 0, 0], [0, 1, 0, 0, 0]])  # the kept tokens keep their true ratio
    _close(out.mask, [[1, 1, 1, 0, 0], [0, 1, 0, 0, 0]])
    metrics = off_policy_metrics(out.sums)
    assert metrics["offpolicy/masked_frac"] == pytest.approx(2 / 6) and metrics["offpolicy/truncated_frac"] == 0
    assert metrics["offpolicy/weight_max"] == pytest.approx(3.0, rel=1e-6)  # before masking


def test_decoupled_zeroes_above_the_cap_but_keeps_the_denominator():
    out = _weights("decoupled", cap=2.0)
    _close(out.weight, [[0.5, 1, 1.5, 0, 0], [0, 1, 0, 0, 0]])
    _close(out.mask, [[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])  # AReaL: zeroed, still counted
    assert off_policy_metrics(out.sums)["offpolicy/masked_frac"] == pytest.approx(2 / 6)
    # a cap above every ratio leaves every true ratio in place
    _close(_weights("decoupled", cap=5.0).weight, [[0.5, 1, 1.5, 2.5, 0], [3.0, 1, 0, 0, 0]])


def test_seq_mask_geometric_and_product():
    behaviour = torch.zeros(4, 4)
    log_w = torch.tensor([[0.01, -0.01, 0.0, 0.0],      # geometric mean exp(0) = 1: kept
                          [0.002, 0.002, 9.0, 9.0],     # exp(0.002) = 1.002 > 1.001: dropped (masked tail ignored)
                          [-0.004, 0.0, 0.0, 0.0],      # exp(-0.001) = 0.9990005 >= 0.999: kept
                          [-0.03, 0.0, 0.0, 0.0]])      # exp(-0.0075) = 0.99253 < 0.999: dropped
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]])
    out = off_policy_weights(log_w, behaviour, mask, OffPolicyConfig(mode="seq_mask"))
    kept = torch.tensor([1.0, 0, 1, 0])[:, None] * mask
    _close(out.mask, kept.tolist())
    _close(out.weight, kept.tolist())  # weight 1 on the kept responses
    metrics = off_policy_metrics(out.sums)
    assert metrics["offpolicy/masked_frac"] == pytest.approx(6 / 12)
    s = [1.0, math.exp(0.002), math.exp(-0.001), math.exp(-0.0075)]
    assert metrics["offpolicy/weight_mean"] == pytest.approx(sum(s) / 4, rel=1e-6)  # over the responses
    assert metrics["offpolicy/weight_max"] == pytest.approx(max(s), rel=1e-6)
    # product: the sequence ratio exp(sum log w); row 2 sums to -0.004 (kept in [0.99, 1.01]), row 1 to 0.004 too
    product = off_policy_weights(log_w, behaviour, mask, OffPolicyConfig(mode="seq_mask", seq_ratio="product",
                                                                          band=[0.99, 1.01]))
    _close(product.mask, (torch.tensor([1.0, 1, 1, 0])[:, None] * mask).tolist())


def test_empty_response_and_extreme_ratios():
    mask = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    proximal = torch.tensor([[5.0, 5.0], [50.0, -50.0]])  # log-ratios clamp to +-20
    behaviour = torch.zeros(2, 2)
    out = off_policy_weights(proximal, behaviour, mask, OffPolicyConfig(mode="seq_mask", band=[0.5, 2.0]))
    _close(out.mask, [[0, 0], [1, 1]])  # geometric mean exp(0) of row 1 is kept; empty row 0 never dropped
    tis = off_policy_weights(proximal, behaviour, mask, OffPolicyConfig(mode="tis"))
    _close(tis.weight, [[0, 0], [2.0, math.exp(-20.0)]])
    assert off_policy_metrics(tis.sums)["offpolicy/weight_max"] == pytest.approx(math.exp(20.0), rel=1e-6)
    assert off_policy_metrics(off_policy_weights(proximal, behaviour, torch.zeros(2, 2),
                                                 OffPolicyConfig(mode="tis")).sums) == {}


# ----- losses and gradients against float64 formulas

def _batch(seed=0, rows=3, tokens=6):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(rows, tokens, generator=g, dtype=torch.float64) * 2 - 0.05
    old = logp + (torch.rand(rows, tokens, generator=g, dtype=torch.float64) - 0.5) * 0.8
    behaviour = old + (torch.rand(rows, tokens, generator=g, dtype=torch.float64) - 0.5) * 2.0  # ratios 0.37 .. 2.7
    adv = torch.randn(rows, tokens, generator=g, dtype=torch.float64)
    ref = logp + (torch.rand(rows, tokens, generator=g, dtype=torch.float64) - 0.5) * 0.3
    mask = torch.ones(rows, tokens, dtype=torch.float64)
    mask[1, 4:] = 0
    mask[2, 1] = 0
    return logp, old, behaviour, adv, ref, mask


def _reference_weight(mode, old, behaviour, mask, cap):
    w = torch.exp(old - behaviour)
    if mode == "tis":
        return torch.minimum(w, torch.tensor(cap, dtype=w.dtype)) * mask
    return torch.where(w <= cap, w, 0.0) * mask  # mis, decoupled


def _ppo_formula(lp, old, adv, eps):
    r = torch.exp(lp - old)
    return -torch.minimum(r * adv, r.clamp(1 - eps, 1 + eps) * adv)


def _cispo_formula(lp, old, adv, eps_high):
    return -torch.exp(lp - old).clamp(max=1 + eps_high).detach() * adv * lp


@pytest.mark.parametrize("mode", ["tis", "mis", "decoupled"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_token_modes_loss_and_gradient_match_the_formula(mode, dtype):
    logp, old, behaviour, adv, ref, mask = _batch()
    cap = 1.5
    out = off_policy_weights(old.to(dtype), behaviour.to(dtype), mask, OffPolicyConfig(mode=mode, cap=cap))
    lp = logp.to(dtype).requires_grad_()
    loss, stats = weighted_policy_loss(POLICY_LOSSES["ppo"], out.weight[:], lp, old.to(dtype), adv.to(dtype),
                                       out.mask, 0.2, 0.2, None)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    lp64 = logp.clone().requires_grad_()
    keep = mask * (torch.exp(old - behaviour) <= cap) if mode == "mis" else mask  # mis: out of the loss
    torch.testing.assert_close(out.mask, keep)
    expected = _reference_weight(mode, old, behaviour, mask, cap) * _ppo_formula(lp64, old, adv, 0.2) * keep
    (expected_grad,) = torch.autograd.grad(expected.sum(), lp64)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(loss.double(), expected.detach(), **tol)
    torch.testing.assert_close(grad.double(), expected_grad, **tol)
    assert stats.count == keep.sum()  # mis: the masked tokens are not trained tokens
    assert (loss.detach()[mask == 0] == 0).all()


def test_tis_on_cispo_and_the_kl_term_stays_unweighted():
    logp, old, behaviour, adv, ref, mask = _batch(seed=1)
    out = off_policy_weights(old, behaviour, mask, OffPolicyConfig(mode="tis", cap=1.2))
    lp = logp.clone().requires_grad_()
    beta = 0.3
    loss, stats = weighted_policy_loss(POLICY_LOSSES["cispo"], out.weight, lp, old, adv, mask, None, 0.28, None,
                                       beta, ref, "k3")
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    lp64 = logp.clone().requires_grad_()
    k3 = torch.exp(ref - lp64) - (ref - lp64) - 1
    w = _reference_weight("tis", old, behaviour, mask, 1.2)
    expected = (w * _cispo_formula(lp64, old, adv, 0.28) + beta * k3) * mask
    (expected_grad,) = torch.autograd.grad(expected.sum(), lp64)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)
    assert stats.kl_mean.item() == pytest.approx((k3 * mask).sum().item() / mask.sum().item(), rel=1e-6)
    # another estimator: k1 = lp - ref, its mean in kl_mean
    loss1, stats1 = weighted_policy_loss(POLICY_LOSSES["cispo"], out.weight, logp, old, adv, mask, None, 0.28, None,
                                         beta, ref, "k1")
    torch.testing.assert_close(loss1, (w * _cispo_formula(logp, old, adv, 0.28) + beta * (logp - ref)) * mask)
    assert stats1.kl_mean.item() == pytest.approx(((logp - ref) * mask).sum().item() / mask.sum().item(), rel=1e-6)


def test_seq_mask_on_gspo_drops_whole_responses():
    logp, old, _, adv, _, mask = _batch(seed=2)
    behaviour = old.clone()
    behaviour[0] -= 0.01  # response 0's geometric-mean ratio exp(0.01) leaves [0.999, 1.001]
    out = off_policy_weights(old, behaviour, mask, OffPolicyConfig(mode="seq_mask"))
    assert out.mask[0].sum() == 0 and torch.equal(out.mask[1:], mask[1:])
    lp = logp.clone().requires_grad_()
    loss, _ = weighted_policy_loss(POLICY_LOSSES["gspo"], out.weight, lp, old, adv, out.mask, 3e-4, 4e-4, None)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    # GSPO-token from the paper on the kept responses: s_i = exp(mean_t (lp - old)), value s_i, gradient s_i dlogp
    lp64 = logp.clone().requires_grad_()
    keep = out.mask
    log_s = ((lp64 - old) * keep).sum(-1) / keep.sum(-1).clamp(min=1)
    s = torch.exp(lp64 - lp64.detach() + log_s.detach()[:, None])
    expected = torch.maximum(-adv * s, -adv * s.clamp(1 - 3e-4, 1 + 4e-4)) * keep
    (expected_grad,) = torch.autograd.grad(expected.sum(), lp64)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)
    assert (grad[0] == 0).all()


@pytest.mark.parametrize("name", ["ppo", "cispo", "gspo"])
def test_weight_one_is_todays_loss_bit_for_bit(name):
    """Proximal == behaviour: every mode's weight is exactly 1 and nothing is dropped, and the weighted loss and its
    gradient are the uncorrected variant's (`actor_policy_loss` without a weight, mode none's path) bit for bit."""
    logp, old, _, adv, _, mask = _batch(seed=3)
    options = PolicyLossOptions(policy_loss=name)
    options.loss_agg = "seq-mean-token-mean"  # the UpdateSchedule field gspo checks
    options.check_policy_loss(token_rewards=False)
    lp32, old32, adv32 = logp.float(), old.float(), adv.float()
    for mode in ("tis", "mis", "seq_mask") + (("decoupled",) if name == "ppo" else ()):
        out = off_policy_weights(old32, old32, mask.float(), OffPolicyConfig(mode=mode))
        assert torch.equal(out.weight, mask.float()) and torch.equal(out.mask, mask.float())
        a = lp32.clone().requires_grad_()
        b = lp32.clone().requires_grad_()
        today, _ = options.actor_policy_loss(a, old32, adv32, mask.float())
        weighted, _ = options.actor_policy_loss(b, old32, adv32, out.mask, weight=out.weight)
        today.sum().backward()
        weighted.sum().backward()
        assert torch.equal(today, weighted) and torch.equal(a.grad, b.grad), mode


# ----- configuration

def test_config_checks_name_the_keys():
    check_off_policy(OffPolicyConfig(), "cispo", "rollout")  # none: nothing required
    check_off_policy(OffPolicyConfig(mode="tis"), "cispo", "recompute")
    with pytest.raises(ValueError, match="rollout.old_logprobs=recompute"):
        check_off_policy(OffPolicyConfig(mode="mis"), "ppo", "rollout")
    with pytest.raises(ValueError, match="algo.policy_loss=ppo"):
        check_off_policy(OffPolicyConfig(mode="decoupled"), "gspo", "recompute")
    for bad in (dict(cap=0.9), dict(cap=float("inf")), dict(band=[1.01, 2.0]), dict(band=[0.5]),
                dict(band=[0.0, 2.0]), dict(mode="icepop")):
        with pytest.raises(ValueError):
            OffPolicyConfig(**bad)
    with pytest.raises(ValueError, match="mode 'none'"):
        off_policy_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), OffPolicyConfig())
    with pytest.raises(ValueError, match="one \\[N, R\\] shape"):
        off_policy_weights(torch.zeros(1, 2), torch.zeros(1, 1), torch.ones(1, 2), OffPolicyConfig(mode="tis"))
    with pytest.raises(ValueError, match="weight"):
        weighted_policy_loss(POLICY_LOSSES["ppo"], torch.ones(2), torch.zeros(1, 2), torch.zeros(1, 2),
                             torch.zeros(1, 2), torch.ones(1, 2), 0.2, 0.2, None)
