"""The parallel layout: how `world_size` ranks split into tensor (tp), data (dp) and pipeline (pp) groups.

Design choices:

- One object, passed explicitly to whatever needs a group (torchtitan's `ParallelDims`); no
  module-level process groups (Megatron's `parallel_state` globals are what we avoid).
- Megatron rank order: tp innermost, then dp, then pp, i.e. a global rank is
  `rank = (pp_rank * dp + dp_rank) * tp + tp_rank`. Tensor-parallel peers are neighbouring ranks, so
  they land on the same node (NVLink) whenever tp divides the GPUs per node.
- The rank arithmetic (`rank_coords`, `group_ranks`) is pure: it needs no process group, so it is
  tested for many world sizes without starting processes. The `DeviceMesh` of shape (pp, dp, tp)
  built by `ParallelLayout.build` lays ranks out row-major, which is exactly that order.
- The same code runs on gloo/CPU (tests) and NCCL/GPU (training): only `device_type` changes.
- Megatron's embedding group (`embedding_group`): per (dp, tp) coordinate, the ranks of the first
  and the last pipeline stage. A model with tied word embeddings split into stages holds the matrix
  twice (embedding on the first stage, LM head on the last); their gradients are summed over this
  group (`data_parallel.allreduce_embedding_gradients`). `build` creates these groups with
  `torch.distributed.new_group`, which every rank must call for every group in the same order, so
  they are made eagerly for pp > 1 (a pair of ranks each, cheap) rather than on first use.
"""
from __future__ import annotations

import dataclasses
from typing import Literal, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

Dim = Literal["pp", "dp", "tp"]
MESH_DIM_NAMES: tuple[Dim, Dim, Dim] = ("pp", "dp", "tp")
"""Mesh dimensions, outermost first (Megatron order: tp varies fastest)."""


