"""The DPO trainer with each of TRL's DPO variants (`algo.loss`: apo_zero, apo_down, nca_pair, sppo_hard, exo_pair,
bco_pair) on the embedded arithmetic pairs, on a tiny policy.

At the first step the policy is its own reference, so every log-ratio is 0 and the loss of every pair is a
hand-worked constant of beta (0.1, the default) and EXO's eps; the second step runs after one update.
"""
import math

import pytest
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import tiny_policy
from trainers.helpers import metric_rows

from megalign.config import load_config
from megalign.trainers.preference import DPOConfig, train_dpo

EPS = 1e-3  # EXO's default eps
FIRST_STEP_LOSS = {
    "apo_zero": 0.5 + 0.5,  # sigma(0) + sigma(0)
    "apo_down": 0.5 + 0.5,
    "nca_pair": -math.log(0.5) - 0.5 * (2 * math.log(0.5)),
    "sppo_hard": (0 - 0.5 / 0.1) ** 2 + (0 + 0.5 / 0.1) ** 2,
    "exo_pair": 0.5 * (math.log(0.5) - math.log(1 - EPS)) + 0.5 * (math.log(0.5) - math.log(EPS)),
    "bco_pair": 2 * math.log(2),  # delta = 0
}


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("policy") / "hf")


def _train(policy, run_dir, loss):
    train_dpo(load_config(DPOConfig, None, [
        f"run_dir={run_dir}", f"model.path={policy}", "steps=2", "batch_size=8", "data.arith.max_operand=4",
        "data.max_length=40", "optim.lr=1e-3", "optim.warmup_steps=0", "eval.max_samples=0", "tensorboard=false",
        "export_hf=false", "save_every=0", f"algo.loss={loss}"]))


@pytest.mark.parametrize("loss", sorted(FIRST_STEP_LOSS))
def test_one_step_with_each_variant(policy, tmp_path, loss):
    run_distributed(_train, policy, str(tmp_path), loss, world_size=1)
    first, second = metric_rows(str(tmp_path))
    assert first["loss"] == pytest.approx(FIRST_STEP_LOSS[loss], rel=1e-6)
    assert first["rewards/margins"] == pytest.approx(0, abs=1e-6) and first["pairs"] == 8
    assert math.isfinite(second["loss"]) and second["loss"] != pytest.approx(first["loss"], rel=1e-6)
    assert second["rewards/margins"] != 0  # the update moved the policy away from its reference
