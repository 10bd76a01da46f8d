"""`activation_checkpointing` of the trained roles (actor, critic, the supervised model): the run is the same as
without it (metrics and weights; the recomputation repeats the forward's own arithmetic), every decoder layer
really runs twice with gradients (forward, then the recomputation in backward), and not at all in scoring and
generation; at pp = 2 inside the pipeline stages too; the planner reads the switch."""
import json

import pytest
import torch
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import tiny_policy
from trainers.helpers import checkpoint_params, compare_runs, metric_rows
from trainers.test_ppo_trainer import tiny_ppo_config
from trainers.test_sft_pipeline import LAYERS, SFT_METRICS, tiny

from megalign.models.decoder import DecoderLayer
from megalign.trainers.ppo import PPOTrainer
from megalign.trainers.sft import train_sft


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("policy") / "hf")


def _counted_run(run, out, *args):
    """`run(*args)` on this rank with every decoder-layer forward counted: {"grad": n, "no_grad": n} to json `out`.
    A worker of `run_distributed` (a forked process: the patch and the counts die with it)."""
    calls = {"grad": 0, "no_grad": 0}
    forward = DecoderLayer.forward

    def counted(self, *a, **kw):
        calls["grad" if torch.is_grad_enabled() else "no_grad"] += 1
        return forward(self, *a, **kw)

    DecoderLayer.forward = counted
    run(*args)
    with open(out, "w") as f:
        json.dump(calls, f)


def _counts(tmp_path, run, *args):
    out = str(tmp_path / f"calls-{len(list(tmp_path.glob('calls-*')))}.json")
    run_distributed(_counted_run, run, out, *args, world_size=1)
    with open(out) as f:
        return json.load(f)


def _train_ppo(policy, run_dir, on):
    flag = str(on).lower()
    trainer = PPOTrainer(tiny_ppo_config(policy, run_dir, "algo.kl_coef=0.01", "save_every=1",
                                         f"actor.activation_checkpointing={flag}", f"critic.activation_checkpointing={flag}"))
    for role in (trainer.actor, trainer.critic):
        assert role.model.model.activation_checkpointing is on
    assert trainer.reference.model.model.activation_checkpointing is False
    trainer.train()


def test_ppo_actor_and_critic_recompute_and_train_the_same(policy, tmp_path):
    """PPO with actor, reference, critic on one rank: checkpointing on both trained roles repeats exactly the
    gradient-mode layer forwards of the updates, nothing else, and trains to the same weights."""
    runs = {on: _counts(tmp_path, _train_ppo, policy, str(tmp_path / str(on)), on) for on in (False, True)}
    # 2 steps x 2 mini-batches x (actor + critic) x 2 layers of gradient-mode forwards, each recomputed once
    assert runs[False]["grad"] == 16
    assert runs[True]["grad"] == 2 * runs[False]["grad"]
    assert runs[True]["no_grad"] == runs[False]["no_grad"] > 0  # rollout, scoring: no recomputation
    assert metric_rows(tmp_path / "True") == metric_rows(tmp_path / "False")
    for role in ("actor", "critic"):
        off, on = checkpoint_params(tmp_path / "False", 2, role), checkpoint_params(tmp_path / "True", 2, role)
        assert sorted(on) == sorted(off)
        for name in off:
            torch.testing.assert_close(on[name], off[name], rtol=0, atol=0, msg=name)


def _sft(run_dir, *overrides):
    train_sft(tiny(run_dir, *overrides))


def test_sft_pp2_with_checkpointing_equals_unpipelined(tmp_path):
    """The switch reaches the pipeline stages (`stage_from_pretrained` / the from-scratch stages): SFT at pp = 2
    with checkpointing equals pp = 1 without it."""
    run_distributed(_sft, str(tmp_path / "ref"), world_size=1)
    run_distributed(_sft, str(tmp_path / "pp2"), "model.pp=2", "model.activation_checkpointing=true", world_size=2)
    compare_runs(tmp_path / "ref", tmp_path / "pp2", 2, 1, LAYERS, SFT_METRICS)


def test_sft_from_scratch_and_from_a_checkpoint_recompute(tmp_path):
    """Both of the supervised trainer's model builders take the switch: from scratch, then from its own export."""
    counts = {on: _counts(tmp_path, _sft, str(tmp_path / f"scratch-{on}"), "steps=1", "export_hf=true",
                          f"model.activation_checkpointing={str(on).lower()}") for on in (False, True)}
    assert counts[True]["grad"] == 2 * counts[False]["grad"] > 0
    loaded = _counts(tmp_path, _sft, str(tmp_path / "loaded"), "steps=1", f"model.path={tmp_path / 'scratch-False' / 'hf'}",
                     "model.activation_checkpointing=true")
    assert loaded["grad"] == counts[True]["grad"]


def test_planner_reads_the_switch(tmp_path, policy):
    from megalign.plan.runconfig import plan_from_run_config
    path = tmp_path / "ppo.yaml"
    path.write_text(f"actor: {{path: {policy}, activation_checkpointing: true, pp: 2}}\ncritic: {{path: {policy}}}\n")
    plan, _ = plan_from_run_config(str(path), gpus=2)
    assert plan.actor.activation_checkpointing == "full" and plan.actor.pp == 2
    assert plan.critic.activation_checkpointing == "none"
