"""PPO end to end on a tiny random policy with four roles: learning at dp=2, offload on/off identical, exact
resume (critic, its optimizer and the KL controller included), critic warm-up, the critic's HF export, start-up checks."""
import json
import os

import pytest
import torch
import transformers
from parallel.dist_utils import RankFailure, run_distributed
from trainers.grpo_helpers import HERE, tiny_policy
from trainers.helpers import ROUNDING_PROBES, capture_warnings, checkpoint_params, metric_rows

from megalign.config import ConfigError, load_config
from megalign.models import from_pretrained
from megalign.trainers.base import SkippedUpdatesError
from megalign.trainers.ppo import PPOConfig, train_ppo


def tiny_ppo_config(policy, run_dir, *overrides):
    """A PPO config that runs a step in about a second on the tiny policy, rewarding digits."""
    return load_config(PPOConfig, None, [
        f"run_dir={run_dir}", f"actor.path={policy}", "steps=2", "seed=0", "device=cpu", "tensorboard=false",
        f"reward.terms=[{{name: '{HERE}/grpo_helpers.py:digit_fraction', weight: 1.0}}]",
        "data.arith.max_operand=4", "data.arith.ops=['+']", "rollout.group_size=4", "rollout.prompts_per_step=4",
        "rollout.max_response_length=8", "algo.mini_batches=2", "optim.lr=0.01", "optim.warmup_steps=0",
        "critic.optim.lr=0.01", "eval.max_samples=0", "save_every=0", *overrides])


def _train(policy, run_dir, *overrides):
    train_ppo(tiny_ppo_config(policy, run_dir, *overrides))


def _rows(run_dir):
    return {row["step"]: row for row in metric_rows(run_dir) if "reward/mean" in row}


def controller_betas(rows, beta, target, horizon, samples):
    """The KL coefficient of each step of `rows` (step rows in order) under the adaptive controller (Ziegler et al.
    2019, eq. 2; TRL's AdaptiveKLController): beta <- beta (1 + clip(KL / target - 1, -0.2, 0.2) samples / horizon)
    after each step, KL the step's logged rollout KL and `samples` its responses over every rank."""
    betas = []
    for row in rows:
        betas.append(beta)
        beta *= 1 + min(max(row["actor/rollout_kl"] / target - 1, -0.2), 0.2) * samples / horizon
    return betas


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("policy") / "hf")


def test_reward_rises_two_ranks_and_critic_exports(policy, tmp_path):
    # dp=2 (gloo), 16 prompts x G=4 per step, adaptive KL in the reward; the digit fraction starts near 0.1
    run_distributed(_train, policy, str(tmp_path), "steps=12", "rollout.prompts_per_step=16",
                    "algo.kl_coef=0.01", "algo.kl_target=0.5", "algo.kl_horizon=100", timeout_s=300)
    rows = _rows(str(tmp_path))
    rewards = [rows[s]["reward/mean"] for s in sorted(rows)]
    assert len(rewards) == 12
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.15, rewards
    # the adaptive controller moved beta by its formula from the logged KL of each step
    betas = controller_betas([rows[s] for s in sorted(rows)], 0.01, 0.5, 100, 64)
    assert [rows[s]["actor/kl_coef"] for s in sorted(rows)] == pytest.approx(betas, rel=1e-9)
    assert betas[-1] != 0.01
    # the critic learned something: its values track the returns better than the fresh head did
    assert rows[12]["critic/loss"] < rows[1]["critic/loss"]
    # per-phase memory of every role, and the critic's export loads in transformers with the same values
    with open(tmp_path / "metrics.jsonl") as f:
        first = json.loads(f.readline())
    assert {"memory/values/critic_mib", "memory/critic_update/critic_mib", "memory/update/actor_mib",
            "memory/reference/reference_mib", "memory/generate/critic_mib"} <= first.keys()
    hf = transformers.AutoModelForTokenClassification.from_pretrained(tmp_path / "critic_hf").eval()
    ours = from_pretrained(tmp_path / "critic_hf", kind="value")
    ids = torch.randint(3, ours.config.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits[..., 0], ours(ids), rtol=1e-5, atol=1e-5)
    assert os.path.isfile(tmp_path / "hf" / "config.json")  # the actor too


def _offload_pair(policy, root):
    common = ("algo.kl_coef=0.05", "algo.ppo_epochs=2", "rollout.old_logprobs=recompute", "export_hf=false")
    _train(policy, f"{root}/resident", *common)
    _train(policy, f"{root}/offloaded", *common, "actor.offload_weights=true", "actor.offload_optimizer=true",
           "reference.offload_weights=true", "critic.offload_weights=true", "critic.offload_optimizer=true")


