"""Expert parallelism (`ep`) as a layout dimension of the trainers, on gloo with 2 processes.

References that can fail: the ep and expert-data-parallel groups against Megatron's rank generator for the expert
layers (order tp-ep-dp-pp, expert tp = tp), for many sizes without processes; an SFT step and a GRPO step on a tiny
Qwen3-MoE at dp = 2, ep = 2 (each rank holding 2 of the 4 experts) against the same run at ep = 1 (every rank holding
every expert): the HF exports (every expert, reloaded by transformers) and the clipped grad norms agree to fp32
rounding; a run at ep = 2 resumed from its checkpoint equals the straight run bit for bit; a checkpoint saved at
another ep is refused naming it; bad settings are refused naming the key before the model loads.
"""
import itertools
import json
import math
import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from parallel.dist_utils import run_distributed
from torch.testing import assert_close
from trainers.grpo_helpers import record_batches, tiny_config, train_replayed
from trainers.test_moe_online import EXPERTS, tiny_moe
from transformers import AutoModelForCausalLM

from megalign.checkpoint.state import SavedCheckpoint, check_saved_layout
from megalign.config import load_config
from megalign.models import from_pretrained
from megalign.parallel import clip_grad_norm_, sync_gradients
from megalign.parallel.layout import ParallelLayout, ep_group_ranks, expert_dp_group_ranks
from megalign.trainers.grpo import GRPOTrainer
from megalign.trainers.sft import SFTConfig, SFTObjective, train_sft
from megalign.trainers.supervised import SupervisedTrainer


def megatron_expert_groups(tp, pp, dp, ep):
    """(ep groups, expert-dp groups) as Megatron-core's `RankGenerator(tp, ep, dp / ep, pp, order="tp-ep-dp-pp")`
    builds them for the expert layers: a rank's coordinates in that order, varying one of them."""
    edp = dp // ep
    sizes = {"tp": tp, "ep": ep, "dp": edp, "pp": pp}
    order = ["tp", "ep", "dp", "pp"]
    groups = {"ep": {}, "dp": {}}
    for coords in itertools.product(*(range(sizes[d]) for d in reversed(order))):
        c = dict(zip(reversed(order), coords))
        rank, stride = 0, 1
        for d in order:
            rank += c[d] * stride
            stride *= sizes[d]
        for dim in groups:
            groups[dim].setdefault(tuple(c[d] for d in order if d != dim), []).append(rank)
    return [sorted(g) for g in groups["ep"].values()], [sorted(g) for g in groups["dp"].values()]


@pytest.mark.parametrize("world", [1, 2, 4, 6, 8, 12, 16, 24])
def test_ep_groups_follow_megatron(world):
    checked = 0
    for tp, pp in itertools.product(range(1, world + 1), repeat=2):
        if world % (tp * pp):
            continue
        dp = world // (tp * pp)
        for ep in (e for e in range(1, dp + 1) if dp % e == 0):
            ep_groups, edp_groups = megatron_expert_groups(tp, pp, dp, ep)
            assert sorted(ep_group_ranks(tp=tp, pp=pp, dp=dp, ep=ep)) == sorted(ep_groups), (tp, pp, dp, ep)
            assert sorted(expert_dp_group_ranks(tp=tp, pp=pp, dp=dp, ep=ep)) == sorted(edp_groups), (tp, pp, dp, ep)
            for rank in range(world):
                layout = ParallelLayout(tp=tp, pp=pp, dp=dp, world_size=world, rank=rank, ep=ep)
                assert layout.ep_group_ranks()[layout.ep_rank] == rank
                assert layout.expert_dp_group_ranks()[layout.expert_dp_rank] == rank
            checked += 1
    assert checked > 0


def test_ep_must_divide_dp():
    with pytest.raises(ValueError, match=r"ep=3 must divide dp=4"):
        ParallelLayout(tp=1, pp=2, dp=4, world_size=8, ep=3)
    with pytest.raises(ValueError, match=r"ep must be a positive int, got 0"):
        ep_group_ranks(tp=1, pp=1, dp=2, ep=0)


