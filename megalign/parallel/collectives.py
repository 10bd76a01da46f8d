"""Autograd-aware collectives for tensor parallelism (Megatron-core `tensor_parallel/mappings.py` style).

Each collective is a small `torch.autograd.Function` whose backward is the adjoint of its forward,
with a plain functional wrapper. Every function takes its process group explicitly and returns its
input unchanged (the same tensor object) when the group has one rank, so tp=1 costs nothing.

    function            forward                             backward
    copy_to_group       identity                            all-reduce (sum)
    reduce_from_group   all-reduce (sum)                    identity
    scatter_to_group    split last dim, keep own chunk      all-gather along last dim
    gather_from_group   all-gather along last dim           split last dim, keep own chunk

`copy_to_group` / `reduce_from_group` bracket a column-parallel -> row-parallel pair; the scatter /
gather pair converts between replicated and last-dim-sharded activations. The plain (non-autograd)
helpers `all_reduce`, `all_reduce_count`, `all_gather_last_dim`, `split_last_dim`, `broadcast_from_first`
and `gather_to_first` never modify their input.

`all_finite` is the trainers' agreement on skipping a step: every rank learns whether any rank saw a
NaN or inf. Unlike the helpers above it also runs without a process group (one process).
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Union

import torch
import torch.distributed as dist

Group = Optional[dist.ProcessGroup]


def group_size(group: Group) -> int:
    """Number of ranks in `group` (None means the default group)."""
    return dist.get_world_size(group)


def all_reduce(x: torch.Tensor, group: Group, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduction (default: sum) of `x` over the ranks of `group`, as a new tensor (`x` is left untouched)."""
    if group_size(group) == 1:
        return x
    out = x.contiguous().clone()
    dist.all_reduce(out, op=op, group=group)
    return out


def all_reduce_count(count: int, group: Group, device: torch.device) -> int:
    """`count` summed over the ranks of `group` (every rank gets the total); `device` is where the collective runs."""
    return int(all_reduce(torch.tensor(float(count), device=device), group))


def all_gather_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dim: [..., n] -> [..., n * group_size]."""
    size = group_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


def split_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's contiguous chunk of the last dim: [..., n] -> [..., n / group_size]."""
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[-1] % size:
        raise ValueError(
            f"split_last_dim: last dim {x.shape[-1]} of shape {tuple(x.shape)} is not divisible by the group size {size}"
        )
    return x.chunk(size, dim=-1)[dist.get_rank(group)].contiguous()


def broadcast_from_first(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Group rank 0's `x` on every rank of `group`, as a new tensor (`x` must have the same shape and dtype everywhere)."""
    if group_size(group) == 1:
        return x
    out = x.contiguous().clone()
    dist.broadcast(out, group_src=0, group=group)
    return out


def gather_to_first(x: torch.Tensor, dim: int, group: Group) -> Optional[torch.Tensor]:
    """Every rank's `x` concatenated along `dim`, on group rank 0 only (None on the others).

    Costs the whole tensor on rank 0 alone (not on every rank, as an all-gather would): what a
    checkpoint writer needs. Shards must have the same shape on every rank.
    """
    size = group_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    first = dist.get_rank(group) == 0
    parts = [torch.empty_like(x) for _ in range(size)] if first else None
    dist.gather(x, parts, group_dst=0, group=group)
    return torch.cat(parts, dim=dim) if first else None


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_last_dim(grad, ctx.group), None


class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return split_last_dim(grad, ctx.group), None


def copy_to_group(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity forward; all-reduce the gradient backward.

    Use where a replicated activation enters rank-local (sharded) computation, e.g. the input of a
    column-parallel linear: each rank's gradient covers only its shard's contribution, and the sum over
    ranks is the full gradient. Shape unchanged.
    """
    if group_size(group) == 1:
        return x
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-reduce (sum) forward; identity backward.

    Use where rank-local partial sums become one replicated activation, e.g. the output of a
    row-parallel linear. The gradient of a replicated output is already the same on every rank.
    Shape unchanged.
    """
    if group_size(group) == 1:
        return x
    return _ReduceFromGroup.apply(x, group)


def scatter_to_group(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep this rank's chunk of the last dim forward; all-gather the gradient backward.

    [..., n] -> [..., n / group_size]; `x` must be replicated across the group.
    """
    if group_size(group) == 1:
        return x
    return _ScatterToGroup.apply(x, group)


def gather_from_group(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather along the last dim forward; keep this rank's chunk of the gradient backward.

    [..., n] -> [..., n * group_size]; whatever consumes the output must be replicated across the group.
    """
    if group_size(group) == 1:
        return x
    return _GatherFromGroup.apply(x, group)


TensorTree = Union[torch.Tensor, float, Mapping[str, Any], Iterable[Any], None]


def _flat_floats(values: TensorTree) -> list[torch.Tensor]:
    """Every floating-point tensor (Python floats as 0-dim tensors) in a nest of mappings and sequences."""
    if isinstance(values, torch.Tensor):
        return [values.detach()] if values.is_floating_point() else []
    if isinstance(values, float):
        return [torch.tensor(values)]
    if isinstance(values, Mapping):
        return [t for v in values.values() for t in _flat_floats(v)]
    if isinstance(values, (list, tuple)):
        return [t for v in values for t in _flat_floats(v)]
    return []


def all_finite(values: TensorTree, group: Group = None) -> bool:
    """Whether every float in `values` (a loss, gradients, a nest of tensors) is finite on every rank of `group`.

    Trainers call it on the loss or the global gradient norm before `optimizer.step()` and skip the
    update when it is False, so NaN / inf never reaches the weights (and so never a checkpoint).
    One MIN all-reduce over `group` (default: the whole world when a process group exists) makes all
    ranks agree, so they skip together and stay in step; one host sync per call.
    """
    tensors = _flat_floats(values)
    device = tensors[0].device if tensors else torch.device("cpu")
    flags = [torch.isfinite(t).all().to(device) for t in tensors]
    ok = (torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool, device=device)).to(torch.int32)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    return bool(ok)
