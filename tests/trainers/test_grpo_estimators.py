"""The GRPO trainer with each new option (REINFORCE++ estimators, CISPO, GSPO) and PPO with CISPO / GSPO: a few steps
on the tiny policy that run with finite metrics, and config errors that name the bad value."""
import math
from types import SimpleNamespace

import pytest
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import tiny_config, tiny_policy
from trainers.helpers import metric_rows
from trainers.test_ppo_trainer import tiny_ppo_config

from megalign.algos.registry import get as get_algorithm
from megalign.config import ConfigError
from megalign.trainers.grpo import GRPOTrainer, train_grpo
from megalign.trainers.ppo import train_ppo


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("policy") / "hf")


def _rows(run_dir):
    return [row for row in metric_rows(run_dir) if "reward/mean" in row]


def _check_finite(rows, steps=2):
    assert len(rows) == steps
    for row in rows:
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, bad
        assert row["actor/grad_norm"] > 0  # an update happened


def _grpo(policy, run_dir, *overrides):
    train_grpo(tiny_config(policy, run_dir, "export_hf=false", *overrides))


@pytest.mark.parametrize("overrides", [
    ("algo.advantage=reinforce_plus_plus", "algo.gamma=0.9"),
    ("algo.advantage=reinforce_plus_plus_baseline",),
    ("algo.policy_loss=cispo", "algo.ppo_epochs=2"),
    ("algo.policy_loss=gspo", "algo.loss_agg=seq-mean-token-mean", "algo.ppo_epochs=2"),
], ids=["reinforce_plus_plus", "reinforce_plus_plus_baseline", "cispo", "gspo"])
def test_grpo_option_runs(policy, tmp_path, overrides):
    run_distributed(_grpo, policy, str(tmp_path), *overrides, world_size=1)
    rows = _rows(str(tmp_path))
    _check_finite(rows)
    if "reinforce" in overrides[0]:
        assert rows[-1]["actor/kl"] > 0  # the reference was built for the KL in the reward
    if "policy_loss=gspo" in overrides[0]:
        # the second epoch moved the policy: a sequence ratio left the paper's tiny range and was clipped
        assert rows[-1]["actor/clip_frac"] > 0


def test_reference_only_when_the_reward_kl_is_on(policy, tmp_path):
    def roles(*overrides):
        cfg = tiny_config(policy, str(tmp_path), *overrides)
        built = GRPOTrainer.needs_reference(SimpleNamespace(cfg=cfg))
        assert get_algorithm("grpo").needs_reference(cfg) == built  # the planner reads the registry
        return built
    assert roles("algo.advantage=reinforce_plus_plus")
    assert not roles("algo.advantage=reinforce_plus_plus", "algo.kl_coef=0")
    assert not roles("algo.advantage=grpo")  # kl_coef is the reward's; the group estimators have none


def _ppo(policy, run_dir, *overrides):
    train_ppo(tiny_ppo_config(policy, run_dir, "export_hf=false", *overrides))


@pytest.mark.parametrize("overrides", [("algo.policy_loss=cispo",),
                                       ("algo.policy_loss=gspo", "algo.loss_agg=seq-mean-token-mean")],
                         ids=["cispo", "gspo"])
def test_ppo_option_runs(policy, tmp_path, overrides):
    run_distributed(_ppo, policy, str(tmp_path), *overrides, world_size=1)
    _check_finite(_rows(str(tmp_path)))


@pytest.mark.parametrize("overrides, message", [
    (("algo.advantage=reinforce",), "unknown advantage estimator 'reinforce'"),
    (("algo.policy_loss=sapo",), "'sapo'"),
    (("algo.policy_loss=gspo",), "loss_agg='token-mean'"),
    (("algo.policy_loss=cispo", "algo.dual_clip=3"), "dual_clip=3.0"),
    (("algo.kl_estimator=k2",), "'k2'"),
    (("algo.cispo_eps_high=-1",), "cispo_eps_high must be >= 0, got -1"),
])
def test_config_errors_name_the_value(policy, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        tiny_config(policy, str(tmp_path), *overrides)
    if overrides[0].startswith("algo.policy_loss"):
        with pytest.raises(ConfigError, match=message):
            tiny_ppo_config(policy, str(tmp_path), *overrides)
