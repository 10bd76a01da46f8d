"""`actor.batch_invariant` in the online trainers: with the switch on, one GRPO / PPO step logs the rollout engine's
log-probs equal to the trainer's bit for bit (`rollout/logprob_bitwise_equal` 1, max |d| 0, k3 0: the statistic of
`megalign.rollout.mismatch`, tested by hand in tests/rollout/test_mismatch.py), from the recomputed old log-probs and
from the first micro-batch of the training forward (`old_logprobs: rollout`), in fp32 and bf16, at pp = 1 and 2;
online DPO rolls out in the mode; the mode is off again once `train()` returns; the start-up check refuses what the
mode cannot hold, and the environment variable overrides the key. The default mode's figures are printed, not
asserted (they are rounding)."""
import json
import os

import pytest
from parallel.dist_utils import RankFailure, run_distributed
from trainers.grpo_helpers import tiny_config, tiny_overrides, tiny_policy

from megalign.config import load_config
from megalign.models import batch_invariant as bi
from megalign.rollout import engine
from megalign.trainers.grpo import train_grpo
from megalign.trainers.online_config import batch_invariant_switch
from megalign.trainers.online_dpo import OnlineDPOConfig, train_online_dpo
from megalign.trainers.ppo import PPOConfig, train_ppo

EQUAL = {"rollout/logprob_max_abs_diff": 0.0, "rollout/logprob_k3": 0.0, "rollout/logprob_bitwise_equal": 1.0}


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("policy") / "hf")


def _probes(run_dir):
    """The logged `rollout/logprob_*` of the run's single step."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {k: v for row in rows if row.get("step") == 1 for k, v in row.items() if k.startswith("rollout/logprob_")}


def _grpo(policy, run_dir, *overrides):
    train_grpo(tiny_config(policy, run_dir, "steps=1", "export_hf=false", *overrides))
    assert not bi.enabled()  # train() turned the mode off again


def _ppo(policy, run_dir, *overrides):
    base = [o for o in tiny_overrides(policy, run_dir) if not o.startswith("steps=")]
    train_ppo(load_config(PPOConfig, None, [*base, "steps=1", "export_hf=false", "critic.optim.lr=0.01", *overrides]))
    assert not bi.enabled()


def _online_dpo(policy, run_dir, calls):
    """Online DPO with the switch; `calls` collects how often the engine took the mode's log-softmax."""
    picked = bi.token_logprobs

    def counting(*args, **kwargs):
        calls.append(1)
        return picked(*args, **kwargs)

    engine.batch_invariant.token_logprobs = counting  # the forked rank's module only
    base = [o for o in tiny_overrides(policy, run_dir) if not o.startswith(("algo.", "rollout.group_size", "steps="))]
    train_online_dpo(load_config(OnlineDPOConfig, None, [*base, "rollout.group_size=2", "steps=1", "export_hf=false",
                                                         "actor.batch_invariant=true"]))
    assert calls and not bi.enabled(), len(calls)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_grpo_step_logs_bitwise_equal_logprobs(policy, tmp_path, dtype):
    runs = {"default": ("rollout.old_logprobs=recompute",),
            "recompute": ("rollout.old_logprobs=recompute", "actor.batch_invariant=true"),
            "rollout": ("rollout.old_logprobs=rollout", "actor.batch_invariant=true")}
    for name, overrides in runs.items():
        run_distributed(_grpo, policy, str(tmp_path / name), f"actor.dtype={dtype}", *overrides, world_size=1)
    print(f"\ndefault mode, {dtype}: {_probes(str(tmp_path / 'default'))}")  # measured, not asserted
    assert _probes(str(tmp_path / "default")).keys() == EQUAL.keys()
    assert _probes(str(tmp_path / "recompute")) == EQUAL
    assert _probes(str(tmp_path / "rollout")) == EQUAL


def test_pipeline_stages_keep_it_bitwise(policy, tmp_path):
    """At pp = 2 the mode holds too; with `old_logprobs: rollout` the probe skips the pipeline's shape-inference call
    of micro-batch 0's loss (uninitialised activations, which gave k3 = NaN), in the default mode as well."""
    pp2 = ("actor.pp=2", "algo.micro_batch_size=4", "rollout.old_logprobs=rollout")
    run_distributed(_grpo, policy, str(tmp_path / "default"), *pp2)
    run_distributed(_grpo, policy, str(tmp_path / "invariant"), *pp2, "actor.batch_invariant=true")
    default = _probes(str(tmp_path / "default"))
    print(f"\ndefault mode, pp=2: {default}")
    assert default.keys() == EQUAL.keys() and 0 <= default["rollout/logprob_k3"] < 1e-6, default
    assert default["rollout/logprob_bitwise_equal"] > 0  # most tokens agree in fp32 even by default
    assert _probes(str(tmp_path / "invariant")) == EQUAL


def test_ppo_and_online_dpo_run_in_the_mode(policy, tmp_path):
    run_distributed(_ppo, policy, str(tmp_path / "ppo"), "rollout.old_logprobs=recompute", "actor.batch_invariant=true",
                    world_size=1)
    assert _probes(str(tmp_path / "ppo")) == EQUAL
    run_distributed(_online_dpo, policy, str(tmp_path / "dpo"), [], world_size=1)


def test_tensor_parallel_actor_is_refused_at_start_up(policy, tmp_path):
    with pytest.raises(RankFailure, match=r"actor.batch_invariant=true: .*tp=1.*actor.tp=2"):
        run_distributed(_grpo, policy, str(tmp_path), "actor.tp=2", "actor.batch_invariant=true")
    assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_switch_checks_and_environment_override(monkeypatch, tmp_path):
    monkeypatch.delenv(bi.ENV, raising=False)
    cfg = lambda *o: tiny_config("unused", str(tmp_path), *o)  # noqa: E731 (the switch reads the config only)
    assert not batch_invariant_switch(cfg(), "cpu", needs_reference=False)
    assert batch_invariant_switch(cfg("actor.batch_invariant=true"), "cpu", needs_reference=False)
    with pytest.raises(ValueError, match=r"actor.batch_invariant=true: .*CPU only.*device=cuda"):
        batch_invariant_switch(cfg("actor.batch_invariant=true"), "cuda", needs_reference=False)
    reference_tp2 = cfg("actor.batch_invariant=true", "reference.tp=2")
    with pytest.raises(ValueError, match=r"got reference.tp=2$"):
        batch_invariant_switch(reference_tp2, "cpu", needs_reference=True)
    assert batch_invariant_switch(reference_tp2, "cpu", needs_reference=False)  # no reference built: no matter
    monkeypatch.setenv(bi.ENV, "0")  # the variable overrides the key either way
    assert not batch_invariant_switch(cfg("actor.batch_invariant=true", "actor.tp=2"), "cpu", needs_reference=False)
    monkeypatch.setenv(bi.ENV, "1")
    assert batch_invariant_switch(cfg(), "cpu", needs_reference=False)
    with pytest.raises(ValueError, match=rf"{bi.ENV}=1: .*got actor.tp=2"):
        batch_invariant_switch(cfg("actor.tp=2"), "cpu", needs_reference=False)
    monkeypatch.setenv(bi.ENV, "on")
    with pytest.raises(ValueError, match=bi.ENV):
        batch_invariant_switch(cfg(), "cpu", needs_reference=False)
