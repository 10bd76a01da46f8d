"""What goes into a training checkpoint: model and optimizer shards, per-rank RNG state, a NaN scan.

Each class here is a `torch.distributed.checkpoint` `Stateful` (`state_dict()` / `load_state_dict()`),
so `CheckpointManager.save(step, {"model": ModelState(...), "optim": OptimizerState(...), ...})`
and `.load(...)` treat them alike with plain dicts (a data sampler's `state_dict()`).

Design choice: tensor-parallel shards are saved under keys prefixed by this rank's coordinates.

DCP treats a plain (non-DTensor) tensor that appears under the same key on several ranks as
*replicated*: its save planner keeps one rank's copy. The tp layers hold plain tensors that are
different shards of one logical tensor under one parameter name, so saved under their bare names
every tp rank but one would be silently dropped. Converting them to DTensors would let DCP reshard,
but the layers and the HF adapter work on plain shards. So every model tensor is saved under
`"tp{t}_pp{p}"` + its name (`ModelState`), and the optimizer state under the same prefix, plus
`"dp{d}_"` when ZeRO-1 shards it across data-parallel ranks (`OptimizerState`). Replicas of the
same shard (the dp ranks of a model shard) share a key, so DCP writes each shard once. RNG state
differs on every rank and is keyed by global rank (`RNGState`).

The price: a checkpoint restores only into the same tp / pp layout (and dp size when ZeRO-1 shards
the optimizer), checked on load through the key names (a missing key is an error naming it).
Changing the layout goes through the HF export (`export_hf`), which gathers whole tensors.
"""
from __future__ import annotations

import random
from typing import Any, Mapping, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.optim import ZeroRedundancyOptimizer

from megalign.parallel.layout import ParallelLayout


def _coords(layout: Optional[ParallelLayout]) -> dict[str, int]:
    """{"tp", "dp", "pp"} of this rank; all 0 without a layout (one process)."""
    return layout.coords() if layout is not None else {"tp": 0, "dp": 0, "pp": 0}


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class ModelState:
    """A model's parameters and persistent buffers, saved as `{"tp{t}_pp{p}": model.state_dict()}`.

    The model's own `state_dict` is what a tp shard holds (the layers keep plain tensors); see the
    module doc for why the prefix. Loading copies into the existing tensors (DCP loads in place),
    so the model must already be built with the saved layout.
    """

    def __init__(self, model: nn.Module, layout: Optional[ParallelLayout] = None):
        self.model = model
        coords = _coords(layout)
        self.key = f"tp{coords['tp']}_pp{coords['pp']}"

    def state_dict(self) -> dict[str, Any]:
        return {self.key: self.model.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state[self.key])


class OptimizerState:
    """An optimizer's state keyed by parameter name (DCP's `get_optimizer_state_dict`), under a shard prefix.

    A `ZeroRedundancyOptimizer` holds the state of ~1/dp of the parameters in its local `.optim`;
    that local optimizer is what is saved, under `"dp{d}_tp{t}_pp{p}"` (ZeRO-1's partition is a
    deterministic function of the parameter list and dp size, so the same rank owns the same
    parameters after a restart). Any other optimizer is saved whole under `"tp{t}_pp{p}"`.

    Learning rates: the trainers set `lr` from the step before every update (`megalign.trainers.optim`),
    so the restored `param_groups` lr does not matter for them. Note `get_optimizer_state_dict` gives an
    optimizer that has never stepped its state by one zero-lr step (the state must exist to be
    loaded into); a save before the first update therefore sets `step` to 1 in the saved *and* the
    running optimizer alike, so a resumed run still continues exactly.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, layout: Optional[ParallelLayout] = None):
        self.model = model
        coords = _coords(layout)
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            self.optimizer = optimizer.optim
            self.key = f"dp{coords['dp']}_tp{coords['tp']}_pp{coords['pp']}"
        else:
            self.optimizer = optimizer
            self.key = f"tp{coords['tp']}_pp{coords['pp']}"

    def state_dict(self) -> dict[str, Any]:
        return {self.key: get_optimizer_state_dict(self.model, self.optimizer)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state[self.key])


def capture_rng_state() -> dict[str, Any]:
    """This process's random generators: Python `random`, NumPy's global one, torch CPU, and every CUDA device."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Put back what `capture_rng_state` captured (CUDA only when it was captured and CUDA is in use here)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class RNGState:
    """The global random generators of this rank, saved under `"rank{r}"` (every rank has its own streams).

    Seeded `torch.Generator`s owned by a trainer are not global: save them through their own
    `get_state()` in the trainer's state.
    """

    def __init__(self, rank: Optional[int] = None):
        self.key = f"rank{_global_rank() if rank is None else rank}"

    def state_dict(self) -> dict[str, Any]:
        return {self.key: capture_rng_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        restore_rng_state(state[self.key])


def nonfinite_keys(state: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys of the floating-point tensors in nested `state` that hold NaN or inf (local, no collective)."""
    bad = []
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                bad.append(name)
        elif isinstance(value, Mapping):
            bad.extend(nonfinite_keys(value, f"{name}."))
    return bad
