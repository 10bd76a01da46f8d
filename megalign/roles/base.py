"""The role interface of colocated RLHF, and the offload that lets roles share one device.

Design choices:

- A role (actor, critic, reference, reward model) owns one model on its own `ParallelLayout` and in
  its own dtype. Placement is colocated: every role lives on every rank, and the trainer runs them
  one phase at a time (rollout, reward, reference, update), as verl's hybrid engine and OpenRLHF's
  colocate mode do. The memory a role holds is grouped in named parts ("weights"; the actor adds
  "optimizer"); before a phase the trainer calls `role.need(parts)` on every role, which brings
  those parts onto the device and moves every other part whose offload switch is on to host memory
  (pinned on CUDA, so the copies back are asynchronous DMA).
- Offload swaps storage, never objects: a parameter keeps its identity (`p.data` is replaced by an
  empty placeholder and later by the copy back), so optimizers, tied weights and autograd hooks
  never notice. A role used while offloaded fails loudly on the empty tensors instead of computing
  on stale data. The copy round trip is exact, so results are identical with offload on and off.
- A critic fits this interface as another trainable role (a `ValueModel` with "weights" and
  "optimizer" parts, see `megalign.roles.actor.TrainableRole`).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Literal, Optional

import torch
from torch import nn

from megalign.config import option
from megalign.parallel import ParallelLayout, StageSplit

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclasses.dataclass
class ModelRoleConfig:
    """Where a model role's weights come from and how it is placed."""

    path: Optional[str] = option(None, doc="HF checkpoint folder (reference: None = the actor's path)")
    tp: int = option(1, doc="tensor-parallel size of this role (dp = world_size / (tp x pp))")
    pp: int = option(1, doc="pipeline stages of this role: its decoder layers split evenly over pp ranks unless the "
                            "options below say otherwise (1F1B updates, forward-only scoring; "
                            "dp = world_size / (tp x pp))")
    first_stage_layers: Optional[int] = option(
        None, doc="pp > 1: decoder layers of the first pipeline stage (Megatron's "
                  "--decoder-first-pipeline-num-layers); the stages between the first and the last split the rest "
                  "evenly. Fewer layers balance the embedding; also for layer counts pp does not divide")
    last_stage_layers: Optional[int] = option(
        None, doc="pp > 1: decoder layers of the last pipeline stage (Megatron's --decoder-last-pipeline-num-layers); "
                  "fewer layers balance the LM head and the loss")
    stage_layers: Optional[list[int]] = option(
        None, doc="pp > 1: decoder layers of every pipeline stage, in order (pp entries, each >= 1, summing to the "
                  "model's layers), e.g. [3, 3, 4, 4, 4, 4, 3, 3] for 28 layers at pp=8; instead of first / last")
    microbatches: int = option(0, doc="pp > 1: micro-batches per pipelined forward / backward (>= pp, dividing the "
                                      "rank's batch); 0: pp")
    dtype: Literal["fp32", "bf16"] = option(
        "fp32", doc="trained roles: bf16 = bf16 compute over fp32 master weights; frozen roles: the weights' dtype")
    offload_weights: bool = option(False, doc="move the weights to host memory in phases that do not use them")

    def __post_init__(self):
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"tp and pp must be >= 1, got tp={self.tp}, pp={self.pp}")
        if self.microbatches < 0:
            raise ValueError(f"microbatches must be >= 0 (0: pp), got {self.microbatches}")
        self.stage_split().check_pp(self.pp)  # types, one way only, a list of pp entries (the layer count comes later)

    def stage_split(self, key: str = "") -> StageSplit:
        """The layer split of this role's pipeline stages (`megalign.parallel.StageSplit`; `key` names the options in
        errors), for `ParallelLayout.with_stages`."""
        layers = tuple(self.stage_layers) if self.stage_layers is not None else None
        return StageSplit(layers, self.first_stage_layers, self.last_stage_layers, key)

    @property
    def n_microbatches(self) -> int:
        """Micro-batches of this role's pipeline schedules (`microbatches`, or pp when it is 0)."""
        return self.microbatches or self.pp


