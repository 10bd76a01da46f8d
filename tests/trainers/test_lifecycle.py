"""The run lifecycle every trainer shares (issue 32): checkpoints that change nothing, runs that never update,
run-directory locking, fresh runs in a used directory, preemption by a signal."""
import pytest
import torch
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import tiny_policy
from trainers.helpers import checkpoint_params
from trainers.test_ppo_trainer import tiny_ppo_config

from megalign.trainers.ppo import train_ppo


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
