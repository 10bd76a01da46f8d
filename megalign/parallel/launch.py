"""Who am I in the job: rank, world size, local rank and the rendezvous address, from the launcher's environment.

`resolve_launch(os.environ)` reads one of four launchers, tried in this order:

- torchrun (`torch.distributed.run`, also Slurm jobs whose container hook exports the same names):
  RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT. Any of the first three present means torchrun;
  torchrun sets all five, so a missing one is an error.
- MPI (`mpirun -n N python ...`): Open MPI's OMPI_COMM_WORLD_SIZE, or MPICH / Intel MPI (Hydra)'s
  PMI_SIZE. Rank and size come from mpi4py's COMM_WORLD (the launcher's variables are checked
  against it: mpi4py built against another MPI sees a one-rank world). The local rank is
  OMPI_COMM_WORLD_LOCAL_RANK or MPI_LOCALRANKID, else the number of lower ranks on the same host
  (hostnames all-gathered). Rank 0 picks the address (its `socket.getfqdn()`, as torchrun does) and a
  free port and broadcasts them, as DeepSpeed's `mpi_discovery` does; MASTER_ADDR / MASTER_PORT, when
  set, win. mpi4py is an optional dependency (`pip install megalign[mpi]`), imported only here.
  Slurm's own srun with `--mpi=pmi2` also exports PMI_RANK / PMI_SIZE, equal to SLURM_PROCID /
  SLURM_NTASKS; such a task is a Slurm task and needs no mpi4py.
- Slurm without torchrun (`srun` one task per GPU): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID;
  MASTER_ADDR is the first host of SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST), and MASTER_PORT is
  `SLURM_JOB_ID % 4536 + 61000`, both as NVIDIA's enroot `50-slurm-pytorch.sh` hook derives them (so
  a job started either way meets at the same place); MASTER_ADDR / MASTER_PORT, when set, win.
- none of these: a single process.

Every value is checked (an integer, 0 <= rank < world size, local rank <= rank, step and job task
counts agree, ...) and a failure is a `LaunchError` naming the variable, raised before any
connection is attempted.
"""
from __future__ import annotations

import dataclasses
import re
import socket
from typing import Any, Mapping, Optional

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class LaunchError(ValueError):
    """The launcher's environment is incomplete or contradicts itself; the message names the variable."""


@dataclasses.dataclass(frozen=True)
class Launch:
    """This process's place in the job.

    launcher: "torchrun", "slurm", "mpi" or "single". master_addr / master_port: the rendezvous
    (None for "single"). local_rank_var: the variable the local rank came from (for error messages
    about the device it selects).
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    local_rank_var: str = "LOCAL_RANK"

    def torchrun_env(self) -> dict[str, str]:
        """The torchrun variables of this launch, so `init_process_group`'s env:// and any code reading them agree."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "MASTER_ADDR": str(self.master_addr), "MASTER_PORT": str(self.master_port)}


_HOST_RE = re.compile(r"([^\[\],]*)\[([^\[\]]*)\]")


