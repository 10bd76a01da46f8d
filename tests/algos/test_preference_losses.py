"""Pairwise preference losses (RM, DPO family, SimPO, CPO, ORPO) against hand-worked numbers and
against TRL's formulas, written out here from TRL's trainers (DPOTrainer.dpo_loss, RewardTrainer.
compute_loss, CPOTrainer.cpo_loss, ORPOTrainer.odds_ratio_loss) on fixed random inputs.

TRL reduces with a mean over the batch; our losses are per pair [B], so the comparisons take our
mean (or compare per pair where TRL's losses are per pair too). TRL's NLL terms are one token mean
over the batch's chosen tokens; ours is the per-pair token mean, the same when the chosen lengths
are equal, which the NLL comparisons use.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from megalign.algos import DPO_LOSSES, cpo_loss, dpo_loss, orpo_loss, reward_model_loss, simpo_loss


def softplus(x: float) -> float:  # -log sigma(-x) = log(1 + e^x)
    return math.log1p(math.exp(x))


def make_pairs(batch: int, seed: int = 0, dtype=torch.float32, lengths_equal: bool = False):
    """Summed log-probs of policy/reference chosen/rejected and token counts, like real responses;
    lengths_equal: every response of the batch has the same token count (where TRL's NLL agrees)."""
    g = torch.Generator().manual_seed(seed)
    nw = torch.randint(1, 20, (batch,), generator=g)
    nl = torch.randint(1, 20, (batch,), generator=g)
    if lengths_equal:
        nw = nl = torch.full((batch,), 6)
    per_token = [-(torch.rand(batch, generator=g, dtype=torch.float64) * 3 + 0.05) for _ in range(4)]
    pw, rw = per_token[0] * nw, per_token[2] * nw
    pl, rl = per_token[1] * nl, per_token[3] * nl
    return [t.to(dtype) for t in (pw, pl, rw, rl)], nw, nl


def leaves(tensors, dtype=None):
    return [t.detach().clone().to(dtype or t.dtype).requires_grad_() for t in tensors]


def grads(loss, inputs):
    return torch.autograd.grad(loss, inputs)


# --- TRL's formulas, written out --------------------------------------------------------------------

def trl_dpo_loss(pw, pl, rw, rl, beta, label_smoothing, loss_type):
    """TRL DPOTrainer.dpo_loss; for "ipo" the inputs are already divided by the token counts
    (TRL's concatenated_forward averages all log-probs when loss_type == "ipo")."""
    logits = (pw - pl) - (rw - rl)
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    elif loss_type == "robust":
        losses = (-F.logsigmoid(beta * logits) * (1 - label_smoothing)
                  + F.logsigmoid(-beta * logits) * label_smoothing) / (1 - 2 * label_smoothing)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * logits)
    elif loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    chosen_rewards = beta * (pw - rw).detach()
    rejected_rewards = beta * (pl - rl).detach()
    return losses, chosen_rewards, rejected_rewards


def trl_reward_loss(rc, rr, margin, center_rewards_coefficient):
    """TRL RewardTrainer.compute_loss."""
    loss = -F.logsigmoid(rc - rr - margin).mean()
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * torch.mean((rc + rr) ** 2)
    return loss


def trl_cpo_loss(pw, pl, beta, loss_type, simpo_gamma=0.5):
    """TRL CPOTrainer.cpo_loss, "sigmoid" (summed log-probs) and "simpo" (averaged log-probs)."""
    logits = pw - pl
    if loss_type == "simpo":
        gamma_logratios = simpo_gamma / beta
        logits = logits - gamma_logratios
    return -F.logsigmoid(beta * logits)


def trl_odds_ratio_loss(pw, pl, beta):
    """TRL ORPOTrainer.odds_ratio_loss on averaged log-probs: the term subtracted from the NLL."""
    log_odds = (pw - pl) - (torch.log1p(-torch.exp(pw)) - torch.log1p(-torch.exp(pl)))
    ratio = F.logsigmoid(log_odds)
    return beta * ratio, log_odds


def token_mean_nll(pw, nw):
    """TRL's NLL: cross-entropy over every chosen token of the batch, from summed log-probs."""
    return -pw.sum() / nw.sum()


# --- hand-worked numbers ----------------------------------------------------------------------------

