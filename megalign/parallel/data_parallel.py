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
  contribute once (tp rank 0 only), pipeline stages sum over pp, expert shards sum over ep. After the sync the
  gradients are identical across dp ranks, so dp needs no reduction: every dp rank computes the same
  norm and clips identically.
- Expert parallelism (`layout.ep` > 1, see `layout`): an MoE model's experts (the parameters its modules mark
  with `ep_shard_dims`, `ep_sharded_parameters`) differ between the ranks of an ep group, and each rank's
  expert gradient already covers the tokens of its whole ep group (the all-to-all's backward). `sync_gradients`
  therefore sums them over the expert-data-parallel group only (dp / ep ranks), which makes them the sum over
  all dp ranks' losses, as the dense gradients' dp sum is; with `average=True` both are divided by dp. The
  grad norm sums the expert shards' squares over the ep group once (`clip_grad_norm_`), and the optimizer
  shards the experts' state over the expert-data-parallel group (`ExpertParallelZero`): a ZeRO-1 over dp
  would broadcast one rank's experts to ranks that hold others.
- Tied word embeddings across pipeline stages (Megatron's embedding group). A tied model split into
  stages holds the matrix twice: the embedding on the first stage, an LM-head copy on the last (see
  `heads.CausalLM`), both loaded from the same checkpoint tensor. Each copy's backward gives only its
  own use's share of the gradient, so `allreduce_embedding_gradients` sums the two over
  `layout.embedding_group`: both then hold the gradient of the shared matrix and identical optimizer
  updates keep them equal. It runs inside `clip_grad_norm_`, because that is the one call every
  trainer makes between the backward and the optimizer step (after `allreduce_gradients`, with
  `max_norm=inf` when not clipping), once per step; the norm then counts the matrix once (the LM-head
  copy is left out). Code that steps without `clip_grad_norm_` calls `allreduce_embedding_gradients`
  itself, exactly once per step (a second call would double the gradient).
"""
from __future__ import annotations

import math
from typing import Iterable, Type, Union

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


def ep_sharded_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of `module` split over the ranks of an ep group (MoE experts), as its modules declare them with
    `ep_shard_dims` ({parameter name: dim}, like `tp_shard_dims`); empty at ep = 1."""
    found: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name in getattr(sub, "ep_shard_dims", {}):
            p = getattr(sub, name)
            found[id(p)] = p
    return list(found.values())


@torch.no_grad()
def sync_gradients(module: nn.Module, layout: ParallelLayout, *, average: bool = True,
                   bucket_cap_mb: float = 25.0) -> None:
    """`allreduce_gradients` of `module`'s parameters over the dp group, its experts' over the expert-dp group (module
    doc), so every gradient is the sum (`average=False`: losses normalised by global counts) or the mean over all dp
    ranks' losses, as at ep = 1. A collective over the dp group; every rank passes the same model."""
    experts = {id(p) for p in ep_sharded_parameters(module)}
    allreduce_gradients([p for p in module.parameters() if id(p) not in experts], layout.dp_group, average=average,
                        bucket_cap_mb=bucket_cap_mb)
    if experts:
        _allreduce([p for p in module.parameters() if id(p) in experts], layout.expert_dp_group,
                   layout.dp if average else 1, bucket_cap_mb)


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
    size = group_size(group)
    if size > 1:
        _allreduce(parameters, group, size if average else 1, bucket_cap_mb)


def _allreduce(parameters: Iterable[nn.Parameter], group: Group, divisor: int, bucket_cap_mb: float) -> None:
    """Sum the `.grad` of the trainable `parameters` over `group` (none missing: zeros) and divide by `divisor`."""
    params = [p for p in parameters if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif p.grad.is_sparse:
            raise ValueError("allreduce_gradients: sparse gradients are not supported")
    for bucket in _buckets(params, int(bucket_cap_mb * 2**20)):
        grads = [p.grad for p in bucket]
        flat = _flatten_dense_tensors(grads)
        if divisor > 1:
            flat.div_(divisor)  # before the sum, so fp16/bf16 sums stay in range
        if group_size(group) > 1:
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
    already be synchronised (`allreduce_gradients`). To checkpoint, wrap it in
    `megalign.checkpoint.OptimizerState`: each rank saves the state of the parameters it owns, by
    parameter name, so the checkpoint loads at any dp size (no consolidation on one rank).
    """
    return ZeroRedundancyOptimizer(parameters, optimizer_class=optimizer_class, process_group=dp_group, **defaults)


class ExpertParallelZero:
    """Two ZeRO-1 optimizers as one: `dense` over the dp group, `experts` over the expert-data-parallel group (module
    doc). It answers what the trainers ask of an optimizer: `param_groups` (the lr is set there before each step),
    `step`, `zero_grad`, `state` (every tensor this rank holds, for offload) and `local_optimizers` (the unsharded
    optimizers holding this rank's part of the state, for `megalign.checkpoint.OptimizerState`)."""

    def __init__(self, dense: ZeroRedundancyOptimizer, experts: ZeroRedundancyOptimizer):
        self.dense, self.experts = dense, experts

    @property
    def param_groups(self) -> list[dict]:
        return self.dense.param_groups + self.experts.param_groups

    @property
    def local_optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.dense.optim, self.experts.optim]

    @property
    def state(self) -> dict:
        """{parameter: its state dict} of both local optimizers (a new dict of the same state dicts: a `ChainMap` over
        their `defaultdict`s would add an empty entry to the first for every lookup of the second's keys)."""
        return {**self.dense.optim.state, **self.experts.optim.state}

    def step(self) -> None:
        """A collective over the dp group (the dense owners' broadcasts) and the expert-dp group."""
        self.dense.step()
        self.experts.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.dense.zero_grad(set_to_none=set_to_none)
        self.experts.zero_grad(set_to_none=set_to_none)


def layout_optimizer(module: nn.Module, param_groups: list[dict], layout: ParallelLayout,
                     optimizer_class: Type[torch.optim.Optimizer] = torch.optim.AdamW,
                     **defaults) -> Union[ZeroRedundancyOptimizer, ExpertParallelZero]:
    """ZeRO-1 for `module`'s `param_groups` (dicts with "params") on `layout`: `zero1_optimizer` over the dp group,
    or, when trainable experts are split over ep ranks, an `ExpertParallelZero` whose expert part is sharded over the
    expert-data-parallel group (each param group split in two, empty halves left out)."""
    experts = {id(p) for p in ep_sharded_parameters(module) if p.requires_grad}
    if not experts:
        return zero1_optimizer(param_groups, layout.dp_group, optimizer_class, **defaults)
    halves: list[list[dict]] = [[], []]
    for group in param_groups:
        for half, is_expert in zip(halves, (False, True)):
            params = [p for p in group["params"] if (id(p) in experts) == is_expert]
            if params:
                half.append({**group, "params": params})
    return ExpertParallelZero(zero1_optimizer(halves[0], layout.dp_group, optimizer_class, **defaults),
                              zero1_optimizer(halves[1], layout.expert_dp_group, optimizer_class, **defaults))


def local_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers holding this rank's state: a ZeRO-1's local one, an `ExpertParallelZero`'s two, or `optimizer`."""
    if isinstance(optimizer, ExpertParallelZero):
        return optimizer.local_optimizers
    return [optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer]


def pp_tied_parameters(module: nn.Module) -> dict[nn.Parameter, bool]:
    """{parameter: is_copy} for every parameter of `module` tied to a parameter on another pipeline stage.

    A module declares them with a `pp_tied` attribute ({parameter name: is_copy}), on the module like
    `tp_shard_dims` (see `layers`): the original is counted in the grad norm, the copy is not.
    """
    tied = {}
    for sub in module.modules():
        for name, is_copy in getattr(sub, "pp_tied", {}).items():
            tied[getattr(sub, name)] = is_copy
    return tied


@torch.no_grad()
def allreduce_embedding_gradients(module: nn.Module, layout: ParallelLayout) -> None:
    """Sum the `.grad` of the pipeline-tied parameters of `module` (`pp_tied_parameters`) over `layout.embedding_group`.

    After it the first stage's embedding and the last stage's LM-head copy hold the same gradient,
    that of the shared `[V_pad / tp, H]` matrix. A no-op at pp=1 and for a stage without tied
    parameters (untied models, middle stages); otherwise a collective between the first and last
    stage of each (dp, tp) coordinate. Call it once per optimizer step (`clip_grad_norm_` does).
    A copy without a gradient (its stage saw no loss) takes part with zeros.
    """
    tied = [p for p in pp_tied_parameters(module) if p.requires_grad]
    if layout.pp == 1 or not tied:
        return
    for p in tied:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=layout.embedding_group)


@torch.no_grad()
def clip_grad_norm_(module: nn.Module, max_norm: float, layout: ParallelLayout, norm_type: float = 2.0) -> torch.Tensor:
    """Finalise the gradients of `module` for the optimizer step: sum the pipeline-tied copies
    (`allreduce_embedding_gradients`), then scale every gradient so the global norm is at most `max_norm`;
    return that norm.

    The norm is taken over the whole model as if unsharded: tp-sharded parameters (declared through
    `tp_shard_dims`, see `layers.tp_sharded_parameters`) count each shard once, replicated parameters
    count once, a matrix tied across pipeline stages counts once (its last-stage copy is left out),
    experts split over ep ranks (`ep_shard_dims`) count each rank's once, and the stages of the pipeline are
    combined. Call it after `sync_gradients` (or `allreduce_gradients`), once per step (`max_norm=inf` only
    finalises); a collective over the tp, pp, embedding (and at ep > 1 the ep) groups, so every rank calls it.
    Returns a 0-dim fp32 tensor (no host sync), the same on every rank.
    """
    allreduce_embedding_gradients(module, layout)
    sharded = {id(p) for p in tp_sharded_parameters(module)}
    copies = {id(p) for p, is_copy in pp_tied_parameters(module).items() if is_copy}
    experts = {id(p) for p in ep_sharded_parameters(module)}
    params = [p for p in module.parameters() if p.grad is not None]
    counted = [p for p in params if id(p) not in copies and (id(p) in sharded or layout.tp_rank == 0)]
    dense, expert = (_norm([p.grad for p in counted if (id(p) in experts) == e], norm_type, layout)
                     for e in (False, True))
    if math.isinf(norm_type):
        local = torch.maximum(dense, all_reduce(expert, layout.ep_group, dist.ReduceOp.MAX) if experts else expert)
        total = all_reduce(all_reduce(local, layout.tp_group, dist.ReduceOp.MAX), layout.pp_group, dist.ReduceOp.MAX)
    else:
        local = dense**norm_type + (all_reduce(expert**norm_type, layout.ep_group) if experts else 0.0)
        total = all_reduce(all_reduce(local, layout.tp_group), layout.pp_group) ** (1.0 / norm_type)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _norm(grads: list[torch.Tensor], norm_type: float, layout: ParallelLayout) -> torch.Tensor:
    """The `norm_type` norm of `grads` (0 when empty) as a 0-dim fp32 tensor on the layout's device."""
    return torch.nn.utils.get_total_norm(grads, norm_type).to(device=layout.device, dtype=torch.float32)
