"""`algo.off_policy` in the online trainers: one GRPO step (bf16, where the rollout engine's log-probs differ from the
recomputation, at dp = 2) with modes tis and mis, and one PPO step with decoupled, log `offpolicy/*` equal to the
formula evaluated by hand on the step's own batch (w = exp(recomputed - rollout) over the response tokens of both
ranks: mean, max, fraction above the cap); the start-up check refuses a mode with `old_logprobs: rollout`."""
import glob
import json
import os

import pytest
import torch
import torch.distributed as dist
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import tiny_config, tiny_overrides, tiny_policy

from megalign.config import ConfigError, load_config
from megalign.trainers.grpo import GRPOTrainer
from megalign.trainers.ppo import PPOConfig, PPOTrainer

METRICS = ("offpolicy/weight_mean", "offpolicy/weight_max", "offpolicy/truncated_frac", "offpolicy/masked_frac")


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("policy") / "hf")


def capturing(trainer_cls):
    """`trainer_cls` that saves each rank's scored batch (recomputed and rollout log-probs, response mask)."""

    class Capturing(trainer_cls):
        def update(self, batch, sums, counts):
            torch.save({"old": batch.old_logp, "rollout": batch.rollout_logp, "mask": batch.response_mask},
                       os.path.join(self.cfg.run_dir, f"batch_rank{dist.get_rank()}.pt"))
            return super().update(batch, sums, counts)

    return Capturing


def _grpo(policy, run_dir, *overrides):
    capturing(GRPOTrainer)(tiny_config(policy, run_dir, "steps=1", "export_hf=false", "actor.dtype=bf16",
                                       "rollout.old_logprobs=recompute", *overrides)).train()


def _ppo(policy, run_dir, *overrides):
    base = [o for o in tiny_overrides(policy, run_dir) if not o.startswith("steps=")]
    capturing(PPOTrainer)(load_config(PPOConfig, None, [*base, "steps=1", "export_hf=false", "actor.dtype=bf16",
                                                        "rollout.old_logprobs=recompute", *overrides])).train()


def _logged(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {k: v for row in rows if row.get("step") == 1 for k, v in row.items() if k.startswith("offpolicy/")}


def _by_hand(run_dir, cap):
    """The token weights' statistics over every rank's batch, from the formula: w = exp(old - rollout) (fp32)."""
    batches = [torch.load(p) for p in sorted(glob.glob(os.path.join(run_dir, "batch_rank*.pt")))]
    w = torch.cat([torch.exp(b["old"] - b["rollout"])[b["mask"] != 0] for b in batches])
    return w.double().mean().item(), w.max().item(), (w > cap).double().mean().item(), len(batches)


def test_grpo_tis_and_mis_log_the_weights_of_the_step(policy, tmp_path):
    cap = 1.0  # bf16 rollout vs recompute: about half the tokens have w > 1
    for mode in ("tis", "mis"):
        run_dir = str(tmp_path / mode)
        run_distributed(_grpo, policy, run_dir, f"algo.off_policy.mode={mode}", f"algo.off_policy.cap={cap}",
                        world_size=2, timeout_s=120)
        mean, top, above, ranks = _by_hand(run_dir, cap)
        logged = _logged(run_dir)
        print(f"\n{mode}, bf16: {logged}")
        assert ranks == 2 and logged.keys() == set(METRICS)
        assert 0 < above < 1, above  # the case exercises the cap
        assert logged["offpolicy/weight_mean"] == pytest.approx(mean, rel=1e-6)
        assert logged["offpolicy/weight_max"] == pytest.approx(top, rel=1e-6)
        dropped, truncated = (above, 0.0) if mode == "mis" else (0.0, above)
        assert logged["offpolicy/truncated_frac"] == pytest.approx(truncated, abs=1e-12)
        assert logged["offpolicy/masked_frac"] == pytest.approx(dropped, abs=1e-12)


def test_ppo_decoupled_logs_the_weights(policy, tmp_path):
    run_dir = str(tmp_path / "ppo")
    run_distributed(_ppo, policy, run_dir, "algo.off_policy.mode=decoupled", "algo.off_policy.cap=1.0",
                    "critic.optim.lr=0.01", world_size=1, timeout_s=120)
    mean, top, above, _ = _by_hand(run_dir, 1.0)
    logged = _logged(run_dir)
    assert logged["offpolicy/weight_mean"] == pytest.approx(mean, rel=1e-6)
    assert logged["offpolicy/weight_max"] == pytest.approx(top, rel=1e-6)
    assert logged["offpolicy/masked_frac"] == pytest.approx(above, abs=1e-12) and 0 < above < 1
    assert logged["offpolicy/truncated_frac"] == 0


def test_modes_refuse_rollout_old_logprobs(policy, tmp_path):
    with pytest.raises(ConfigError, match="rollout.old_logprobs=recompute"):
        tiny_config(policy, str(tmp_path), "algo.off_policy.mode=tis", "rollout.old_logprobs=rollout")
    with pytest.raises(ConfigError, match="algo.policy_loss=ppo"):
        tiny_config(policy, str(tmp_path), "algo.off_policy.mode=decoupled", "rollout.old_logprobs=recompute",
                    "algo.policy_loss=cispo")
    assert not tiny_config(policy, str(tmp_path)).algo.off_policy.active  # default none