# log pi(y_w) = -10, log pi(y_l) = -12, reference -11 and -11: h = 2, beta h = 0.2.
HAND = [torch.tensor([-10.0]), torch.tensor([-12.0]), torch.tensor([-11.0]), torch.tensor([-11.0])]
HAND_EXPECTED = {
    ("sigmoid", 0.0): softplus(-0.2),
    ("sigmoid", 0.1): 0.9 * softplus(-0.2) + 0.1 * softplus(0.2),                  # cDPO
    ("robust", 0.1): (0.9 * softplus(-0.2) - 0.1 * softplus(0.2)) / 0.8,
    ("robust", 0.0): softplus(-0.2),
    ("hinge", 0.0): 0.8,
    # token counts 2 (chosen) and 4 (rejected): averages -5, -3, -5.5, -2.75, h_avg = -2 + 2.75 = 0.75
    ("ipo", 0.0): (0.75 - 1 / 0.2) ** 2,
}


@pytest.mark.parametrize("loss_type,eps", sorted(HAND_EXPECTED))
def test_dpo_hand_worked(loss_type, eps):
    losses, stats = dpo_loss(*HAND, loss_type=loss_type, beta=0.1, label_smoothing=eps,
                             chosen_lengths=torch.tensor([2]), rejected_lengths=torch.tensor([4]))
    assert losses.shape == (1,) and losses.dtype == torch.float32
    assert losses.item() == pytest.approx(HAND_EXPECTED[loss_type, eps], rel=1e-6)
    if loss_type == "ipo":  # rewards on the averages: 0.1 * (-5 + 5.5), 0.1 * (-3 + 2.75)
        assert stats.chosen_rewards.item() == pytest.approx(0.05) and stats.rejected_rewards.item() == pytest.approx(-0.025)
        assert stats.chosen_logps.item() == -5.0
    else:
        assert stats.chosen_rewards.item() == pytest.approx(0.1) and stats.rejected_rewards.item() == pytest.approx(-0.1)
        assert stats.chosen_logps.item() == -10.0 and stats.rejected_logps.item() == -12.0


def test_dpo_sigmoid_gradient_hand_worked():
    inputs = leaves(HAND)
    losses, _ = dpo_loss(*inputs, beta=0.1)
    g = grads(losses.sum(), inputs)
    # d/dh -log sigma(beta h) = -beta sigma(-beta h); h = pw - pl - rw + rl
    d = -0.1 / (1 + math.exp(0.2))
    assert [x.item() for x in g] == pytest.approx([d, -d, -d, d], rel=1e-6)


def test_rpo_nll_hand_worked():
    # chosen NLL per token: 10 / 2 = 5, times nll_coef 0.5
    losses, stats = dpo_loss(*HAND, nll_coef=0.5, chosen_lengths=torch.tensor([2]))
    assert losses.item() == pytest.approx(softplus(-0.2) + 2.5, rel=1e-6)
    assert stats.nll.item() == 5.0
    # with IPO the NLL is still on the summed log-prob over the chosen count
    losses, _ = dpo_loss(*HAND, loss_type="ipo", nll_coef=0.5, chosen_lengths=torch.tensor([2]),
                         rejected_lengths=torch.tensor([4]))
    assert losses.item() == pytest.approx(HAND_EXPECTED["ipo", 0.0] + 2.5, rel=1e-6)


# --- against TRL on fixed random inputs, forward and gradients ---------------------------------------

CASES = [("sigmoid", 0.0), ("sigmoid", 0.2), ("robust", 0.0), ("robust", 0.3), ("hinge", 0.0), ("ipo", 0.0)]


