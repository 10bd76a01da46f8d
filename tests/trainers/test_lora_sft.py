"""LoRA in the supervised trainers (`model.lora`): SFT and DPO train the adapters only (the base stays bit-identical,
the optimizer holds adapter state only), DPO's reference is the policy with adapters off, checkpoints hold only
the adapters and a LoRA SFT run resumes exactly (also at tp = 2, which equals tp = 1), and the PEFT export loads
in `peft`.
"""
import math
import os

import pytest
import torch
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import tiny_policy
from trainers.helpers import checkpoint_params, metric_rows

from megalign.config import load_config
from megalign.models import from_pretrained, lora_modules
from megalign.roles.adapter_reference import AdapterOffReference
from megalign.trainers.kto import KTOConfig, KTOObjective
from megalign.trainers.preference import DPOConfig, PairwiseObjective
from megalign.trainers.sft import SFTConfig, SFTObjective
from megalign.trainers.supervised import SupervisedTrainer

LORA = ["model.lora={rank: 4, alpha: 8, target_modules: all-linear}"]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("policy") / "hf")


def sft_config(policy, run_dir, *overrides) -> SFTConfig:
    return load_config(SFTConfig, None, [
        f"run_dir={run_dir}", f"model.path={policy}", "steps=3", "batch_size=8", "data.arith.max_operand=4",
        "optim.lr=2e-2", "optim.warmup_steps=0", "optim.schedule=constant", "eval.max_samples=0", "tensorboard=false",
        "export_hf=false",
        "save_every=1", "keep_last=10", *LORA, *overrides])


def _base_unchanged(trainer, policy):
    """The trained model's non-adapter tensors equal `policy`'s, bit for bit; returns how many were compared."""
    start = dict(from_pretrained(policy).named_parameters())
    compared = 0
    for name, p in trainer.policy.model.named_parameters():
        if not name.endswith((".lora_A", ".lora_B")):
            assert torch.equal(p.detach(), start[name].detach()), name
            compared += 1
    return compared


def _sft_trains_adapters_only(policy, run_dir):
    trainer = SupervisedTrainer(sft_config(policy, run_dir, "steps=8", "save_every=0"), SFTObjective, "SFT")
    model = trainer.policy.model
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all(n.endswith((".lora_A", ".lora_B")) for n in adapters)
    assert len(adapters) == 2 * 7 * 2  # 2 layers x 7 linears x (A, B)
    result = trainer.train()
    losses = [row["loss"] for row in result.metrics]
    assert all(math.isfinite(x) for x in losses) and sum(losses[-2:]) < sum(losses[:2]), losses
    assert any(m.lora_B.abs().max() > 0 for m in lora_modules(model).values())  # B left zero: the adapters moved
    assert _base_unchanged(trainer, policy) > 0
    optimizer = trainer.policy.optimizer
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert held == {id(p) for n, p in model.named_parameters() if n in adapters}  # optimizer state: adapters only


def test_sft_with_lora_trains_the_adapters_only(policy, tmp_path):
    run_distributed(_sft_trains_adapters_only, policy, str(tmp_path), world_size=1)


def _resume(policy, tmp):
    straight, split = os.path.join(tmp, "straight"), os.path.join(tmp, "split")
    SupervisedTrainer(sft_config(policy, straight), SFTObjective, "SFT").train()
    SupervisedTrainer(sft_config(policy, split, "steps=2"), SFTObjective, "SFT").train()
    resumed = SupervisedTrainer(sft_config(policy, split), SFTObjective, "SFT").train()
    assert [row["step"] for row in resumed.metrics] == [3]
    assert metric_rows(straight)[2]["loss"] == metric_rows(split)[2]["loss"]
    a, b = checkpoint_params(straight, 3), checkpoint_params(split, 3)
    assert a.keys() == b.keys() and a
    assert all(k.endswith((".lora_A", ".lora_B")) for k in a)  # the checkpoint holds the adapters only
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def test_lora_sft_resumes_exactly(policy, tmp_path):
    run_distributed(_resume, policy, str(tmp_path), world_size=1)


def _sft(policy, run_dir, *overrides):
    SupervisedTrainer(sft_config(policy, run_dir, *overrides), SFTObjective, "SFT").train()


