"""A reward that never returns, or a rank that stops making progress, ends the job with a message instead of hanging
it until the cluster's walltime: the per-sample reward timeout (counted against reward.max_failure_fraction) and
the step watchdog, in-process and under torchrun with 2 gloo ranks, where one hung rank must not leave the other
waiting forever."""
import os
import subprocess
import sys

import pytest
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import HERE, tiny_config, tiny_overrides, tiny_policy

from megalign.trainers.grpo import train_grpo
from megalign.trainers.watchdog import WATCHDOG_EXIT_STATUS

ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("policy") / "hf")


def _hung_reward_run(cfg):
    with pytest.raises(RuntimeError, match=r"reward term 'never_returns' failed on 16 of 16 samples this step, more "
                                           r"than reward.max_failure_fraction=0.5; its last error: RewardTimeout"):
        train_grpo(cfg)


def test_a_reward_that_never_returns_times_out_and_stops_the_run(policy, tmp_path):
    cfg = tiny_config(policy, str(tmp_path / "run"), "reward.timeout_s=0.05",
                      f"reward.terms=[{{name: '{HERE}/grpo_helpers.py:never_returns'}}]")
    run_distributed(_hung_reward_run, cfg, world_size=1, timeout_s=120)


def _torchrun(tmp_path, *overrides, timeout=240):
    """(exit status, output) of a 2-rank torchrun of launch/train_grpo.py whose reward hangs on rank 0."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            os.path.join(ROOT, "launch", "train_grpo.py"),
            *tiny_overrides(tmp_path / "policy", tmp_path / "run", "export_hf=false",
                            f"reward.terms=[{{name: '{HERE}/grpo_helpers.py:hangs_on_rank0'}}]", *overrides)]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    return done.returncode, done.stdout


def test_a_reward_hung_on_one_rank_times_out_and_both_ranks_stop_under_torchrun(tmp_path):
    tiny_policy(tmp_path / "policy")
    # rank 0's 8 samples time out and rank 1's score: 8 of 16 fail, more than a quarter
    status, out = _torchrun(tmp_path, "reward.timeout_s=0.2", "reward.max_failure_fraction=0.25")
    assert status != 0 and out.count("failed on 8 of 16 samples this step") >= 2, out  # both ranks raised


def test_the_watchdog_ends_a_torchrun_job_whose_rank_hangs_naming_the_phase(tmp_path):
    tiny_policy(tmp_path / "policy")
    status, out = _torchrun(tmp_path, "reward.timeout_s=0", "watchdog_minutes=0.05")
    assert status != 0, out
    assert "rank 0: no progress for" in out and "in phase 'reward' of step 1" in out, out
    assert f"exit status {WATCHDOG_EXIT_STATUS}" in out and "never_returns" in out, out  # the stack shows where
