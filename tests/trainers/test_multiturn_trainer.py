"""The online trainers on multi-turn episodes (`rollout.env`, `megalign.trainers.episodes`) with a small
deterministic environment (`multiturn_envs.DigitEnv`: the prompt as text, each turn answered with a fixed
observation, each turn rewarded by its digit share): the batch's loss mask against the layout worked out by hand
from the sampled ids, zero gradient on every environment token, recomputed old log-probs against the rollout's,
rewards against the environment's by hand; PPO's GAE over the holes against a hand recursion; dp = 2 against one
process on recorded episodes; actor tp = 2 against one process on live episodes; exact resume; an environment that
raises (counted, scored 0, the run stopped above reward.max_failure_fraction); online DPO on episodes; start-up
refusals."""
import json
import os

import pytest
import torch
from parallel.dist_utils import RankFailure, run_distributed
from trainers.grpo_helpers import HERE, digit_fraction, record_batches, tiny_config, tiny_policy, train_replayed
from trainers.helpers import compare_runs, metric_rows
from trainers.multiturn_envs import OBSERVATION, digit_share

from megalign.algos.aggregation import aggregate_loss, loss_normalizer
from megalign.config import load_config
from megalign.trainers.grpo import GRPOTrainer
from megalign.trainers.online_dpo import OnlineDPOConfig, train_online_dpo
from megalign.trainers.ppo import PPOConfig, PPOTrainer

ENVS = os.path.join(HERE, "multiturn_envs.py")
TURN = 4  # rollout.env.max_turn_tokens
R = 24  # rollout.max_response_length: an episode holds R + 1 tokens at most
GRPO_METRICS = ("reward/mean", "response_length/mean", "actor/loss", "actor/grad_norm", "actor/kl",
                "actor/entropy", "actor/clip_frac", "actor/approx_kl")


def env(cls="DigitEnv", kwargs="{}", extra=""):
    return (f"rollout.env={{name: '{ENVS}:{cls}', max_turn_tokens: {TURN}, kwargs: {kwargs}{extra}}}",
            f"rollout.max_response_length={R}")


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("policy") / "hf")


def recording_sampler(trainer):
    """Record the dataset indices each sampling round draws (the prompts of the batch's groups, in order)."""
    seen, draw = [], trainer.sampler.next_indices
    trainer.sampler.next_indices = lambda n: seen.append(draw(n)) or seen[-1]
    return seen


def hand_layout(tok, prompt, ids, eos):
    """(loss mask over the episode's ids, [turn texts]) worked out from the sampled ids: the prompt's characters,
    then 2 turns of up to TURN tokens (ending at eos), OBSERVATION between them."""
    p = len(tok.encode(prompt))
    assert ids[:p] == tok.encode(prompt)
    turns, mask, at = [], [0] * p, p
    for k in range(2):
        end = at
        while end < at + TURN and (end == at or ids[end - 1] != eos):
            end += 1
        turns.append(ids[at:end])
        mask += [1] * (end - at)
        at = end
        if k == 0:
            obs = tok.encode(OBSERVATION)
            assert ids[at:at + len(obs)] == obs
            mask += [0] * len(obs)
            at += len(obs)
    assert at == len(ids)
    return mask, [tok.decode(t) for t in turns]