@pytest.mark.parametrize("batch", [1, 7])
@pytest.mark.parametrize("loss_type,eps", CASES)
def test_dpo_matches_trl(loss_type, eps, batch):
    logps, nw, nl = make_pairs(batch, seed=batch)
    beta = 0.3
    ours_in, trl_in = leaves(logps), leaves(logps)
    losses, stats = dpo_loss(*ours_in, loss_type=loss_type, beta=beta, label_smoothing=eps,
                             chosen_lengths=nw, rejected_lengths=nl)
    pw, pl, rw, rl = trl_in
    if loss_type == "ipo":
        pw, rw, pl, rl = pw / nw, rw / nw, pl / nl, rl / nl
    expected, chosen_rewards, rejected_rewards = trl_dpo_loss(pw, pl, rw, rl, beta, eps, loss_type)
    torch.testing.assert_close(losses, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stats.chosen_rewards, chosen_rewards)
    torch.testing.assert_close(stats.rejected_rewards, rejected_rewards)
    for got, want in zip(grads(losses.sum(), ours_in), grads(expected.sum(), trl_in)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_rpo_matches_trl_with_equal_lengths():
    logps, nw, _ = make_pairs(5, seed=3, lengths_equal=True)
    ours_in, trl_in = leaves(logps), leaves(logps)
    losses, _ = dpo_loss(*ours_in, beta=0.1, nll_coef=0.7, chosen_lengths=nw)
    dpo, _, _ = trl_dpo_loss(*trl_in, 0.1, 0.0, "sigmoid")
    expected = (dpo + 0.7 * token_mean_nll(trl_in[0], nw)).mean()  # TRL: losses + rpo_alpha * nll_loss
    torch.testing.assert_close(losses.mean(), expected)
    for got, want in zip(grads(losses.mean(), ours_in), grads(expected, trl_in)):
        torch.testing.assert_close(got, want)


def test_reward_model_hand_worked():
    rc, rr = torch.tensor([2.0, -1.0]), torch.tensor([0.5, 1.0])
    losses, stats = reward_model_loss(rc, rr, margin=torch.tensor([1.0, 0.0]), center_coef=0.01)
    # -log sigma(2 - 0.5 - 1) + 0.01 (2.5)^2 and -log sigma(-2) + 0.01 * 0^2
    assert losses.tolist() == pytest.approx([softplus(-0.5) + 0.0625, softplus(2.0)], rel=1e-6)
    metrics = stats.metrics()
    assert metrics["rewards/accuracies"].total.item() == 1.0 and metrics["rewards/accuracies"].count.item() == 2.0
    assert metrics["rewards/margins"].total.item() == pytest.approx(1.5 - 2.0)
    assert metrics["rewards/chosen"].total.item() == 1.0 and metrics["rewards/rejected"].total.item() == 1.5
    assert "logps/chosen" not in metrics


@pytest.mark.parametrize("batch", [1, 6])
def test_reward_model_matches_trl(batch):
    g = torch.Generator().manual_seed(batch)
    inputs = [torch.randn(batch, generator=g) * 3 for _ in range(2)] + [torch.rand(batch, generator=g) * 2]
    ours_in, trl_in = leaves(inputs), leaves(inputs)
    losses, _ = reward_model_loss(ours_in[0], ours_in[1], margin=ours_in[2], center_coef=0.05)
    expected = trl_reward_loss(*trl_in, center_rewards_coefficient=0.05)
    torch.testing.assert_close(losses.mean(), expected)
    for got, want in zip(grads(losses.mean(), ours_in), grads(expected, trl_in)):
        torch.testing.assert_close(got, want)
    plain, _ = reward_model_loss(inputs[0], inputs[1])
    torch.testing.assert_close(plain.mean(), trl_reward_loss(inputs[0], inputs[1], 0.0, 0.0))


def test_simpo_hand_worked():
    # averages -3/3 = -1 and -8/4 = -2; beta 2, gamma = 2 * 0.5 = 1: -log sigma(2 * 1 - 1)
    losses, stats = simpo_loss(torch.tensor([-3.0]), torch.tensor([-8.0]), torch.tensor([3]), torch.tensor([4]))
    assert losses.item() == pytest.approx(softplus(-1.0), rel=1e-6)
    assert stats.chosen_rewards.item() == -2.0 and stats.rejected_logps.item() == -2.0


@pytest.mark.parametrize("batch", [1, 7])
def test_simpo_matches_trl(batch):
    logps, nw, nl = make_pairs(batch, seed=10 + batch)
    ours_in, trl_in = leaves(logps[:2]), leaves(logps[:2])
    losses, _ = simpo_loss(*ours_in, nw, nl, beta=2.5, gamma_beta_ratio=0.4)
    expected = trl_cpo_loss(trl_in[0] / nw, trl_in[1] / nl, beta=2.5, loss_type="simpo", simpo_gamma=2.5 * 0.4)
    torch.testing.assert_close(losses, expected)
    for got, want in zip(grads(losses.sum(), ours_in), grads(expected.sum(), trl_in)):
        torch.testing.assert_close(got, want)


def test_cpo_hand_worked():
    # -log sigma(0.1 (-3 + 8)) + 1 * 3 / 3
    losses, stats = cpo_loss(torch.tensor([-3.0]), torch.tensor([-8.0]), torch.tensor([3]))
    assert losses.item() == pytest.approx(softplus(-0.5) + 1.0, rel=1e-6)
    assert stats.nll.item() == 1.0 and stats.chosen_rewards.item() == pytest.approx(-0.3)


@pytest.mark.parametrize("batch", [1, 5])
def test_cpo_matches_trl_with_equal_lengths(batch):
    logps, nw, _ = make_pairs(batch, seed=20 + batch, lengths_equal=True)
    ours_in, trl_in = leaves(logps[:2]), leaves(logps[:2])
    losses, _ = cpo_loss(*ours_in, nw, beta=0.2, alpha=0.5)
    # CPOTrainer: loss = losses.mean() + cpo_alpha * policy_nll_loss
    expected = trl_cpo_loss(*trl_in, beta=0.2, loss_type="sigmoid").mean() + 0.5 * token_mean_nll(trl_in[0], nw)
    torch.testing.assert_close(losses.mean(), expected)
    for got, want in zip(grads(losses.mean(), ours_in), grads(expected, trl_in)):
        torch.testing.assert_close(got, want)


def test_orpo_hand_worked():
    # p_w = 0.5 per token (2 tokens), p_l = 0.25 (3 tokens): odds 1 and 1/3, log odds ratio log 3,
    # -log sigma(log 3) = log(4/3); NLL_w = log 2
    lw, ll = 2 * math.log(0.5), 3 * math.log(0.25)
    losses, stats = orpo_loss(torch.tensor([lw]), torch.tensor([ll]), torch.tensor([2]), torch.tensor([3]), lam=0.1)
    assert losses.item() == pytest.approx(math.log(2) + 0.1 * math.log(4 / 3), rel=1e-6)
    assert stats.log_odds.item() == pytest.approx(math.log(3), rel=1e-6)
    metrics = stats.metrics()
    assert metrics["log_odds_ratio"].total.item() == pytest.approx(math.log(3 / 4), rel=1e-6)
    assert metrics["nll_loss"].total.item() == pytest.approx(math.log(2), rel=1e-6)


@pytest.mark.parametrize("batch", [1, 7])
def test_orpo_matches_trl_with_equal_lengths(batch):
    logps, nw, _ = make_pairs(batch, seed=30 + batch, lengths_equal=True)
    ours_in, trl_in = leaves(logps[:2]), leaves(logps[:2])
    losses, stats = orpo_loss(*ours_in, nw, nw, lam=0.25)
    ratio, log_odds = trl_odds_ratio_loss(trl_in[0] / nw, trl_in[1] / nw, beta=0.25)
    expected = token_mean_nll(trl_in[0], nw) - ratio.mean()  # ORPOTrainer: policy_nll_loss - losses.mean()
    torch.testing.assert_close(losses.mean(), expected)
    torch.testing.assert_close(stats.log_odds, log_odds.detach())
    for got, want in zip(grads(losses.mean(), ours_in), grads(expected, trl_in)):
        torch.testing.assert_close(got, want)


def test_orpo_log_odds_accurate_near_probability_one():
    # avg log-prob -1e-4: fp32's log1p(-exp(x)) loses ~3 digits here; the loss must match float64.
    aw, al = torch.tensor([-1e-4, -3e-3]), torch.tensor([-2e-4, -0.5])
    n = torch.ones(2)
    got = orpo_loss(aw, al, n, n)[1].log_odds
    want = trl_odds_ratio_loss(aw.double(), al.double(), 1.0)[1]
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)


