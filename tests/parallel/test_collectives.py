"""Each autograd collective, forward and backward, against the same computation written densely in one process.

Every rank builds the inputs of all ranks from one seed. The dense reference evaluates the total loss
of the whole group (per-rank losses summed; a replicated loss counted once) with plain torch ops and
autograd; each rank's gradient must equal its part of the dense gradient.
"""
import torch
import torch.distributed as dist
from torch.testing import assert_close

from megalign.parallel.collectives import (
    all_finite,
    all_gather_last_dim,
    all_reduce,
    broadcast_from_first,
    copy_to_group,
    gather_from_group,
    gather_to_first,
    reduce_from_group,
    scatter_to_group,
    split_last_dim,
)
from megalign.parallel.layout import ParallelLayout

from .dist_utils import run_distributed

F64 = torch.float64


def _leaf(t):
    return t.detach().clone().requires_grad_()


def _check_collectives_on_tp_group():
    layout = ParallelLayout.build(tp=2)
    group, r, n = layout.tp_group, layout.tp_rank, layout.tp
    torch.manual_seed(0)
    xs = torch.randn(n, 3, 4, dtype=F64)  # rank i's input: xs[i]
    ups = torch.randn(n, 3, 8, dtype=F64)  # upstream-gradient weights of rank i's loss: ups[i]

    # copy: y_i = x on every rank, L = sum_i <ups_i, y_i>
    x = _leaf(xs[0])
    y = copy_to_group(x, group)
    assert_close(y, xs[0])
    (y * ups[r, :, :4]).sum().backward()
    dense_x = _leaf(xs[0])
    sum((dense_x * ups[i, :, :4]).sum() for i in range(n)).backward()
    assert_close(x.grad, dense_x.grad)

    # reduce: y = sum_i x_i (replicated), L = <ups_0, y> counted once
    x = _leaf(xs[r].t())  # a non-contiguous input
    y = reduce_from_group(x, group)
    dense = [_leaf(xs[i].t()) for i in range(n)]
    dense_y = sum(dense)
    assert_close(y, dense_y)
    (y * ups[0, :, :4].t()).sum().backward()
    (dense_y * ups[0, :, :4].t()).sum().backward()
    assert_close(x.grad, dense[r].grad)
    assert_close(x, xs[r].t())  # the input is not reduced in place

    # scatter: x replicated [3, 4]; y_i = x[:, 2i:2i+2], L = sum_i <ups_i, y_i>
    x = _leaf(xs[0])
    y = scatter_to_group(x, group)
    assert_close(y, xs[0][:, 2 * r : 2 * r + 2])
    (y * ups[r, :, :2]).sum().backward()
    dense_x = _leaf(xs[0])
    sum((dense_x[:, 2 * i : 2 * i + 2] * ups[i, :, :2]).sum() for i in range(n)).backward()
    assert_close(x.grad, dense_x.grad)

    # gather: y = cat_i x_i along the last dim (replicated), L = <ups_0, y> counted once
    x = _leaf(xs[r])
    y = gather_from_group(x, group)
    dense = [_leaf(xs[i]) for i in range(n)]
    dense_y = torch.cat(dense, dim=-1)
    assert_close(y, dense_y)
    (y * ups[0]).sum().backward()
    (dense_y * ups[0]).sum().backward()
    assert_close(x.grad, dense[r].grad)

    # plain helpers
    assert_close(all_reduce(xs[r], group, dist.ReduceOp.MAX), xs.max(dim=0).values)
    assert_close(all_gather_last_dim(xs[r], group), torch.cat(list(xs), dim=-1))
    assert_close(split_last_dim(xs[0], group), xs[0].chunk(n, dim=-1)[r])
    x = xs[r].t()  # non-contiguous
    assert_close(broadcast_from_first(x, group), xs[0].t())
    assert_close(x, xs[r].t())  # the input is left as it was
    gathered = gather_to_first(x, 0, group)
    assert gathered is None if r else torch.equal(gathered, torch.cat([xs[i].t() for i in range(n)], dim=0))
    try:
        split_last_dim(torch.zeros(2, 3), group)
    except ValueError as e:
        assert "last dim 3 of shape (2, 3) is not divisible by the group size 2" in str(e)
    else:
        raise AssertionError("split of 3 columns over 2 ranks was accepted")


def _check_size_one_group_is_identity():
    layout = ParallelLayout.build(tp=1)  # dp=2: the tp group holds one rank
    x = torch.randn(3, 4, requires_grad=True)
    for fn in (copy_to_group, reduce_from_group, scatter_to_group, gather_from_group, all_reduce,
               all_gather_last_dim, split_last_dim, broadcast_from_first):
        assert fn(x, layout.tp_group) is x, fn.__name__
    assert gather_to_first(x, 0, layout.tp_group) is x


def _check_all_finite_agrees_across_ranks():
    layout = ParallelLayout.build(tp=1)
    mine = torch.tensor([1.0, float("nan") if layout.rank == 1 else 2.0])
    assert all_finite(mine) is False  # rank 0's values are finite, but rank 1 saw a NaN: both skip
    assert all_finite(mine, group=layout.tp_group) is (layout.rank == 0)  # a one-rank group: no agreement
    assert all_finite(torch.ones(2)) is True


def _check_all():
    _check_collectives_on_tp_group()
    _check_size_one_group_is_identity()
    _check_all_finite_agrees_across_ranks()


def test_collectives_match_dense_math():
    run_distributed(_check_all)


def test_all_finite_without_a_process_group():
    assert not dist.is_initialized()
    assert all_finite(torch.tensor(1.5))
    assert all_finite([torch.ones(2), {"a": torch.zeros(3)}, 2.0, torch.tensor([1, 2])])  # ints are never NaN
    assert not all_finite([torch.ones(2), {"a": torch.tensor([0.0, float("inf")])}])
    assert not all_finite(float("nan"))
    assert all_finite([])
