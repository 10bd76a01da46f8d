"""PPO across data-parallel sizes, the four model roles offloaded and resumed, and the critic's vocabulary check.

dp=2 equals dp=1 on the same global batch: the rollout is recorded once (one rank, the real sampler,
rollout engine and reward) and replayed (`train_replayed`), each dp rank taking its contiguous half of the
rows (whole groups), so what is compared is everything after sampling: reference and critic forwards, k1 KL in
the reward, GAE, advantage whitening over every dp rank, the critic's and the actor's updates with
gradients summed over dp and globally normalised losses. Two PPO epochs of one mini-batch (each rank's
mini-batch order is its own shuffle, so with one mini-batch per epoch the global mini-batches are the
same rows) and micro-batches of 4 rows (gradient accumulation on each rank).

Four model roles (actor, reference, critic, and a reward model, the critic starting from it): a run with
every offload switch on, stopped after step 1 and resumed, equals a resident straight run, step by step.
"""
import json

import pytest
import torch
from parallel.dist_utils import RankFailure, run_distributed
from trainers.grpo_helpers import record_batches, tiny_policy, train_replayed
from trainers.helpers import assert_rows_close, checkpoint_params, metric_rows
from trainers.test_ppo_trainer import _train, controller_betas, tiny_ppo_config

from megalign.models import RewardModel, from_pretrained
from megalign.trainers.ppo import PPOTrainer, train_ppo


COMMON = ("steps=1", "save_every=1", "export_hf=false", "algo.kl_coef=0.05", "algo.ppo_epochs=2", "algo.mini_batches=1",
          "algo.micro_batch_size=4", "rollout.prompts_per_step=4")


def _record_then_replay(policy, reference, run_dir, batch_file):
    """One rank: sample and score the global batch with the real trainer, save it, then train on it (the dp=1 run)."""
    record_batches(PPOTrainer(tiny_ppo_config(policy, f"{run_dir}_record", *COMMON, f"reference.path={reference}")), 1,
                   batch_file)
    _replay(policy, reference, run_dir, batch_file)


def _replay(policy, reference, run_dir, batch_file):
    train_replayed(PPOTrainer, tiny_ppo_config(policy, run_dir, *COMMON, f"reference.path={reference}"), batch_file)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return tiny_policy(root / "policy"), tiny_policy(root / "reference", seed=1)


def test_dp2_equals_dp1_on_the_same_global_batch(models, tmp_path):
    policy, reference = models
    batch_file = str(tmp_path / "batch.pt")
    run_distributed(_record_then_replay, policy, reference, str(tmp_path / "dp1"), batch_file, world_size=1)
    run_distributed(_replay, policy, reference, str(tmp_path / "dp2"), batch_file, world_size=2)
    (dp1,), (dp2,) = metric_rows(str(tmp_path / "dp1")), metric_rows(str(tmp_path / "dp2"))
    # losses, gradient norms, KL, values, returns, rewards: the same numbers from either layout
    assert_rows_close(dp1, dp2, across_layouts=True)
    assert dp1["actor/token_kl"] > 0 and dp1["actor/grad_norm"] > 0 and dp1["critic/grad_norm"] > 0
    initial = dict(from_pretrained(policy).named_parameters())  # the actor's start, and the critic's trunk
    for role in ("actor", "critic"):
        one, two = checkpoint_params(str(tmp_path / "dp1"), 1, role), checkpoint_params(str(tmp_path / "dp2"), 1, role)
        assert one.keys() == two.keys() and one
        for key in one:
            # AdamW divides by sqrt(v): an element whose gradient is float noise (~1e-9 against eps = 1e-8)
            # moves by a noise-sized fraction of lr = 0.01; one such element measured 1.5e-5 apart. A gradient
            # of another direction (a rank's rows missing) moves elements by ~lr; its scale is in the norms above
            torch.testing.assert_close(two[key], one[key], rtol=1e-5, atol=1e-4, msg=key)
        # the step moved the role's weights, so the equality is about trained weights
        names = {key: key.split(".", 2)[2] for key in one}
        assert any(not torch.allclose(one[k], initial[n], rtol=0, atol=1e-6) for k, n in names.items() if n in initial)

def test_critic_for_another_tokenizer_fails_at_start_up(models, tmp_path):
    # more embedding rows than the char tokenizer's 99 ids, and not that checkpoint's own tokenizer: the
    # critic's head would read states of ids the actor can sample but the critic was never built for
    policy, _ = models
    other = tiny_policy(tmp_path / "other", vocab_size=300)
    with pytest.raises(RankFailure, match=r"tokenizer \(char, 99 ids\) does not match critic\.path .*vocab_size 300"):
        run_distributed(train_ppo, tiny_ppo_config(policy, str(tmp_path / "run"), f"critic.path={other}"),
                        world_size=1)


OFFLOAD = ("actor.offload_weights=true", "actor.offload_optimizer=true", "reference.offload_weights=true",
           "reward.model.offload_weights=true", "critic.offload_weights=true", "critic.offload_optimizer=true")


def _resident_then_offloaded_resumed(policy, rm, root):
    common = (f"reward.model.path={rm}", "reward.model_weight=0.5", "algo.kl_coef=0.05", "algo.kl_target=1.0",
              "algo.kl_horizon=50", "rollout.old_logprobs=recompute", "export_hf=false")
    _train(policy, f"{root}/resident", "steps=3", *common)
    _train(policy, f"{root}/offloaded", "steps=1", *common, *OFFLOAD)
    _train(policy, f"{root}/offloaded", "steps=3", *common, *OFFLOAD)


@pytest.mark.slow
def test_four_model_roles_offloaded_and_resumed_equal_resident(models, tmp_path):
    policy, _ = models
    rm = tiny_policy(tmp_path / "rm", seed=2, model_cls=RewardModel)
    run_distributed(_resident_then_offloaded_resumed, policy, rm, str(tmp_path), world_size=1, timeout_s=300)
    resident, offloaded = (metric_rows(str(tmp_path / name)) for name in ("resident", "offloaded"))
    steps = [[row for row in rows if "reward/mean" in row] for rows in (resident, offloaded)]
    assert [row["step"] for row in steps[0]] == [row["step"] for row in steps[1]] == [1, 2, 3]
    assert steps[0] == steps[1]
    assert steps[0][0]["reward/reward_model/mean"] != 0  # the reward model scored
    # the adaptive KL coefficient moved by its formula and came back from the checkpoint with the rest
    betas = controller_betas(steps[0], 0.05, 1.0, 50, 16)
    assert [row["actor/kl_coef"] for row in steps[0]] == pytest.approx(betas, rel=1e-9) and betas[2] != 0.05
    with open(tmp_path / "offloaded" / "metrics.jsonl") as f:
        row = json.loads(f.readline())
    # the reward model holds memory only while it scores, the critic only in its phases
    assert row["memory/reward/reward_model_mib"] > 0 and row["memory/update/reward_model_mib"] == 0
    assert row["memory/values/reward_model_mib"] == 0 and row["memory/generate/critic_mib"] == 0
