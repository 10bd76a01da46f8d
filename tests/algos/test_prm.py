"""Process reward model losses against hand-worked numbers and torch's own cross-entropy / BCE."""
import math

import pytest
import torch
import torch.nn.functional as F

from megalign.algos import IGNORE_INDEX, math_shepherd_labels, prm_loss, prm_token_loss

I = IGNORE_INDEX
# Three steps in two sequences; the ignored positions carry large logits that must not matter.
HAND_LOGITS = torch.tensor([[[50.0, -50.0], [0.0, math.log(3)], [7.0, 7.0]],
                            [[2.0, 0.0], [-30.0, 30.0], [0.0, math.log(3)]]])
HAND_LABELS = torch.tensor([[I, 1.0, I], [0.0, I, 0.25]])


def test_prm_hand_worked():
    loss_sum, stats = prm_loss(HAND_LOGITS, HAND_LABELS)
    # p_1 = 3/4 with label 1; p_0 = e^2 / (e^2 + 1) with label 0; p_1 = 3/4 with soft label 1/4
    expected = math.log(4 / 3) + math.log1p(math.exp(-2)) - (0.25 * math.log(0.75) + 0.75 * math.log(0.25))
    assert loss_sum.item() == pytest.approx(expected, rel=1e-6)
    # correct: step 1 (p_1 > 1/2, label 1), step 2 (p_1 < 1/2, label 0); wrong: step 3 (label 1/4 < 1/2)
    assert stats.num_steps.item() == 3.0 and stats.num_correct.item() == 2.0
    acc = stats.metrics()["step_accuracy"]
    assert (acc.total.item(), acc.count.item()) == (2.0, 3.0)


def random_case(batch, tokens, seed, soft, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, tokens, 2, generator=g) * 3).to(dtype)
    steps = torch.rand(batch, tokens, generator=g) < 0.4
    values = torch.rand(batch, tokens, generator=g) if soft else (torch.rand(batch, tokens, generator=g) < 0.5).float()
    return logits, torch.where(steps, values, torch.full_like(values, I)), steps


@pytest.mark.parametrize("batch,tokens", [(1, 1), (1, 7), (3, 13)])
def test_prm_hard_labels_match_torch_cross_entropy(batch, tokens):
    logits, labels, steps = random_case(batch, tokens, seed=batch * tokens, soft=False)
    labels[0, 0] = 1.0  # at least one step
    ours, theirs = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss_sum, stats = prm_loss(ours, labels)
    expected = F.cross_entropy(theirs.view(-1, 2), labels.long().view(-1), ignore_index=I, reduction="sum")
    torch.testing.assert_close(loss_sum, expected)
    assert stats.num_steps.item() == (labels != I).sum().item()
    predicted = logits.argmax(-1) == labels.long()
    assert stats.num_correct.item() == (predicted & (labels != I)).sum().item()
    (got,) = torch.autograd.grad(loss_sum, [ours])
    (want,) = torch.autograd.grad(expected, [theirs])
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("batch,tokens", [(1, 5), (4, 11)])
def test_prm_soft_labels_match_bce_on_the_logit_difference(batch, tokens):
    logits, labels, steps = random_case(batch, tokens, seed=100 + tokens, soft=True)
    ours, theirs = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss_sum, _ = prm_loss(ours, labels)
    # softmax over 2 classes = sigmoid of l_1 - l_0
    expected = F.binary_cross_entropy_with_logits((theirs[..., 1] - theirs[..., 0])[steps], labels[steps], reduction="sum")
    torch.testing.assert_close(loss_sum, expected)
    (got,) = torch.autograd.grad(loss_sum, [ours])
    (want,) = torch.autograd.grad(expected, [theirs])
    torch.testing.assert_close(got, want)


def test_prm_all_ignored_is_zero_with_zero_count():
    logits = torch.randn(2, 3, 2, requires_grad=True)
    loss_sum, stats = prm_loss(logits, torch.full((2, 3), float(I)))
    assert loss_sum.item() == 0.0 and stats.num_steps.item() == 0.0 and stats.num_correct.item() == 0.0
    (g,) = torch.autograd.grad(loss_sum, [logits])
    assert (g == 0).all()


