"""The schedule simulation (`megalign.plan.schedule`) against step times worked by hand."""
import numpy as np
import pytest

from megalign.plan.schedule import Costs, Placement, fit_costs, simulate

COSTS = Costs(decode_step_s=0.1, token_s=0.01, train_token_s=0.02, train_fixed_s=0.5)


def test_generation_and_training_costs():
    assert COSTS.generation_s(np.array([3, 10, 1])) == pytest.approx(0.1 * 10 + 0.01 * 14)
    assert COSTS.training_s(100) == pytest.approx(0.5 + 2.0)


def test_colocated_step_is_the_slowest_generation_plus_the_slowest_training():
    lengths = [np.array([10, 2, 4, 4])]  # groups of 2: device 0 gets [10, 2], device 1 [4, 4]
    out = simulate(Placement("colocated", 2), COSTS, lengths, group=2, prompt_tokens=5)
    gen = [0.1 * 10 + 0.01 * 12, 0.1 * 4 + 0.01 * 8]
    train = [0.5 + 0.02 * (12 + 10), 0.5 + 0.02 * (8 + 10)]
    assert out["step_s"] == pytest.approx(max(gen) + max(train))
    assert out["idle_fraction"] == pytest.approx(1 - (sum(gen) + sum(train)) / (2 * (max(gen) + max(train))))
    assert out["samples_per_s"] == pytest.approx(4 / (max(gen) + max(train)))


def test_disaggregated_k0_adds_the_phases_and_k1_overlaps_them():
    lengths = [np.array([4, 4])] * 5
    gen = 0.1 * 4 + 0.01 * 8  # one rollout device, the whole batch
    train = 0.5 + 0.02 * 8  # one training device, no prompt tokens
    sync = Costs(**{**COSTS.__dict__, "sync_s": 0.05})
    k0 = simulate(Placement("disaggregated", 2, 1, k=0), sync, lengths, group=2, prompt_tokens=0)
    assert k0["wall_s"] == pytest.approx(5 * (gen + train) + 4 * 0.05)
    k1 = simulate(Placement("disaggregated", 2, 1, k=1), sync, lengths, group=2, prompt_tokens=0)
    # steps 0 and 1 sample with version 0 back to back; sampling t then waits for training t - 2 and its broadcast;
    # training (the longer phase here) runs back to back after the first batch, sending versions 1..3 (step 4
    # samples with version 3, the last any batch needs): wall = gen + 5 * train + 3 * sync
    assert train + 0.05 > gen
    assert k1["wall_s"] == pytest.approx(gen + 5 * train + 3 * 0.05)
    assert k1["idle_fraction"] == pytest.approx(1 - 5 * (gen + train) / (2 * k1["wall_s"]))


def test_fit_recovers_the_costs_it_was_given():
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(20):
        lengths = rng.integers(1, 40, size=int(rng.integers(8, 64)))
        rows.append({"decode_steps": lengths.max(), "tokens": lengths.sum(), "generate_s": COSTS.generation_s(lengths),
                     "train_tokens": lengths.sum() + 7 * lengths.size,
                     "train_s": COSTS.training_s(lengths.sum() + 7 * lengths.size)})
    fitted = fit_costs(rows)
    for name in ("decode_step_s", "token_s", "train_token_s", "train_fixed_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(COSTS, name), rel=1e-6), name


def test_bad_placements_are_refused():
    with pytest.raises(ValueError, match="1 <= rollout_devices < devices"):
        Placement("disaggregated", 2, 2)
    with pytest.raises(ValueError, match="k must be >= 0"):
        Placement("disaggregated", 2, 1, k=-1)
