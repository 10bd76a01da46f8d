"""CISPO and GSPO (`megalign.algos.policy_losses`) against hand-worked numbers, their analytic gradients and the
published sequence objective; masks, uneven lengths, the KL term, dtypes and bad arguments."""
import math

import pytest
import torch

from megalign.algos import POLICY_LOSSES, cispo_loss, gspo_loss, select_policy_loss
from megalign.algos.aggregation import aggregate_loss, loss_normalizer
from megalign.algos.policy_loss_options import positive_nll_weights
from megalign.ops.policy_loss import policy_loss

LN15, LN05 = math.log(1.5), math.log(0.5)


def _cispo_inputs():
    # row 0: three valid tokens with ratios 1.5, 0.5, 1.0; row 1: one valid token (ratio e^0.1) then a
    # masked token with absurd values that must change nothing
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, 50.0, 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.0 - LN15, -2.0 - LN05, -0.5], [-0.4, -50.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[2.0, -1.0, 0.5], [1.0, 1e6, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    return logp, old, adv, mask


def test_cispo_hand_worked_upper_clip_only():
    logp, old, adv, mask = _cispo_inputs()
    loss, stats = cispo_loss(logp, old, adv, mask, eps_low=None, eps_high=0.28)
    # weights w = clip(r, -, 1.28) = [1.28, 0.5, 1.0] and [e^0.1 = 1.105171]; loss = -w * A * log pi
    w1 = math.exp(0.1)
    expected = torch.tensor([[-1.28 * 2.0 * -1.0, -0.5 * -1.0 * -2.0, -1.0 * 0.5 * -0.5],
                             [-w1 * 1.0 * -0.3, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    # gradient: -w * A per valid token, no token dropped even where the weight was clipped
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.56, 0.5, -0.5], [-w1, 0.0, 0.0]], dtype=torch.float64))
    assert stats.count == 4
    assert stats.clip_frac.item() == pytest.approx(1 / 4)  # only the 1.5 ratio was clipped
    assert stats.approx_kl.item() == pytest.approx((-LN15 - LN05 + 0.0 - 0.1) / 4, rel=1e-6)
    assert stats.ratio_min.item() == pytest.approx(0.5) and stats.ratio_max.item() == pytest.approx(1.5)
    assert stats.dual_clip_frac.item() == 0 and stats.kl_mean.item() == 0


def test_cispo_lower_bound_and_kl_term():
    logp, old, adv, mask = _cispo_inputs()
    ref = logp.detach() + 0.5  # d = ref - logp = 0.5 on every token: k3 = e^0.5 - 1.5
    loss, stats = cispo_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, beta=0.1, ref_logp=ref)
    k3 = math.exp(0.5) - 1.5
    # the 0.5 ratio is now clipped up to 0.8: loss -0.8 * -1 * -2 = -1.6, gradient 0.8; k3's gradient is -(e^d - 1)
    assert loss[0, 1].item() == pytest.approx(-1.6 + 0.1 * k3, rel=1e-12)
    assert stats.clip_frac.item() == pytest.approx(2 / 4) and stats.kl_mean.item() == pytest.approx(k3, rel=1e-6)
    loss.sum().backward()
    assert logp.grad[0, 1].item() == pytest.approx(0.8 - 0.1 * (math.exp(0.5) - 1), rel=1e-12)
    assert logp.grad[1, 1].item() == 0 and loss[1, 1].item() == 0