def _grpo_step(policy, run_dir):
    t = GRPOTrainer(tiny_config(policy, run_dir, *env(), "rollout.old_logprobs=recompute"))
    seen = recording_sampler(t)
    batch, _, _ = t.collect()
    t.score(batch)
    t.advantages(batch)
    tok, group = t.tokenizer, t.cfg.rollout.group_size
    assert batch.sequences.shape == (16, R + 1) and batch.response_mask.shape == (16, R)
    with_digits = 0
    for i in range(len(batch)):
        example = t.train_set[seen[0][i // group]]
        ids = batch.sequences[i][batch.attention_mask[i].bool()].tolist()
        mask, turns = hand_layout(tok, example.prompt_text, ids, tok.eos_id)
        want = torch.zeros(R)
        want[:len(ids) - 1] = torch.tensor(mask[1:], dtype=torch.float32)
        assert torch.equal(batch.response_mask[i], want), i
        # (c) the environment's reward (each turn's digit share) plus the reward term on the last turn
        env_reward = digit_share(turns[0]) + digit_share(turns[1])
        with_digits += any(ch.isdigit() for ch in turns[0] + turns[1])
        assert batch.terms["env"][i].item() == pytest.approx(env_reward, abs=1e-6)
        total = env_reward + digit_fraction(example.prompt_text, turns[1], example.answer, example.metadata)
        assert batch.rewards[i].item() == pytest.approx(total, abs=1e-6)
    policy_tokens = batch.response_mask.bool()
    # (b) the trainer's recomputed old log-probs equal the rollout's on the policy's tokens
    torch.testing.assert_close(batch.old_logp[policy_tokens], batch.rollout_logp[policy_tokens], rtol=0, atol=2e-5)
    assert (batch.rollout_logp[~policy_tokens] == 0).all()
    # (a) the update's loss: zero gradient and zero advantage on every environment (and prompt) token
    assert (batch.advantages[~policy_tokens] == 0).all() and (batch.advantages[policy_tokens] != 0).any()
    captured, forward = {}, t.actor.logprobs_with_grad

    def keep_logp(*args, **kwargs):
        logp, entropy = forward(*args, **kwargs)
        logp.retain_grad()
        captured["logp"] = logp
        return logp, entropy

    t.actor.logprobs_with_grad = keep_logp
    rows = torch.arange(len(batch))
    per_token, _ = t.policy_loss(batch, 0.0).fn(rows)
    agg = t.cfg.algo.loss_agg
    aggregate_loss(per_token, batch.response_mask, agg, loss_normalizer(batch.response_mask, agg, t.layout.dp_group),
                   R).backward()
    grad = captured["logp"].grad
    assert (grad[~policy_tokens] == 0).all() and (grad[policy_tokens] != 0).sum() > policy_tokens.sum() // 2
    metrics = t.rollout_metrics  # collect's step: the episodes' counts
    assert metrics["env/episodes"] == 16 and metrics["env/turns_mean"] == 2 and metrics["env/end/env"] == 16
    assert metrics["env/errors"] == 0 and metrics["env/observation_tokens_mean"] == len(tok.encode(OBSERVATION))
    assert metrics["env/policy_tokens_mean"] == pytest.approx(batch.lengths.mean().item())
    assert metrics["env/share/digits"] == pytest.approx(with_digits / 16) and 0 < with_digits < 16


def test_grpo_step_on_episodes(policy, tmp_path):
    run_distributed(_grpo_step, policy, str(tmp_path), world_size=1)


def _packed_scores(policy, run_dir):
    scores = []
    for pack in ("true", "false"):  # pack_max_fill=1: every forward packed
        t = GRPOTrainer(tiny_config(policy, f"{run_dir}_{pack}", *env(), "rollout.old_logprobs=recompute",
                                    f"rollout.pack={pack}", "rollout.pack_max_fill=1.0"))
        batch, _, _ = t.collect()
        t.score(batch)
        scores.append(batch)
    packed, padded = scores
    assert torch.equal(packed.sequences, padded.sequences)  # the same episodes (same seed)
    policy_tokens = padded.response_mask.bool()
    torch.testing.assert_close(packed.old_logp[policy_tokens], padded.old_logp[policy_tokens], rtol=0, atol=2e-5)
    torch.testing.assert_close(packed.old_logp[policy_tokens], packed.rollout_logp[policy_tokens], rtol=0, atol=2e-5)


def test_packed_forwards_score_episodes_like_padded_rows(policy, tmp_path):
    run_distributed(_packed_scores, policy, str(tmp_path / "run"), world_size=1)


def _ppo_gae(policy, run_dir):
    cfg = load_config(PPOConfig, None, [
        f"run_dir={run_dir}", f"actor.path={policy}", "steps=1", "seed=0", "device=cpu", "tensorboard=false",
        f"reward.terms=[{{name: '{HERE}/grpo_helpers.py:digit_fraction', weight: 1.0}}]",
        "data.arith.max_operand=4", "data.arith.ops=['+']", "rollout.group_size=2", "rollout.prompts_per_step=4",
        "algo.kl_coef=0.0", "algo.whiten_advantages=false", "algo.gamma=0.9", "algo.lam=0.8", "optim.lr=0.01",
        "critic.optim.lr=0.01", "eval.max_samples=0", "save_every=0", "export_hf=false", *env()])
    t = PPOTrainer(cfg)
    batch, _, _ = t.collect()
    t.score(batch)
    t.advantages(batch)
    assert (batch.response_mask[:, 0] == 0).all() and (batch.response_mask.sum(-1) > 0).all()
    for i in range(len(batch)):  # by hand: the recursion visits the policy's tokens only, the score at the last
        where = batch.response_mask[i].nonzero()[:, 0].tolist()
        values = batch.values[i, where].double().tolist()
        adv, after, next_value = [0.0] * len(where), 0.0, 0.0
        for j in reversed(range(len(where))):
            reward = batch.rewards[i].item() if j == len(where) - 1 else 0.0
            after = reward + 0.9 * next_value - values[j] + 0.9 * 0.8 * after
            adv[j], next_value = after, values[j]
        torch.testing.assert_close(batch.advantages[i, where].double(), torch.tensor(adv, dtype=torch.float64),
                                   rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(batch.returns[i, where].double(), torch.tensor(adv, dtype=torch.float64)
                                   + torch.tensor(values, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    result = t.train()  # one whole step on episodes (critic and actor updates) runs
    assert result.step == 1 and all(torch.isfinite(torch.tensor(v)) for v in result.metrics[-1].values())


def test_ppo_gae_over_holes_equals_hand_recursion(policy, tmp_path):
    run_distributed(_ppo_gae, policy, str(tmp_path), world_size=1)


DP_OVERRIDES = ("algo.micro_batch_size=4", "algo.mini_batches=1", "algo.ppo_epochs=2", "algo.kl_coef=0.1",
                "rollout.old_logprobs=recompute", "save_every=1", "export_hf=false", *env())


def _record_then_replay(policy, run_dir, batch_file):
    record_batches(GRPOTrainer(tiny_config(policy, f"{run_dir}_record", *DP_OVERRIDES)), 2, batch_file)
    _replay(policy, run_dir, batch_file)


def _replay(policy, run_dir, batch_file):
    train_replayed(GRPOTrainer, tiny_config(policy, run_dir, *DP_OVERRIDES), batch_file)


def test_dp2_equals_one_process_on_the_same_episodes(policy, tmp_path):
    batches = str(tmp_path / "batches.pt")
    run_distributed(_record_then_replay, policy, str(tmp_path / "ref"), batches, world_size=1)
    recorded = torch.load(batches, weights_only=False)
    assert (recorded[0].response_mask[:, 0] == 0).all()  # episodes: the prompt's tokens are holes too
    run_distributed(_replay, policy, str(tmp_path / "dp2"), batches, world_size=2)
    compare_runs(tmp_path / "ref", tmp_path / "dp2", 1, 1, 2, GRPO_METRICS, role="actor")


TP_OVERRIDES = ("steps=1", "algo.kl_coef=0.1", "algo.mini_batches=1", "rollout.old_logprobs=recompute", "save_every=1",
                "export_hf=false", *env())


def _grpo(policy, run_dir, *overrides):
    GRPOTrainer(tiny_config(policy, run_dir, *TP_OVERRIDES, *overrides)).train()


def test_tp2_grpo_step_on_live_episodes_equals_one_process(policy, tmp_path):
    """Sampled live at actor.tp=2 (dp=1 both times: the same prompts and seed): the same episodes as one process
    (every env/ count, the rewards), one update to the same weights (one: a second would start from weights AdamW
    moved by lr in near-zero gradient elements, where the tp sums' rounding decides the sign). The weights agree to
    1e-4 (1% of the lr = 0.01 step): AdamW's first step is lr g / (|g| + eps), so an element whose gradient is a few eps
    (measured: a k_proj element moved 0.0084, |g| ~ 5e-8) carries its gradient's rounding into the weight."""
    run_distributed(_grpo, policy, str(tmp_path / "tp2"), "actor.tp=2")
    run_distributed(_grpo, policy, str(tmp_path / "tp1"), world_size=1)
    (row,) = [r for r in metric_rows(tmp_path / "tp1") if "reward/mean" in r]
    counts = [k for k in row if k.startswith("env/") and not k.endswith("_s")]
    assert row["env/episodes"] == 16 and row["env/end/env"] == 16 and "env/share/digits" in counts
    compare_runs(tmp_path / "tp1", tmp_path / "tp2", 1, 2, 2, (*GRPO_METRICS, *counts), steps=1, role="actor",
                 atol=1e-4)


def _live_dp2(policy, run_dir):
    GRPOTrainer(tiny_config(policy, run_dir, *env("FlakyEnv", "{fraction: 0.3}"), "steps=1", "export_hf=false")).train()


def test_live_dp2_sums_the_episode_counts_over_ranks(policy, tmp_path):
    """Sampled live at dp = 2: each rank's 8 episodes, the counts (and the failure check) summed over both."""
    run_distributed(_live_dp2, policy, str(tmp_path), world_size=2)
    (row,) = [r for r in metric_rows(tmp_path) if "reward/mean" in r]
    assert row["env/episodes"] == 16 and row["env/end/env"] + row["env/end/error"] == 16
    assert 0 < row["env/errors"] == row["env/end/error"] < 8


def _straight_then_resumed(policy, root):
    common = (*env(), "save_every=1", "export_hf=false", "algo.ppo_epochs=2")
    GRPOTrainer(tiny_config(policy, f"{root}/straight", *common)).train()
    GRPOTrainer(tiny_config(policy, f"{root}/resumed", *common, "steps=1")).train()
    GRPOTrainer(tiny_config(policy, f"{root}/resumed", *common)).train()  # resume=auto: from the step-1 checkpoint


def test_resume_mid_run_is_exact(policy, tmp_path):
    run_distributed(_straight_then_resumed, policy, str(tmp_path), world_size=1)
    volatile = ("time/", "memory/", "tokens_per_s", "env/forward_s", "env/env_s")
    straight = {r["step"]: r for r in metric_rows(tmp_path / "straight", volatile) if "reward/mean" in r}
    resumed = {r["step"]: r for r in metric_rows(tmp_path / "resumed", volatile) if "reward/mean" in r}
    assert sorted(straight) == sorted(resumed) == [1, 2]
    assert straight == resumed and straight[2]["env/episodes"] == 16


def _flaky(policy, run_dir):
    t = GRPOTrainer(tiny_config(policy, run_dir, *env("FlakyEnv", "{fraction: 0.3}"), "reward.max_failure_fraction=0.5"))
    episodes, run = [], t.episodes.run
    t.episodes.run = lambda *a: (lambda out: episodes.extend(out[0]) or out)(run(*a))
    batch, _, _ = t.collect()
    failed = torch.tensor([e.end == "error" for e in episodes])
    assert 0 < int(failed.sum()) < len(episodes)
    assert (batch.rewards[failed] == 0).all() and (batch.rewards[~failed] > 0).any()
    assert all("RuntimeError: the environment broke" in e.error for e in episodes if e.end == "error")
    assert t.rollout_metrics["env/errors"] == int(failed.sum()) == t.rollout_metrics["env/end/error"]
    broken = GRPOTrainer(tiny_config(policy, run_dir + "_broken", *env("FlakyEnv", "{fraction: 1.0}")))
    with pytest.raises(RuntimeError, match=r"raised in 16 of 16 episodes this step, more than "
                                           r"reward.max_failure_fraction=0.5; last error on this rank: "
                                           r"'step: RuntimeError: the environment broke'"):
        broken.collect()


def test_env_errors_are_counted_scored_zero_and_stop_the_run(policy, tmp_path):
    run_distributed(_flaky, policy, str(tmp_path / "run"), world_size=1)


def _reset_fails(policy, run_dir):
    cfg = tiny_config(policy, run_dir, *env("FlakyEnv", "{fraction: 0.3, where: reset}"), "steps=1")
    result = GRPOTrainer(cfg).train()
    (row,) = result.metrics
    assert row["env/errors"] == row["env/end/error"] > 0 and row["env/turns_mean"] < 2
    assert all(v == v for v in row.values()) and row["actor/grad_norm"] > 0  # the rows without ids train nothing


def test_an_episode_without_ids_is_a_harmless_row(policy, tmp_path):
    """An environment failing at reset leaves an episode with no ids: one attended pad token, nothing NaN."""
    run_distributed(_reset_fails, policy, str(tmp_path), world_size=1)


def _online_dpo(policy, run_dir):
    cfg = load_config(OnlineDPOConfig, None, [
        f"run_dir={run_dir}", f"actor.path={policy}", "steps=2", "seed=0", "device=cpu", "tensorboard=false",
        f"reward.terms=[{{name: '{HERE}/grpo_helpers.py:digit_fraction', weight: 1.0}}]",
        "data.arith.max_operand=4", "data.arith.ops=['+']", "rollout.group_size=2", "rollout.prompts_per_step=4",
        "optim.lr=0.01", "optim.warmup_steps=0", "eval.max_samples=2", "save_every=0", "export_hf=false", *env()])
    result = train_online_dpo(cfg)
    assert result.step == 2 and result.accuracy is not None
    for row in result.metrics:
        assert row["env/episodes"] == 8 and all(v == v for v in row.values())


def test_online_dpo_trains_on_pairs_of_episodes(policy, tmp_path):
    run_distributed(_online_dpo, policy, str(tmp_path), world_size=1)


def _refusals(policy, run_dir):
    with pytest.raises(ValueError, match=r"rollout.env.name / rollout.env.kwargs: environment '.*:NoSuchEnv'"):
        GRPOTrainer(tiny_config(policy, run_dir, *env("NoSuchEnv")))
    with pytest.raises(ValueError, match=r"rollout.env.name / rollout.env.kwargs: .* do not fit DigitEnv"):
        GRPOTrainer(tiny_config(policy, run_dir, *env(kwargs="{colour: 1}")))


def test_start_up_refusals_name_the_keys(policy, tmp_path):
    run_distributed(_refusals, policy, str(tmp_path), world_size=1)
    with pytest.raises(ValueError, match="rollout.env.max_turns must be an integer >= 1"):
        tiny_config(policy, str(tmp_path), *env(extra=", max_turns: 0"))
    with pytest.raises(RankFailure, match=r"rollout.env: multi-turn episodes run at actor.pp=1 for now "
                                          r"\(got actor.pp=2\)"):
        run_distributed(lambda: GRPOTrainer(tiny_config(policy, str(tmp_path / "pp"), *env(), "actor.pp=2")),
                        world_size=2)
