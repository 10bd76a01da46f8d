"""Data parallelism: gradient all-reduce over the dp group, ZeRO-1 optimizer sharding, global grad-norm clipping.

Design choices:

- Gradients are synchronised by an explicit call after backward (`allreduce_gradients`), not by
  wrapping the model in DDP: the tp/pp layers already own their collectives, gradient accumulation
  over micro-batches needs no `no_sync`, and the same call works for every pipeline stage. Gradients
  go through flat buckets (one all-reduce per ~`bucket_cap_mb`, per dtype and device) rather than one
  collective per tensor, which is what makes small tensors (norms, biases) cheap.
- ZeRO-1 uses `torch.distributed.optim.ZeroRedundancyOptimizer` with the dp group: it runs on gloo
  and NCCL with subgroups (it maps group ranks to global ranks for its broadcasts), shards the
  optimizer state by whole parameters across dp ranks, and broadcasts each updated parameter from its
  owner. Sharding by whole parameters balances less evenly than Megatron's flat distributed optimizer
  but needs no code of our own; gradients stay full on every rank (ZeRO-1, not ZeRO-2).
- Grad-norm clipping computes one global norm over every distinct parameter of the model: tp-sharded
  parameters contribute their shard on every tp rank (summed over tp), replicated parameters
  contribute once (tp rank 0 only), pipeline stages sum over pp. After `allreduce_gradients` the
  gradients are identical across dp ranks, so dp needs no reduction: every dp rank computes the same
  norm and clips identically.
"""
from __future__ import annotations

import math
from typing import Iterable, Type

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.optim import ZeroRedundancyOptimizer

from .collectives import Group, all_reduce, group_size
from .layers import tp_sharded_parameters
from .layout import ParallelLayout


def _buckets(params: list[nn.Parameter], cap_bytes: int) -> list[list[nn.Parameter]]:
    """Split `params` (in order) into buckets of one dtype and device and at most `cap_bytes` of
    gradient each (a single larger gradient gets a bucket of its own). The order depends only on the
    parameter list, so every rank forms the same buckets."""
    open_buckets: dict[tuple, tuple[list[nn.Parameter], int]] = {}
    done = []
    for p in params:
        key = (p.grad.dtype, p.grad.device)
        bucket, used = open_buckets.get(key, ([], 0))
        nbytes = p.grad.numel() * p.grad.element_size()
        if bucket and used + nbytes > cap_bytes:
            done.append(bucket)
            bucket, used = [], 0
        bucket.append(p)
        open_buckets[key] = (bucket, used + nbytes)
    return done + [bucket for bucket, _ in open_buckets.values()]


@torch.no_grad()
def allreduce_gradients(
    parameters: Iterable[nn.Parameter], group: Group, *, average: bool = True, bucket_cap_mb: float = 25.0
) -> None:
    """All-reduce the `.grad` of every trainable parameter over the dp `group`, in place.

    With `average=True` the result is the mean over dp ranks: the gradient of the global-batch mean
    loss when each rank's loss is the mean over an equal-sized local batch. Use `average=False` when
    the loss is already normalised by a global count (e.g. tokens across all dp ranks).

    A trainable parameter without a gradient gets a zero one, so every rank reduces the same buckets.
    Every rank must pass the same parameters in the same order.
    """
    params = [p for p in parameters if p.requires_grad]
    size = group_size(group)
    if size == 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif p.grad.is_sparse:
            raise ValueError("allreduce_gradients: sparse gradients are not supported")
    for bucket in _buckets(params, int(bucket_cap_mb * 2**20)):
        grads = [p.grad for p in bucket]
        flat = _flatten_dense_tensors(grads)
        if average:
            flat.div_(size)  # before the sum, so fp16/bf16 sums stay in range
        dist.all_reduce(flat, group=group)
        for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(synced)


def zero1_optimizer(
    parameters: Iterable[nn.Parameter],
    dp_group: Group,
    optimizer_class: Type[torch.optim.Optimizer] = torch.optim.AdamW,
    **defaults,
) -> ZeroRedundancyOptimizer:
    """`optimizer_class(parameters, **defaults)` with its state sharded across the dp group (ZeRO-1).

    Each dp rank keeps the optimizer state of about 1/dp of the parameters; `step()` (a collective:
    every dp rank calls it) updates those and broadcasts them to the other dp ranks. Gradients must
    already be synchronised (`allreduce_gradients`). To checkpoint, call `consolidate_state_dict(to=0)`
    on every rank, then `state_dict()` on rank 0.
    """
    return ZeroRedundancyOptimizer(parameters, optimizer_class=optimizer_class, process_group=dp_group, **defaults)


@torch.no_grad()
def clip_grad_norm_(module: nn.Module, max_norm: float, layout: ParallelLayout, norm_type: float = 2.0) -> torch.Tensor:
    """Scale every gradient of `module` so the global gradient norm is at most `max_norm`; return that norm.

    The norm is taken over the whole model as if unsharded: tp-sharded parameters (declared through
    `tp_shard_dims`, see `layers.tp_sharded_parameters`) count each shard once, replicated parameters
    count once, and the stages of the pipeline are combined. Call it after `allreduce_gradients`; a
    collective over the tp and pp groups, so every rank calls it. Returns a 0-dim fp32 tensor (no
    host sync), the same on every rank.
    """
    sharded = {id(p) for p in tp_sharded_parameters(module)}
    params = [p for p in module.parameters() if p.grad is not None]
    counted = [p.grad for p in params if id(p) in sharded or layout.tp_rank == 0]
    local = torch.nn.utils.get_total_norm(counted, norm_type).to(device=layout.device, dtype=torch.float32)
    if math.isinf(norm_type):
        total = all_reduce(all_reduce(local, layout.tp_group, dist.ReduceOp.MAX), layout.pp_group, dist.ReduceOp.MAX)
    else:
        total = all_reduce(all_reduce(local**norm_type, layout.tp_group), layout.pp_group) ** (1.0 / norm_type)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
