"""LoRA adapters on the decoder's linear layers (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models").

A target linear `y = x W^T (+ b)`, W `[out, in]`, gains two matrices A `[r, in]` and B `[out, r]`:

    y = x W^T (+ b) + (alpha / r) * dropout(x) A^T B^T

B starts at zero (the adapted model starts as the base model) and A as PEFT draws it
(`kaiming_uniform_(a=sqrt(5))` on the whole `[r, in]`, i.e. U(-1/sqrt(in), 1/sqrt(in))), from a generator
seeded by `seed` and the module's name, drawn whole and then sliced, so tp = 1 and tp = 2 start equal.

Tensor parallelism, the Megatron way (the product B A has the base weight's sharding):

    base layer              W shard          A shard            B shard
    ColumnParallelLinear    [out / tp, in]   [r, in] (repl.)    [out / tp, r]
    RowParallelLinear       [out, in / tp]   [r, in / tp]       [out, r] (repl.)

Forward needs no collective beyond the base layer's: the column layer's adapter reads the same replicated
input, its output shard adds to the base's output shard; the row layer's adapter output
`x_shard A_shard^T B^T` is a partial sum over ranks like `x_shard W_shard^T`, so both are added
*before* the base layer's one all-reduce (B is linear: sum_ranks (x_i A_i^T) B^T = x A^T B^T). The
replicated matrix (column: A, row: B) gets only this rank's part of its gradient; it passes through
`copy_to_group` (identity forward, all-reduce backward), one all-reduce of an `[r, in]` / `[out, r]`
gradient per layer, so every rank holds the full gradient of the replicated matrix.

The adapters are parameters `lora_A` / `lora_B` of the base module itself (whose class is swapped for
a LoRA subclass), so every other name in the model is unchanged and HF name rules, checkpoint names and
`tp_shard_dims` keep working; `tp_shard_dims` gains the sharded adapter (column: `lora_B` dim 0, row:
`lora_A` dim 1). `apply_lora` freezes every base parameter: only adapters require grad.

`adapters_disabled(model)` switches the adapters off (the reference model of DPO / KTO / GRPO is the
base model: no second copy of the weights, as TRL and verl do). `merge_adapters` / `unmerge_adapters`
fold `scale * B A` into W and back. Unmerging by subtraction would drift the frozen base (W + D - D != W
in floating point, a few ulps per cycle, worse in bf16), so the merge swaps each adapted layer's weight
storage for a new tensor W + scale * B A (summed in fp32, rounded once to W's dtype) and keeps the original
storage aside; the unmerge swaps it back: after any number of cycles the base is bitwise the original, and
the Parameter objects never change (optimizers and tied references keep theirs). The cost while merged is
one extra tensor per adapted layer (the adapted weights only: embeddings, norms, unadapted layers are not
copied), plus one fp32 temporary of one layer during the merge. Whatever writes into W while merged is
dropped by the unmerge.
Dropout at tp > 1 draws its mask per rank (the row layer on its input shard), so only dropout = 0 is
identical across tp sizes.
"""
from __future__ import annotations

import contextlib
import math
import zlib
from dataclasses import dataclass
from typing import Iterator, Union

import torch
import torch.nn.functional as F
from torch import nn

from megalign.config import option
from megalign.parallel.collectives import copy_to_group, gather_from_group, reduce_from_group, scatter_to_group
from megalign.parallel.layers import ColumnParallelLinear, RowParallelLinear, _shard

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""PEFT's module names for the linear layers of Llama / Qwen / Mistral decoders; `all-linear` means all of them."""