# --- float64 gradcheck, dtypes, extremes ------------------------------------------------------------

def test_gradcheck_float64():
    logps, nw, nl = make_pairs(3, seed=40, dtype=torch.float64)
    inputs = leaves(logps)
    for loss_type, eps in [("sigmoid", 0.1), ("robust", 0.2), ("ipo", 0.0)]:
        assert torch.autograd.gradcheck(
            lambda *x: dpo_loss(*x, loss_type=loss_type, label_smoothing=eps, nll_coef=0.3,
                                chosen_lengths=nw, rejected_lengths=nl)[0], inputs)
    assert torch.autograd.gradcheck(lambda a, b: orpo_loss(a, b, nw, nl)[0], inputs[:2])
    assert torch.autograd.gradcheck(lambda a, b: simpo_loss(a, b, nw, nl)[0], inputs[:2])
    assert torch.autograd.gradcheck(lambda a, b: cpo_loss(a, b, nw)[0], inputs[:2])
    assert torch.autograd.gradcheck(lambda a, b, m: reward_model_loss(a, b, margin=m, center_coef=0.1)[0], inputs[:3])


CALLS = {
    "dpo": lambda x, nw, nl: dpo_loss(*x, nll_coef=0.5, chosen_lengths=nw),
    "ipo": lambda x, nw, nl: dpo_loss(*x, loss_type="ipo", chosen_lengths=nw, rejected_lengths=nl),
    "simpo": lambda x, nw, nl: simpo_loss(x[0], x[1], nw, nl),
    "cpo": lambda x, nw, nl: cpo_loss(x[0], x[1], nw),
    "orpo": lambda x, nw, nl: orpo_loss(x[0], x[1], nw, nl),
    "rm": lambda x, nw, nl: reward_model_loss(x[0], x[1], margin=x[2], center_coef=1e-3),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(CALLS))
