"""The run lifecycle every trainer shares (issue 32): checkpoints that change nothing, runs that never update,
run-directory locking, fresh runs in a used directory, preemption by a signal."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from parallel.dist_utils import RankFailure, run_distributed
from trainers.grpo_helpers import policy_and_rm, tiny_config, tiny_overrides, tiny_policy
from trainers.helpers import NaNOnCalls, checkpoint_params, metric_rows
from trainers.test_ppo_trainer import tiny_ppo_config
from trainers.test_sft import tiny_config as sft_config

from megalign.checkpoint import CheckpointManager, Counters
from megalign.config import ConfigError
from megalign.roles.reward import OutcomeReward
from megalign.trainers import sft as sft_mod
from megalign.trainers.base import SkippedUpdatesError
from megalign.trainers.grpo import train_grpo
from megalign.trainers.ppo import train_ppo
from megalign.trainers.sft import train_sft
from megalign.trainers.stopping import PREEMPTED_EXIT_STATUS, Preempted

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)


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


HOLDER = """
import sys, torch.distributed as dist
from trainers.test_sft import tiny_config
from megalign.trainers.sft import train_sft
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
train_sft(tiny_config(sys.argv[1], "steps=100000", "save_every=0", "log_every=1"))
"""


def _second_job(run_dir, holder_pid):
    from megalign.checkpoint import RunDirLocked
    with pytest.raises(RunDirLocked, match=rf"run_dir '{run_dir}' is in use by host .*, pid {holder_pid}, job 4242 "
                                           rf"\(since .*\), last alive \d+ s ago"):
        train_sft(sft_config(run_dir, "steps=2"))


def test_a_second_job_on_a_run_directory_fails_at_once_naming_the_first(tmp_path):
    run_dir = str(tmp_path / "run")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS]), "SLURM_JOB_ID": "4242", "OMP_NUM_THREADS": "1"}
    env.pop("SLURM_RESTART_COUNT", None)
    first = subprocess.Popen([sys.executable, "-c", HOLDER, run_dir], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        metrics = os.path.join(run_dir, "metrics.jsonl")
        deadline = time.monotonic() + 120
        while not (os.path.exists(metrics) and os.path.getsize(metrics)):  # the first job is training
            assert first.poll() is None and time.monotonic() < deadline, "the first job did not start"
            time.sleep(0.2)
        with open(os.path.join(run_dir, "config.yaml")) as f:
            config = f.read()
        run_distributed(_second_job, run_dir, first.pid)  # both ranks fail together
        with open(os.path.join(run_dir, "config.yaml")) as f:
            assert f.read() == config  # the second job wrote nothing
    finally:
        first.kill()
        first.wait()
    # the first job is gone (killed): its lock is stale, a new job takes the directory over and releases it at the end
    run_distributed(train_sft, sft_config(run_dir, "steps=2"), world_size=1)
    assert not os.path.exists(os.path.join(run_dir, ".lock"))


def _fresh_run_in_a_used_directory(root):
    old = sft_config(root, "steps=4", "save_every=2", "keep_last=1", "seed=1")
    train_sft(old)
    manager = CheckpointManager(root)
    assert manager.steps() == [4]
    with pytest.raises(ConfigError, match=r"resume='none' starts from scratch, but .*checkpoints holds checkpoints this "
                                          r"run does not continue \(steps 4\).*overwrite_checkpoints=true"):
        train_sft(sft_config(root, "steps=2", "keep_last=1", "resume=none"))
    assert manager.steps() == [4]
    # told to overwrite: the old checkpoints go first, so the new run's own are kept and resume=auto continues it
    train_sft(sft_config(root, "steps=2", "keep_last=1", "resume=none", "overwrite_checkpoints=true"))
    assert manager.steps() == [2]
    assert manager.saved_config(2)["seed"] == 0
    # a resume from an earlier step of this run: the later checkpoints are not continued either
    train_sft(sft_config(root, "steps=4", "save_every=1", "keep_last=4"))
    with pytest.raises(ConfigError, match=r"starts from .*step_00000002, but .* \(steps 3, 4\)"):
        train_sft(sft_config(root, "steps=4", "keep_last=4", "resume=2"))
    train_sft(sft_config(root, "steps=3", "keep_last=4", "resume=2", "overwrite_checkpoints=true"))
    assert manager.steps() == [2, 3]


def test_a_fresh_run_in_a_used_run_directory_refuses_unless_told_to_overwrite(tmp_path):
    # before: resume=none saved step 2, pruning kept the old run's step 4 (the highest) and deleted it
    run_distributed(_fresh_run_in_a_used_directory, str(tmp_path), world_size=1)


class SignalOnCall:
    """Wraps a loss function: on rank `rank`, its call number `call` (1-based) first sends `sig` to this process, as
    Slurm or torchrun would at that moment."""

    def __init__(self, real, rank, call, sig):
        self.real, self.rank, self.call, self.sig, self.calls = real, rank, call, sig, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if dist.get_rank() == self.rank and self.calls == self.call:
            os.kill(os.getpid(), self.sig)
        return self.real(*args, **kwargs)


def _stopped_then_resumed(root):
    real = sft_mod.sft_loss
    sft_mod.sft_loss = SignalOnCall(real, rank=1, call=2, sig=signal.SIGUSR1)  # only rank 1, during step 2
    with pytest.raises(Preempted) as stopped:
        train_sft(sft_config(f"{root}/stopped", "save_every=0"))
    assert stopped.value.code == PREEMPTED_EXIT_STATUS == 75
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # the handlers are the process's again
    assert CheckpointManager(f"{root}/stopped").steps() == [2]  # every rank stopped after the same step, saved
    sft_mod.sft_loss = real
    train_sft(sft_config(f"{root}/stopped", "save_every=0"))
    train_sft(sft_config(f"{root}/straight", "save_every=0"))


def test_a_signal_on_one_rank_stops_every_rank_after_the_step_with_a_checkpoint(tmp_path):
    run_distributed(_stopped_then_resumed, str(tmp_path))
    assert metric_rows(tmp_path / "stopped") == metric_rows(tmp_path / "straight")
    expected = checkpoint_params(str(tmp_path / "straight"), 4)
    for name, value in checkpoint_params(str(tmp_path / "stopped"), 4).items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)


def test_save_every_minutes_checkpoints_when_the_time_has_passed(tmp_path):
    run_distributed(train_sft, sft_config(str(tmp_path), "steps=3", "save_every=0", "save_every_minutes=1e-9"),
                    world_size=1)
    assert CheckpointManager(str(tmp_path)).steps() == [1, 2, 3]


def _grpo(policy, run_dir, *overrides):
    train_grpo(tiny_config(policy, run_dir, *overrides))


def test_sigterm_to_torchrun_mid_run_then_resume_equals_the_uninterrupted_run(policy, tmp_path):
    steps, run_dir = 40, str(tmp_path / "stopped")
    entry = os.path.join(ROOT, "launch", "train_grpo.py")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", entry,
            *tiny_overrides(policy, run_dir, f"steps={steps}", "export_hf=false")]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    with open(tmp_path / "torchrun.log", "w") as log:
        torchrun = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            metrics, deadline = os.path.join(run_dir, "metrics.jsonl"), time.monotonic() + 120
            while not (os.path.exists(metrics) and os.path.getsize(metrics)):  # step 1 is done
                assert torchrun.poll() is None and time.monotonic() < deadline, open(tmp_path / "torchrun.log").read()
                time.sleep(0.05)
            torchrun.send_signal(signal.SIGTERM)  # as scancel or a preemption does; torchrun forwards it
            torchrun.wait(timeout=120)
        finally:
            if torchrun.poll() is None:
                torchrun.kill()
    text = open(tmp_path / "torchrun.log").read()
    assert text.count(f"exiting with status {PREEMPTED_EXIT_STATUS}") == 2, text  # both workers saved and stopped
    saved = CheckpointManager(run_dir).steps()
    assert len(saved) == 1 and 1 <= saved[0] < steps, (saved, text)
    run_distributed(_grpo, policy, run_dir, f"steps={steps}", "export_hf=false")  # resume=auto
    run_distributed(_grpo, policy, str(tmp_path / "straight"), f"steps={steps}", "export_hf=false")
    assert metric_rows(run_dir) == metric_rows(tmp_path / "straight")
    expected = checkpoint_params(str(tmp_path / "straight"), steps, role="actor")
    for name, value in checkpoint_params(run_dir, steps, role="actor").items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)


def _finished_before_the_counters_existed(root):
    real = Counters.state_dict
    Counters.state_dict = lambda self: {k: v for k, v in real(self).items() if k not in ("updates", "skipped_steps")}
    train_sft(sft_config(root, "steps=2"))  # checkpoints as written before issue 32
    Counters.state_dict = real
    assert train_sft(sft_config(root, "steps=2")).updates == 0  # started again: nothing ran, nothing to judge
    with pytest.raises(SkippedUpdatesError, match="never updated"):  # a step that ran and did not update is judged
        sft_mod.sft_loss = NaNOnCalls(sft_mod.sft_loss, nan_calls={1})
        train_sft(sft_config(root, "steps=3"))


def test_a_finished_run_from_before_the_update_counters_starts_again_without_judging(tmp_path):
    run_distributed(_finished_before_the_counters_existed, str(tmp_path), world_size=1)
