"""launch/slurm/*.sbatch ahead of the time limit: Slurm's SIGUSR1 to the batch shell (`--signal=B:USR1@...`) reaches
every rank through srun (and torchrun), the run stops after its step with a checkpoint, and the job requeues itself
(`scontrol requeue`). Run under the stand-ins of slurm_standins/ (test_launchers.py), one worker per "node"."""
import os
import signal
import subprocess
import time

import pytest
from launch.test_launchers import ENTRY, ROOT, _free_port, _sbatch_env
from trainers.grpo_helpers import tiny_overrides, tiny_policy

from megalign.checkpoint import CheckpointManager
from megalign.trainers.stopping import PREEMPTED_EXIT_STATUS


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("policy") / "hf")


@pytest.mark.parametrize("script, extra", [("srun.sbatch", {"SLURM_NTASKS_PER_NODE": "1"}),
                                           ("torchrun.sbatch", {"GPUS_PER_NODE": "1"})])
def test_usr1_ahead_of_the_time_limit_checkpoints_and_requeues(policy, script, extra, tmp_path):
    steps, run_dir = 60, str(tmp_path / "run")
    env = _sbatch_env(tmp_path, SCONTROL_STANDIN_LOG=str(tmp_path / "scontrol.calls"), RDZV_PORT=str(_free_port()),
                      **extra)
    argv = ["bash", os.path.join(ROOT, "launch", "slurm", script), ENTRY,
            *tiny_overrides(policy, run_dir, f"steps={steps}", "export_hf=false")]
    with open(tmp_path / "batch.log", "w") as log:
        batch = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            metrics, deadline = os.path.join(run_dir, "metrics.jsonl"), time.monotonic() + 120
            while not (os.path.exists(metrics) and os.path.getsize(metrics)):
                assert batch.poll() is None and time.monotonic() < deadline, open(tmp_path / "batch.log").read()
                time.sleep(0.05)
            batch.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@300 sends to the batch shell
            status = batch.wait(timeout=120)
        finally:
            if batch.poll() is None:
                batch.kill()
    job_logs = tmp_path / "logs" / f"t-{env['SLURM_JOB_ID']}"
    text = "".join(open(job_logs / name).read() for name in sorted(os.listdir(job_logs)))
    assert status != 0 and text.count(f"exiting with status {PREEMPTED_EXIT_STATUS}") == 2, text
    if script == "srun.sbatch":  # the ranks are srun's tasks: their status is the job's
        assert status == PREEMPTED_EXIT_STATUS
    saved = CheckpointManager(run_dir).steps()
    assert len(saved) == 1 and 1 <= saved[0] < steps, (saved, text)
    assert open(tmp_path / "scontrol.calls").read() == f"requeue {env['SLURM_JOB_ID']}\n"
    assert "requeueing it" in open(tmp_path / "batch.log").read()
