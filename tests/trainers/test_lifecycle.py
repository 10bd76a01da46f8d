"""The run lifecycle every trainer shares (issue 32): checkpoints that change nothing, runs that never update,
run-directory locking, fresh runs in a used directory, preemption by a signal."""
import os

import pytest
import torch
from parallel.dist_utils import RankFailure, run_distributed
from trainers.grpo_helpers import policy_and_rm, tiny_config, tiny_policy
from trainers.helpers import NaNOnCalls, checkpoint_params
from trainers.test_ppo_trainer import tiny_ppo_config
from trainers.test_sft import tiny_config as sft_config

from megalign.config import ConfigError
from megalign.roles.reward import OutcomeReward
from megalign.trainers import sft as sft_mod
from megalign.trainers.base import SkippedUpdatesError
from megalign.trainers.grpo import train_grpo
from megalign.trainers.ppo import train_ppo
from megalign.trainers.sft import train_sft


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("policy") / "hf")


def _ppo_saving_every(policy, root, save_every_values):
    for every in save_every_values:
        train_ppo(tiny_ppo_config(policy, f"{root}/every{every}", "steps=6", "algo.critic_warmup=5",
                                  f"save_every={every}", "export_hf=false"))


def test_saving_checkpoints_does_not_change_training(policy, tmp_path):
    # PPO's actor waits 5 steps for the critic: saves at steps 1..5 (or 5) come before its optimizer's first step
    run_distributed(_ppo_saving_every, policy, str(tmp_path), (0, 1, 5), world_size=1, timeout_s=300)
    for role in ("actor", "critic"):
        expected = checkpoint_params(str(tmp_path / "every0"), 6, role=role)
        for every in (1, 5):
            got = checkpoint_params(str(tmp_path / f"every{every}"), 6, role=role)
            for name, value in expected.items():
                torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=f"save_every={every} {name}")


def _nan_reward_model_run(cfg, match):
    real = OutcomeReward.score
    OutcomeReward.score = lambda *args: real(*args) * float("nan")  # a broken reward model: every score NaN
    with pytest.raises(SkippedUpdatesError, match=match):
        train_grpo(cfg)


def test_a_run_whose_rewards_are_all_nan_fails_after_its_last_checkpoint(tmp_path):
    policy, rm = policy_and_rm(tmp_path)
    cfg = tiny_config(policy, str(tmp_path / "run"), f"reward.model.path={rm}", "export_hf=true")
    # 2 steps x 2 mini-batches, each skipped
    run_distributed(_nan_reward_model_run, cfg,
                    r"GRPO: the policy was never updated: updated in 0 of 2 steps \(2 skipped: nan_skips 4, "
                    r"empty_updates 0\)\. The checkpoint of step 2 is kept and nothing was exported", world_size=1)
    assert os.path.isdir(tmp_path / "run" / "checkpoints" / "step_00000002")
    assert not os.path.exists(tmp_path / "run" / "hf")  # no unchanged model handed to the next stage


def _sft_one_nan_step(root, *overrides):
    sft_mod.sft_loss = NaNOnCalls(sft_mod.sft_loss, nan_calls={2})
    result = train_sft(sft_config(root, "steps=3", *overrides))
    assert result.updates == 2


def test_too_many_skipped_updates_fail_the_run_and_the_closing_line_counts_updates(tmp_path, capfd):
    run_distributed(_sft_one_nan_step, str(tmp_path / "default"), world_size=1)  # 1 of 3 skipped <= 0.5
    assert "SFT: policy updated in 2 of 3 steps (1 skipped: nan_skips 1, empty_updates 0)" in capfd.readouterr().out
    with pytest.raises(RankFailure, match=r"SkippedUpdatesError: SFT: more than max_skipped_fraction=0.3 of the "
                                          r"steps meant to update the policy skipped their update: updated in 2 of 3"):
        run_distributed(_sft_one_nan_step, str(tmp_path / "strict"), "max_skipped_fraction=0.3", world_size=1)


def test_a_critic_warmup_as_long_as_the_run_fails_at_start_up(policy, tmp_path):
    with pytest.raises(ConfigError, match=r"algo\.critic_warmup=3 >= steps=3: the actor would never be trained"):
        tiny_ppo_config(policy, str(tmp_path), "steps=3", "algo.critic_warmup=3")
    with pytest.raises(ConfigError, match=r"max_skipped_fraction must be in \[0, 1\], got 1\.5"):
        tiny_ppo_config(policy, str(tmp_path), "max_skipped_fraction=1.5")
