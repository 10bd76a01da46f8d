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
- Expert parallelism (`ep`, Megatron's): the experts of an MoE model are split over groups of `ep` consecutive
  data-parallel ranks (same tp and pp coordinates), so `ep` divides dp; a rank's dp coordinate is
  `expert_dp_rank * ep + ep_rank` (Megatron's expert rank order tp-ep-dp-pp with the expert tensor-parallel size
  equal to tp). Two kinds of group: the ep group (`ep_group_ranks`, `ep` ranks holding different experts, which
  exchange tokens by all-to-all) and the expert-data-parallel group (`expert_dp_group_ranks`, dp / ep ranks
  holding the same experts, over which the experts' gradients are summed and their optimizer state sharded).
  Both are pure arithmetic beside `group_ranks`; `build` creates them eagerly when ep > 1, every rank every
  group in the same order, as the embedding groups. At ep = 1 the expert-data-parallel group is the dp group.
- Pipeline stages of uneven size (`StageSplit`, pure arithmetic like the ranks'): `L / pp` layers each by
  default; Megatron's `--decoder-first-pipeline-num-layers` / `--decoder-last-pipeline-num-layers`
  (`first_stage_layers` / `last_stage_layers`: the middle stages split the rest evenly) or an explicit
  `stage_layers` list, for layer counts pp does not divide (28-layer Qwen2.5-7B at pp = 8) or to give the
  first stage (embedding) and the last (LM head and loss) fewer layers. A layout carries the split of the
  model built on it (`with_stages`, a copy sharing the groups), so every builder that takes the layout
  (`megalign.parallel.stage_layer_range`, `stage_from_pretrained`, `scratch_model`) builds the same stage.
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


def check_ep(ep: int, dp: int) -> None:
    """Raise ValueError unless `ep` is a positive int dividing `dp` (the experts split over ep of the dp ranks)."""
    if not _is_int(ep) or ep < 1:
        raise ValueError(f"parallel layout: ep must be a positive int, got {ep!r}")
    if dp % ep:
        raise ValueError(f"parallel layout: ep={ep} must divide dp={dp} (experts are split over groups of ep "
                         f"data-parallel ranks)")


def ep_group_ranks(*, tp: int, pp: int, dp: int, ep: int) -> list[list[int]]:
    """Every expert-parallel group: `ep` consecutive ranks of a dp group (they hold different experts), sorted."""
    check_ep(ep, dp)
    return [g[i:i + ep] for g in group_ranks("dp", tp=tp, pp=pp, dp=dp) for i in range(0, dp, ep)]


def expert_dp_group_ranks(*, tp: int, pp: int, dp: int, ep: int) -> list[list[int]]:
    """Every expert-data-parallel group: the dp / ep ranks of a dp group at the same ep rank (they hold the same
    experts), sorted; the dp groups themselves at ep = 1."""
    check_ep(ep, dp)
    return [g[j::ep] for g in group_ranks("dp", tp=tp, pp=pp, dp=dp) for j in range(ep)]


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
class StageSplit:
    """How a model's decoder layers split over the pipeline stages (module doc); at most one of the two ways.

    Attributes:
        stage_layers: layers of every stage, in order (length pp, each >= 1, summing to the model's layers).
        first_stage_layers, last_stage_layers: Megatron's first / last stage layer counts; the stages between split
            the remaining layers evenly (which must divide), each >= 1.
        key: the config key the options sit under (e.g. "actor"), named in errors; "" for none.
    """

    stage_layers: Optional[tuple[int, ...]] = None
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    key: str = ""

    def __post_init__(self) -> None:
        if self.stage_layers is not None:
            object.__setattr__(self, "stage_layers", tuple(self.stage_layers))
            if self.first_stage_layers is not None or self.last_stage_layers is not None:
                raise ValueError(f"{self._name('stage_layers')} and {self._name('first_stage_layers')} / "
                                 f"{self._name('last_stage_layers')} are two ways of one split: set one")
        for name in ("first_stage_layers", "last_stage_layers"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"{self._name(name)} must be an int >= 1, got {value!r}")
        if self.stage_layers is not None and any(not _is_int(n) or n < 1 for n in self.stage_layers):
            raise ValueError(f"{self._name('stage_layers')}={list(self.stage_layers)}: each stage needs at least "
                             f"one layer (an int)")

    @property
    def uneven(self) -> bool:
        """Whether any option is set (otherwise: L / pp layers each)."""
        return (self.stage_layers, self.first_stage_layers, self.last_stage_layers) != (None, None, None)

    def _name(self, option: str) -> str:
        return f"{self.key}.{option}" if self.key else option

    def check_pp(self, pp: int) -> None:
        """ValueError naming the option unless it fits `pp` stages (before the layer count is known)."""
        if self.stage_layers is not None and len(self.stage_layers) != pp:
            raise ValueError(f"{self._name('stage_layers')}={list(self.stage_layers)} has {len(self.stage_layers)} "
                             f"entries but pp={pp}: one per pipeline stage")
        ends = (self.first_stage_layers is not None) + (self.last_stage_layers is not None)
        if ends and pp < 2:
            raise ValueError(f"{self._name('first_stage_layers')} / {self._name('last_stage_layers')} need pp >= 2 "
                             f"(pipeline stages), got pp={pp}")

    def sizes(self, num_layers: int, pp: int) -> list[int]:
        """Layers of each of the `pp` stages of a model of `num_layers` decoder layers; ValueError naming the
        options."""
        self.check_pp(pp)
        if self.stage_layers is not None:
            if sum(self.stage_layers) != num_layers:
                raise ValueError(f"{self._name('stage_layers')}={list(self.stage_layers)} sums to "
                                 f"{sum(self.stage_layers)}, not the model's {num_layers} decoder layers")
            return list(self.stage_layers)
        if not self.uneven:
            if num_layers % pp:
                raise ValueError(
                    f"num_hidden_layers={num_layers} is not divisible by pp={pp}; set "
                    f"{self._name('first_stage_layers')} / {self._name('last_stage_layers')} or "
                    f"{self._name('stage_layers')}, e.g. {example_split(num_layers, pp)}")
            return [num_layers // pp] * pp
        first, last = self.first_stage_layers, self.last_stage_layers
        middle = pp - (first is not None) - (last is not None)
        rest = num_layers - (first or 0) - (last or 0)
        if (rest != 0) if middle == 0 else (rest < middle or rest % middle):
            given = [f"{self._name(n)}={getattr(self, n)}" for n in ("first_stage_layers", "last_stage_layers")
                     if getattr(self, n) is not None]
            raise ValueError(f"{' and '.join(given)} {'leave' if len(given) > 1 else 'leaves'} {rest} of the "
                             f"{num_layers} decoder layers for the {middle} other stage(s) of pp={pp}, which must "
                             f"split them evenly, each >= 1")
        inner = [rest // middle] * middle if middle else []
        return ([first] if first is not None else []) + inner + ([last] if last is not None else [])


def example_split(num_layers: int, pp: int) -> list[int]:
    """A split for an error message, Megatron's way: stages in the middle one layer more than the ends when pp does
    not divide (e.g. 28 layers at pp=8: [3, 3, 4, 4, 4, 4, 3, 3])."""
    base, extra = divmod(num_layers, pp)
    sizes = [base] * pp
    order = sorted(range(pp), key=lambda s: (min(s, pp - 1 - s) == 0, -min(s, pp - 1 - s), s))
    for s in order[:extra]:
        sizes[s] += 1
    return sizes


def _own_group(groups: list[list[int]]) -> dist.ProcessGroup:
    """Create every group of `groups` (a collective: every rank, the same order); return the one holding this rank."""
    own = None
    for ranks in groups:
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            own = group
    return own


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """Sizes, this rank's coordinates and the named process groups of a tp x dp x pp layout.

    Create it with `ParallelLayout.build(tp=..., pp=..., device_type=...)` after
    `torch.distributed.init_process_group`; constructing it directly (without `mesh`) gives a plan
    that only answers the pure rank-arithmetic questions.

    Attributes:
        tp, pp, dp: tensor-, pipeline- and data-parallel sizes; `tp * pp * dp == world_size`.
        ep: expert-parallel size (module doc): the MoE experts split over `ep` consecutive dp ranks; divides dp.
        world_size: number of ranks.
        rank: this process's global rank (0 for a plan without processes).
        mesh: the (pp, dp, tp) `DeviceMesh`, or None for a plan.
        embedding_pg: this rank's embedding group when pp > 1 and this rank is on the first or last stage
            (made by `build`), else None; read it through `embedding_group`.
        ep_pg, expert_dp_pg: this rank's ep and expert-data-parallel groups when ep > 1 (made by `build`), else
            None; read them through `ep_group` / `expert_dp_group`.
        stages: how the decoder layers of the model built on this layout split over the pp stages
            (`StageSplit`; default L / pp each); set with `with_stages`.
    """

    tp: int
    pp: int
    dp: int
    world_size: int
    rank: int = 0
    mesh: Optional[DeviceMesh] = dataclasses.field(default=None, repr=False, compare=False)
    embedding_pg: Optional[dist.ProcessGroup] = dataclasses.field(default=None, repr=False, compare=False)
    stages: StageSplit = StageSplit()
    ep: int = 1
    ep_pg: Optional[dist.ProcessGroup] = dataclasses.field(default=None, repr=False, compare=False)
    expert_dp_pg: Optional[dist.ProcessGroup] = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_sizes(self.tp, self.pp, self.dp, self.world_size)
        check_ep(self.ep, self.dp)
        self.stages.check_pp(self.pp)
        rank_coords(self.rank, tp=self.tp, pp=self.pp, dp=self.dp)  # validates rank
        if self.mesh is not None and tuple(self.mesh.mesh.shape) != (self.pp, self.dp, self.tp):
            raise ValueError(
                f"parallel layout: mesh shape {tuple(self.mesh.mesh.shape)} does not match "
                f"(pp, dp, tp) = {(self.pp, self.dp, self.tp)}"
            )

    @classmethod
    def build(cls, *, tp: int = 1, pp: int = 1, dp: Optional[int] = None, ep: int = 1,
              device_type: str = "cpu") -> "ParallelLayout":
        """Build the layout and its DeviceMesh for the already-initialised default process group.

        `dp` defaults to `world_size / (tp * pp)`; `ep` (expert parallelism) must divide it. `device_type` is
        "cpu" (gloo) or "cuda" (NCCL); for "cuda" the caller sets the current device
        (`torch.cuda.set_device(local_rank)`) first.
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
        check_ep(ep, dp)
        mesh = init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=MESH_DIM_NAMES)
        embedding_pg = _own_group(embedding_group_ranks(tp=tp, pp=pp, dp=dp)) if pp > 1 else None
        ep_pg = expert_dp_pg = None
        if ep > 1:  # every rank creates every group, in order: the ep groups, then the expert-dp groups
            ep_pg = _own_group(ep_group_ranks(tp=tp, pp=pp, dp=dp, ep=ep))
            expert_dp_pg = _own_group(expert_dp_group_ranks(tp=tp, pp=pp, dp=dp, ep=ep))
        return cls(tp=tp, pp=pp, dp=dp, world_size=world_size, rank=dist.get_rank(), mesh=mesh,
                   embedding_pg=embedding_pg, ep=ep, ep_pg=ep_pg, expert_dp_pg=expert_dp_pg)

    def with_stages(self, stages: Optional[StageSplit]) -> "ParallelLayout":
        """This layout (the same groups) with `stages` as its layer split; checked against pp (naming the options)."""
        return self if stages is None else dataclasses.replace(self, stages=stages)

    def stage_sizes(self, num_layers: int) -> list[int]:
        """Decoder layers of every pipeline stage of a model of `num_layers` layers (`stages`)."""
        return self.stages.sizes(num_layers, self.pp)

    # ----- pure rank arithmetic (no processes needed)

    def coords(self, rank: Optional[int] = None) -> dict[Dim, int]:
        """{"pp", "dp", "tp"} coordinates of `rank` (default: this rank)."""
        return rank_coords(self.rank if rank is None else rank, tp=self.tp, pp=self.pp, dp=self.dp)

    def group_ranks(self, dim: Dim, rank: Optional[int] = None) -> list[int]:
        """Global ranks of the `dim` group holding `rank` (default: this rank)."""
        rank = self.rank if rank is None else rank
        return next(g for g in group_ranks(dim, tp=self.tp, pp=self.pp, dp=self.dp) if rank in g)

    def ep_group_ranks(self, rank: Optional[int] = None) -> list[int]:
        """Global ranks of the expert-parallel group holding `rank` (default: this rank)."""
        rank = self.rank if rank is None else rank
        return next(g for g in ep_group_ranks(tp=self.tp, pp=self.pp, dp=self.dp, ep=self.ep) if rank in g)

    def expert_dp_group_ranks(self, rank: Optional[int] = None) -> list[int]:
        """Global ranks of the expert-data-parallel group holding `rank` (default: this rank)."""
        rank = self.rank if rank is None else rank
        return next(g for g in expert_dp_group_ranks(tp=self.tp, pp=self.pp, dp=self.dp, ep=self.ep) if rank in g)

    def refuse_expert_parallel(self, what: str) -> None:
        """NotImplementedError naming `what` at ep > 1, for generation that is not lock-stepped: the experts'
        all-to-all needs every rank of an ep group in every MoE forward, and each rank decodes until its own samples
        end. The single-turn rollout and `generate` keep the group in step (`megalign.rollout.generate.ExpertLockstep`);
        the pipelined ones (pp > 1) do not."""
        if self.ep > 1:
            raise NotImplementedError(f"{what} at ep={self.ep}: the ranks of an ep group would run different numbers "
                                      f"of forwards (each decodes until its own samples end), and every MoE forward "
                                      f"is an all-to-all over the group; this path is not lock-stepped over the group "
                                      f"yet (the rollout and generation at pp = 1 are)")

    @property
    def ep_rank(self) -> int:
        """This rank's place in its ep group: which `E / ep` experts it holds."""
        return self.dp_rank % self.ep

    @property
    def expert_dp_rank(self) -> int:
        """This rank's place in its expert-data-parallel group."""
        return self.dp_rank // self.ep

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
    def ep_group(self) -> Optional[dist.ProcessGroup]:
        """The ranks holding the other experts (same tp, pp; `ep` consecutive dp ranks); None at ep = 1 (no experts
        are split)."""
        self.group("dp")  # raises for a plan
        return self.ep_pg

    @property
    def expert_dp_group(self) -> dist.ProcessGroup:
        """The ranks holding this rank's experts (dp / ep ranks); the dp group at ep = 1."""
        return self.dp_group if self.ep == 1 else self.expert_dp_pg

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