def parse_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm hostlist expression into host names, in order.

    "node[01-03,07],gpu[1-2]-ib,login" -> node01 node02 node03 node07 gpu1-ib gpu2-ib login. A range
    keeps the zero padding of its lower bound ("[08-10]" -> 08 09 10); several bracket groups in one
    name expand as a product ("r[1-2]n[1-2]" -> r1n1 r1n2 r2n1 r2n2), as `scontrol show hostnames` does.
    Raises ValueError on an empty list, unbalanced brackets or a bad range.
    """
    names: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(nodelist + ","):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested '[' in nodelist {nodelist!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in nodelist {nodelist!r}")
        elif ch == "," and depth == 0:
            names.extend(_expand_host(nodelist[start:i], nodelist))
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced '[' in nodelist {nodelist!r}")
    return names


def _expand_host(item: str, nodelist: str) -> list[str]:
    """One comma-free item of a hostlist ("node[01-03,07]-ib") -> its host names."""
    if not item:
        raise ValueError(f"empty host name in nodelist {nodelist!r}")
    hosts, pos = [""], 0
    for match in _HOST_RE.finditer(item):
        if match.start() != pos:
            raise ValueError(f"bad host expression {item!r} in nodelist {nodelist!r}")
        prefix, ranges = match.groups()
        hosts = [h + prefix + n for h in hosts for n in _expand_ranges(ranges, item, nodelist)]
        pos = match.end()
    rest = item[pos:]
    if "[" in rest or "]" in rest:
        raise ValueError(f"bad host expression {item!r} in nodelist {nodelist!r}")
    return [h + rest for h in hosts]


def _expand_ranges(ranges: str, item: str, nodelist: str) -> list[str]:
    """"01-03,07" -> ["01", "02", "03", "07"]."""
    out = []
    for part in ranges.split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {part!r} in {item!r} of nodelist {nodelist!r}")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"descending range {part!r} in {item!r} of nodelist {nodelist!r}")
        out.extend(str(n).zfill(len(lo)) for n in range(first, last + 1))
    return out


def slurm_master_port(job_id: int) -> int:
    """The rendezvous port of Slurm job `job_id`: `job_id % 4536 + 61000` (61000..65535), NVIDIA enroot's rule."""
    return job_id % 4536 + 61000


def _int(env: Mapping[str, str], name: str, required_by: str) -> int:
    if name not in env:
        raise LaunchError(f"{name} is not set ({required_by})")
    try:
        return int(env[name])
    except ValueError:
        raise LaunchError(f"{name}={env[name]!r} is not an integer") from None


def _check_ranks(rank: int, world_size: int, local_rank: int, names: tuple[str, str, str]) -> None:
    """0 <= local rank <= rank < world size (a local rank counts lower ranks on the same host)."""
    rank_var, size_var, local_var = names
    if world_size < 1:
        raise LaunchError(f"{size_var}={world_size} must be at least 1")
    if not 0 <= rank < world_size:
        raise LaunchError(f"{rank_var}={rank} is not in [0, {size_var}={world_size})")
    if not 0 <= local_rank <= rank:
        raise LaunchError(f"{local_var}={local_rank} is not in [0, {rank_var}={rank}]: a local rank counts the "
                          "lower ranks on the same host")


def _port(env: Mapping[str, str], name: str = "MASTER_PORT") -> int:
    port = _int(env, name, "the rendezvous port")
    if not 1 <= port <= 65535:
        raise LaunchError(f"{name}={port} is not a TCP port (1..65535)")
    return port


def _torchrun(env: Mapping[str, str]) -> Launch:
    why = "torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT together; " \
          f"found {', '.join(v for v in TORCHRUN_VARS if v in env)}"
    rank, world, local = (_int(env, v, why) for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if not env.get("MASTER_ADDR"):
        raise LaunchError(f"MASTER_ADDR is not set ({why})")
    _check_ranks(rank, world, local, ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if "LOCAL_WORLD_SIZE" in env:
        local_world = _int(env, "LOCAL_WORLD_SIZE", why)
        if not local < local_world <= world:
            raise LaunchError(f"LOCAL_WORLD_SIZE={local_world} is not in (LOCAL_RANK={local}, WORLD_SIZE={world}]")
    return Launch("torchrun", rank, world, local, env["MASTER_ADDR"], _port(env))


def _slurm(env: Mapping[str, str]) -> Launch:
    why = "srun sets SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID for every task"
    rank, world, local = (_int(env, v, why) for v in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))
    if "SLURM_STEP_NUM_TASKS" in env:
        step_tasks = _int(env, "SLURM_STEP_NUM_TASKS", why)
        if step_tasks != world:
            raise LaunchError(f"SLURM_STEP_NUM_TASKS={step_tasks} contradicts SLURM_NTASKS={world}")
    _check_ranks(rank, world, local, ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))
    addr = env.get("MASTER_ADDR")
    if not addr:
        list_var = "SLURM_STEP_NODELIST" if env.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
        if not env.get(list_var):
            raise LaunchError("SLURM_STEP_NODELIST and SLURM_JOB_NODELIST are not set (the first host is the "
                              "rendezvous address) and neither is MASTER_ADDR")
        try:
            addr = parse_nodelist(env[list_var])[0]
        except ValueError as exc:
            raise LaunchError(f"{list_var}: {exc}") from None
    if "MASTER_PORT" in env:
        port = _port(env)
    else:
        job_id = _int(env, "SLURM_JOB_ID", "the rendezvous port is derived from it unless MASTER_PORT is set")
        port = slurm_master_port(job_id)
    return Launch("slurm", rank, world, local, addr, port, local_rank_var="SLURM_LOCALID")