def check_sizes(tp: int, pp: int, dp: int, world_size: int) -> None:
    """Raise ValueError unless every size is a positive int and `tp * pp * dp == world_size`."""
    for name, value in (("tp", tp), ("pp", pp), ("dp", dp), ("world_size", world_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"parallel layout: {name} must be a positive int, got {value!r}")
    if tp * pp * dp != world_size:
        raise ValueError(
            f"parallel layout: tp * pp * dp must equal world_size, but tp={tp} * pp={pp} * dp={dp} "
            f"= {tp * pp * dp} != world_size={world_size}"
        )


def rank_coords(rank: int, *, tp: int, pp: int, dp: int) -> dict[Dim, int]:
    """Coordinates {"pp", "dp", "tp"} of global `rank` in Megatron order (tp innermost, then dp, then pp)."""
    world_size = tp * pp * dp
    if not 0 <= rank < world_size:
        raise ValueError(f"parallel layout: rank={rank} is outside [0, world_size={world_size})")
    rest, tp_rank = divmod(rank, tp)
    pp_rank, dp_rank = divmod(rest, dp)
    return {"pp": pp_rank, "dp": dp_rank, "tp": tp_rank}


def coords_rank(*, pp_rank: int, dp_rank: int, tp_rank: int, tp: int, dp: int) -> int:
    """The global rank at the given coordinates; the inverse of `rank_coords`."""
    return (pp_rank * dp + dp_rank) * tp + tp_rank


def embedding_group_ranks(*, tp: int, pp: int, dp: int) -> list[list[int]]:
    """Every embedding group (Megatron's): per pp group, its first and last stage's ranks (one rank at pp=1)."""
    return [sorted({g[0], g[-1]}) for g in group_ranks("pp", tp=tp, pp=pp, dp=dp)]


def group_ranks(dim: Dim, *, tp: int, pp: int, dp: int) -> list[list[int]]:
    """Every group along mesh dimension `dim`, as sorted lists of global ranks.

    The groups partition the ranks: there are `world_size / size(dim)` groups of `size(dim)` ranks;
    the members of a group share their two other coordinates.
    """
    sizes = {"pp": pp, "dp": dp, "tp": tp}
    if dim not in sizes:
        raise ValueError(f"parallel layout: dim must be one of {MESH_DIM_NAMES}, got {dim!r}")
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(tp * pp * dp):
        coords = rank_coords(rank, tp=tp, pp=pp, dp=dp)
        key = tuple(coords[d] for d in MESH_DIM_NAMES if d != dim)
        groups.setdefault(key, []).append(rank)
    return [groups[k] for k in sorted(groups)]


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """Sizes, this rank's coordinates and the named process groups of a tp x dp x pp layout.

    Create it with `ParallelLayout.build(tp=..., pp=..., device_type=...)` after
    `torch.distributed.init_process_group`; constructing it directly (without `mesh`) gives a plan
    that only answers the pure rank-arithmetic questions.

    Attributes:
        tp, pp, dp: tensor-, pipeline- and data-parallel sizes; `tp * pp * dp == world_size`.
        world_size: number of ranks.
        rank: this process's global rank (0 for a plan without processes).
        mesh: the (pp, dp, tp) `DeviceMesh`, or None for a plan.
        embedding_pg: this rank's embedding group when pp > 1 and this rank is on the first or last stage
            (made by `build`), else None; read it through `embedding_group`.
    """

    tp: int
    pp: int
    dp: int
    world_size: int
    rank: int = 0
    mesh: Optional[DeviceMesh] = dataclasses.field(default=None, repr=False, compare=False)
    embedding_pg: Optional[dist.ProcessGroup] = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_sizes(self.tp, self.pp, self.dp, self.world_size)
        rank_coords(self.rank, tp=self.tp, pp=self.pp, dp=self.dp)  # validates rank
        if self.mesh is not None and tuple(self.mesh.mesh.shape) != (self.pp, self.dp, self.tp):
            raise ValueError(
                f"parallel layout: mesh shape {tuple(self.mesh.mesh.shape)} does not match "
                f"(pp, dp, tp) = {(self.pp, self.dp, self.tp)}"
            )

    @classmethod
    def build(cls, *, tp: int = 1, pp: int = 1, dp: Optional[int] = None, device_type: str = "cpu") -> "ParallelLayout":
        """Build the layout and its DeviceMesh for the already-initialised default process group.

        `dp` defaults to `world_size / (tp * pp)`. `device_type` is "cpu" (gloo) or "cuda" (NCCL);
        for "cuda" the caller sets the current device (`torch.cuda.set_device(local_rank)`) first.
        Collective: every rank must call it with the same arguments.
        """
        if not dist.is_initialized():
            raise RuntimeError("ParallelLayout.build: call torch.distributed.init_process_group first")
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"ParallelLayout.build: device_type must be 'cpu' or 'cuda', got {device_type!r}")
        if device_type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("ParallelLayout.build: device_type='cuda' but CUDA is not available")
        world_size = dist.get_world_size()
        if dp is None:
            if tp < 1 or pp < 1 or world_size % (tp * pp):
                raise ValueError(
                    f"parallel layout: world_size={world_size} is not divisible by tp={tp} * pp={pp}, "
                    f"so dp cannot be inferred"
                )
            dp = world_size // (tp * pp)
        check_sizes(tp, pp, dp, world_size)
        mesh = init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=MESH_DIM_NAMES)
        embedding_pg = None
        if pp > 1:
            for ranks in embedding_group_ranks(tp=tp, pp=pp, dp=dp):  # every rank creates every group, in order
                group = dist.new_group(ranks)
                if dist.get_rank() in ranks:
                    embedding_pg = group
        return cls(tp=tp, pp=pp, dp=dp, world_size=world_size, rank=dist.get_rank(), mesh=mesh,
                   embedding_pg=embedding_pg)

    # ----- pure rank arithmetic (no processes needed)

    def coords(self, rank: Optional[int] = None) -> dict[Dim, int]:
        """{"pp", "dp", "tp"} coordinates of `rank` (default: this rank)."""
        return rank_coords(self.rank if rank is None else rank, tp=self.tp, pp=self.pp, dp=self.dp)

    def group_ranks(self, dim: Dim, rank: Optional[int] = None) -> list[int]:
        """Global ranks of the `dim` group holding `rank` (default: this rank)."""
        rank = self.rank if rank is None else rank
        return next(g for g in group_ranks(dim, tp=self.tp, pp=self.pp, dp=self.dp) if rank in g)

    @property
    def tp_rank(self) -> int:
        return self.coords()["tp"]

    @property
    def dp_rank(self) -> int:
        return self.coords()["dp"]

    @property
    def pp_rank(self) -> int:
        return self.coords()["pp"]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def stage_rank(self, stage: int) -> int:
        """Global rank of pipeline stage `stage` in this rank's pp group (same dp and tp coordinates)."""
        if not 0 <= stage < self.pp:
            raise ValueError(f"parallel layout: stage={stage} is outside [0, pp={self.pp})")
        return coords_rank(pp_rank=stage, dp_rank=self.dp_rank, tp_rank=self.tp_rank, tp=self.tp, dp=self.dp)

    @property
    def prev_stage_rank(self) -> Optional[int]:
        """Global rank of the previous pipeline stage (sends us activations), None on the first stage."""
        return None if self.is_first_stage else self.stage_rank(self.pp_rank - 1)

    @property
    def next_stage_rank(self) -> Optional[int]:
        """Global rank of the next pipeline stage (receives our activations), None on the last stage."""
        return None if self.is_last_stage else self.stage_rank(self.pp_rank + 1)

    @property
    def device(self) -> torch.device:
        """The device this rank computes on: the current CUDA device for a "cuda" mesh, else the CPU."""
        if self.mesh is not None and self.mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # ----- process groups (need the mesh)

    def group(self, dim: Dim) -> dist.ProcessGroup:
        """The process group of this rank along `dim` ("pp", "dp" or "tp")."""
        if self.mesh is None:
            raise RuntimeError(
                "parallel layout: this layout has no DeviceMesh (a plan); create it with ParallelLayout.build(...)"
            )
        return self.mesh.get_group(dim)

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.group("tp")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.group("dp")

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.group("pp")

    @property
    def embedding_group(self) -> dist.ProcessGroup:
        """The ranks of this rank's first and last pipeline stage (same dp and tp coordinates); at pp=1 the one-rank pp group.

        Only first- and last-stage ranks are members: on a middle stage (pp > 2) it is an error.
        """
        pp_group = self.pp_group  # raises for a plan
        if self.pp == 1:
            return pp_group
        if self.embedding_pg is None:
            raise RuntimeError(f"parallel layout: rank {self.rank} is on pipeline stage {self.pp_rank} of "
                               f"{self.pp}, so in no embedding group (first and last stages only)")
        return self.embedding_pg