def test_saved_ep_must_match():
    keys = frozenset({"model.tp0_pp0.model.norm.weight", "model.tp0_pp0_ep0.model.layers.0.mlp.experts.up_proj",
                      "model.tp0_pp0_ep1.model.layers.0.mlp.experts.up_proj"})
    saved = SavedCheckpoint("ckpt", keys)
    check_saved_layout("model", saved, tp=1, pp=1, ep=2)
    for ep in (1, 4):
        with pytest.raises(ValueError, match=rf"saved with ep=2, but this run has ep={ep}"):
            check_saved_layout("model", saved, tp=1, pp=1, ep=ep)
    dense = SavedCheckpoint("ckpt", frozenset({"model.tp0_pp0.model.norm.weight"}))
    with pytest.raises(ValueError, match=r"saved with ep=1, but this run has ep=2"):
        check_saved_layout("model", dense, tp=1, pp=1, ep=2)


# ----- gradient sync and grad norm on the model: ep = 2 against ep = 1, each rank its own batch

def _synced(policy, layout, average, norm_type):
    """(grads by name, the clip's total norm) of one backward of this rank's batch on `layout`'s model."""
    model = from_pretrained(policy, layout=layout).train()
    ids = torch.randint(4, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(dist.get_rank()))
    logits = model(ids).float()
    F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    sync_gradients(model, layout, average=average)
    norm = clip_grad_norm_(model, math.inf, layout, norm_type)
    return {n: p.grad.clone() for n, p in model.named_parameters()}, norm


def _sync_and_norm(policy):
    one, two = ParallelLayout.build(), ParallelLayout.build(ep=2)
    assert (two.ep_group_ranks(), two.expert_dp_group_ranks()) == ([0, 1], [dist.get_rank()])
    for average, norm_type in ((True, 2.0), (False, 2.0), (False, math.inf)):
        (ref, ref_norm), (got, norm) = (_synced(policy, layout, average, norm_type) for layout in (one, two))
        assert_close(norm, ref_norm, rtol=1e-6, atol=0)
        per_rank = EXPERTS // 2
        for name, grad in got.items():
            expected = ref[name]
            if ".experts." in name:  # this rank's experts [2 r, 2 r + 2) of 4
                expected = expected[per_rank * dist.get_rank():per_rank * (dist.get_rank() + 1)]
            assert_close(grad, expected, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name} {average}: {m}")


def test_sync_and_grad_norm_at_ep2_equal_ep1(tmp_path):
    """`sync_gradients` (summed and averaged) and `clip_grad_norm_` (2-norm and max) on the model itself."""
    run_distributed(_sync_and_norm, tiny_moe(tmp_path / "policy", k=2))


# ----- trainers at dp = 2: ep = 2 against ep = 1

LR = 1e-2
ADAM_TOL = dict(rtol=0, atol=LR / 100)
"""Weights after AdamW steps at ep = 2 vs ep = 1: the gradients differ by fp32 rounding (the experts' sums run in
another order), and Adam divides by sqrt(v), so a coordinate whose gradient is at rounding level may move by a good
part of lr either way (seen: 1.1e-5 on 1 of 4096); everything else agrees to ~1e-7. 1% of one step's lr bounds both."""


def sft_config(policy, run_dir, *overrides) -> SFTConfig:
    """SFT on the arithmetic task from the MoE policy; a grad clip small enough to act, so the norm counts."""
    return load_config(SFTConfig, None, [
        f"run_dir={run_dir}", f"model.path={policy}", "steps=2", "batch_size=8", "data.arith.max_operand=4",
        f"optim.lr={LR}", "optim.warmup_steps=0", "optim.grad_clip=0.5", "eval.max_samples=0", "tensorboard=false",
        "save_every=0", "keep_last=10", *overrides])


def _grad_norms(run_dir, key="grad_norm", steps=2):
    """The logged (pre-clip) grad norm of each of the run's `steps` steps."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        norms = [row[key] for row in map(json.loads, f) if key in row]
    assert len(norms) == steps, norms
    return norms


def _same_export(a, b, exact=False):
    """transformers' reload of two exports: the same parameters (every expert), to `ADAM_TOL` or bit for bit."""
    ma, mb = (dict(AutoModelForCausalLM.from_pretrained(os.path.join(d, "hf")).named_parameters()) for d in (a, b))
    assert ma.keys() == mb.keys() and any(".experts." in n for n in ma)
    for name in ma:
        tol = dict(rtol=0, atol=0) if exact else ADAM_TOL
        assert_close(ma[name], mb[name], **tol, msg=lambda m: f"{name}: {m}")


