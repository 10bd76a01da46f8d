"""Platt scaling: a reward model's score read as a probability, p = sigmoid(a * s + b).

A Bradley-Terry RM is trained only on score differences, so its scale and offset are arbitrary and its order
among responses of the same class (two wrong answers) is unconstrained. Fitting a logistic curve from the score
to a 0/1 label (Platt 1999, "Probabilistic outputs for support vector machines") on held-out labelled responses
turns it into a calibrated probability of the label; as a PPO reward that probability is flat where the RM is
sure (the differences among responses it ranks far below the boundary shrink toward 0) and steep where it is not.

`platt_fit` follows Platt's recipe with the numerical fixes of Lin, Lin & Weng (2007, "A note on Platt's
probabilistic outputs for support vector machines"): regularised targets t+ = (N+ + 1) / (N+ + 2) and
t- = 1 / (N- + 2) instead of 1 / 0, so separable data do not send the slope to infinity, and Newton's method
with a backtracking line search on the cross-entropy, in float64.
"""
from __future__ import annotations

import torch

__all__ = ["platt_fit", "platt_nll"]


def _targets(labels: torch.Tensor, positives: float, negatives: float) -> torch.Tensor:
    """Platt's regularised targets [N] float64: (N+ + 1) / (N+ + 2) for a positive, 1 / (N- + 2) for a negative."""
    hi, lo = (torch.tensor(v, dtype=torch.float64) for v in ((positives + 1) / (positives + 2), 1 / (negatives + 2)))
    return torch.where(labels > 0, hi, lo)


def platt_nll(a: float, b: float, scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The objective `platt_fit` minimises: sum_i cross-entropy(t_i, sigmoid(a * s_i + b)) with Platt's targets.
    `scores` [N], `labels` [N] in {0, 1}; float64 scalar."""
    s, y = scores.double(), labels.double()
    return _nll(a, b, s, _targets(y, float(y.sum()), float(y.numel() - y.sum())))


def _nll(a: float, b: float, s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """sum_i t_i * -log sigmoid(z_i) + (1 - t_i) * -log(1 - sigmoid(z_i)), z = a * s + b, in the stable form
    softplus(z) - t * z."""
    z = a * s + b
    return (torch.nn.functional.softplus(z) - t * z).sum()


def platt_fit(scores: torch.Tensor, labels: torch.Tensor, max_iters: int = 100,
              tol: float = 1e-10) -> tuple[float, float]:
    """(a, b) minimising `platt_nll` over `scores` [N] and their 0/1 `labels` [N] (both classes present).

    Newton steps on (a, b) with the 2 x 2 Hessian (plus a tiny ridge where it is singular) and step halving
    until the objective does not increase beyond float64 rounding (which near the minimum hides the decrease of
    a full step); stops when the gradient's largest entry is below `tol` times N.
    Starts from a = 0, b = log((N+ + 1) / (N- + 1)) as Platt's pseudo-code does.
    """
    s, y = scores.double().flatten(), labels.double().flatten()
    if s.numel() != y.numel():
        raise ValueError(f"platt_fit: {s.numel()} scores but {y.numel()} labels")
    if not bool(((y == 0) | (y == 1)).all()):
        raise ValueError("platt_fit: labels must be 0 or 1")
    positives, negatives = float(y.sum()), float(y.numel() - y.sum())
    if positives == 0 or negatives == 0:
        raise ValueError(f"platt_fit needs both labels, got {int(positives)} positive and {int(negatives)} negative")
    if not bool(torch.isfinite(s).all()):
        raise ValueError("platt_fit: scores must be finite")
    t = _targets(y, positives, negatives)
    a, b = 0.0, float(torch.log(torch.tensor((positives + 1) / (negatives + 1))))
    loss = _nll(a, b, s, t)
    for _ in range(max_iters):
        p = torch.sigmoid(a * s + b)
        r = p - t  # d loss / d z
        grad = torch.stack([(r * s).sum(), r.sum()])
        if float(grad.abs().max()) < tol * s.numel():
            break
        w = p * (1 - p)
        hess = torch.tensor([[float((w * s * s).sum()), float((w * s).sum())],
                             [float((w * s).sum()), float(w.sum())]], dtype=torch.float64)
        step = torch.linalg.solve(hess + 1e-12 * torch.eye(2, dtype=torch.float64), grad)
        size = 1.0
        while size > 1e-10:
            a_new, b_new = a - size * float(step[0]), b - size * float(step[1])
            new_loss = _nll(a_new, b_new, s, t)
            if new_loss <= loss + 1e-13 * abs(float(loss)):  # within rounding: near the minimum the full step is right
                break
            size /= 2
        else:
            break  # no decrease along Newton's direction: at the minimum to float64 precision
        a, b, loss = a_new, b_new, new_loss
    return a, b
