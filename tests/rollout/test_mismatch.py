"""The rollout-vs-trainer log-prob mismatch statistic (`megalign.rollout.mismatch`) against hand-worked numbers."""
import math

import pytest
import torch

from megalign.rollout.mismatch import MismatchMeter, mismatch_metrics, mismatch_sums

RECOMPUTED = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, 0.0, 0.0]])
ROLLOUT = torch.tensor([[-1.0, -2.5, -0.25], [-3.0, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_sums_and_metrics_by_hand():
    # d = recomputed - rollout on the 4 masked tokens: 0, 0.5, -0.25, 0 (the masked-out 9.0s are ignored)
    sums = mismatch_sums(RECOMPUTED, ROLLOUT, MASK)
    k3 = (math.exp(0.5) - 1 - 0.5) + (math.exp(-0.25) - 1 + 0.25)  # 0.148721... + 0.028800...
    assert sums.dtype == torch.float64
    assert sums.tolist() == pytest.approx([0.5, k3, 2.0, 4.0], rel=1e-12)
    metrics = mismatch_metrics(sums)
    assert metrics["rollout/logprob_max_abs_diff"] == 0.5
    assert metrics["rollout/logprob_k3"] == pytest.approx(0.0443805134, rel=1e-9)
    assert metrics["rollout/logprob_bitwise_equal"] == 0.5


def test_k3_keeps_tiny_differences():
    """A one-ulp difference of a fp32 log-prob near -1 (d = 1.19e-7): k3 = d^2 / 2 = 7.1e-15, which fp32 arithmetic
    (exp(d) - 1 - d) would round to 0 or to a wrong sign."""
    a = torch.tensor([[-1.0]])
    b = torch.nextafter(a, torch.tensor(0.0))
    d = float(a.double() - b.double())
    sums = mismatch_sums(a, b, torch.ones(1, 1))
    assert sums[1].item() == pytest.approx(d * d / 2, rel=1e-6) and sums[1].item() > 0
    assert sums[2].item() == 0  # not bitwise equal


def test_meter_combines_micro_batches_and_observes_once():
    meter = MismatchMeter()
    meter.start(measure_in_loss=False)
    meter.add(RECOMPUTED[:1], ROLLOUT[:1], MASK[:1])
    meter.add(RECOMPUTED[1:], ROLLOUT[1:], MASK[1:])
    assert torch.equal(meter.sums, mismatch_sums(RECOMPUTED, ROLLOUT, MASK))
    meter.observe(RECOMPUTED, RECOMPUTED, MASK)  # not pending: ignored
    assert torch.equal(meter.sums, mismatch_sums(RECOMPUTED, ROLLOUT, MASK))
    meter.start(measure_in_loss=True)
    meter.observe(RECOMPUTED[:1], ROLLOUT[:1], MASK[:1])  # the first micro-batch is measured ...
    meter.observe(RECOMPUTED[1:], RECOMPUTED[1:], MASK[1:])  # ... the later ones are not
    assert meter.metrics(torch.device("cpu")) == pytest.approx(
        {"rollout/logprob_max_abs_diff": 0.5, "rollout/logprob_k3": (math.exp(0.5) - 1.5 + math.exp(-0.25) - 0.75) / 3,
         "rollout/logprob_bitwise_equal": 1 / 3})


def test_no_tokens_no_metrics_and_bad_shapes():
    assert mismatch_metrics(mismatch_sums(RECOMPUTED, ROLLOUT, torch.zeros(2, 3))) == {}
    assert MismatchMeter().metrics(torch.device("cpu")) == {}
    with pytest.raises(ValueError, match="same shape"):
        mismatch_sums(RECOMPUTED, ROLLOUT[:, :2], MASK)