def test_prm_gradcheck_float64_half_inputs_and_extremes():
    logits, labels, _ = random_case(2, 5, seed=7, soft=True)
    labels[0, 0] = 0.3
    assert torch.autograd.gradcheck(lambda x: prm_loss(x, labels)[0], [logits.double().requires_grad_()])
    for dtype in (torch.bfloat16, torch.float16):
        low = logits.to(dtype)
        loss_sum, stats = prm_loss(low, labels)
        assert loss_sum.dtype == stats.num_steps.dtype == torch.float32
        torch.testing.assert_close(loss_sum, prm_loss(low.float(), labels)[0], rtol=1e-6, atol=1e-6)
    # logits +-1e4 at the steps: confident and right costs ~0, confident and wrong costs 2e4; the gradient is
    # softmax - onehot(label) = [1 - 1, 0 - 0] for the right step and [0 - 1, 1 - 0] for the wrong one
    extreme = torch.tensor([[[1e4, -1e4], [-1e4, 1e4]]], requires_grad=True)
    loss_sum, _ = prm_loss(extreme, torch.tensor([[0.0, 0.0]]))
    (g,) = torch.autograd.grad(loss_sum, [extreme])
    assert loss_sum.item() == pytest.approx(2e4)
    assert g.tolist() == [[[0.0, 0.0], [-1.0, 1.0]]]


def test_prm_token_loss_on_two_reward_tokens():
    g = torch.Generator().manual_seed(3)
    vocab, pos, neg = 11, 7, 3
    lm_logits = torch.randn(2, 5, vocab, generator=g, requires_grad=True)
    labels = torch.tensor([[I, 1.0, I, 0.0, I], [0.6, I, I, I, 1.0]])
    loss_sum, stats = prm_token_loss(lm_logits, labels, positive_token_id=pos, negative_token_id=neg)
    # the softmax is over the two reward tokens only (Math-Shepherd's "+" / "-"), not the vocabulary
    two = lm_logits[..., [pos, neg]]
    lp_pos = two[..., 0] - torch.logsumexp(two, -1)
    lp_neg = two[..., 1] - torch.logsumexp(two, -1)
    steps = labels != I
    expected = -(labels * lp_pos + (1 - labels) * lp_neg)[steps].sum()
    torch.testing.assert_close(loss_sum, expected)
    assert stats.num_steps.item() == 4.0
    (grad,) = torch.autograd.grad(loss_sum, [lm_logits])
    (want,) = torch.autograd.grad(expected, [lm_logits])  # the formula above, differentiated
    torch.testing.assert_close(grad, want)
    others = [v for v in range(vocab) if v not in (pos, neg)]
    assert (grad[..., others] == 0).all()


def test_prm_argument_errors():
    logits, labels = torch.zeros(2, 3, 2), torch.zeros(2, 3)
    for call, message in [
        (lambda: prm_loss(torch.zeros(2, 3, 3), labels), r"logits must be \[batch, tokens, 2\]"),
        (lambda: prm_loss(torch.zeros(6, 2), labels), r"logits must be \[batch, tokens, 2\]"),
        (lambda: prm_loss(logits, torch.zeros(2, 4)), r"labels must be \[batch, tokens\] = \(2, 3\)"),
        (lambda: prm_token_loss(torch.zeros(2, 3), labels, positive_token_id=0, negative_token_id=1), "lm_logits"),
        (lambda: prm_token_loss(torch.zeros(2, 3, 5), labels, positive_token_id=5, negative_token_id=1),
         r"positive_token_id must be a token id in \[0, 5\), got 5"),
        (lambda: prm_token_loss(torch.zeros(2, 3, 5), labels, positive_token_id=1, negative_token_id=-1),
         "negative_token_id"),
        (lambda: prm_token_loss(torch.zeros(2, 3, 5), labels, positive_token_id=2, negative_token_id=2), "must differ"),
    ]:
        with pytest.raises(ValueError, match=message):
            call()


def test_math_shepherd_labels():
    # 3 steps, 4 completions each: half, none and all reach the answer
    reached = torch.tensor([[True, True, False, False], [False] * 4, [True] * 4])
    assert math_shepherd_labels(reached).tolist() == [0.5, 0.0, 1.0]
    assert math_shepherd_labels(reached, mode="hard").tolist() == [1.0, 0.0, 1.0]
    for bad, message in [(reached.float(), "reached must be a bool tensor"), (reached[0], "reached must be a bool"),
                         (torch.zeros(3, 0, dtype=torch.bool), "at least one completion")]:
        with pytest.raises(ValueError, match=message):
            math_shepherd_labels(bad)
    with pytest.raises(ValueError, match="unknown mode 'any'"):
        math_shepherd_labels(reached, mode="any")