def _mpi_vars(env: Mapping[str, str]) -> Optional[tuple[str, str]]:
    """(rank variable, size variable) of the MPI launcher that started this process, or None."""
    if "OMPI_COMM_WORLD_SIZE" in env:
        return "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"
    if "PMI_SIZE" in env:
        srun_pmi = "SLURM_PROCID" in env and env.get("PMI_RANK") == env["SLURM_PROCID"] \
            and env["PMI_SIZE"] == env.get("SLURM_NTASKS")
        return None if srun_pmi else ("PMI_RANK", "PMI_SIZE")
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _mpi(env: Mapping[str, str], names: tuple[str, str], comm: Any) -> Launch:
    rank_var, size_var = names
    if comm is None:
        try:
            from mpi4py import MPI
        except ImportError:
            raise LaunchError(f"{size_var} is set (started by mpirun) but mpi4py is not installed: "
                              "pip install 'megalign[mpi]'") from None
        comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    for var, value in ((size_var, world), (rank_var, rank)):
        if var in env and _int(env, var, "") != value:
            raise LaunchError(f"{var}={env[var]} but mpi4py's COMM_WORLD says {value}: mpi4py is built against "
                              "another MPI than the mpirun that started this process")
    hosts = comm.allgather(socket.gethostname())  # collective: every rank takes part, whatever it uses
    local_var = next((v for v in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID") if v in env), None)
    if local_var is not None:
        local = _int(env, local_var, "")
    else:
        local_var, local = "the hostname count", hosts[:rank].count(hosts[rank])
    _check_ranks(rank, world, local, ("the MPI rank", "the MPI size", local_var))
    addr, port = comm.bcast((socket.getfqdn(), _free_port()) if rank == 0 else None, root=0)
    return Launch("mpi", rank, world, local, env.get("MASTER_ADDR") or addr,
                  _port(env) if "MASTER_PORT" in env else port, local_rank_var=local_var)


def resolve_launch(env: Mapping[str, str], mpi_comm: Any = None) -> Launch:
    """This process's `Launch` from the environment `env` (module doc for the launchers and their order).

    `mpi_comm`: an mpi4py-like communicator (Get_rank, Get_size, bcast, allgather) to use instead of
    importing mpi4py's COMM_WORLD. Under MPI this is collective: every rank must call it.
    """
    if any(v in env for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return _torchrun(env)
    mpi = _mpi_vars(env)
    if mpi is not None:
        return _mpi(env, mpi, mpi_comm)
    if "SLURM_PROCID" in env:
        return _slurm(env)
    return Launch("single", 0, 1, 0)


def cuda_device_index(launch: Launch, device_count: int) -> int:
    """The CUDA device this process drives: its local rank, or 0 when it sees exactly one GPU.

    `srun --gpus-per-task=1` (or `--gpu-bind`) gives each task only its own GPU, so local rank 3 sees
    one device, index 0. Any other local rank at or past the visible device count is an error naming
    the variable it came from.
    """
    if launch.local_rank < device_count:
        return launch.local_rank
    if device_count == 1:
        return 0
    raise LaunchError(f"{launch.local_rank_var}={launch.local_rank} but this process sees {device_count} CUDA "
                      "devices (CUDA_VISIBLE_DEVICES): start at most one process per visible GPU")
