"""Tensor-parallel layers: vocab-parallel embedding, column- and row-parallel linear (Megatron-core style).

Each layer takes its tensor-parallel process group explicitly and holds only this rank's shard:

    layer                     weight shard                  forward
    Embedding                 [vocab, dim] (tp = 1)         embed
    VocabParallelEmbedding    [padded_vocab / tp, dim]      mask ids outside the shard, embed, all-reduce
    ColumnParallelLinear      [out / tp, in]                copy_to_group, x @ W^T (+ b shard), gather?
    RowParallelLinear         [out, in / tp]                scatter?, x @ W^T, all-reduce, + b

Each layer names its sharded parameters in `tp_shard_dims` ({parameter name: split dim}) so that
grad-norm clipping and checkpointing can tell them from replicated ones (like the row-parallel bias);
`tp_sharded_parameters` collects them from a whole model. The marks live on the module, not as
attributes on the tensors, because `to_empty`/`load_state_dict(assign=True)` replace the tensors.

Weights from a full, unsharded checkpoint go in through `from_full` / `load_full_weight`, which
slice this rank's part; the HF state-dict adapters use them. Initialisation of a fresh layer draws
each shard independently (normal, `init_std`), so it depends on tp; load a full weight when results
must not depend on tp.

Both embeddings look up through `embedding_into_grad`: their backward adds the looked-up rows' gradient
into the weight's `.grad` (a tied LM head's gradient, an earlier micro-batch's) instead of building a
second dense `[V, H]` gradient for autograd to sum (see that function).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from .collectives import Group, copy_to_group, gather_from_group, group_size, reduce_from_group, scatter_to_group


def tp_sharded_parameters(module: nn.Module) -> dict[nn.Parameter, int]:
    """{parameter: split dim} for every tp-sharded parameter of `module` and its children.

    A module declares its sharded parameters with a `tp_shard_dims` attribute ({name: dim}); every
    other parameter is replicated across the tp group.
    """
    sharded = {}
    for sub in module.modules():
        for name, dim in getattr(sub, "tp_shard_dims", {}).items():
            param = getattr(sub, name)
            if param is not None:
                sharded[param] = dim
    return sharded


def divide(numerator: int, denominator: int, what: str) -> int:
    """`numerator / denominator`, or a ValueError naming `what` and both numbers when it is not exact."""
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


def pad_vocab_size(vocab_size: int, tp: int, multiple_of: int = 1) -> int:
    """Round `vocab_size` up to a multiple of `multiple_of * tp` (Megatron's padded vocab)."""
    if vocab_size < 1 or tp < 1 or multiple_of < 1:
        raise ValueError(f"pad_vocab_size: need positive sizes, got vocab_size={vocab_size}, tp={tp}, multiple_of={multiple_of}")
    step = multiple_of * tp
    return -(-vocab_size // step) * step


def _shard(full: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's contiguous slice of `full` along `dim` (the size along `dim` divides the group size)."""
    size = group_size(group)
    part = full.shape[dim] // size
    return full.narrow(dim, dist.get_rank(group) * part, part)


def _check_full_shape(layer: str, name: str, full: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(full.shape) != expected:
        raise ValueError(f"{layer}: full {name} has shape {tuple(full.shape)}, expected {expected}")


class _EmbeddingIntoGrad(torch.autograd.Function):
    """`F.embedding` whose weight gradient is added into `.grad` by the backward itself (`embedding_into_grad`)."""

    @staticmethod
    def forward(ctx, ids, anchor, weight_holder):
        ctx.save_for_backward(ids)
        ctx.weight = weight_holder[0]
        return F.embedding(ids, anchor)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        if weight.grad is None:  # the first gradient this weight gets: what the dense backward builds
            weight.grad = torch.zeros_like(weight)
        # index_put_ rather than index_add_: its accumulate is sort-based (deterministic) on CUDA, as the dense
        # embedding backward is; CUDA's index_add_ adds repeated ids with atomics
        rows = grad_out.reshape(-1, weight.shape[1]).to(weight.grad.dtype)
        weight.grad.index_put_((ids.reshape(-1),), rows, accumulate=True)
        return None, None, None


def embedding_into_grad(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.embedding(ids, weight)`: ids `[*]` -> `[*, H]` rows of weight `[V, H]`; the backward adds the rows'
    gradient straight into `weight.grad` (created as zeros when None) instead of handing autograd a `[V, H]`.

    Why: the dense embedding backward builds a zero `[V, H]` gradient and adds the `[*, H]` output
    gradient into the looked-up rows. With the weight tied to the LM head that is a second `[V, H]` beside
    the head's, summed by autograd before `.grad` takes it (at Qwen2's V = 151936, H = 1024 fp32: 594 MiB
    made and freed every backward); after an earlier micro-batch, it is summed into `.grad`. Here the
    `[*, H]` rows are only added into `.grad` (`index_put_(accumulate=True)`). A sparse gradient (`sparse=True`) does not
    do it: autograd adds a sparse gradient into a dense one in place only in `.grad`, and into the head's
    gradient out of place.

    This is Megatron's gradient-accumulation fusion (its linears add into `main_grad` in the backward),
    with `.grad` as the buffer: the autograd graph has no edge from the lookup to `weight`, so the tied
    head's gradient becomes `.grad` as soon as the head's backward ends and the lookup's rows are added
    into it; untied, or on a pipeline stage holding its own copy, the first micro-batch's lookup creates
    the dense `.grad` the dense backward would have built. Either order gives the same sum, and
    `.backward()`, gradient accumulation over micro-batches, the dp all-reduce, clipping and the optimizers
    see a plain dense `.grad`. What this changes: the lookup's part reaches the weight only through
    `.backward()` without `inputs=`. `torch.autograd.grad(..., weight)` and `backward(inputs=[...])` prune
    the lookup's backward (it leads to no requested input), so they return or accumulate only the weight's
    other uses (the tied head's part); hooks on the weight's gradient do not see the lookup's part.
    Without grad mode, or for a frozen weight, this is plain `F.embedding`.
    """
    if not (torch.is_grad_enabled() and weight.requires_grad):
        return F.embedding(ids, weight)
    return _EmbeddingIntoGrad.apply(ids, weight.detach().requires_grad_(), (weight,))


class Embedding(nn.Embedding):
    """The tp = 1 token embedding: `nn.Embedding` (ids `[*]` -> `[*, H]`) looking up through `embedding_into_grad`."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return embedding_into_grad(ids, self.weight)


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split across the tp group.

    The vocabulary is padded to `pad_vocab_size(num_embeddings, tp, pad_to_multiple_of)` rows so every
    rank holds the same number; rank r holds rows [vocab_start_index, vocab_end_index). The padding
    rows are zero when loaded from a full weight and are never looked up by valid ids.

    Input: integer ids of any shape with values in [0, num_embeddings). Output: [*ids.shape,
    embedding_dim], replicated across the group. At tp > 1, ids outside [0, padded_num_embeddings)
    embed to zero (no rank owns them) instead of raising as `nn.Embedding` does at tp = 1; checking
    would cost a device-to-host sync per call, so the data pipeline validates token ids instead.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        group: Group,
        pad_to_multiple_of: int = 1,
        init_std: float = 0.02,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.group = group
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.init_std = init_std
        tp = group_size(group)
        self.padded_num_embeddings = pad_vocab_size(num_embeddings, tp, pad_to_multiple_of)
        per_rank = self.padded_num_embeddings // tp
        self.vocab_start_index = dist.get_rank(group) * per_rank
        self.vocab_end_index = self.vocab_start_index + per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim, device=device, dtype=dtype))
        self.tp_shard_dims = {"weight": 0}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.init_std)

    @classmethod
    def from_full(cls, weight: torch.Tensor, *, group: Group, pad_to_multiple_of: int = 1) -> "VocabParallelEmbedding":
        """Build from the full [num_embeddings, dim] weight, keeping this rank's rows (copied)."""
        layer = cls(weight.shape[0], weight.shape[1], group=group, pad_to_multiple_of=pad_to_multiple_of,
                    device="meta", dtype=weight.dtype)
        layer.to_empty(device=weight.device)
        layer.load_full_weight(weight)
        return layer

    @torch.no_grad()
    def load_full_weight(self, weight: torch.Tensor) -> None:
        """Copy this rank's rows of the full weight, [num_embeddings, dim] (padding rows become zero) or
        already padded [padded_num_embeddings, dim] (copied as is)."""
        if weight.ndim != 2 or weight.shape[1] != self.embedding_dim or weight.shape[0] not in (
            self.num_embeddings, self.padded_num_embeddings
        ):
            raise ValueError(
                f"VocabParallelEmbedding: full weight has shape {tuple(weight.shape)}, expected "
                f"({self.num_embeddings} or padded {self.padded_num_embeddings}, {self.embedding_dim})"
            )
        self.weight.zero_()
        stop = min(self.vocab_end_index, weight.shape[0])
        if stop > self.vocab_start_index:
            self.weight[: stop - self.vocab_start_index].copy_(weight[self.vocab_start_index : stop])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if group_size(self.group) == 1:
            return embedding_into_grad(ids, self.weight)
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local_ids = (ids - self.vocab_start_index).masked_fill(outside, 0)
        # ids outside the shard look up row 0; masked_fill's backward gives them zero rows of the gradient
        out = embedding_into_grad(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_group(out, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (padded {self.padded_num_embeddings}), {self.embedding_dim}, "
                f"rows [{self.vocab_start_index}, {self.vocab_end_index})")


class _ParallelLinear(nn.Module):
    """Shared parameter handling of the two parallel linears: shard shapes, init, loading full weights.

    `weight_shard_dim` is 0 (split output features) or 1 (split input features); the bias has
    `out_features` entries, split along with the weight when the output is split.
    """

    weight_shard_dim: int

    def __init__(self, in_features: int, out_features: int, *, group: Group, bias: bool, device, dtype):
        super().__init__()
        self.group = group
        self.in_features = in_features
        self.out_features = out_features
        tp = group_size(group)
        name = type(self).__name__
        if self.weight_shard_dim == 0:
            shape = (divide(out_features, tp, f"{name}: out_features"), in_features)
        else:
            shape = (out_features, divide(in_features, tp, f"{name}: in_features"))
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.tp_shard_dims = {"weight": self.weight_shard_dim}
        if bias:
            self.bias = nn.Parameter(torch.empty(shape[0], device=device, dtype=dtype))
            if self.weight_shard_dim == 0:
                self.tp_shard_dims["bias"] = 0
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's init, using the full `in_features` as fan-in so it matches the dense layer's scale."""
        bound = 1.0 / math.sqrt(self.in_features)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_full(cls, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *, group: Group, **kwargs):
        """Build from the full (unsharded) [out_features, in_features] weight and optional [out_features] bias.

        `kwargs` are the layer's flags (`gather_output` / `input_is_parallel`). Parameters are copies.
        """
        layer = cls(weight.shape[1], weight.shape[0], group=group, bias=bias is not None,
                    device="meta", dtype=weight.dtype, **kwargs)
        layer.to_empty(device=weight.device)
        layer.load_full_weight(weight, bias)
        return layer

    @torch.no_grad()
    def load_full_weight(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        """Copy this rank's slice of the full [out_features, in_features] weight (and [out_features] bias)."""
        name = type(self).__name__
        _check_full_shape(name, "weight", weight, (self.out_features, self.in_features))
        self.weight.copy_(_shard(weight, self.weight_shard_dim, self.group))
        if (bias is None) != (self.bias is None):
            raise ValueError(f"{name}: layer has bias={self.bias is not None} but a full bias was "
                             f"{'not ' if bias is None else ''}given")
        if bias is not None:
            _check_full_shape(name, "bias", bias, (self.out_features,))
            self.bias.copy_(_shard(bias, 0, self.group) if self.weight_shard_dim == 0 else bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"shard={tuple(self.weight.shape)}, bias={self.bias is not None}")


class ColumnParallelLinear(_ParallelLinear):
    """y = x W^T + b with W's output features split across the tp group (weight shard [out / tp, in]).

    Input: [..., in_features], replicated across the group. Output: [..., out_features / tp], this
    rank's slice of the features, or with `gather_output=True` the full [..., out_features] (replicated).
    The bias is split with the weight.
    """

    weight_shard_dim = 0

    def __init__(self, in_features: int, out_features: int, *, group: Group, bias: bool = True,
                 gather_output: bool = False, device=None, dtype=None):
        super().__init__(in_features, out_features, group=group, bias=bias, device=device, dtype=dtype)
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_group(x, self.group), self.weight, self.bias)
        return gather_from_group(y, self.group) if self.gather_output else y


class RowParallelLinear(_ParallelLinear):
    """y = x W^T + b with W's input features split across the tp group (weight shard [out, in / tp]).

    Input: [..., in_features / tp], this rank's slice (the output of a `ColumnParallelLinear`), or with
    `input_is_parallel=False` the full replicated [..., in_features], split here. Output: [...,
    out_features], replicated. The bias is replicated and added once, after the all-reduce.
    """

    weight_shard_dim = 1

    def __init__(self, in_features: int, out_features: int, *, group: Group, bias: bool = True,
                 input_is_parallel: bool = True, device=None, dtype=None):
        super().__init__(in_features, out_features, group=group, bias=bias, device=device, dtype=dtype)
        self.input_is_parallel = input_is_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_group(x, self.group)
        y = reduce_from_group(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias
