"""`optim.fused`: the ZeRO-1 AdamW with torch's fused kernel makes the update of the plain (for-loop) AdamW.

Reference: `torch.optim.AdamW(foreach=False)` (the per-tensor loop) over the same two parameter
groups (decay on matrices only, `param_groups`), fed the same gradients for three steps; the
fused ZeRO-1 optimizer must land on the same weights up to float rounding.
"""
import torch
from parallel.dist_utils import run_distributed

from megalign.data import CharTokenizer
from megalign.parallel import ParallelLayout
from megalign.trainers.optim import OptimConfig, build_optimizer, param_groups
from megalign.trainers.supervised import PolicyModelConfig, scratch_model


def _fused_matches_loop():
    layout = ParallelLayout.build(tp=1)
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, fused=True)
    tiny = PolicyModelConfig(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=2)
    model = scratch_model(tiny, CharTokenizer(), layout, seed=0)
    ref = scratch_model(tiny, CharTokenizer(), layout, seed=0)
    fused = build_optimizer(model, cfg, layout)
    assert fused.optim.defaults["fused"] is True  # the local optimizer ZeRO-1 wraps
    loop = torch.optim.AdamW(param_groups(ref, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                             foreach=False, fused=False)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p, q in zip(model.parameters(), ref.parameters()):
            g = torch.randn(p.shape, generator=gen)
            p.grad, q.grad = g.clone(), g.clone()
        fused.step()
        loop.step()
    moved = 0.0
    for (name, p), q, p0 in zip(model.named_parameters(), ref.parameters(),
                                scratch_model(tiny, CharTokenizer(), layout, seed=0).parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)
        moved = max(moved, float((p - p0).abs().max()))
    assert moved > 1e-3  # the three steps did move the weights (lr 1e-2)


def test_fused_adamw_matches_the_loop():
    run_distributed(_fused_matches_loop, world_size=1)