@dataclass
class LoRAConfig:
    """rank r, alpha (the update is scaled by alpha / r, or alpha / sqrt(r) with `use_rslora`), dropout on the
    adapter's input, target modules by name."""

    rank: int = option(8, doc="adapter rank r")
    alpha: float = option(16.0, doc="the update is scaled by alpha / rank")
    dropout: float = option(0.0, doc="dropout on the adapter's input (drawn per tp rank: only 0 is identical across tp sizes)")
    target_modules: Union[str, list[str]] = option(
        ["q_proj", "v_proj"], doc="adapted linears by name (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
                                  "down_proj), or 'all-linear'")
    use_rslora: bool = option(False, doc="scale by alpha / sqrt(rank) (rank-stabilised LoRA, Kalajievski 2023; "
                                         "PEFT's use_rslora) instead of alpha / rank")

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"lora.rank must be a positive integer, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha must be positive, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout!r}")
        names = self.modules()
        unknown = sorted(set(names) - set(LINEAR_NAMES))
        if unknown or not names:
            raise ValueError(f"lora.target_modules: unknown names {unknown or names}; choose from "
                             f"{list(LINEAR_NAMES)} or 'all-linear'")

    @property
    def scale(self) -> float:
        """alpha / r; with `use_rslora` alpha / sqrt(r), which keeps the update's size (and so the learning rate
        that suits it) from shrinking as the rank grows (Kalajievski 2023, arXiv 2312.03732)."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def modules(self) -> list[str]:
        """The target names, `all-linear` expanded."""
        if self.target_modules == "all-linear":
            return list(LINEAR_NAMES)
        if isinstance(self.target_modules, str):
            return [self.target_modules]
        return list(self.target_modules)


class _LoRAMixin:
    """The adapter half of a LoRA linear; `_base_forward(x, extra)` is the base layer's forward with
    `extra(x_local)` (the adapter's output on the same input, `[..., out_local]`) added before any collective."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    lora_scale: float
    lora_enabled: bool
    lora_merged: bool

    def _lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        """scale * dropout(x) A^T B^T: `[..., in_local]` -> `[..., out_local]`; the replicated matrix's gradient
        is all-reduced over the tp group (module doc)."""
        group = getattr(self, "group", None)
        a, b = self.lora_A, self.lora_B
        if isinstance(self, ColumnParallelLinear):
            a = copy_to_group(a, group)
        elif isinstance(self, RowParallelLinear):
            b = copy_to_group(b, group)
        x = self.lora_dropout(x)
        return F.linear(F.linear(x.to(a.dtype), a), b) * self.lora_scale

    def _lora_active(self) -> bool:
        return self.lora_enabled and not self.lora_merged


class LoRALinear(_LoRAMixin, nn.Linear):
    """`nn.Linear` (tp = 1) with an adapter."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return y + self._lora_delta(x).to(y.dtype) if self._lora_active() else y


class LoRAColumnParallelLinear(_LoRAMixin, ColumnParallelLinear):
    """`ColumnParallelLinear` with an adapter: A replicated, B split on the output dim like W."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_group(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        if self._lora_active():
            y = y + self._lora_delta(x).to(y.dtype)
        return gather_from_group(y, self.group) if self.gather_output else y


class LoRARowParallelLinear(_LoRAMixin, RowParallelLinear):
    """`RowParallelLinear` with an adapter: A split on the input dim like W, B replicated; the adapter's
    partial output joins the base's before the one all-reduce."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_group(x, self.group)
        y = F.linear(x, self.weight)
        if self._lora_active():
            y = y + self._lora_delta(x).to(y.dtype)
        y = reduce_from_group(y, self.group)
        return y if self.bias is None else y + self.bias


_LORA_CLASS = {nn.Linear: LoRALinear, ColumnParallelLinear: LoRAColumnParallelLinear,
               RowParallelLinear: LoRARowParallelLinear}


def _full_a(name: str, rank: int, in_features: int, seed: int) -> torch.Tensor:
    """The whole A `[r, in]`, PEFT's init (kaiming_uniform_, a = sqrt(5)), from a generator seeded by
    `seed` and `name` (crc32), on the CPU in fp32, so every tp size and device draws the same numbers."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    a = torch.empty(rank, in_features)
    bound = math.sqrt(6.0 / ((1 + 5.0) * in_features))  # kaiming gain sqrt(2 / (1 + a^2)), a = sqrt(5)
    return a.uniform_(-bound, bound, generator=gen)


def _global_name(model: nn.Module, name: str) -> str:
    """`name` with the layer index made global (a pipeline stage numbers its layers from 0), so a stage
    seeds its adapters as the whole model does."""
    offset = getattr(getattr(model, "model", None), "layer_range", (0, 0))[0]
    parts = name.split(".")
    if offset and "layers" in parts:
        i = parts.index("layers") + 1
        parts[i] = str(int(parts[i]) + offset)
    return ".".join(parts)


def apply_lora(model: nn.Module, config: LoRAConfig, seed: int = 0) -> list[str]:
    """Give every linear of `model` whose last name is in `config.modules()` an adapter; freeze all other
    parameters. Returns the adapted module names (raises ValueError when none matched or when the model
    already has adapters)."""
    if lora_modules(model):
        raise ValueError("apply_lora: the model already has LoRA adapters")
    targets = set(config.modules())
    adapted = []
    for param in model.parameters():
        param.requires_grad_(False)
    for name, module in list(model.named_modules()):
        if name.rsplit(".", 1)[-1] not in targets:
            continue
        cls = _LORA_CLASS.get(type(module))
        if cls is None:
            raise ValueError(f"apply_lora: {name} is a {type(module).__name__}, not a linear layer LoRA supports")
        weight = module.weight
        full_a = _full_a(_global_name(model, name), config.rank, module.in_features, seed)
        if cls is LoRARowParallelLinear:
            a = _shard(full_a, 1, module.group)
        else:
            a = full_a
        b_rows = weight.shape[0]  # column: out / tp (B split like W); row and tp = 1: out
        module.__class__ = cls
        module.lora_A = nn.Parameter(a.to(device=weight.device, dtype=weight.dtype).contiguous())
        module.lora_B = nn.Parameter(torch.zeros(b_rows, config.rank, device=weight.device, dtype=weight.dtype))
        module.lora_dropout = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()
        module.lora_scale = config.scale
        module.lora_enabled = True
        module.lora_merged = False
        if cls is LoRAColumnParallelLinear:
            module.tp_shard_dims = {**module.tp_shard_dims, "lora_B": 0}
        elif cls is LoRARowParallelLinear:
            module.tp_shard_dims = {**module.tp_shard_dims, "lora_A": 1}
        adapted.append(name)
    if not adapted:
        raise ValueError(f"apply_lora: no module of the model is named one of {sorted(targets)}")
    model.lora_config = config
    return adapted


def lora_modules(model: nn.Module) -> dict[str, _LoRAMixin]:
    """{module name: LoRA linear} of `model`."""
    return {name: m for name, m in model.named_modules() if isinstance(m, _LoRAMixin)}


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """{parameter name: tensor} of the adapters only (this rank's shards)."""
    return {name: p for name, p in model.named_parameters() if name.endswith((".lora_A", ".lora_B"))}


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block `model` computes as its base model (the adapters add nothing); refused on merged adapters."""
    modules = list(lora_modules(model).values())
    if any(m.lora_merged for m in modules):
        raise ValueError("adapters_disabled: the adapters are merged into the weights; unmerge_adapters first")
    before = [m.lora_enabled for m in modules]
    for m in modules:
        m.lora_enabled = False
    try:
        yield model
    finally:
        for m, was in zip(modules, before):
            m.lora_enabled = was


@torch.no_grad()
def merge_adapters(model: nn.Module) -> None:
    """W <- W + scale * B A on every adapted layer (each rank its shard: the product has W's sharding); the
    original storage of W is kept aside for `unmerge_adapters` (module doc: bitwise restore, one extra tensor
    per adapted layer while merged)."""
    for m in lora_modules(model).values():
        if not m.lora_merged:
            base = m.weight.data
            merged = m.lora_B.float() @ m.lora_A.float()  # [out_local, in_local] fp32, reused for the sum
            merged.mul_(m.lora_scale).add_(base)  # (B A) s + W in fp32: one rounding to W's dtype below
            m._lora_unmerged_weight = base
            m.weight.data = merged.to(base.dtype)
            m.lora_merged = True


@torch.no_grad()
def unmerge_adapters(model: nn.Module) -> None:
    """Undo `merge_adapters`: put W's original storage back (bit for bit, no subtraction)."""
    for m in lora_modules(model).values():
        if m.lora_merged:
            m.weight.data = m._lora_unmerged_weight
            del m._lora_unmerged_weight
            m.lora_merged = False


@contextlib.contextmanager
def merged_base_view(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block the adapters are merged into W and their parameters are detached from the modules,
    so `model` looks like a plain base model (for the HF export, whose name rules know no adapters). On exit
    the base weights are bitwise the ones before (`unmerge_adapters` restores the kept storage)."""
    merge_adapters(model)
    modules = lora_modules(model)
    held = {name: (m._parameters.pop("lora_A"), m._parameters.pop("lora_B")) for name, m in modules.items()}
    try:
        yield model
    finally:
        for name, m in modules.items():
            m.lora_A, m.lora_B = held[name]
        unmerge_adapters(model)
