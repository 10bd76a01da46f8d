"""TRL's DPO variants (APO zero / down, NCA, SPPO hard, EXO, BCO pair) and WPO's weighting against hand-worked
numbers and against the published formulas as TRL's DPOTrainer writes them (`dpo_loss`, `concatenated_forward`'s
`use_weighting`), written out here on fixed inputs: forward and gradient, fp32 and fp64.
"""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from parallel.dist_utils import run_distributed

from megalign.algos import (DPO_VARIANTS, PAIR_LOSSES, PairLogps, PreferenceAlgoConfig, dpo_loss, dpo_variant_loss,
                            pair_losses, wpo_token_logps, wpo_weights)

LN3 = math.log(3.0)


def logps(rw, rl, ref_w=(-5.0,), ref_l=(-7.0,), dtype=torch.float64):
    """Policy and reference summed log-probs [B] with the log-ratios r_w, r_l given (policy = reference + r)."""
    ref_w = torch.tensor(ref_w * len(rw) if len(ref_w) == 1 else ref_w, dtype=dtype)
    ref_l = torch.tensor(ref_l * len(rl) if len(ref_l) == 1 else ref_l, dtype=dtype)
    pw = (ref_w + torch.tensor(rw, dtype=dtype)).requires_grad_()
    pl = (ref_l + torch.tensor(rl, dtype=dtype)).requires_grad_()
    return pw, pl, ref_w, ref_l


# --- hand-worked numbers ----------------------------------------------------------------------------

@pytest.mark.parametrize("loss_type, beta, rw, rl, eps, expected", [
    # sigma(ln 3) = 3/4, sigma(-ln 3) = 1/4
    ("apo_zero", 1.0, [LN3], [-LN3], None, 0.25 + 0.25),
    ("apo_down", 1.0, [LN3], [-LN3], None, 0.75 + 1 / (1 + 9)),  # sigma(-2 ln 3) = 1/10
    ("nca_pair", 1.0, [LN3], [-LN3], None, math.log(4 / 3) - 0.5 * (math.log(1 / 4) + math.log(3 / 4))),
    ("sppo_hard", 0.5, [3.0], [-2.0], None, (3 - 1) ** 2 + (-2 + 1) ** 2),  # 1 / (2 beta) = 1
    ("exo_pair", 0.5, [LN3], [-LN3], 0.25, 0.0),  # sigma(beta h) = 3/4 = 1 - eps: the KL to (3/4, 1/4) is 0
    ("exo_pair", 0.5, [LN3], [-LN3], 0.1, 0.75 * math.log(0.75 / 0.9) + 0.25 * math.log(0.25 / 0.1)),
    ("bco_pair", 1.0, [LN3, LN3], [-LN3, -LN3], None, 2 * math.log(4 / 3)),  # delta = 0
])
def test_variants_by_hand(loss_type, beta, rw, rl, eps, expected):
    pw, pl, ref_w, ref_l = logps(rw, rl)
    kwargs = {} if eps is None else {"exo_epsilon": eps}
    losses, stats = dpo_variant_loss(pw, pl, ref_w, ref_l, loss_type=loss_type, beta=beta, **kwargs)
    assert losses.tolist() == pytest.approx([expected] * len(rw), abs=1e-12)
    assert stats.chosen_rewards.tolist() == pytest.approx([beta * r for r in rw], abs=1e-12)
    assert stats.rejected_rewards.tolist() == pytest.approx([beta * r for r in rl], abs=1e-12)


def test_bco_shift_is_the_batch_mean_reward_and_a_constant():
    # beta = 1, r_w = (3, 1), r_l = (1, -1): delta = (3 + 1 + 1 - 1) / 4 = 1; each pair
    # -log sigma(r_w - 1) - log sigma(1 - r_l) = softplus(-2) + ln 2
    pw, pl, ref_w, ref_l = logps([3.0, 1.0], [1.0, -1.0])
    losses, _ = dpo_variant_loss(pw, pl, ref_w, ref_l, loss_type="bco_pair", beta=1.0)
    assert losses.tolist() == pytest.approx([math.log1p(math.exp(-2)) + math.log(2)] * 2, abs=1e-12)
    gw, gl = torch.autograd.grad(losses.sum(), [pw, pl])
    # delta carries no gradient: d/d r_w = -sigma(-(r_w - 1)), d/d r_l = sigma(r_l - 1)
    sig = torch.sigmoid
    assert gw.tolist() == pytest.approx([-sig(torch.tensor(-2.0)).item(), -0.5], abs=1e-7)
    assert gl.tolist() == pytest.approx([0.5, sig(torch.tensor(-2.0)).item()], abs=1e-7)