def test_offload_gives_identical_results_with_four_roles(policy, tmp_path):
    run_distributed(_offload_pair, policy, str(tmp_path), world_size=1)
    resident, offloaded = _rows(f"{tmp_path}/resident"), _rows(f"{tmp_path}/offloaded")
    assert resident == offloaded and resident[2]["actor/token_kl"] != 0
    with open(os.path.join(tmp_path, "offloaded", "metrics.jsonl")) as f:
        row = json.loads(f.readline())
    # idle roles hold nothing: the critic while the actor generates and updates, the actor in the critic update
    assert row["memory/generate/critic_mib"] == 0 and row["memory/update/critic_mib"] == 0
    assert row["memory/critic_update/actor_mib"] == 0 and row["memory/critic_update/critic_mib"] > 0
    assert row["memory/values/reference_mib"] == 0 and row["memory/values/critic_mib"] > 0


def _straight_then_resumed(policy, root):
    common = ("algo.kl_coef=0.05", "algo.kl_target=1.0", "algo.kl_horizon=50", "export_hf=false")
    _train(policy, f"{root}/straight", "steps=4", *common)
    _train(policy, f"{root}/resumed", "steps=2", *common)
    _train(policy, f"{root}/resumed", "steps=4", *common)


def test_resume_is_exact_with_four_roles(policy, tmp_path):
    run_distributed(_straight_then_resumed, policy, str(tmp_path))
    straight, resumed = _rows(f"{tmp_path}/straight"), _rows(f"{tmp_path}/resumed")
    assert sorted(straight) == sorted(resumed) == [1, 2, 3, 4]
    assert straight == resumed
    # the adaptive beta, moved by its formula, came back from the checkpoint (16 responses a step)
    betas = controller_betas([straight[s] for s in (1, 2, 3, 4)], 0.05, 1.0, 50, 16)
    assert [straight[s]["actor/kl_coef"] for s in (1, 2, 3, 4)] == pytest.approx(betas, rel=1e-9)
    assert betas[2] != 0.05


def test_critic_warmup_leaves_the_actor_alone(policy, tmp_path):
    run_distributed(_train, policy, str(tmp_path), "steps=3", "algo.critic_warmup=2", "save_every=1", "keep_last=3",
                    "export_hf=false", world_size=1)
    actor = {s: checkpoint_params(str(tmp_path), s, role="actor") for s in (1, 2, 3)}
    critic = {s: checkpoint_params(str(tmp_path), s, role="critic") for s in (1, 2)}
    initial = dict(from_pretrained(policy).named_parameters())
    for key, value in actor[2].items():
        torch.testing.assert_close(value, initial[key.split(".", 2)[2]].detach(), rtol=0, atol=0, msg=key)
        torch.testing.assert_close(actor[1][key], value, rtol=0, atol=0)
    assert any(not torch.equal(actor[3][k], actor[2][k]) for k in actor[2])  # step 3 trains the actor
    assert any(not torch.equal(critic[2][k], critic[1][k]) for k in critic[1])  # the critic trained meanwhile
    rows = _rows(str(tmp_path))
    assert rows[1]["actor/loss"] == 0 and rows[3]["actor/loss"] != 0


def _no_informative_group(policy, run_dir):
    warnings = capture_warnings("megalign.trainers")
    with pytest.raises(SkippedUpdatesError, match=r"PPO: the policy was never updated: updated in 0 of 2 steps"):
        _train(policy, run_dir, "algo.dynamic_sampling=true", "algo.max_sampling_rounds=2", "save_every=1",
               f"reward.terms=[{{name: '{HERE}/grpo_helpers.py:constant_one', weight: 1.0}}]")
    assert sum("kept no group" in w and "skipping the update" in w for w in warnings) == 2, warnings


def test_dynamic_sampling_without_informative_groups_skips_both_updates(policy, tmp_path):
    # every group's 4 rewards are 1: both rounds drop all 4 groups; the critic's GAE advantages (1 - V) would be
    # nonzero, but with the filter neither the critic nor the actor takes an optimizer step (AdamW's momentum and
    # weight decay would move them on zero gradients)
    run_distributed(_no_informative_group, policy, str(tmp_path), world_size=1)
    rows = _rows(str(tmp_path))
    assert [rows[s]["empty_updates"] for s in (1, 2)] == [1, 2]
    assert all(rows[s]["sampling/kept_groups"] == 0 and rows[s]["sampling/dropped_groups"] == 8 for s in (1, 2))
    assert all(rows[s]["sampling/rounds"] == 2 for s in (1, 2))
    for role in ("actor", "critic"):
        initial = checkpoint_params(str(tmp_path), 1, role=role)
        for name, value in checkpoint_params(str(tmp_path), 2, role=role).items():
            torch.testing.assert_close(value, initial[name], rtol=0, atol=0)  # no optimizer step moved anything
    actor = checkpoint_params(str(tmp_path), 1, role="actor")
    initial = dict(from_pretrained(policy).named_parameters())
    for key, value in actor.items():
        torch.testing.assert_close(value, initial[key.split(".", 2)[2]].detach(), rtol=0, atol=0, msg=key)


