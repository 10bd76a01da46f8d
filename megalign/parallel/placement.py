"""Disaggregated placement: the job's ranks split into training ranks and rollout ranks, and the bridge between them.

With `placement.mode: disaggregated` and `placement.rollout_ranks: n` a job of W ranks (started by torchrun, Slurm
or mpirun as any other) runs training on global ranks [0, W - n) and generation on [W - n, W). Each side gets its
own default process group (`init_side_group`), so every layout, collective and checkpoint of the side sees a world
of its own ranks and runs unchanged: the trainers' tp x pp x dp layout spans W - n ranks, the rollout engine's tp x
dp layout spans n. The two sides meet only through the `Bridge`, a process group over all W ranks built directly on
the job's rendezvous store (so it is not the default group and no side's collective can step on it):

- objects (rollout batches, control messages) go point to point between the two sides' rank 0, pickled into uint8
  tensors, a length then the payload; gloo matches sends and receives of one pair and tag in order;
- weights go from the training side to every rollout rank by bucketed broadcasts (`send_weights` /
  `receive_weights`; the sender does not wait for them): one group per training pipeline stage, holding that stage's tp-rank-0 of dp replica 0
  (which gathers the stage's tensors, `megalign.models.hf_adapter.hf_tensor_stream`) and every rollout rank, which
  keeps what its own tp shard needs. The tensors travel under their HF names as whole tensors, so the two sides'
  tp sizes need not agree (resharding is the HF loader's slicing).

On CUDA the weight groups are NCCL (device buffers); objects always go over gloo on the CPU.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
from typing import Any, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

SIDES = ("train", "rollout")


@dataclasses.dataclass(frozen=True)
class Split:
    """Which side global `rank` of a `world_size`-rank job is on when its last `rollout_ranks` ranks roll out."""

    rank: int
    world_size: int
    rollout_ranks: int

    def __post_init__(self) -> None:
        if not 1 <= self.rollout_ranks < self.world_size:
            raise ValueError(f"placement.rollout_ranks={self.rollout_ranks}: a disaggregated job needs at least one "
                             f"rollout and one training rank, and the job has {self.world_size} rank(s)")

    @property
    def train_ranks(self) -> int:
        return self.world_size - self.rollout_ranks

    @property
    def side(self) -> str:
        return "train" if self.rank < self.train_ranks else "rollout"

    @property
    def side_rank(self) -> int:
        """This rank's rank in its side's default group."""
        return self.rank if self.side == "train" else self.rank - self.train_ranks

    @property
    def side_size(self) -> int:
        return self.train_ranks if self.side == "train" else self.rollout_ranks

    @property
    def rollout_leader(self) -> int:
        """Global rank of the rollout side's rank 0 (the one that talks to the training side's rank 0)."""
        return self.train_ranks


def job_store(launch_rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """A client of the job's rendezvous store (MASTER_ADDR / MASTER_PORT). Under torchrun the agent hosts it
    (TORCHELASTIC_USE_AGENT_STORE); otherwise global rank 0 hosts it: the first caller there binds the port, and the
    store stays alive inside its side's default group."""
    hosted = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                         is_master=launch_rank == 0 and not hosted, timeout=timeout, wait_for_workers=False)


def init_side_group(backend: str, split: Split, timeout: datetime.timedelta) -> None:
    """The default process group over this rank's side only (module doc)."""
    store = job_store(split.rank, split.world_size, timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"megalign/{split.side}", store), rank=split.side_rank,
                            world_size=split.side_size, timeout=timeout)


def _payload(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)


