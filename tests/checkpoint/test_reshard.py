"""Resume on another dp size: ZeRO-1 optimizer state, per-rank RNG and sampler carried across; a changed tp refused up front.

The references are taken from the running optimizers (their `.state`, gathered over the dp ranks at
save time), not from the checkpoint files, so the test checks what a resumed run computes with.
"""
import math
import os

import pytest
import torch
import torch.distributed as dist
from parallel.dist_utils import run_distributed
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from trainers.test_sft import read_metrics, tiny_config

from megalign.checkpoint import CheckpointManager, ModelState, OptimizerState, RNGState
from megalign.data import CharTokenizer
from megalign.parallel import ParallelLayout, allreduce_gradients
from megalign.trainers.optim import OptimConfig, build_optimizer
from megalign.trainers.sft import train_sft
from megalign.trainers.supervised import PolicyModelConfig, scratch_model

TOKENIZER = CharTokenizer()


def build(layout):
    model = scratch_model(PolicyModelConfig(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                                          num_kv_heads=2), TOKENIZER, layout, seed=0)
    return model, build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.1), layout)


def train_step(model, optimizer, layout, seed, shared_batch=False):
    """One AdamW step on a [2, 6] batch of random ids, each dp rank's own (or the same on every rank: then the
    averaged gradient, hence the update, does not depend on dp); returns the loss."""
    rank_seed = seed if shared_batch else seed + layout.dp_rank
    ids = torch.randint(0, TOKENIZER.vocab_size, (2, 6), generator=torch.Generator().manual_seed(rank_seed))
    loss = model(ids).float().logsumexp(-1).mean()
    loss.backward()
    allreduce_gradients(list(model.parameters()), layout.dp_group)
    optimizer.step()
    optimizer.zero_grad()
    return float(loss)


def owned_state(model, optimizer):
    """{parameter name: {state key: tensor}} that this rank's ZeRO-1 shard holds, read from the optimizer itself."""
    names = {p: n for n, p in model.named_parameters()}
    return {names[p]: {k: v.clone() for k, v in s.items()} for p, s in optimizer.optim.state.items()}


def gathered(value):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def _save(run_dir, legacy):
    layout = ParallelLayout.build(tp=1)
    torch.manual_seed(10 + layout.rank)
    model, optimizer = build(layout)
    for seed in (1, 2):
        train_step(model, optimizer, layout, seed)
    shards = gathered(owned_state(model, optimizer))
    full = {name: values for shard in shards for name, values in shard.items()}
    assert len(full) == sum(map(len, shards)) == len(list(model.parameters()))  # ZeRO-1: each parameter on one rank
    if legacy:  # the format before dp-independent saves: each dp rank's ZeRO shard under "dp{d}_tp0_pp0"
        optim = {f"dp{layout.dp_rank}_tp0_pp0": get_optimizer_state_dict(model, optimizer.optim)}
    else:
        optim = OptimizerState(model, optimizer, layout)
    CheckpointManager(run_dir).save(2, {"model": ModelState(model, layout), "optim": optim, "rng": RNGState()})
    draws = gathered(torch.rand(3))  # what each rank's restored streams must give next
    train_step(model, optimizer, layout, seed=3, shared_batch=True)  # what a resumed run's next update must give
    after = {name: p.detach().clone() for name, p in model.named_parameters()}
    if layout.rank == 0:
        torch.save({"optim": full, "draws": draws, "after": after}, os.path.join(run_dir, "reference.pt"))


def _load(run_dir):
    layout = ParallelLayout.build(tp=1)
    ref = torch.load(os.path.join(run_dir, "reference.pt"))
    model, optimizer = build(layout)
    state = {"model": ModelState(model, layout), "optim": OptimizerState(model, optimizer, layout), "rng": RNGState()}
    CheckpointManager(run_dir).load(2, state)
    mine = owned_state(model, optimizer)
    owners = gathered(sorted(mine))
    assert sorted(n for names in owners for n in names) == sorted(ref["optim"])  # every parameter, once
    for name, values in mine.items():
        assert values.keys() == ref["optim"][name].keys(), name
        for key, value in values.items():
            torch.testing.assert_close(value, ref["optim"][name][key], rtol=0, atol=0, msg=f"{name}.{key}")
    draw = torch.rand(3)
    saved_draws = ref["draws"]
    if layout.rank < len(saved_draws):  # this rank's own saved streams
        torch.testing.assert_close(draw, saved_draws[layout.rank], rtol=0, atol=0)
    else:  # a new rank: streams derived from rank 0's, its own ...
        assert all(not torch.equal(draw, d) for d in saved_draws)
    CheckpointManager(run_dir).load(2, {"rng": RNGState()})  # ... and the same at every load
    torch.testing.assert_close(torch.rand(3), draw, rtol=0, atol=0)
    train_step(model, optimizer, layout, seed=3, shared_batch=True)  # the saving run's next update, on another dp
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref["after"][name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("save_world, load_world, legacy", [(1, 2, False), (2, 1, False), (2, 1, True)],
                         ids=["dp1-to-dp2", "dp2-to-dp1", "legacy-dp2-to-dp1"])
def test_optimizer_and_rng_state_reshard_to_another_dp(tmp_path, save_world, load_world, legacy):
    run_distributed(_save, str(tmp_path), legacy, world_size=save_world)
    run_distributed(_load, str(tmp_path), world_size=load_world)


def _load_at_tp2(run_dir):
    layout = ParallelLayout.build(tp=2)
    model, optimizer = build(layout)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    manager = CheckpointManager(run_dir)
    for name, value in (("model", ModelState(model, layout)), ("optim", OptimizerState(model, optimizer, layout))):
        with pytest.raises(ValueError, match=rf"step_00000002: '{name}' was saved with tp=1 pp=1, but this run has "
                                             r"tp=2 pp=1; a checkpoint loads only into the same tp and pp \(dp may differ\)"):
            manager.load(2, {name: value, "rng": RNGState()})
    for k, v in model.state_dict().items():  # refused before anything was read
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def test_a_changed_tp_is_refused_up_front_naming_both_layouts(tmp_path):
    run_distributed(_save, str(tmp_path), False, world_size=1)
    run_distributed(_load_at_tp2, str(tmp_path))


def _sft(run_dir, *overrides):
    train_sft(tiny_config(run_dir, *overrides))


def test_sft_resumed_on_another_dp_continues_like_a_straight_run(tmp_path):
    straight = str(tmp_path / "straight")
    run_distributed(_sft, straight, world_size=1)
    expected = {row["step"]: row["loss"] for row in read_metrics(straight)}
    for name, first, then in (("dp1-dp2", 1, 2), ("dp2-dp1", 2, 1)):
        run_dir = str(tmp_path / name)
        run_distributed(_sft, run_dir, "steps=2", world_size=first)
        run_distributed(_sft, run_dir, world_size=then)  # resume=auto at step 2
        losses = {row["step"]: row["loss"] for row in read_metrics(run_dir)}
        assert sorted(losses) == [1, 2, 3, 4] and all(math.isfinite(x) for x in losses.values()), (name, losses)
        # the same global batches (sampler) and updates (optimizer state): dp changes only the order of sums
        for step, loss in losses.items():
            assert math.isclose(loss, expected[step], rel_tol=1e-5), (name, step, loss, expected[step])