def _gspo_inputs(adv_rows=(1.0, -2.0)):
    # token log-ratios row 0: [0.3, -0.1, 0.1] (mean 0.1, s_0 = e^0.1); row 1: [-0.2, 0.0] then a masked token
    # with log-ratio 7 (mean -0.1, s_1 = e^-0.1): uneven lengths 3 and 2
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.5, -3.0]], dtype=torch.float64, requires_grad=True)
    old = logp.detach() - torch.tensor([[0.3, -0.1, 0.1], [-0.2, 0.0, 7.0]], dtype=torch.float64)
    adv = torch.tensor([[adv_rows[0]] * 3, [adv_rows[1]] * 3], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    return logp, old, adv, mask


def test_gspo_hand_worked_unclipped():
    logp, old, adv, mask = _gspo_inputs()
    s0, s1 = math.exp(0.1), math.exp(-0.1)  # 1.105171, 0.904837: inside [0.8, 1.2]
    loss, stats = gspo_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    expected = torch.tensor([[-s0] * 3, [2 * s1, 2 * s1, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    loss.sum().backward()
    # GSPO-token: d loss_t / d log pi_t = -A_t * s_i (the sequence ratio, not the token's)
    torch.testing.assert_close(logp.grad, torch.tensor([[-s0] * 3, [2 * s1, 2 * s1, 0.0]], dtype=torch.float64))
    assert stats.count == 5 and stats.clip_frac.item() == 0
    assert stats.ratio_min.item() == pytest.approx(s1) and stats.ratio_max.item() == pytest.approx(s0)
    assert stats.approx_kl.item() == pytest.approx(-(0.3 - 0.1 + 0.1 - 0.2) / 5)


def test_gspo_clipping_is_per_sequence():
    # eps 0.05: s_0 = 1.105 > 1.05 with A > 0 -> the whole row is clipped (loss -1.05, no gradient);
    # s_1 = 0.905 < 0.95 with A = +2 > 0 -> min keeps the unclipped -A s_1, gradient -2 s_1
    logp, old, adv, mask = _gspo_inputs(adv_rows=(1.0, 2.0))
    loss, stats = gspo_loss(logp, old, adv, mask, eps_low=0.05, eps_high=0.05)
    s1 = math.exp(-0.1)
    torch.testing.assert_close(loss, torch.tensor([[-1.05] * 3, [-2 * s1, -2 * s1, 0.0]], dtype=torch.float64))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0] * 3, [-2 * s1, -2 * s1, 0.0]], dtype=torch.float64))
    assert stats.clip_frac.item() == pytest.approx(3 / 5)  # the three tokens of row 0


@pytest.mark.parametrize("eps", [(3e-4, 4e-4), (0.2, 0.2), (0.05, 0.05)])
def test_gspo_token_with_seq_mean_token_mean_is_the_sequence_objective(eps):
    # Zheng et al. 2025, eq. 5: J = 1/G sum_i min(s_i A_i, clip(s_i, 1 - eps_l, 1 + eps_h) A_i), s_i computed
    # with autograd straight from the definition; ours aggregated with seq-mean-token-mean must equal -J
    torch.manual_seed(0)
    B, T = 5, 7
    lengths = torch.tensor([7, 3, 1, 5, 6])
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    old = -torch.rand(B, T, dtype=torch.float64) * 3
    logp = (old + 0.02 * torch.randn(B, T, dtype=torch.float64)).requires_grad_()
    seq_adv = torch.randn(B, dtype=torch.float64)
    adv = seq_adv[:, None].expand(B, T)
    loss, _ = gspo_loss(logp, old, adv, mask, *eps)
    ours = aggregate_loss(loss, mask, "seq-mean-token-mean", loss_normalizer(mask, "seq-mean-token-mean"))
    (g_ours,) = torch.autograd.grad(ours, logp)

    lp = logp.detach().clone().requires_grad_()
    s = torch.exp(((lp - old) * mask).sum(-1) / lengths)
    objective = torch.minimum(s * seq_adv, s.clamp(1 - eps[0], 1 + eps[1]) * seq_adv).mean()
    (g_ref,) = torch.autograd.grad(-objective, lp)
    torch.testing.assert_close(ours, -objective, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-10, atol=1e-12)