def _sft(policy, root):
    one, two = os.path.join(root, "ep1"), os.path.join(root, "ep2")
    train_sft(sft_config(policy, one))
    trainer = SupervisedTrainer(sft_config(policy, two, "model.ep=2"), SFTObjective, "SFT")
    experts = trainer.policy.model.model.layers[0].mlp.experts
    assert experts.gate_proj.shape[0] == EXPERTS // 2 and trainer.layout.ep_rank == dist.get_rank()
    assert trainer.train().updates == 2
    # resume at ep = 2: the first step, its checkpoint, then the second step, equal the straight run
    split = os.path.join(root, "split")
    train_sft(sft_config(policy, split, "model.ep=2", "steps=1", "save_every=1"))
    train_sft(sft_config(policy, split, "model.ep=2"))
    if dist.get_rank() == 0:
        assert_close(_grad_norms(two), _grad_norms(one), rtol=1e-5, atol=0)
        assert min(_grad_norms(one)) > 0.5  # clipped: the weights below depend on the norm
        _same_export(one, two)
        _same_export(two, split, exact=True)
    dist.barrier()


def _bad_settings(policy, root):
    dense_dir = os.path.join(root, "dense")
    if dist.get_rank() == 0:
        os.makedirs(dense_dir, exist_ok=True)
        odd_dir = os.path.join(root, "odd")
        shutil.copytree(policy, odd_dir, dirs_exist_ok=True)
        with open(os.path.join(odd_dir, "config.json")) as f:
            config = json.load(f)
        config["num_experts"] = 3
        with open(os.path.join(odd_dir, "config.json"), "w") as f:
            json.dump(config, f)
        config.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"], num_experts=0)
        with open(os.path.join(dense_dir, "config.json"), "w") as f:
            json.dump(config, f)
    dist.barrier()
    cases = [(os.path.join(root, "odd"), "model.ep=2", r"model\.ep=2 must divide the 3 experts of model\.path"),
             (dense_dir, "model.ep=2", r"model\.ep=2: model\.path .* is a dense model"),
             (policy, "model.ep=4", r"model\.ep=4 must divide dp=2")]
    for i, (path, ep, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message):
            SupervisedTrainer(sft_config(path, os.path.join(root, f"bad{i}"), ep), SFTObjective, "SFT")
    with pytest.raises(ValueError, match=r"model\.ep=2: expert parallelism needs an MoE model from model\.path"):
        SupervisedTrainer(load_config(SFTConfig, None, [f"run_dir={root}/scratch", "model.ep=2", "tensorboard=false"]),
                          SFTObjective, "SFT")


def _sft_and_bad_settings(policy, root):
    _bad_settings(policy, os.path.join(root, "bad"))
    _sft(policy, root)


def test_sft_at_ep2_equals_ep1_and_resumes_exactly(tmp_path):
    policy = tiny_moe(tmp_path / "policy", k=2)
    assert EXPERTS % 2 == 0
    run_distributed(_sft_and_bad_settings, policy, str(tmp_path), timeout_s=120)


def _record(policy, run_dir, batch_file):
    record_batches(GRPOTrainer(tiny_config(policy, run_dir)), 2, batch_file)


def _grpo(policy, root, batch_file):
    runs = {}
    for ep in (1, 2):
        run_dir = os.path.join(root, f"ep{ep}")
        train_replayed(GRPOTrainer, tiny_config(policy, run_dir, f"actor.ep={ep}", "optim.grad_clip=0.5",
                                                f"optim.lr={LR}", "export_hf=true", "rollout.pack=false"), batch_file)
        runs[ep] = run_dir
    if dist.get_rank() == 0:
        norms = _grad_norms(runs[1], "actor/grad_norm")
        assert_close(_grad_norms(runs[2], "actor/grad_norm"), norms, rtol=1e-5, atol=0)
        assert min(norms) > 0.5  # clipped
        _same_export(runs[1], runs[2])
    dist.barrier()


def test_grpo_at_ep2_equals_ep1(tmp_path):
    policy = tiny_moe(tmp_path / "policy", k=2)
    batch_file = str(tmp_path / "batches.pt")
    run_distributed(_record, policy, str(tmp_path / "record"), batch_file, world_size=1)
    run_distributed(_grpo, policy, str(tmp_path), batch_file, timeout_s=120)