def test_sppo_hard_gradient_by_hand():
    # d/d r_w (r_w - 1/(2 beta))^2 = 2 (r_w - 1/(2 beta)); beta = 0.5, r_w = 3, r_l = -2: 4 and 2 (-2 + 1) = -2
    pw, pl, ref_w, ref_l = logps([3.0], [-2.0])
    losses, _ = dpo_variant_loss(pw, pl, ref_w, ref_l, loss_type="sppo_hard", beta=0.5)
    gw, gl = torch.autograd.grad(losses.sum(), [pw, pl])
    assert (gw.item(), gl.item()) == pytest.approx((4.0, -2.0), abs=1e-12)


# --- TRL's formulas, written out --------------------------------------------------------------------

def trl_variant(loss_type, pw, pl, rw, rl, beta, label_smoothing=0.0):
    """TRL DPOTrainer.dpo_loss for the variants; bco_pair at TRL's first step, where the running mean of the
    batch's mean reward is that mean."""
    chosen_logratios, rejected_logratios = pw - rw, pl - rl
    logits = (pw - pl) - (rw - rl)
    if loss_type == "exo_pair":
        if label_smoothing == 0:
            label_smoothing = 1e-3
        return (beta * logits).sigmoid() * (F.logsigmoid(beta * logits) - math.log(1 - label_smoothing)) + \
            (-beta * logits).sigmoid() * (F.logsigmoid(-beta * logits) - math.log(label_smoothing))
    if loss_type == "bco_pair":
        delta = torch.cat((beta * chosen_logratios, beta * rejected_logratios), 0).mean().detach()
        return -F.logsigmoid((beta * chosen_logratios) - delta) - F.logsigmoid(-(beta * rejected_logratios - delta))
    if loss_type == "sppo_hard":
        return (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2
    if loss_type == "nca_pair":
        chosen_rewards, rejected_rewards = chosen_logratios * beta, rejected_logratios * beta
        return -F.logsigmoid(chosen_rewards) - 0.5 * F.logsigmoid(-chosen_rewards) - 0.5 * F.logsigmoid(-rejected_rewards)
    if loss_type == "apo_zero":
        return (1 - F.sigmoid(beta * chosen_logratios)) + F.sigmoid(beta * rejected_logratios)
    if loss_type == "apo_down":
        return F.sigmoid(beta * chosen_logratios) + (1 - F.sigmoid(beta * (chosen_logratios - rejected_logratios)))
    raise AssertionError(loss_type)


def random_logps(batch, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    n = torch.randint(1, 20, (2, batch), generator=g).to(torch.float64)
    per_token = -(torch.rand(4, batch, generator=g, dtype=torch.float64) * 3 + 0.05)
    return [t.to(dtype) for t in (per_token[0] * n[0], per_token[1] * n[1], per_token[2] * n[0], per_token[3] * n[1])]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("beta", [0.1, 0.7])
@pytest.mark.parametrize("loss_type", sorted(DPO_VARIANTS))
def test_variants_match_trl(loss_type, beta, dtype, tol):
    pw, pl, rw, rl = random_logps(9, seed=3, dtype=dtype)
    ours_in = [t.clone().requires_grad_() for t in (pw, pl)]
    trl_in = [t.clone().requires_grad_() for t in (pw, pl)]
    eps = {"exo_epsilon": 0.2} if loss_type == "exo_pair" else {}
    losses, stats = dpo_variant_loss(*ours_in, rw, rl, loss_type=loss_type, beta=beta, **eps)
    expected = trl_variant(loss_type, *trl_in, rw, rl, beta, label_smoothing=0.2 if eps else 0.0)
    assert losses.dtype == dtype
    torch.testing.assert_close(losses, expected, rtol=tol, atol=tol)
    for got, want in zip(torch.autograd.grad(losses.mean(), ours_in), torch.autograd.grad(expected.mean(), trl_in)):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(stats.chosen_rewards, beta * (pw - rw), rtol=tol, atol=tol)
    torch.testing.assert_close(stats.rejected_rewards, beta * (pl - rl), rtol=tol, atol=tol)


def test_exo_default_epsilon_is_trls():
    pw, pl, rw, rl = random_logps(5, seed=4, dtype=torch.float64)
    losses, _ = dpo_variant_loss(pw, pl, rw, rl, loss_type="exo_pair", beta=0.1)
    torch.testing.assert_close(losses, trl_variant("exo_pair", pw, pl, rw, rl, 0.1, label_smoothing=0.0))


@pytest.mark.parametrize("loss_type", sorted(set(DPO_VARIANTS) - {"bco_pair"}))
def test_variants_gradcheck(loss_type):
    # bco_pair's shift is a constant by definition (detached), which finite differences would move: its gradient
    # is checked against TRL's above and by hand
    pw, pl, rw, rl = random_logps(4, seed=5, dtype=torch.float64)
    inputs = [t.requires_grad_() for t in (pw, pl, rw, rl)]
    assert torch.autograd.gradcheck(lambda *xs: dpo_variant_loss(*xs, loss_type=loss_type, beta=0.3,
                                                                 exo_epsilon=0.05)[0], inputs)


def test_extreme_log_ratios_stay_finite():
    pw = torch.tensor([-1e4, -5e4, -1.0], requires_grad=True)
    pl = torch.tensor([-9e4, -1.0, -3e4], requires_grad=True)
    ref = torch.tensor([-2e4, -2e4, -2e4])
    for loss_type in DPO_VARIANTS:
        losses, _ = dpo_variant_loss(pw, pl, ref, ref, loss_type=loss_type)
        grads = torch.autograd.grad(losses.sum(), [pw, pl])
        assert torch.isfinite(losses).all() and all(torch.isfinite(g).all() for g in grads), loss_type


def test_variant_argument_errors():
    x = [torch.zeros(3)] * 4
    for call, message in [
        (lambda: dpo_variant_loss(*x, loss_type="aot"), "unknown DPO variant loss_type 'aot'; one of apo_zero"),
        (lambda: dpo_variant_loss(*x, loss_type="nca_pair", beta=0.0), "beta must be"),
        (lambda: dpo_variant_loss(*x, loss_type="exo_pair", exo_epsilon=0.0), r"exo_epsilon must be in \(0, 0.5\)"),
        (lambda: dpo_variant_loss(*x, loss_type="exo_pair", exo_epsilon=0.5), "exo_epsilon"),
        (lambda: dpo_variant_loss(*x[:3], torch.zeros(2), loss_type="apo_zero"), "ref_rejected_logps"),
        (lambda: dpo_variant_loss(*x, loss_type="apo_zero", weights=torch.ones(2)), "weights"),
    ]:
        with pytest.raises(ValueError, match=message):
            call()


# --- the registry and the config ---------------------------------------------------------------------

def test_registry_entries_call_the_variants():
    pw, pl, rw, rl = random_logps(6, seed=6, dtype=torch.float64)
    n = torch.ones(6)
    for name in DPO_VARIANTS:
        entry = PAIR_LOSSES[name]
        assert entry.reference and "beta" in entry.reads and ("exo_epsilon" in entry.reads) == (name == "exo_pair")
        algo = PreferenceAlgoConfig(loss=name, beta=0.4, **({"exo_epsilon": 0.2} if name == "exo_pair" else {}))
        assert algo.uses_reference
        losses, _ = pair_losses(algo, PairLogps(pw, pl, n, n, rw, rl))
        torch.testing.assert_close(losses, trl_variant(name, pw, pl, rw, rl, 0.4, 0.2 if name == "exo_pair" else 0.0))


@pytest.mark.parametrize("kwargs, message", [
    ({"loss": "apo_zero", "label_smoothing": 0.1}, "label_smoothing=0.1 is not defined for loss 'apo_zero'; only for "
                                                   "sigmoid, robust"),
    ({"loss": "bco_pair", "nll_coef": 1.0}, "nll_coef=1.0 is not defined for loss 'bco_pair'; only for sigmoid, robust, "
                                            "hinge, ipo"),
    ({"loss": "sigmoid", "exo_epsilon": 0.1}, "exo_epsilon=0.1 is not defined for loss 'sigmoid'; only for exo_pair"),
    ({"loss": "exo_pair", "exo_epsilon": 0.0}, r"exo_epsilon must be in \(0, 0.5\), got 0.0"),
    ({"loss": "sppo_hard", "beta": -1.0}, "beta must be a finite number > 0, got -1.0"),
    ({"loss": "hinge", "label_smoothing": 0.2}, "label_smoothing=0.2 is not defined for loss 'hinge'"),
    ({"loss": "orpo", "use_weighting": True}, "use_weighting=True is not defined for loss 'orpo'; only for sigmoid, "
                                              "robust, hinge, ipo, apo_zero"),
])
def test_config_refuses_what_the_loss_does_not_read(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PreferenceAlgoConfig(**kwargs)


# --- WPO ---------------------------------------------------------------------------------------------

def test_wpo_weights_by_hand():
    # pair 0: A_w / n_w + A_l / n_l = -2/2 - 3/3 = -2 -> e^-2; pair 1: 1/1 + 1/2 > 0 -> capped at 1
    w = wpo_weights(torch.tensor([-2.0, 1.0]), torch.tensor([-3.0, 1.0]), torch.tensor([2, 1]), torch.tensor([3, 2]))
    assert w.tolist() == pytest.approx([math.exp(-2.0), 1.0], rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_weights_scale_loss_and_gradient_as_constants(dtype):
    pw, pl, rw, rl = random_logps(5, seed=7, dtype=dtype)
    n = torch.full((5,), 4.0)
    w = torch.tensor([0.5, 1.0, 0.25, 0.0, 0.8], dtype=dtype, requires_grad=True)
    calls = [lambda p, q, **k: dpo_loss(p, q, rw, rl, beta=0.2, nll_coef=0.5, chosen_lengths=n, **k),
             lambda p, q, **k: dpo_variant_loss(p, q, rw, rl, loss_type="nca_pair", beta=0.2, **k)]
    for call in calls:
        a = [t.clone().requires_grad_() for t in (pw, pl)]
        b = [t.clone().requires_grad_() for t in (pw, pl)]
        weighted, _ = call(*a, weights=w)
        plain, _ = call(*b)
        torch.testing.assert_close(weighted, plain * w.detach())  # TRL: losses (NLL term included) * weights
        *got, grad_w = torch.autograd.grad(weighted.sum(), [*a, w], allow_unused=True)
        assert grad_w is None
        for ga, gb in zip(got, torch.autograd.grad((plain * w.detach()).sum(), b)):
            torch.testing.assert_close(ga, gb)


def test_registry_passes_the_weights_and_asks_for_them():
    pw, pl, rw, rl = random_logps(4, seed=12, dtype=torch.float64)
    n, w = torch.full((4,), 3.0), torch.tensor([0.2, 1.0, 0.5, 0.9], dtype=torch.float64)
    for name, plain in [("ipo", lambda: dpo_loss(pw, pl, rw, rl, loss_type="ipo", beta=0.1, chosen_lengths=n,
                                                 rejected_lengths=n)[0]),
                        ("sppo_hard", lambda: dpo_variant_loss(pw, pl, rw, rl, loss_type="sppo_hard")[0])]:
        algo = PreferenceAlgoConfig(loss=name, use_weighting=True)
        losses, _ = pair_losses(algo, PairLogps(pw, pl, n, n, rw, rl, w))
        torch.testing.assert_close(losses, plain() * w)
        with pytest.raises(ValueError, match="algo.use_weighting needs WPO's per-pair weights"):
            pair_losses(algo, PairLogps(pw, pl, n, n, rw, rl))


def trl_wpo_weights(logits, labels, loss_mask, num_examples):
    """TRL's `use_weighting` (concatenated_forward), on full logits [2B, T, V] and labels aligned with them."""
    per_token_logps = torch.gather(logits.log_softmax(-1), 2, labels.unsqueeze(2)).squeeze(2) * loss_mask
    logprobs = F.log_softmax(logits, dim=-1)
    weights_adjustment_factor = torch.logsumexp(2 * logprobs, dim=-1)
    per_token_logps_adjusted = per_token_logps - weights_adjustment_factor
    all_weights = (per_token_logps_adjusted * loss_mask).sum(-1) / loss_mask.sum(-1)
    return torch.clamp(torch.exp(all_weights[:num_examples] + all_weights[num_examples:]), max=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_wpo_weights_from_the_head_match_trl(dtype):
    # 3 pairs, T = 5, V = 11, H = 6: the head's adjusted log-probs of the response tokens, summed per row, through
    # wpo_weights, equal TRL's formula on the full logits. Scaled hidden states keep some weights below 1.
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(6, 5, 6, generator=g, dtype=dtype) * 2
    weight = torch.randn(11, 6, generator=g, dtype=dtype)
    labels = torch.randint(0, 11, (6, 5), generator=g)
    mask = torch.ones(6, 5, dtype=dtype)
    mask[:, :2] = 0  # the prompt
    mask[1, 4] = mask[4, 3:] = 0  # padding
    expected = trl_wpo_weights(hidden @ weight.t(), labels, mask, 3)
    rows, cols = mask.nonzero(as_tuple=True)
    terms = wpo_token_logps(hidden[rows, cols], weight, labels[rows, cols], chunk_size=4)
    adjusted = torch.zeros(6, dtype=dtype).index_add(0, rows, terms)
    lengths = mask.sum(1)
    got = wpo_weights(adjusted[:3], adjusted[3:], lengths[:3], lengths[3:])
    assert terms.dtype == dtype
    torch.testing.assert_close(got, expected)
    assert (got < 1).any() and (got > 0).all()


def adjusted_by_hand(h, w, targets):
    """log p(y) - log sum_v p_v^2 from the full softmax over the rows of w."""
    probs = (h @ w.t()).softmax(-1)
    return probs.gather(1, targets[:, None]).squeeze(1).log() - probs.pow(2).sum(-1).log()


def test_wpo_token_logps_excludes_vocab_padding():
    g = torch.Generator().manual_seed(9)
    h, w = torch.randn(7, 4, generator=g, dtype=torch.float64), torch.randn(10, 4, generator=g, dtype=torch.float64)
    w[8:] = 50.0  # padding rows with huge logits: they must not count
    targets = torch.tensor([0, 7, 3, 3, 5, 1, 6])
    torch.testing.assert_close(wpo_token_logps(h, w, targets, vocab_size=8, chunk_size=3),
                               adjusted_by_hand(h, w[:8], targets))


def test_wpo_token_logps_bf16_head_reduces_in_fp32():
    g = torch.Generator().manual_seed(11)
    h, w = torch.randn(5, 8, generator=g), torch.randn(12, 8, generator=g)
    targets = torch.randint(0, 12, (5,), generator=g)
    got = wpo_token_logps(h.bfloat16(), w.bfloat16(), targets)
    assert got.dtype == torch.float32
    expected = adjusted_by_hand(h.bfloat16().float(), w.bfloat16().float(), targets)
    torch.testing.assert_close(got, expected, rtol=0.05, atol=0.05)  # the logits are rounded to bf16


def _tp2_wpo_token_logps(h, w, targets, expected):
    rank = dist.get_rank()
    shard = w[rank * 5:(rank + 1) * 5]  # V_pad = 10 over 2 ranks, real vocabulary 9: rank 1's last row is padding
    got = wpo_token_logps(h, shard, targets, dist.group.WORLD, vocab_start=rank * 5, vocab_size=9, chunk_size=2)
    torch.testing.assert_close(got, expected)


def test_wpo_token_logps_tp2_equals_the_whole_vocabulary():
    g = torch.Generator().manual_seed(10)
    h, w = torch.randn(5, 4, generator=g, dtype=torch.float64), torch.randn(10, 4, generator=g, dtype=torch.float64)
    targets = torch.tensor([0, 4, 5, 8, 2])  # on both shards
    run_distributed(_tp2_wpo_token_logps, h, w, targets, adjusted_by_hand(h, w[:9], targets), world_size=2)


def test_wpo_token_logps_shape_errors():
    with pytest.raises(ValueError, match="need hidden"):
        wpo_token_logps(torch.zeros(2, 3), torch.zeros(4, 5), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="targets must be"):
        wpo_token_logps(torch.zeros(2, 3), torch.zeros(4, 3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_size"):
        wpo_token_logps(torch.zeros(2, 3), torch.zeros(4, 3), torch.zeros(2, dtype=torch.long), chunk_size=0)
