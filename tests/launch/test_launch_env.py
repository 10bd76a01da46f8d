"""megalign.parallel.launch: each launcher's variables, the Slurm hostlist parser, and every missing or
contradictory variable's error, against hand-worked expectations."""
import os
import socket
import subprocess
import sys

import pytest

from megalign.parallel.launch import (Launch, LaunchError, cuda_device_index, parse_nodelist, resolve_launch,
                                      slurm_master_port)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node01", "MASTER_PORT": "29500"}
# what srun gives task 5 of 8 (4 per node, second node) of job 123456
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "123456",
         "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_NODELIST": "gpu[07-08],gpu11", "SLURM_STEP_NUM_TASKS": "8"}


@pytest.mark.parametrize("nodelist, hosts", [
    ("login1", ["login1"]),
    ("a,b", ["a", "b"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("node[8-10]", ["node8", "node9", "node10"]),
    ("node[08-10]", ["node08", "node09", "node10"]),
    ("gpu[1-2]-ib,login", ["gpu1-ib", "gpu2-ib", "login"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("cn[5],x[001-002]", ["cn5", "x001", "x002"]),
    ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
])
def test_parse_nodelist(nodelist, hosts):
    assert parse_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist, message", [
    ("", "empty host name"), ("a,,b", "empty host name"), ("node[1-2", "unbalanced '['"),
    ("node1-2]", "unbalanced ']'"), ("node[[1]]", "nested '['"), ("node[3-1]", "descending range"),
    ("node[a-b]", "bad range"), ("node[1-]", "bad range"), ("node[]", "bad range"),
])
def test_parse_nodelist_errors(nodelist, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        parse_nodelist(nodelist)


def test_slurm_master_port():
    # enroot's 50-slurm-pytorch.sh: SLURM_JOB_ID % 4536 + 61000; 123456 = 27 * 4536 + 984
    assert [slurm_master_port(j) for j in (0, 4535, 4536, 123456)] == [61000, 65535, 61000, 61984]


def test_torchrun():
    assert resolve_launch(TORCHRUN) == Launch("torchrun", 3, 8, 1, "node01", 29500)


@pytest.mark.parametrize("missing", ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"])
def test_torchrun_missing_variable(missing):
    env = {k: v for k, v in TORCHRUN.items() if k != missing}
    with pytest.raises(LaunchError, match=f"^{missing} is not set"):
        resolve_launch(env)


@pytest.mark.parametrize("change, message", [
    ({"WORLD_SIZE": "eight"}, "WORLD_SIZE='eight' is not an integer"),
    ({"RANK": "8"}, r"RANK=8 is not in \[0, WORLD_SIZE=8\)"),
    ({"RANK": "-1"}, r"RANK=-1 is not in \[0, WORLD_SIZE=8\)"),
    ({"WORLD_SIZE": "0", "RANK": "0", "LOCAL_RANK": "0"}, "WORLD_SIZE=0 must be at least 1"),
    ({"LOCAL_RANK": "4"}, r"LOCAL_RANK=4 is not in \[0, RANK=3\]"),
    ({"LOCAL_WORLD_SIZE": "1"}, r"LOCAL_WORLD_SIZE=1 is not in \(LOCAL_RANK=1, WORLD_SIZE=8\]"),
    ({"LOCAL_WORLD_SIZE": "16"}, r"LOCAL_WORLD_SIZE=16 is not in"),
    ({"MASTER_PORT": "70000"}, r"MASTER_PORT=70000 is not a TCP port"),
])
def test_torchrun_contradictions(change, message):
    with pytest.raises(LaunchError, match=message):
        resolve_launch({**TORCHRUN, **change})


def test_torchrun_wins_inside_srun():
    # `srun torchrun ...` (one torchrun per node): the workers carry both sets; torchrun's are theirs
    assert resolve_launch({**SLURM, **TORCHRUN}).launcher == "torchrun"


def test_slurm():
    # the step's first host and enroot's port (123456 % 4536 + 61000)
    assert resolve_launch(SLURM) == Launch("slurm", 5, 8, 1, "gpu07", 61984, local_rank_var="SLURM_LOCALID")


def test_slurm_job_nodelist_and_overrides():
    env = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_NODELIST"}
    env["SLURM_JOB_NODELIST"] = "n[3-4]"
    assert (resolve_launch(env).master_addr, resolve_launch(env).master_port) == ("n3", 61984)
    set_by_user = resolve_launch({**env, "MASTER_ADDR": "head", "MASTER_PORT": "1234"})
    assert (set_by_user.master_addr, set_by_user.master_port) == ("head", 1234)
    no_job_id = {k: v for k, v in env.items() if k != "SLURM_JOB_ID"}
    assert resolve_launch({**no_job_id, "MASTER_PORT": "1234"}).master_port == 1234


@pytest.mark.parametrize("missing", ["SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_ID"])
def test_slurm_missing_variable(missing):
    with pytest.raises(LaunchError, match=f"^{missing} is not set"):
        resolve_launch({k: v for k, v in SLURM.items() if k != missing})


def test_slurm_missing_nodelist():
    env = {k: v for k, v in SLURM.items() if not k.endswith("NODELIST")}
    with pytest.raises(LaunchError, match="SLURM_STEP_NODELIST and SLURM_JOB_NODELIST are not set"):
        resolve_launch(env)


@pytest.mark.parametrize("change, message", [
    ({"SLURM_STEP_NUM_TASKS": "4"}, "SLURM_STEP_NUM_TASKS=4 contradicts SLURM_NTASKS=8"),
    ({"SLURM_PROCID": "8"}, r"SLURM_PROCID=8 is not in \[0, SLURM_NTASKS=8\)"),
    ({"SLURM_LOCALID": "6"}, r"SLURM_LOCALID=6 is not in \[0, SLURM_PROCID=5\]"),
    ({"SLURM_JOB_ID": "12a"}, "SLURM_JOB_ID='12a' is not an integer"),
    ({"SLURM_STEP_NODELIST": "gpu[07-"}, "SLURM_STEP_NODELIST: unbalanced"),
    ({"MASTER_PORT": "0"}, "MASTER_PORT=0 is not a TCP port"),
])
def test_slurm_contradictions(change, message):
    with pytest.raises(LaunchError, match=message):
        resolve_launch({**SLURM, **change})


def test_srun_pmi2_task_is_slurm():
    # srun --mpi=pmi2 exports PMI_RANK / PMI_SIZE equal to the Slurm ones: a Slurm task, no mpi4py needed
    assert resolve_launch({**SLURM, "PMI_RANK": "5", "PMI_SIZE": "8"}).launcher == "slurm"


class FakeComm:
    """An mpi4py COMM_WORLD as seen from one rank: `hosts` are every rank's hostname, `from_root` what rank 0 sends."""

    def __init__(self, rank, hosts, from_root=None):
        self.rank, self.hosts, self.from_root = rank, hosts, from_root

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return len(self.hosts)

    def allgather(self, value):
        assert value == socket.gethostname()  # each rank contributes its own hostname
        return list(self.hosts)

    def bcast(self, value, root):
        assert root == 0 and (value is None) == (self.rank != 0)
        return value if self.rank == 0 else self.from_root


def _ompi(rank, size, **extra):
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size), **extra}


def test_mpi_rank0_broadcasts_its_address_and_a_free_port():
    got = resolve_launch(_ompi(0, 2), mpi_comm=FakeComm(0, ["a", "a"]))
    assert (got.launcher, got.rank, got.world_size, got.local_rank) == ("mpi", 0, 2, 0)
    assert got.master_addr == socket.getfqdn() and 1 <= got.master_port <= 65535


def test_mpi_other_ranks_take_rank0s_address():
    got = resolve_launch(_ompi(3, 4, OMPI_COMM_WORLD_LOCAL_RANK="1"), mpi_comm=FakeComm(3, ["a", "b", "a", "b"],
                                                                                         ("head", 40000)))
    assert got == Launch("mpi", 3, 4, 1, "head", 40000, local_rank_var="OMPI_COMM_WORLD_LOCAL_RANK")
    user = resolve_launch(_ompi(3, 4, MASTER_ADDR="mine", MASTER_PORT="1234"),
                          mpi_comm=FakeComm(3, ["a", "b", "a", "b"], ("head", 40000)))
    assert (user.master_addr, user.master_port) == ("mine", 1234)


@pytest.mark.parametrize("rank, local", [(0, 0), (1, 0), (2, 1), (3, 1), (4, 2)])
def test_mpi_local_rank_from_hostname_count(rank, local):
    # no local-rank variable (e.g. another MPI): the lower ranks on the same host, round-robin placement
    hosts = ["a", "b", "a", "b", "a"]
    env = {"PMI_RANK": str(rank), "PMI_SIZE": "5"}
    assert resolve_launch(env, mpi_comm=FakeComm(rank, hosts, ("a", 40000))).local_rank == local


def test_mpi_hydra_inside_a_slurm_allocation_is_mpi():
    # mpiexec (Hydra) inside sbatch: its proxies are Slurm tasks, the PMI variables disagree with them
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "PMI_RANK": "3", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1"}
    got = resolve_launch(env, mpi_comm=FakeComm(3, ["a"] * 2 + ["b"] * 6, ("a", 40000)))
    assert (got.launcher, got.rank, got.local_rank, got.local_rank_var) == ("mpi", 3, 1, "MPI_LOCALRANKID")


@pytest.mark.parametrize("env, comm_rank, message", [
    (_ompi(0, 2), 0, "OMPI_COMM_WORLD_SIZE=2 but mpi4py's COMM_WORLD says 1"),
    (_ompi(1, 1), 0, "OMPI_COMM_WORLD_RANK=1 but mpi4py's COMM_WORLD says 0"),
])
def test_mpi_contradicts_mpi4py(env, comm_rank, message):
    # mpi4py built against another MPI: each process is a one-rank world
    with pytest.raises(LaunchError, match=message):
        resolve_launch(env, mpi_comm=FakeComm(comm_rank, ["a"]))


def test_mpi_local_rank_contradiction():
    with pytest.raises(LaunchError, match=r"OMPI_COMM_WORLD_LOCAL_RANK=2 is not in \[0, the MPI rank=1\]"):
        resolve_launch(_ompi(1, 2, OMPI_COMM_WORLD_LOCAL_RANK="2"), mpi_comm=FakeComm(1, ["a", "a"], ("a", 1)))


def test_mpi_without_mpi4py(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import fails as if not installed
    with pytest.raises(LaunchError, match=r"OMPI_COMM_WORLD_SIZE is set .* mpi4py is not installed.*megalign\[mpi\]"):
        resolve_launch(_ompi(0, 2))


def test_single_process():
    assert resolve_launch({}) == Launch("single", 0, 1, 0)
    assert resolve_launch({"MASTER_ADDR": "x", "MASTER_PORT": "1"}).launcher == "single"


def test_cuda_device_index():
    slurm = Launch("slurm", 3, 8, 3, "a", 1, local_rank_var="SLURM_LOCALID")
    assert cuda_device_index(slurm, 8) == 3
    assert cuda_device_index(slurm, 1) == 0  # srun --gpus-per-task=1: the task's own GPU
    with pytest.raises(LaunchError, match="SLURM_LOCALID=3 but this process sees 2 CUDA devices"):
        cuda_device_index(slurm, 2)


def test_entry_point_reports_launch_error():
    # through launch/train_grpo.py: one `error:` line naming the variable, exit status 2, before any connection
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(RANK="0", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "train_grpo.py"), "device=cpu"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: WORLD_SIZE is not set (torchrun sets RANK")