def test_half_inputs_compute_in_fp32(name, dtype):
    logps, nw, nl = make_pairs(7, seed=50)
    low = leaves(logps, dtype)
    losses, stats = CALLS[name](low, nw, nl)
    assert losses.dtype == torch.float32 and stats.chosen_rewards.dtype == torch.float32
    rounded = leaves([t.detach().float() for t in low])
    expected, _ = CALLS[name](rounded, nw, nl)
    torch.testing.assert_close(losses, expected, rtol=1e-6, atol=1e-6)
    low_grads = torch.autograd.grad(losses.sum(), low, allow_unused=True)
    for got, want in zip(low_grads, torch.autograd.grad(expected.sum(), rounded, allow_unused=True)):
        assert (got is None) == (want is None)
        if got is not None:  # the fp32 gradient rounded once to the input dtype
            assert got.dtype == dtype
            torch.testing.assert_close(got, want.to(dtype), rtol=0, atol=0)


def test_extreme_log_probs_stay_finite():
    # very negative log-probs and a huge gap either way: the sigmoid losses saturate, no inf/NaN; losses and
    # gradients equal TRL's formulas in float64 (plus the per-pair chosen NLL -pw / n where the loss has one)
    pw = torch.tensor([-1e4, -5e4, -1.0], requires_grad=True)
    pl = torch.tensor([-9e4, -1.0, -3e4], requires_grad=True)
    ref = torch.tensor([-2e4, -2e4, -2e4])
    n = torch.tensor([1000, 4000, 1])
    w64, l64 = leaves([pw, pl], torch.float64)
    r64, n64 = ref.double(), n.double()

    def check(losses, expected, name):
        torch.testing.assert_close(losses.double(), expected, rtol=1e-6, atol=1e-6, msg=name)
        for got, want in zip(grads(losses.sum(), [pw, pl]), grads(expected.sum(), [w64, l64])):
            torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6, msg=name)

    for loss_type, spec in DPO_LOSSES.items():
        losses, _ = dpo_loss(pw, pl, ref, ref, loss_type=loss_type, label_smoothing=0.0, chosen_lengths=n,
                             rejected_lengths=n, nll_coef=1.0)
        per = n64 if spec.length_averaged else 1.0
        expected, _, _ = trl_dpo_loss(w64 / per, l64 / per, r64 / per, r64 / per, 0.1, 0.0, loss_type)
        check(losses, expected - w64 / n64, loss_type)
    losses, _ = dpo_loss(pw, pl, ref, ref, beta=0.1)  # beta h = 8000, -4999.9, 2999.9
    assert losses.tolist() == pytest.approx([0.0, 4999.9, 0.0], rel=1e-6, abs=1e-30)
    check(simpo_loss(pw, pl, n, n)[0], trl_cpo_loss(w64 / n64, l64 / n64, 2.0, "simpo", simpo_gamma=1.0), "simpo")
    check(cpo_loss(pw, pl, n)[0], trl_cpo_loss(w64, l64, 0.1, "sigmoid") - w64 / n64, "cpo")
    ratio, _ = trl_odds_ratio_loss(w64 / n64, l64 / n64, beta=0.1)
    check(orpo_loss(pw, pl, n, n)[0], -w64 / n64 - ratio, "orpo")


def test_orpo_finite_at_probability_one():
    # average log-probs 0 (p = 1 to rounding), tiny, and very negative: loss and gradients finite
    aw = torch.tensor([0.0, -1e-12, -1e-7, -80.0, 0.0], requires_grad=True)
    al = torch.tensor([-1e-9, 0.0, -60.0, -1e-8, 0.0], requires_grad=True)
    n = torch.ones(5)
    losses, stats = orpo_loss(aw, al, n, n)
    g = grads(losses.sum(), [aw, al])
    assert torch.isfinite(losses).all() and torch.isfinite(stats.log_odds).all()
    assert all(torch.isfinite(x).all() for x in g)
    # p_w ~ 1, p_l = e^-60: the odds-ratio term vanishes, the loss is the NLL 1e-7
    assert losses[2].item() == pytest.approx(1e-7, rel=1e-3)
    assert stats.log_odds[4].item() == 0.0


