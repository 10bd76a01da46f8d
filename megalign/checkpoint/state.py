"""What goes into a training checkpoint: model and optimizer shards, per-rank RNG state, a NaN scan.

Each class here is a `torch.distributed.checkpoint` `Stateful` (`state_dict()` / `load_state_dict()`),
so `CheckpointManager.save(step, {"model": ModelState(...), "optim": OptimizerState(...), ...})`
and `.load(...)` treat them alike with plain dicts (a data sampler's `state_dict()`). They are also
`Reshardable`: before reading, `CheckpointManager.load` hands each one the checkpoint's keys
(`SavedCheckpoint`) and reads what its `load_target` asks for, which is how a checkpoint written at
one dp size loads at another.

Design choice: tensor-parallel shards are saved under keys prefixed by this rank's coordinates.

DCP treats a plain (non-DTensor) tensor that appears under the same key on several ranks as
*replicated*: its save planner keeps one rank's copy. The tp layers hold plain tensors that are
different shards of one logical tensor under one parameter name, so saved under their bare names
every tp rank but one would be silently dropped. Converting them to DTensors would let DCP reshard,
but the layers and the HF adapter work on plain shards. So every model tensor is saved under
`"tp{t}_pp{p}"` + its name (`ModelState`). Replicas of the same shard (the dp ranks of a model
shard) share a key, so DCP writes each shard once.

Expert parallelism (`layout.ep` > 1): the ranks of an ep group hold different experts under the same parameter
names, so those tensors (and their optimizer state) are saved under `"tp{t}_pp{p}_ep{e}"` with this rank's ep rank
(`megalign.parallel.ep_sharded_parameters` says which); the replicas of an expert shard (the expert-data-parallel
group) share the key. The rest of the model stays under `"tp{t}_pp{p}"`.

The optimizer state is saved independently of dp: per parameter (by its name in the model), whole,
under the same `"tp{t}_pp{p}"` prefix (`OptimizerState`). ZeRO-1 shards the state by whole
parameters, so each parameter's state lives on one dp rank, which saves it under its own name;
on load every rank asks for the parameters it owns in the *current* partition, wherever they were
saved. The `param_groups` are not saved: their hyper-parameters come from the config and the lr is
set before every step (`megalign.trainers.optim`). Checkpoints of the earlier layout (ZeRO shards
under `"dp{d}_tp{t}_pp{p}"`) load the same way, at any dp.

RNG state differs on every rank and is keyed by global rank (`RNGState`). Rank r restores saved rank
r's streams when the checkpoint has them; a rank beyond the saved ones (dp grew) restores rank 0's
and then reseeds every generator from a hash of rank 0's torch state and r: deterministic, and
distinct per rank. When dp shrinks, the streams of the ranks that are gone are dropped.

What cannot be resharded: tp, pp and ep, and the layers of each pipeline stage (uneven stages,
`megalign.parallel.StageSplit`: a stage's layers are saved under its local indices). They are read from
the saved key names before anything is loaded, and a change fails up front naming the saved and the
current layout. Changing tp or pp goes
through the HF export (`export_hf`), which gathers whole tensors.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import random
import re
from typing import Any, Mapping, Optional, Protocol, runtime_checkable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from megalign.models.lora import lora_modules
from megalign.parallel.data_parallel import ep_sharded_parameters, local_optimizers
from megalign.parallel.layout import ParallelLayout

logger = logging.getLogger(__name__)


def _coords(layout: Optional[ParallelLayout]) -> dict[str, int]:
    """{"tp", "dp", "pp"} of this rank; all 0 without a layout (one process)."""
    return layout.coords() if layout is not None else {"tp": 0, "dp": 0, "pp": 0}


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@dataclasses.dataclass(frozen=True)
class SavedCheckpoint:
    """What `CheckpointManager.load` tells a `Reshardable` before reading: the folder and every key it holds.

    Keys are DCP's flattened names: top-level name, then the nested dict keys, joined by ".".
    """

    path: str
    keys: frozenset[str]

    def under(self, prefix: str) -> list[str]:
        """The saved keys that start with `prefix + "."`, with that part cut off."""
        return [k[len(prefix) + 1:] for k in self.keys if k.startswith(prefix + ".")]


@runtime_checkable
class Reshardable(Protocol):
    """A `Stateful` whose saved form may be read back under other keys (another dp, an older format).

    `load_target(name, saved)` returns the nested dict to read (keys as saved, tensors to fill in
    place), raising ValueError up front when the checkpoint cannot be loaded into this object;
    `load_state_dict` then receives that dict, filled.
    """

    def load_target(self, name: str, saved: SavedCheckpoint) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


_SHARD = re.compile(r"(?:dp\d+_)?tp(\d+)_pp(\d+)\.")
_EXPERTS = re.compile(r"tp\d+_pp\d+_ep(\d+)\.")
_LAYER = re.compile(r"(?:dp\d+_)?tp\d+_pp(\d+)\.(?:state\.)?model\.layers\.(\d+)\.")


def _stage_sizes(model: nn.Module, layout: Optional[ParallelLayout]) -> Optional[list[int]]:
    """Decoder layers of every pipeline stage of the model this rank's `model` is a stage of (the layout's split), or
    None at pp = 1 and for a stage built with a split its layout does not carry (nothing to compare all stages with)."""
    decoder, config = getattr(model, "model", None), getattr(model, "config", None)
    if layout is None or layout.pp == 1 or not hasattr(decoder, "layer_range") or config is None:
        return None
    sizes = layout.stage_sizes(config.num_hidden_layers)
    start = sum(sizes[: layout.pp_rank])
    return sizes if decoder.layer_range == (start, start + sizes[layout.pp_rank]) else None


def _keys(layout: Optional[ParallelLayout]) -> tuple[str, Optional[str]]:
    """(this rank's key `"tp{t}_pp{p}"`, its experts' key `"tp{t}_pp{p}_ep{e}"` or None at ep = 1) (module doc)."""
    coords = _coords(layout)
    key = f"tp{coords['tp']}_pp{coords['pp']}"
    return key, (f"{key}_ep{layout.ep_rank}" if layout is not None and layout.ep > 1 else None)


def _expert_names(model: nn.Module) -> set[str]:
    """Names of `model`'s parameters split over an ep group (empty at ep = 1)."""
    experts = {id(p) for p in ep_sharded_parameters(model)}
    return {name for name, p in model.named_parameters() if id(p) in experts}