def test_start_up_checks(policy, tmp_path):
    # a critic built for another tokenizer (fewer embedding rows than the tokenizer has ids) fails before training
    other = tiny_policy(tmp_path / "other", vocab_size=20)
    with pytest.raises(RankFailure, match="critic.path"):
        run_distributed(_train, policy, str(tmp_path / "run"), f"critic.path={other}", world_size=1)
    # a normalisation with no reward model to normalise is a config error, raised as the config loads
    with pytest.raises(ConfigError, match="reward_normalize=true needs a reward model"):
        tiny_ppo_config(policy, str(tmp_path / "run"), "algo.reward_normalize=true")
    with pytest.raises(ConfigError, match="reward_calibrate=true needs a reward model"):
        tiny_ppo_config(policy, str(tmp_path / "run"), "algo.reward_calibrate=true")
    with pytest.raises(ConfigError, match="reward_normalize=true needs a reward model .* outside reward.gated and "
                                          "reward.ensemble"):  # an ensemble's members are standardised inside it
        tiny_ppo_config(policy, str(tmp_path / "run"), "algo.reward_normalize=true",
                        f"reward.models=[{{name: a, path: {policy}}}, {{name: b, path: {policy}}}]",
                        "reward.ensemble={models: [a, b]}")
    with pytest.raises(ValueError, match="two readings of the RM's score; set one"):
        tiny_ppo_config(policy, str(tmp_path / "run"), "algo.reward_normalize=true", "algo.reward_calibrate=true")
    with pytest.raises(ValueError, match="positive_nll_coef is VAPO's token-level NLL mean: it needs loss_agg"):
        tiny_ppo_config(policy, str(tmp_path / "run"), "algo.positive_nll_coef=0.1", "algo.loss_agg=seq-mean-token-mean")
    with pytest.raises(ValueError, match="kl_estimator must be one of"):
        tiny_ppo_config(policy, str(tmp_path / "run"), "algo.kl_in=loss", "algo.kl_estimator=k1")


def _loss_terms(policy, other, root):
    common = ("steps=1", "algo.mini_batches=1", "export_hf=false")
    _train(policy, f"{root}/plain", *common, "algo.kl_coef=0")
    _train(policy, f"{root}/entropy", *common, "algo.kl_coef=0", "algo.entropy_coef=0.01")
    _train(policy, f"{root}/positive_nll", *common, "algo.kl_coef=0", "algo.positive_nll_coef=0.1",
           "algo.positive_reward=0.5")
    _train(policy, f"{root}/kl_loss", *common, "algo.kl_in=loss", "algo.kl_estimator=k3", "algo.kl_coef=0.1",
           f"reference.path={other}")


def test_entropy_bonus_and_kl_loss_term(policy, tmp_path):
    # step 1 samples the same responses in all three runs (a KL in the loss changes no reward), so with one
    # update the losses differ by exactly the added terms at the same weights
    other = tiny_policy(tmp_path / "other_ref", seed=1)
    run_distributed(_loss_terms, policy, other, str(tmp_path), world_size=1)
    plain, entropy, kl, nll = (_rows(f"{tmp_path}/{name}")[1] for name in ("plain", "entropy", "kl_loss",
                                                                             "positive_nll"))
    assert plain["reward/mean"] == entropy["reward/mean"] == kl["reward/mean"] == nll["reward/mean"]
    assert entropy["actor/loss"] - plain["actor/loss"] == pytest.approx(-0.01 * plain["actor/entropy"], rel=1e-4)
    # VAPO's term: 0.1 x the mean NLL over the tokens of the samples rewarded >= 0.5 (some, not all, here)
    assert 0 < nll["actor/positive_token_frac"] < 1 and nll["actor/positive_nll"] > 0
    assert nll["actor/loss"] - plain["actor/loss"] == pytest.approx(0.1 * nll["actor/positive_nll"], rel=1e-4)
    assert kl["actor/kl"] > 0.01
    assert kl["actor/loss"] - plain["actor/loss"] == pytest.approx(0.1 * kl["actor/kl"], rel=1e-4)
    # the KL of the update's forward is the rollout's (same weights at step 1), measured on another path
    assert kl["actor/kl"] == pytest.approx(kl["actor/token_kl"], rel=1e-4)


def test_tensor_parallel_step_matches_single_device(policy, tmp_path):
    # one step on the same global batch (dp=1 both times: the same sampler and generator): the four roles at
    # tp=2 on two ranks against tp=1 on one rank
    common = ("steps=1", "algo.kl_coef=0.05", "export_hf=false")
    run_distributed(_train, policy, str(tmp_path / "tp2"), *common, "actor.tp=2", "critic.tp=2", "reference.tp=2")
    run_distributed(_train, policy, str(tmp_path / "tp1"), *common, world_size=1)
    tp2, tp1 = _rows(str(tmp_path / "tp2"))[1], _rows(str(tmp_path / "tp1"))[1]
    assert tp2.keys() == tp1.keys()
    for key in tp1:
        # a clip fraction counts tokens on either side of a threshold: float noise of the tp sums may move one
        # of the ~120 tokens across it
        tol = 0.02 if key.endswith("clip_frac") else 1e-5
        if not key.startswith(ROUNDING_PROBES):
            assert tp2[key] == pytest.approx(tp1[key], rel=1e-4, abs=tol), key