# --- argument validation ----------------------------------------------------------------------------

def test_argument_errors_name_the_argument():
    x = [torch.zeros(3)] * 4
    n = torch.ones(3)
    bad = [
        (lambda: dpo_loss(*x, beta=0.0), "beta"),
        (lambda: dpo_loss(*x, beta=-1.0), "beta"),
        (lambda: dpo_loss(*x, beta=float("nan")), "beta"),
        (lambda: dpo_loss(*x, label_smoothing=0.5), r"label_smoothing must be in \[0, 0.5\)"),
        (lambda: dpo_loss(*x, label_smoothing=-0.1), "label_smoothing"),
        (lambda: dpo_loss(*x, loss_type="hinge", label_smoothing=0.1), "not defined for loss_type 'hinge'"),
        (lambda: dpo_loss(*x, loss_type="kto_pair"), "unknown DPO loss_type 'kto_pair'; one of sigmoid"),
        (lambda: dpo_loss(*x, loss_type="ipo", chosen_lengths=n), "rejected_lengths .* required by loss_type 'ipo'"),
        (lambda: dpo_loss(*x, loss_type="ipo", rejected_lengths=n), "chosen_lengths .* required by loss_type 'ipo'"),
        (lambda: dpo_loss(*x, nll_coef=1.0), "chosen_lengths .* required when nll_coef > 0"),
        (lambda: dpo_loss(*x, nll_coef=-1.0), "nll_coef"),
        (lambda: dpo_loss(x[0], x[1], torch.zeros(2), x[3]), r"ref_chosen_logps must have the shape .* \(3,\)"),
        (lambda: dpo_loss(torch.zeros(3, 1), *x[1:]), r"policy_chosen_logps must be a 1-d tensor"),
        (lambda: dpo_loss(*x, nll_coef=1.0, chosen_lengths=torch.ones(4)), "chosen_lengths must have the shape"),
        (lambda: reward_model_loss(x[0], x[1], center_coef=-0.1), "center_coef"),
        (lambda: reward_model_loss(x[0], x[1], margin=torch.zeros(2)), "margin must have the shape"),
        (lambda: simpo_loss(x[0], x[1], n, n, beta=0), "beta"),
        (lambda: simpo_loss(x[0], x[1], n, n, gamma_beta_ratio=-1), "gamma_beta_ratio"),
        (lambda: simpo_loss(x[0], x[1], n, torch.ones(2)), "rejected_lengths must have the shape"),
        (lambda: cpo_loss(x[0], x[1], n, alpha=-1), "alpha"),
        (lambda: cpo_loss(x[0], x[1], n, beta=float("inf")), "beta"),
        (lambda: orpo_loss(x[0], x[1], n, n, lam=-0.1), "lam"),
    ]
    for call, message in bad:
        with pytest.raises(ValueError, match=message):
            call()


def test_metrics_are_sums_and_counts():
    # two pairs: implicit rewards (0.1, -0.1) and (-0.2, 0.3) -> accuracy 1 of 2
    pw, pl = torch.tensor([-10.0, -5.0]), torch.tensor([-12.0, -4.0])
    rw, rl = torch.tensor([-11.0, -3.0]), torch.tensor([-11.0, -7.0])
    _, stats = dpo_loss(pw, pl, rw, rl, beta=0.1)
    m = stats.metrics()
    assert sorted(m) == ["logps/chosen", "logps/rejected", "rewards/accuracies", "rewards/chosen",
                         "rewards/margins", "rewards/rejected"]
    assert m["rewards/chosen"].total.item() == pytest.approx(0.1 - 0.2)
    assert m["rewards/rejected"].total.item() == pytest.approx(-0.1 + 0.3)
    assert m["rewards/accuracies"].total.item() == 1.0
    assert m["rewards/margins"].total.item() == pytest.approx(0.2 - 0.5)
    assert m["logps/chosen"].total.item() == -15.0 and m["logps/rejected"].total.item() == -16.0
    assert all(v.count.item() == 2.0 for v in m.values())
    assert not any(v.total.requires_grad for v in m.values())