def test_all_masked_rows_and_bf16():
    logp = torch.randn(3, 4, dtype=torch.bfloat16, requires_grad=True)
    old, adv = logp.detach() + 0.01, torch.ones(3, 4, dtype=torch.bfloat16)
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    # the formulas in fp32 on the bf16-rounded inputs (A = 1; old = logp + 0.01 rounded to bf16 is >= logp, so r <= 1):
    # CISPO -min(r, 1.28) logp; GSPO -min(s_i, clip(s_i)) with s_i the row's geometric-mean ratio
    lp, o, m = logp.detach().float(), old.float(), mask.float()
    r = torch.exp(lp - o)
    s_row = torch.exp(((lp - o) * m).sum(-1) / m.sum(-1).clamp(min=1))
    s = s_row[:, None].expand(3, 4)
    expected = {cispo_loss: (-r.clamp(max=1.28) * lp * m, r[mask]),
                gspo_loss: (-torch.minimum(s, s.clamp(1 - 3e-4, 1 + 4e-4)) * m, s_row[[0, 2]])}
    for fn, eps in ((cispo_loss, (None, 0.28)), (gspo_loss, (3e-4, 4e-4))):
        loss, stats = fn(logp, old, adv, mask, *eps)
        want_loss, ratios = expected[fn]
        assert loss.dtype == torch.float32
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-7)
        (g,) = torch.autograd.grad(loss.sum(), logp)
        assert g.dtype == torch.bfloat16 and (g[1] == 0).all() and (g[0, 2:] == 0).all()
        assert stats.count == 6 and stats.clip_frac == 0 and stats.dual_clip_frac == 0 and stats.kl_mean == 0
        torch.testing.assert_close(stats.approx_kl, (o - lp)[mask].mean(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close((stats.ratio_min, stats.ratio_max), (ratios.min(), ratios.max()), rtol=1e-6, atol=0)
    empty = torch.zeros(2, 3, requires_grad=True)
    for fn, eps in ((cispo_loss, (None, 0.28)), (gspo_loss, (3e-4, 4e-4))):
        loss, stats = fn(empty, empty.detach(), empty.detach(), torch.zeros(2, 3), *eps)
        assert stats.count == 0 and stats.ratio_min == 1 and stats.ratio_max == 1 and (loss == 0).all()


def test_registry_and_bad_arguments():
    assert set(POLICY_LOSSES) == {"ppo", "cispo", "gspo"}
    logp, old, adv, mask = _cispo_inputs()
    got, _ = select_policy_loss("ppo")(logp, old, adv, mask, 0.2, 0.28)
    want, _ = policy_loss(logp, old, adv, mask, 0.2, 0.28)
    assert torch.equal(got, want)  # "ppo" is the fused op itself
    with pytest.raises(ValueError, match="'sapo'"):
        select_policy_loss("sapo")
    with pytest.raises(ValueError, match="dual_clip"):
        cispo_loss(logp, old, adv, mask, None, 0.28, dual_clip=3.0)
    with pytest.raises(ValueError, match="ref_logp"):
        gspo_loss(logp, old, adv, mask, 3e-4, 4e-4, beta=0.1)
    with pytest.raises(ValueError, match="eps_high"):
        cispo_loss(logp, old, adv, mask, None, -1.0)
    with pytest.raises(TypeError, match="old_logp"):
        gspo_loss(logp, old.float(), adv, mask, 3e-4, 4e-4)


def test_positive_nll_weights_give_vapo_mean_over_positive_tokens_under_token_mean():
    # rows 0 and 2 are right (reward >= 1): 3 + 1 = 4 positive tokens of the 3 + 2 + 1 = 6 masked ones
    rewards = torch.tensor([1.0, 0.0, 1.5])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -4.0, 9.0], [-0.25, 7.0, 7.0]], dtype=torch.float64,
                        requires_grad=True)
    w = positive_nll_weights(rewards, mask, threshold=1.0, coef=0.1)
    torch.testing.assert_close(w, 0.1 * 6 / 4 * torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]],
                                                             dtype=torch.float64))
    term = aggregate_loss(-w * logp, mask, "token-mean", loss_normalizer(mask, "token-mean"), 3)
    # VAPO eq. 9: mu x the mean NLL over the positive tokens = 0.1 x (1 + 2 + 0.5 + 0.25) / 4
    assert term.item() == pytest.approx(0.1 * 3.75 / 4, rel=1e-12)
    term.backward()
    expected = -0.1 / 4 * torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected)
    assert not positive_nll_weights(torch.zeros(3), mask, threshold=1.0, coef=0.1).any()  # no right sample: no term
