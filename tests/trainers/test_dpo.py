"""Pairwise preference trainer (DPO family, SimPO, CPO, ORPO) on the embedded arithmetic pairs, on a tiny policy.

Equalities on the same global batch: dp=2 equals dp=1, tp=2 equals tp=1, cached reference
log-probs equal on-the-fly ones, a resumed run equals a straight one; and the first step of DPO
from its own reference is the hand-worked ln 2 with zero margins.
"""
import math

import pytest
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import tiny_policy
from trainers.helpers import assert_rows_close, metric_rows

from megalign.config import ConfigError, load_config
from megalign.trainers.preference import DPOConfig, train_dpo


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("policy") / "hf")


def dpo_config(policy, run_dir, *overrides) -> DPOConfig:
    return load_config(DPOConfig, None, [
        f"run_dir={run_dir}", f"model.path={policy}", "steps=2", "batch_size=8", "data.arith.max_operand=4",
        "data.max_length=40", "optim.lr=1e-3", "optim.warmup_steps=0", "eval.max_samples=0", "tensorboard=false",
        "export_hf=false", "save_every=1", "keep_last=10", "data.shuffle=true", *overrides])


def _train(policy, run_dir, *overrides):
    train_dpo(dpo_config(policy, run_dir, *overrides))


def test_first_step_from_its_own_reference_is_ln2(policy, tmp_path):
    run_distributed(_train, policy, str(tmp_path), "steps=1", world_size=1)
    row = metric_rows(str(tmp_path))[0]
    assert row["loss"] == pytest.approx(math.log(2), abs=1e-6)  # h = 0 for every pair
    assert row["rewards/margins"] == pytest.approx(0, abs=1e-6) and row["rewards/accuracies"] == 0
    assert row["logps/chosen"] < 0 and row["pairs"] == 8


def test_dp2_equals_dp1_and_cached_reference_equals_online(policy, tmp_path):
    run_distributed(_train, policy, f"{tmp_path}/dp1", world_size=1)
    run_distributed(_train, policy, f"{tmp_path}/dp2", world_size=2)
    run_distributed(_train, policy, f"{tmp_path}/online", "reference.mode=online", world_size=1)
    dp1, dp2, online = (metric_rows(f"{tmp_path}/{n}") for n in ("dp1", "dp2", "online"))
    assert len(dp1) == len(dp2) == len(online) == 2
    for a, b, c in zip(dp1, dp2, online):  # step 2's numbers also check step 1's update
        assert_rows_close(a, b)
        assert_rows_close(a, c)


def test_tp2_equals_tp1(policy, tmp_path):
    run_distributed(_train, policy, f"{tmp_path}/tp1", "steps=1", world_size=1)
    run_distributed(_train, policy, f"{tmp_path}/tp2", "steps=1", "model.tp=2", "reference.tp=2", world_size=2)
    assert_rows_close(metric_rows(f"{tmp_path}/tp1")[0], metric_rows(f"{tmp_path}/tp2")[0])


def _straight_then_resumed(policy, root):
    _train(policy, f"{root}/straight", "steps=4")
    _train(policy, f"{root}/resumed", "steps=2")
    _train(policy, f"{root}/resumed", "steps=4")


def test_resume_is_exact(policy, tmp_path):
    run_distributed(_straight_then_resumed, policy, str(tmp_path), world_size=2)
    straight, resumed = metric_rows(f"{tmp_path}/straight"), metric_rows(f"{tmp_path}/resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert straight == resumed


def _mean(rows, key):
    return sum(r[key] for r in rows) / len(rows)


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "simpo", "cpo", "orpo"])
def test_preference_losses_learn_the_pairs(policy, tmp_path, loss):
    # 60 steps of 8 pairs (the ~60 training pairs of operands up to 4) from a random policy, beta = 1: the chosen
    # responses end up ranked above the rejected ones; ORPO, whose NLL term dominates, raises the odds ratio
    run_distributed(_train, policy, str(tmp_path), f"algo.loss={loss}", "algo.beta=1.0", "algo.lam=1.0", "steps=60",
                    "save_every=0", "optim.lr=2e-3", world_size=1)
    rows = metric_rows(str(tmp_path))
    first, last = rows[:10], rows[-10:]
    assert _mean(last, "loss") < _mean(first, "loss")
    if loss == "orpo":
        assert _mean(last, "log_odds_chosen") > _mean(first, "log_odds_chosen")
    else:
        assert _mean(last, "rewards/accuracies") >= 0.75 > _mean(first, "rewards/accuracies"), \
            [r["rewards/accuracies"] for r in rows]


@pytest.mark.parametrize("override, message", [
    ("algo.label_smoothing=0.7", r"label_smoothing must be in \[0, 0.5\), got 0.7"),
    ("algo.nll_coef=-1", r"nll_coef must be a finite number >= 0, got -1.0"),
    ("algo.alpha=-1", r"alpha must be a finite number >= 0, got -1.0"),
    ("algo.lam=nan", r"lam must be a finite number >= 0, got nan"),
    ("algo.gamma_beta_ratio=-0.5", r"gamma_beta_ratio must be a finite number >= 0, got -0.5"),
    ("algo.loss=orpo", r"label_smoothing=0.1 is read only by the DPO losses \(sigmoid, robust, hinge, ipo\), not by "
                       r"loss 'orpo'"),
])
def test_every_loss_coefficient_is_checked_when_the_config_loads(override, message):
    """Checked where declared: before, label_smoothing failed in the first loss (after the whole reference pass
    and the first evaluation) and the others were never checked at the config."""
    extra = ["algo.label_smoothing=0.1"] if override == "algo.loss=orpo" else []
    with pytest.raises(ConfigError, match=rf"invalid config 'algo' \(PreferenceAlgoConfig\): {message}"):
        load_config(DPOConfig, None, [override, *extra])