class Bridge:
    """Point-to-point objects between the two sides' leaders and the weight groups (module doc).

    Collective over the whole job: every rank of both sides constructs it, after its side's default group exists.
    `train_senders`: global ranks of the training side that send weights, one per pipeline stage, in stage order.
    """

    OBJECT_TAG = 7

    def __init__(self, split: Split, train_senders: list[int], device_type: str, timeout: datetime.timedelta):
        self.split, self.senders, self.device_type = split, list(train_senders), device_type
        store = job_store(split.rank, split.world_size, timeout)
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("megalign/bridge", store), split.rank, split.world_size,
                                        timeout)
        self.rollout = list(range(split.train_ranks, split.world_size))
        self.weight_groups: list[Optional[Any]] = []
        for stage, sender in enumerate(self.senders):  # members: the sender, then every rollout rank
            members = [sender] + self.rollout
            group = None
            if split.rank in members:
                prefix = dist.PrefixStore(f"megalign/weights{stage}", store)
                index, size = members.index(split.rank), len(members)
                if device_type == "cuda":
                    group = dist.ProcessGroupNCCL(prefix, index, size)
                else:
                    group = dist.ProcessGroupGloo(prefix, index, size, timeout)
            self.weight_groups.append(group)
        self._pending: list[tuple[Any, list[torch.Tensor]]] = []
        self._weight_works: list[tuple[Any, torch.Tensor]] = []

    @property
    def peer(self) -> int:
        """The other side's leader, for this side's rank 0."""
        return self.split.rollout_leader if self.split.side == "train" else 0

    def send(self, obj: Any) -> None:
        """Send `obj` to the other side's leader without waiting for it to be received (`flush` waits)."""
        self._pending = [(works, kept) for works, kept in self._pending  # free what the peer already received
                         if not all(work.is_completed() for work in works)]
        payload = _payload(obj)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        works = [self.pg.send([size], self.peer, self.OBJECT_TAG), self.pg.send([payload], self.peer, self.OBJECT_TAG)]
        self._pending.append((works, [size, payload]))

    def flush(self) -> None:
        """Wait until every object sent so far was received."""
        for works, _ in self._pending:
            for work in works:
                work.wait()
        self._pending.clear()

    def recv(self) -> Any:
        """The next object the other side's leader sent (blocks)."""
        size = torch.zeros(1, dtype=torch.int64)
        self.pg.recv([size], self.peer, self.OBJECT_TAG).wait()
        payload = torch.empty(int(size), dtype=torch.uint8)
        self.pg.recv([payload], self.peer, self.OBJECT_TAG).wait()
        return pickle.loads(payload.numpy().tobytes())

    def close(self, meet: bool = True) -> None:
        """Shut the bridge's process groups down while the interpreter is whole. They are not the default group, so
        `destroy_process_group` does not reach them, and a gloo group left to interpreter finalization can abort the
        process at exit (SIGABRT, "terminate called without an active exception": its worker threads release tensors
        after Python is gone). `meet`: a normal end; first wait for every send and meet the other side at a barrier,
        so that neither side closes its connections under the other's traffic (after an error the other side may
        never come, and nothing is waited for)."""
        if self.pg is None:
            return
        if meet:
            self.flush()
            self.wait_weights()
            self.pg.barrier().wait()
        self._pending.clear()
        self._weight_works.clear()
        for group in [self.pg, *self.weight_groups]:
            if group is not None:
                group.shutdown()
        self.pg, self.weight_groups = None, []

    # ----- weights

    def _broadcast(self, group, tensor: torch.Tensor) -> None:
        group.broadcast([tensor], _root0()).wait()

    def send_weights(self, stage: int, tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                     bucket_bytes: int) -> None:
        """On the sender of `stage`: broadcast `tensors` ((HF name, whole tensor)) to the rollout ranks in buckets of
        about `bucket_bytes`, then an empty bucket that ends the version. The broadcasts are not waited for: the
        rollout ranks take a version only when a batch needs it (k steps later), and the sender trains on meanwhile;
        the buckets are copies, kept until the next version's send (`wait_weights`) waits for them."""
        self.wait_weights()
        group = self.weight_groups[stage]
        device = torch.device("cuda", torch.cuda.current_device()) if self.device_type == "cuda" else torch.device("cpu")
        for names, flat in _buckets(tensors, bucket_bytes):
            self._post_bucket(group, device, {"version": version, "entries": names}, flat)
        self._post_bucket(group, device, {"version": version, "entries": []}, None)

    def _post_bucket(self, group, device: torch.device, header: dict, flat: Optional[torch.Tensor]) -> None:
        head = _payload(header)
        size = torch.tensor([head.numel(), 0 if flat is None else flat.numel()], dtype=torch.int64, device=device)
        for tensor in (size, head.to(device)) + (() if flat is None else (flat.to(device),)):
            self._weight_works.append((group.broadcast([tensor], _root0()), tensor))

    def wait_weights(self) -> None:
        """Wait until the rollout ranks received every weight version sent so far."""
        for work, _ in self._weight_works:
            work.wait()
        self._weight_works.clear()

    def receive_weights(self, stage: int) -> Iterator[tuple[int, str, torch.Tensor]]:
        """On a rollout rank: (version, HF name, whole tensor) of `stage`'s next version, bucket by bucket."""
        group = self.weight_groups[stage]
        device = torch.device("cuda", torch.cuda.current_device()) if self.device_type == "cuda" else torch.device("cpu")
        while True:
            size = torch.zeros(2, dtype=torch.int64, device=device)
            self._broadcast(group, size)
            head = torch.empty(int(size[0]), dtype=torch.uint8, device=device)
            self._broadcast(group, head)
            header = pickle.loads(head.cpu().numpy().tobytes())
            if not header["entries"]:
                return
            flat = torch.empty(int(size[1]), dtype=torch.uint8, device=device)
            self._broadcast(group, flat)
            for name, dtype, shape, offset, nbytes in header["entries"]:
                yield header["version"], name, flat[offset:offset + nbytes].view(dtype).view(shape)


def _root0() -> dist.BroadcastOptions:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    return options


def _buckets(tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[tuple[list, torch.Tensor]]:
    """Group (name, tensor) into flat uint8 buckets of at least one tensor and about `bucket_bytes` at most:
    (entries [(name, dtype, shape, byte offset, bytes)], flat bytes). Each tensor starts 16-byte aligned, so the
    receiver views its bytes as the dtype in place."""
    entries, parts, used = [], [], 0
    for name, tensor in tensors:
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        if parts and used + data.numel() > bucket_bytes:
            yield entries, torch.cat(parts)
            entries, parts, used = [], [], 0
        entries.append((name, tensor.dtype, tuple(tensor.shape), used, data.numel()))
        pad = -data.numel() % 16
        parts += [data] + ([data.new_zeros(pad)] if pad else [])
        used += data.numel() + pad
    if parts:
        yield entries, torch.cat(parts)
