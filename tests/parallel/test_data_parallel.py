"""Data parallelism at dp=2 and global grad-norm clipping, each against the dense single-process computation.

Every rank builds the same model and global batch from one seed, trains on its half of the batch,
and compares with a dense copy trained on the whole batch in the same process.
"""
import copy
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.testing import assert_close

from megalign.parallel.data_parallel import allreduce_gradients, clip_grad_norm_, zero1_optimizer
from megalign.parallel.layers import ColumnParallelLinear, RowParallelLinear, tp_sharded_parameters
from megalign.parallel.layout import ParallelLayout

from .dist_utils import run_distributed

F64 = torch.float64


class _Net(nn.Module):
    """Two float64 linears, one float32 linear (a second bucket dtype), an unused and a frozen parameter."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 7, dtype=F64)
        self.b = nn.Linear(7, 3, dtype=F64)
        self.c = nn.Linear(3, 3, dtype=torch.float32)
        self.unused = nn.Parameter(torch.ones(4, dtype=F64))
        self.frozen = nn.Parameter(torch.ones(2, dtype=F64), requires_grad=False)

    def forward(self, x):
        return self.c(self.b(torch.tanh(self.a(x))).float()).double()


def _batch(step, n=8):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 5, dtype=F64, generator=g), torch.randn(n, 3, dtype=F64, generator=g)


def _local(t, layout):
    return t.chunk(layout.dp)[layout.dp_rank]


def _check_gradient_allreduce():
    layout = ParallelLayout.build(tp=1)  # dp=2
    torch.manual_seed(0)
    dense = _Net()
    x, y = _batch(0)
    nn.functional.mse_loss(dense(x), y).backward()
    for average in (True, False):
        model = copy.deepcopy(dense)
        model.zero_grad(set_to_none=True)
        xl, yl = _local(x, layout), _local(y, layout)
        if average:  # the mean over the local half; averaging over dp gives the global mean
            loss = nn.functional.mse_loss(model(xl), yl)
        else:  # already normalised by the global element count
            loss = nn.functional.mse_loss(model(xl), yl, reduction="sum") / y.numel()
        loss.backward()
        allreduce_gradients(model.parameters(), layout.dp_group, average=average, bucket_cap_mb=100 / 2**20)
        for (name, p), p_ref in zip(model.named_parameters(), dense.parameters()):
            if name == "unused":
                assert_close(p.grad, torch.zeros_like(p))
            elif name == "frozen":
                assert p.grad is None
            else:
                assert_close(p.grad, p_ref.grad, msg=name)


def test_gradient_allreduce_equals_full_batch_gradient():
    run_distributed(_check_gradient_allreduce)


def _check_zero1_adam():
    layout = ParallelLayout.build(tp=1)  # dp=2
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(5, 7, dtype=F64), nn.Tanh(), nn.Linear(7, 3, dtype=F64))
    model = copy.deepcopy(dense)
    dense_opt = torch.optim.Adam(dense.parameters(), lr=0.05, weight_decay=0.01)
    opt = zero1_optimizer(model.parameters(), layout.dp_group, torch.optim.Adam, lr=0.05, weight_decay=0.01)
    for step in range(4):
        x, y = _batch(step)
        dense_opt.zero_grad()
        nn.functional.mse_loss(dense(x), y).backward()
        dense_opt.step()
        opt.zero_grad()
        nn.functional.mse_loss(model(_local(x, layout)), _local(y, layout)).backward()
        allreduce_gradients(model.parameters(), layout.dp_group)
        opt.step()
        for p, p_ref in zip(model.parameters(), dense.parameters()):
            assert_close(p, p_ref, msg=f"step {step}")
    # the state really is sharded: each rank holds Adam moments for only some of the parameters
    owned = len(opt.optim.state)
    counts = [None] * layout.dp
    dist.all_gather_object(counts, owned, group=layout.dp_group)
    assert 0 < owned < 4 and sum(counts) == 4, counts


def test_zero1_adam_equals_single_process_adam():
    run_distributed(_check_zero1_adam)


def _dense_tp_model():
    return nn.Sequential(nn.Linear(6, 8, dtype=F64), nn.Tanh(), nn.Linear(8, 4, dtype=F64), nn.LayerNorm(4, dtype=F64))


def _dense_clip(dense, max_norm, norm_type):
    """Dense reference: torch's own clip_grad_norm_ over the unsharded model."""
    return torch.nn.utils.clip_grad_norm_(dense.parameters(), max_norm, norm_type)


def _check_clip_tp():
    layout = ParallelLayout.build(tp=2)
    r, tp = layout.tp_rank, layout.tp
    torch.manual_seed(0)
    x, u = torch.randn(3, 6, dtype=F64), torch.randn(3, 4, dtype=F64)
    for max_norm, norm_type in ((0.05, 2.0), (0.05, math.inf), (0.05, 1.0), (1e6, 2.0)):
        dense = _dense_tp_model()
        model = nn.Sequential(
            ColumnParallelLinear.from_full(dense[0].weight.detach(), dense[0].bias.detach(), group=layout.tp_group),
            nn.Tanh(),
            RowParallelLinear.from_full(dense[2].weight.detach(), dense[2].bias.detach(), group=layout.tp_group),
            copy.deepcopy(dense[3]),  # replicated, like the row-parallel bias
        )
        (model(x) * u).sum().backward()
        (dense(x) * u).sum().backward()
        total = clip_grad_norm_(model, max_norm, layout, norm_type)
        dense_total = _dense_clip(dense, max_norm, norm_type)
        assert_close(total, dense_total.float(), msg=f"norm {norm_type}")
        sharded = tp_sharded_parameters(model)
        for (name, p), p_ref in zip(model.named_parameters(), dense.parameters()):
            ref = p_ref.grad.chunk(tp, dim=sharded[p])[r] if p in sharded else p_ref.grad
            assert_close(p.grad, ref, msg=f"{name}, norm {norm_type}, max_norm {max_norm}")


def _check_clip_pp_and_dp():
    torch.manual_seed(0)
    dense = _dense_tp_model()
    (dense(torch.randn(3, 6, dtype=F64)) * torch.randn(3, 4, dtype=F64)).sum().backward()
    full_grads = [p.grad.clone() for p in dense.parameters()]
    dense_total = _dense_clip(dense, 0.05, 2.0)  # clips dense's grads in place: the reference
    for pp in (2, 1):  # pp=2: stage 0 holds modules 0-1, stage 1 modules 2-3; pp=1: dp=2, replicated grads
        layout = ParallelLayout.build(tp=1, pp=pp)
        mine = [i for i in range(len(dense)) if pp == 1 or (i < 2) == layout.is_first_stage]
        stage = nn.Sequential(*[copy.deepcopy(dense[i]) for i in mine])
        dense_params = [p for i in mine for p in dense[i].parameters()]
        unclipped = dict(zip(dense.parameters(), full_grads))
        for p, p_ref in zip(stage.parameters(), dense_params):
            p.grad = unclipped[p_ref].clone()
        total = clip_grad_norm_(stage, 0.05, layout)
        assert_close(total, dense_total.float(), msg=f"pp={pp}")
        for p, p_ref in zip(stage.parameters(), dense_params):
            assert_close(p.grad, p_ref.grad, msg=f"pp={pp}")


def _check_clip():
    _check_clip_tp()
    _check_clip_pp_and_dp()


def test_clip_grad_norm_equals_dense_over_tp_pp_dp():
    run_distributed(_check_clip)