def test_lora_sft_tp2_equals_tp1_and_resumes(policy, tmp_path):
    """Adapters sharded at tp = 2 (seeded whole, then sliced) train as at tp = 1; the sharded adapter checkpoint resumes."""
    run_distributed(_sft, policy, f"{tmp_path}/tp1", world_size=1)
    run_distributed(_sft, policy, f"{tmp_path}/tp2", "model.tp=2", "steps=2", world_size=2)
    run_distributed(_sft, policy, f"{tmp_path}/tp2", "model.tp=2", world_size=2)
    tp1, tp2 = metric_rows(f"{tmp_path}/tp1"), metric_rows(f"{tmp_path}/tp2")
    assert [r["step"] for r in tp2] == [1, 2, 3]
    for a, b in zip(tp1, tp2):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)


def _dpo(policy, run_dir):
    cfg = load_config(DPOConfig, None, [
        f"run_dir={run_dir}", f"model.path={policy}", "steps=10", "batch_size=8", "data.arith.max_operand=4",
        "data.max_length=40", "data.shuffle=false", "optim.lr=5e-3", "optim.warmup_steps=0", "optim.schedule=constant", "eval.max_samples=0", "tensorboard=false",
        "export_hf=true", "model.lora_export=peft", "save_every=0", "reference.mode=online", *LORA])
    trainer = SupervisedTrainer(cfg, PairwiseObjective, "DPO")
    assert isinstance(trainer.reference, AdapterOffReference) and trainer.reference.model is trainer.policy.model
    result = trainer.train()
    rows = result.metrics
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # B = 0: the policy is its own reference
    last = [row["loss"] for row in rows[-3:]]
    # the adapters learn to prefer the chosen answers; a reference scored with the adapters on would be the policy
    # itself (every margin 0, the loss ln 2 at every step)
    assert sum(last) / 3 < math.log(2) - 0.01, rows
    assert _base_unchanged(trainer, policy) > 0
    return trainer


def _dpo_and_peft(policy, run_dir):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM
    trainer = _dpo(policy, run_dir)
    ids = torch.randint(3, 90, (2, 9), generator=torch.Generator().manual_seed(0))
    model = trainer.policy.model.eval()
    with torch.no_grad():
        ours = model(ids)
    hf = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(policy),
                                        os.path.join(run_dir, "hf")).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours, rtol=1e-4, atol=1e-4)


def test_dpo_with_lora_reference_is_the_adapter_off_policy(policy, tmp_path):
    run_distributed(_dpo_and_peft, policy, str(tmp_path), world_size=1)


def _kto_cached_reference(policy, run_dir):
    cfg = load_config(KTOConfig, None, [
        f"run_dir={run_dir}", f"model.path={policy}", "steps=3", "batch_size=8", "data.arith.max_operand=4",
        "data.max_length=40", "optim.lr=5e-3", "optim.warmup_steps=0", "eval.max_samples=0", "tensorboard=false",
        "export_hf=false", "save_every=0", *LORA])  # reference.mode: cache, scored before the first step
    trainer = SupervisedTrainer(cfg, KTOObjective, "KTO")
    assert isinstance(trainer.reference, AdapterOffReference)
    result = trainer.train()
    assert trainer.ref_cache["ready"] and all(math.isfinite(row["loss"]) for row in result.metrics)
    assert any(m.lora_B.abs().max() > 0 for m in lora_modules(trainer.policy.model).values())
    assert _base_unchanged(trainer, policy) > 0


def test_kto_with_lora_caches_the_adapter_off_reference(policy, tmp_path):
    run_distributed(_kto_cached_reference, policy, str(tmp_path), world_size=1)


def _refuses_another_reference(policy, run_dir):
    cfg = load_config(DPOConfig, None, [f"run_dir={run_dir}", f"model.path={policy}", f"reference.path={run_dir}",
                                        "tensorboard=false", *LORA])
    with pytest.raises(ValueError, match="with model.lora the reference is model.path's base model"):
        SupervisedTrainer(cfg, PairwiseObjective, "DPO")


def test_lora_refuses_another_reference_path(policy, tmp_path):
    run_distributed(_refuses_another_reference, policy, str(tmp_path), world_size=1)