def _split(values: dict[str, Any], key: str, expert_key: Optional[str], experts: set[str]) -> dict[str, Any]:
    """`{key: values}`, or with `expert_key` the `experts` entries under it and the rest under `key` (none empty but
    `key`'s)."""
    if expert_key is None:
        return {key: values}
    split = {key: {n: v for n, v in values.items() if n not in experts},
             expert_key: {n: v for n, v in values.items() if n in experts}}
    return split if split[expert_key] else {key: split[key]}


def _saved_ep(ep: int, expert_key: Optional[str], target: dict[str, Any]) -> Optional[int]:
    """The ep a checkpoint must have been saved at to load into `target` (`_split`'s): this run's, unless its experts
    are split (`expert_key`) but hold nothing to load (frozen under LoRA), when any ep will do (None)."""
    return ep if expert_key is None or expert_key in target else None


def check_saved_layout(name: str, saved: SavedCheckpoint, tp: int, pp: int,
                       stage_sizes: Optional[list[int]] = None, ep: Optional[int] = None) -> None:
    """Raise ValueError unless the `name` entry of `saved` holds tp x pp shards (read from its key names), given `ep`
    (this run's expert-parallel size, for a model with experts) experts saved at that ep (1 when no key has an ep
    rank) and, given `stage_sizes` (this run's layers per pipeline stage), stages of those sizes (the highest layer
    index per stage)."""
    coords = {(int(m.group(1)), int(m.group(2))) for m in map(_SHARD.match, saved.under(name)) if m}
    if not coords:
        names = sorted({k.split(".")[0] for k in saved.keys})
        raise ValueError(f"checkpoint {saved.path} holds no '{name}' shards (its entries: {', '.join(names)})")
    saved_tp, saved_pp = max(t for t, _ in coords) + 1, max(p for _, p in coords) + 1
    if (saved_tp, saved_pp) != (tp, pp):
        raise ValueError(f"checkpoint {saved.path}: '{name}' was saved with tp={saved_tp} pp={saved_pp}, but this run "
                         f"has tp={tp} pp={pp}; a checkpoint loads only into the same tp and pp (dp may differ). "
                         f"To change them, start a new run from the model's HF export")
    saved_ep = max((int(m.group(1)) + 1 for m in map(_EXPERTS.match, saved.under(name)) if m), default=1)
    if ep is not None and saved_ep != ep:
        raise ValueError(f"checkpoint {saved.path}: '{name}' was saved with ep={saved_ep}, but this run has ep={ep}; "
                         f"a checkpoint loads only into the same ep (its experts are split by it). To change it, start "
                         f"a new run from the model's HF export")
    saved_sizes = [0] * pp
    for m in map(_LAYER.match, saved.under(name)):
        if m:
            stage, layer = int(m.group(1)), int(m.group(2))
            saved_sizes[stage] = max(saved_sizes[stage], layer + 1)
    if stage_sizes is not None and all(saved_sizes) and saved_sizes != list(stage_sizes):
        raise ValueError(f"checkpoint {saved.path}: '{name}' was saved with pipeline stages of {saved_sizes} layers, "
                         f"but this run splits them {list(stage_sizes)}; set the role's stage_layers={saved_sizes} "
                         f"to resume, or start a new run from the model's HF export")