@dataclasses.dataclass
class TrainedRoleConfig(ModelRoleConfig):
    """A role whose model is trained (the actor, the PPO critic, the supervised trainers' model)."""

    activation_checkpointing: bool = option(
        False, doc="recompute each decoder layer in the backward instead of keeping its activations "
                   "(torch.utils.checkpoint per layer, Megatron's full recomputation): a layer keeps only its "
                   "input, for one more trunk forward per update; the same numbers")
    ep: int = option(1, doc="expert-parallel size of an MoE model (Megatron's): its experts split over groups of ep "
                            "consecutive dp ranks, tokens exchanged by all-to-all; must divide dp and the model's "
                            "num_experts (checked before it loads); 1: every rank holds every expert")

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.ep, int) or isinstance(self.ep, bool) or self.ep < 1:
            raise ValueError(f"ep must be an int >= 1, got {self.ep!r}")


class _Slot:
    """One offloadable tensor: a parameter or buffer's `.data`, or an entry of an optimizer state dict."""

    def __init__(self, owner, key, attribute: bool):
        self.owner, self.key, self.attribute = owner, key, attribute
        self.host: Optional[torch.Tensor] = None
        self.device: Optional[torch.device] = None

    def get(self) -> torch.Tensor:
        return getattr(self.owner, self.key) if self.attribute else self.owner[self.key]

    def set(self, value: torch.Tensor) -> None:
        if self.attribute:
            setattr(self.owner, self.key, value)
        else:
            self.owner[self.key] = value

    def offload(self) -> None:
        tensor = self.get()
        self.device = tensor.device
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
        host.copy_(tensor)
        self.host = host
        self.set(tensor.new_empty(0))

    def load(self) -> None:
        self.set(self.host.to(self.device, non_blocking=True))
        self.host = None


def module_slots(module: nn.Module) -> list[_Slot]:
    """Slots of every distinct parameter and buffer of `module` (tied weights once)."""
    return [_Slot(t, "data", True) for t in [*module.parameters(), *module.buffers()]]


def optimizer_slots(optimizer: torch.optim.Optimizer) -> list[_Slot]:
    """Slots of every tensor in the optimizer's per-parameter state (empty before the first step)."""
    return [_Slot(state, key, False) for state in optimizer.state.values()
            for key, value in state.items() if torch.is_tensor(value)]


class Role:
    """A named holder of device memory in parts that can be offloaded; subclasses add the compute.

    `parts()` maps part names to the slots they hold right now (optimizer state appears lazily);
    `offload_switches` says which parts may leave the device.
    """

    def __init__(self, name: str, layout: Optional[ParallelLayout], offload_switches: dict[str, bool]):
        self.name = name
        self.layout = layout
        self.offload_switches = offload_switches
        self._offloaded: dict[str, list[_Slot]] = {}

    def parts(self) -> dict[str, list[_Slot]]:
        return {}

    def need(self, *parts: str) -> None:
        """Bring `parts` onto the device and offload the other parts whose switch is on."""
        unknown = set(parts) - set(self.offload_switches)
        if unknown:
            raise ValueError(f"role {self.name!r} has no part {sorted(unknown)}; parts: {sorted(self.offload_switches)}")
        for part in parts:
            for slot in self._offloaded.pop(part, []):
                slot.load()
        current = self.parts()
        for part, enabled in self.offload_switches.items():
            if enabled and part not in parts and part not in self._offloaded:
                slots = current.get(part, [])
                for slot in slots:
                    slot.offload()
                self._offloaded[part] = slots

    def resident_bytes(self) -> int:
        """Bytes of this role's parts currently on its device (placeholders of offloaded tensors hold none)."""
        return sum(s.get().nbytes for part, slots in self.parts().items() if part not in self._offloaded for s in slots)


class ModelRole(Role):
    """A role around one model, with a "weights" part."""

    def __init__(self, name: str, model: nn.Module, layout: ParallelLayout, offload_weights: bool,
                 extra_switches: Optional[dict[str, bool]] = None):
        super().__init__(name, layout, {"weights": offload_weights, **(extra_switches or {})})
        self.model = model

    def parts(self) -> dict[str, list[_Slot]]:
        return {"weights": module_slots(self.model)}

    def parameters(self) -> Iterable[nn.Parameter]:
        return self.model.parameters()
