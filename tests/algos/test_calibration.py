"""Platt scaling (`megalign.algos.platt_fit`): a hand-derived symmetric case, the minimum found by an independent
optimiser (L-BFGS on the same objective, float64), the parameters of a known logistic model recovered from its
samples, and the input checks."""
import math

import pytest
import torch

from megalign.algos import platt_fit, platt_nll


@pytest.mark.parametrize("n, c", [(1, 1.0), (3, 0.5), (10, 2.0)])
def test_symmetric_classes_by_hand(n, c):
    # n positives at +c, n negatives at -c: by symmetry b = 0, and the fit puts sigmoid(a c) at Platt's target
    # t+ = (n + 1) / (n + 2) (so sigmoid(-a c) = 1 / (n + 2) = t-): a = logit(t+) / c = log(n + 1) / c
    scores = torch.tensor([c] * n + [-c] * n)
    labels = torch.tensor([1.0] * n + [0.0] * n)
    a, b = platt_fit(scores, labels)
    assert a == pytest.approx(math.log(n + 1) / c, rel=1e-9)
    assert b == pytest.approx(0.0, abs=1e-9)


def _lbfgs(scores, labels):
    params = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([params], lr=1, max_iter=500, tolerance_grad=1e-14, tolerance_change=1e-16,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = platt_nll(params[0], params[1], scores, labels)
        loss.backward()
        return loss

    opt.step(closure)
    return params.detach().tolist()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_minimum_matches_an_independent_optimiser(seed):
    g = torch.Generator().manual_seed(seed)
    n = 57 + 20 * seed  # odd sizes, unbalanced classes, overlapping scores
    labels = (torch.rand(n, generator=g) < 0.3).double()
    scores = torch.randn(n, generator=g, dtype=torch.float64) * 3 + 2 * labels - 1
    a, b = platt_fit(scores.float(), labels)
    ref_a, ref_b = _lbfgs(scores.float().double(), labels)
    assert (a, b) == pytest.approx((ref_a, ref_b), rel=1e-6, abs=1e-8)
    assert float(platt_nll(a, b, scores.float(), labels)) <= float(platt_nll(ref_a, ref_b, scores.float(), labels)) + 1e-9


def test_separable_data_give_a_finite_slope():
    # Platt's regularised targets: perfectly separated classes still give the finite fit of the symmetric case
    a, b = platt_fit(torch.tensor([-3.0, -2.0, 2.0, 3.0]), torch.tensor([0.0, 0.0, 1.0, 1.0]))
    assert math.isfinite(a) and 0 < a < 10 and math.isfinite(b)


def test_a_known_logistic_model_is_recovered():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(200_000, generator=g, dtype=torch.float64) * 2
    labels = (torch.rand(200_000, generator=g, dtype=torch.float64) < torch.sigmoid(1.5 * scores - 0.7)).double()
    a, b = platt_fit(scores, labels)
    assert a == pytest.approx(1.5, abs=0.03) and b == pytest.approx(-0.7, abs=0.03)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="needs both labels"):
        platt_fit(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 1.0]))
    with pytest.raises(ValueError, match="labels must be 0 or 1"):
        platt_fit(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 0.5]))
    with pytest.raises(ValueError, match="3 scores but 2 labels"):
        platt_fit(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="finite"):
        platt_fit(torch.tensor([float("nan"), 2.0]), torch.tensor([1.0, 0.0]))