class ModelState:
    """A model's parameters and persistent buffers, saved as `{"tp{t}_pp{p}": model.state_dict()}`.

    The model's own `state_dict` is what a tp shard holds (the layers keep plain tensors); see the
    module doc for why the prefix. Loading copies into the existing tensors (DCP loads in place),
    so the model must already be built with the saved tp and pp (checked first, `load_target`);
    any dp size loads it.

    A model with LoRA adapters (`megalign.models.lora`) saves and loads its trainable parameters only
    (the adapters): the frozen base is rebuilt from the run's `model.path` (or seed) before loading,
    so a checkpoint holds a few MB instead of the whole model.
    """

    def __init__(self, model: nn.Module, layout: Optional[ParallelLayout] = None):
        self.model = model
        self.key, self.expert_key = _keys(layout)
        self.tp, self.pp, self.ep = (layout.tp, layout.pp, layout.ep) if layout is not None else (1, 1, 1)
        self.stage_sizes = _stage_sizes(model, layout)
        self.adapters_only = bool(lora_modules(model))
        self.experts = _expert_names(model)

    def state_dict(self) -> dict[str, Any]:
        state = self.model.state_dict()
        if self.adapters_only:
            trainable = {name for name, p in self.model.named_parameters() if p.requires_grad}
            state = {name: t for name, t in state.items() if name in trainable}
        return _split(state, self.key, self.expert_key, self.experts)

    def load_target(self, name: str, saved: SavedCheckpoint) -> dict[str, Any]:
        target = self.state_dict()
        check_saved_layout(name, saved, self.tp, self.pp, self.stage_sizes, _saved_ep(self.ep, self.expert_key, target))
        return target

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        whole = {n: t for part in state.values() for n, t in part.items()}
        result = self.model.load_state_dict(whole, strict=not self.adapters_only)
        if self.adapters_only and result.unexpected_keys:
            raise ValueError(f"ModelState: checkpoint tensors {result.unexpected_keys} are not adapters of this model")


class OptimizerState:
    """An optimizer's per-parameter state, by parameter name, under `"tp{t}_pp{p}"`: independent of dp (module doc).

    Saved as `{"tp{t}_pp{p}": {"state": {param name: {"exp_avg": ..., "step": ...}}}}` (and the experts' under
    `"tp{t}_pp{p}_ep{e}"` at ep > 1), from DCP's `get_optimizer_state_dict`. For a `ZeroRedundancyOptimizer` that is
    its local `.optim`, which holds the state of the parameters this dp rank owns (for an
    `megalign.parallel.ExpertParallelZero` its two local ones); any other optimizer is saved whole (its dp
    replicas share the keys, so it is written once). Loading asks for the parameters this rank owns
    now, from whichever shard of whichever format holds them, after checking tp and pp.

    Learning rates and other hyper-parameters: not restored (module doc); the trainers set `lr` from
    the step before every update.

    Saving changes nothing. `get_optimizer_state_dict` builds the state of an optimizer that has never
    stepped by one zero-gradient, zero-lr step (the state must exist to be saved and loaded into),
    which left AdamW's `step` at 1: the first real update was then bias-corrected as the second,
    about 26% smaller, whenever a save came first (PPO's critic warm-up, GRPO's empty first steps).
    That step leaves the moments at exactly zero and the weights untouched, so with its `step`
    counters set back to 0 the state is bit for bit the one AdamW creates at its first real step;
    the running optimizer keeps it and the checkpoint holds it, and a resume continues identically.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, layout: Optional[ParallelLayout] = None):
        self.model = model
        self.optimizers = local_optimizers(optimizer)  # ZeRO-1's local one; at ep > 1 the dense and the experts' ones
        self.key, self.expert_key = _keys(layout)
        self.tp, self.pp, self.ep = (layout.tp, layout.pp, layout.ep) if layout is not None else (1, 1, 1)
        self.stage_sizes = _stage_sizes(model, layout)
        self.experts = _expert_names(model)

    def state_dict(self) -> dict[str, Any]:
        fresh = [optimizer for optimizer in self.optimizers if not optimizer.state]
        if fresh:
            self._build_fresh_state(fresh)
        state = get_optimizer_state_dict(self.model, self.optimizers)["state"]
        return {key: {"state": part} for key, part in _split(state, self.key, self.expert_key, self.experts).items()}

    def _build_fresh_state(self, fresh: list[torch.optim.Optimizer]) -> None:
        """The state of the Adam-family optimizers (the trainers' AdamW) in `fresh`, which never stepped, as their
        first real step would create it (class doc)."""
        get_optimizer_state_dict(self.model, self.optimizers)  # one zero-gradient, zero-lr step of each fresh one
        for optimizer in fresh:
            for values in optimizer.state.values():
                values["step"].zero_()

    def load_target(self, name: str, saved: SavedCheckpoint) -> dict[str, Any]:
        """{saved shard prefix: {"state": {name: {key: tensor}}}} for the parameters this optimizer holds."""
        own = self.state_dict()
        check_saved_layout(name, saved, self.tp, self.pp, self.stage_sizes, _saved_ep(self.ep, self.expert_key, own))
        shard_of = {}  # "param name.state key" -> the saved prefix holding it: "tp{t}_pp{p}", "dp{d}_tp{t}_pp{p}", or
        for key in saved.under(name):  # "tp{t}_pp{p}_ep{e}" for this rank's experts
            shard, _, rest = key.partition(".state.")
            if rest and (shard in (self.key, self.expert_key) or shard.endswith("_" + self.key)):
                shard_of[rest] = shard
        target: dict[str, Any] = {}
        missing = []
        for param, values in ((p, v) for part in own.values() for p, v in part["state"].items()):
            for key, value in values.items():
                shard = shard_of.get(f"{param}.{key}")
                if shard is None:
                    missing.append(f"{param}.{key}")
                    continue
                target.setdefault(shard, {"state": {}})["state"].setdefault(param, {})[key] = value
        if missing:
            raise ValueError(f"checkpoint {saved.path}: no saved '{name}' state ({self.key}) for {missing[:4]}"
                             f"{' ...' if len(missing) > 4 else ''}: written for another model or optimizer?")
        return target

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load `{any shard prefix: {"state": {param name: {...}}}}` (what `state_dict` or `load_target` gives)."""
        merged: dict[str, dict[str, Any]] = {}
        for shard in state.values():
            for param, values in shard["state"].items():
                merged.setdefault(param, {}).update(values)
        groups = get_optimizer_state_dict(self.model, self.optimizers)["param_groups"]  # this run's hyper-parameters
        set_optimizer_state_dict(self.model, self.optimizers, {"state": merged, "param_groups": groups})


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


def _reseed(state: Mapping[str, Any], rank: int) -> None:
    """Seed every global generator from a hash of `state`'s torch generator and `rank` (module doc)."""
    digest = hashlib.sha256(state["torch"].numpy().tobytes() + rank.to_bytes(8, "little")).digest()
    seed = int.from_bytes(digest[:8], "little")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also every CUDA device


class RNGState:
    """The global random generators of this rank, saved under `"rank{r}"` (every rank has its own streams).

    Loading at a larger world size: a rank the checkpoint has no streams for takes rank 0's, reseeded
    from them and its rank (module doc). Seeded `torch.Generator`s owned by a trainer are not
    global: save them through their own `get_state()` in the trainer's state.
    """

    def __init__(self, rank: Optional[int] = None):
        self.rank = _global_rank() if rank is None else rank
        self.key = f"rank{self.rank}"

    def state_dict(self) -> dict[str, Any]:
        return {self.key: capture_rng_state()}

    def load_target(self, name: str, saved: SavedCheckpoint) -> dict[str, Any]:
        ranks = {k.split(".")[0] for k in saved.under(name)}
        if self.key not in ranks and "rank0" not in ranks:
            raise ValueError(f"checkpoint {saved.path} holds no '{name}' streams of {self.key} or rank0")
        return {self.key if self.key in ranks else "rank0": capture_rng_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `{"rank{r}": streams}`: this rank's own, or rank 0's to derive new streams from."""
        (key, streams), = state.items()
        restore_rng_state(streams)
        if key != self.key:
            _reseed(streams, self.rank)


class Counters:
    """A dict of run counters (a trainer's progress: step, skipped updates...) saved as it is.

    It loads from a checkpoint written before some of its keys existed: those keep their values (the
    start values) and are named in a warning, so a counter added to the trainers does not make the
    checkpoints of earlier runs unloadable. `values` is updated in place.
    """

    def __init__(self, values: dict[str, Any]):
        self.values = values

    def state_dict(self) -> dict[str, Any]:
        return dict(self.values)

    def load_target(self, name: str, saved: SavedCheckpoint) -> dict[str, Any]:
        present = set(saved.under(name))
        missing = [key for key in self.values if key not in present]
        if missing:
            logger.warning("checkpoint %s predates the counters %s: they count from this resume on", saved.path,
                           ", ".join(missing))
        return {key: value for key, value in self.values.items() if key in present}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.values.update(state)


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
