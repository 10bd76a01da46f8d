"""Per-turn rewards on multi-turn episodes (`rollout.env.reward_placement`, `megalign.trainers.episodes`): the turn
reward layout and the rest of the total left at the last token against hand-built episodes; PPO's advantages and
returns with per_turn against a float64 GAE written out over the policy's tokens (the holes skipped) with each
turn's digit share at its last policy token worked out from the sampled ids, and unlike last_token's; GRPO's
rewards and advantages identical under both placements; the refusal of per_turn with PPO's reward clip, naming
both keys."""
import pytest
import torch
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import HERE, digit_fraction, tiny_config, tiny_policy
from trainers.multiturn_envs import digit_share
from trainers.test_multiturn_trainer import R, env, hand_layout

from megalign.config import ConfigError, load_config
from megalign.rollout import Episode, RolloutBatch
from megalign.trainers.episodes import check_episode_setup, episode_rows, turn_reward_rows
from megalign.trainers.grpo import GRPOTrainer
from megalign.trainers.ppo import PPOConfig, PPOTrainer

GAMMA, LAM = 0.9, 0.8


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("policy") / "hf")


def test_turn_rewards_sit_at_each_turns_last_policy_token():
    # ids: prompt 0-2 | turn 3-5 | observation 6-7 | turn 8-9 | observation 10 | turn 11; column j = token j + 1
    ids = list(range(20, 32))
    mask = [0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 1]
    three = Episode(0, 0, 1, ids=ids, loss_mask=mask, logprobs=[0.0] * 12,
                    action_ranges=[(3, 6), (8, 10), (11, 12)], turn_rewards=[0.5, -1.25, 2.0], reward=1.25)
    failed = Episode(0, 1, 2, ids=ids[:8], loss_mask=mask[:8], logprobs=[0.0] * 8, action_ranges=[(3, 6)],
                     turn_rewards=[0.0], end="error")  # the rollout zeroes a failed episode's turn rewards
    empty = Episode(1, 0, 3)  # reset failed: no ids, no turn
    # a one-token turn at the episode's first token (an empty first observation): no trained column to sit on
    first = Episode(1, 1, 4, ids=[5, 6, 7, 8, 9], loss_mask=[1, 0, 0, 1, 1], logprobs=[0.0] * 5,
                    action_ranges=[(0, 1), (3, 5)], turn_rewards=[0.75, 1.0], reward=1.75)
    episodes, width = [three, failed, empty, first], 13
    got = turn_reward_rows(episodes, width)
    want = torch.zeros(4, width)
    want[0, 4], want[0, 8], want[0, 10], want[3, 3] = 0.5, -1.25, 2.0, 1.0
    assert torch.equal(got, want)
    rows = episode_rows(episodes, width, pad_id=0)
    assert (rows["response_mask"][got != 0] == 1).all()  # every placed reward is on a policy token, none on a hole
    holes = torch.tensor([0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 1, 0, 0]) == 0
    assert torch.equal(rows["response_mask"][0] == 0, holes)
    # PPO's scores at the last token: the rest of each total (a final-turn term of 0.5 on `three`, `first`'s
    # unplaced first turn)
    totals = torch.tensor([1.25 + 0.5, 0.0, 0.0, 1.75])
    batch = RolloutBatch(**rows, finished=torch.ones(4, dtype=torch.bool), rewards=totals, terms={},
                         group=torch.tensor([0, 0, 1, 1]), group_size=2, turn_rewards=got)
    scores, placed = batch.placed_rewards()
    assert torch.equal(scores, torch.tensor([0.5, 0.0, 0.0, 0.75])) and placed is got


def ppo_config(policy, run_dir, placement):
    return load_config(PPOConfig, None, [
        f"run_dir={run_dir}", f"actor.path={policy}", "steps=1", "seed=0", "device=cpu", "tensorboard=false",
        f"reward.terms=[{{name: '{HERE}/grpo_helpers.py:digit_fraction', weight: 1.0}}]",
        "data.arith.max_operand=4", "data.arith.ops=['+']", "rollout.group_size=2", "rollout.prompts_per_step=4",
        "algo.kl_coef=0.0", "algo.whiten_advantages=false", f"algo.gamma={GAMMA}", f"algo.lam={LAM}",
        "eval.max_samples=0", "save_every=0", "export_hf=false", *env(extra=f", reward_placement: {placement}")])


def gae64(rewards, values):
    """float64 GAE over one row's policy tokens (lists in order): (advantages, returns)."""
    adv, after, next_value = [0.0] * len(values), 0.0, 0.0
    for j in reversed(range(len(values))):
        after = rewards[j] + GAMMA * next_value - values[j] + GAMMA * LAM * after
        adv[j], next_value = after, values[j]
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(adv, dtype=torch.float64) + torch.tensor(values)


def _ppo_per_turn(policy, run_dir):
    t = PPOTrainer(ppo_config(policy, run_dir, "per_turn"))
    seen, draw = [], t.sampler.next_indices
    t.sampler.next_indices = lambda n: seen.append(draw(n)) or seen[-1]
    batch, _, _ = t.collect()
    t.score(batch)
    t.advantages(batch)
    tok, earlier_rewarded = t.tokenizer, 0
    for i in range(len(batch)):
        example = t.train_set[seen[0][i // 2]]
        ids = batch.sequences[i][batch.attention_mask[i].bool()].tolist()
        mask, turns = hand_layout(tok, example.prompt_text, ids, tok.eos_id)
        where = [j - 1 for j in range(1, len(ids)) if mask[j]]  # the policy's tokens as response columns
        first_end = next(j for j in range(1, len(where)) if where[j] != where[j - 1] + 1)  # the hole after turn 1
        final = digit_fraction(example.prompt_text, turns[1], example.answer, example.metadata)
        per_turn = [0.0] * len(where)
        per_turn[first_end - 1] = digit_share(turns[0])
        per_turn[-1] = digit_share(turns[1]) + final
        last_token = [0.0] * len(where)
        last_token[-1] = digit_share(turns[0]) + digit_share(turns[1]) + final
        earlier_rewarded += digit_share(turns[0]) != 0
        values = batch.values[i, where].double().tolist()
        adv, ret = gae64(per_turn, values)
        torch.testing.assert_close(batch.advantages[i, where].double(), adv, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(batch.returns[i, where].double(), ret, rtol=1e-5, atol=1e-6)
        holes = batch.response_mask[i] == 0
        assert (batch.advantages[i][holes] == 0).all() and (batch.turn_rewards[i][holes] == 0).all()
        if digit_share(turns[0]) != 0:  # an earlier turn's reward moved: last_token's credit differs
            assert not torch.allclose(batch.advantages[i, where].double(), gae64(last_token, values)[0], atol=1e-4)
    assert earlier_rewarded > 0
    per_turn_adv = batch.advantages.clone()
    batch.turn_rewards = None  # the same episodes and values with last_token placement: the total at the last token
    t.advantages(batch)
    for i in range(len(batch)):
        where = batch.response_mask[i].nonzero()[:, 0].tolist()
        last_token = [0.0] * (len(where) - 1) + [batch.rewards[i].item()]
        adv, _ = gae64(last_token, batch.values[i, where].double().tolist())
        torch.testing.assert_close(batch.advantages[i, where].double(), adv, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(per_turn_adv, batch.advantages, atol=1e-4)


def test_ppo_per_turn_gae_equals_float64_reference_and_differs_from_last_token(policy, tmp_path):
    run_distributed(_ppo_per_turn, policy, str(tmp_path), world_size=1)


def _grpo_both(policy, run_dir):
    batches = []
    for placement in ("last_token", "per_turn"):
        t = GRPOTrainer(tiny_config(policy, f"{run_dir}_{placement}",
                                    *env(extra=f", reward_placement: {placement}")))
        batch, _, _ = t.collect()
        t.score(batch)
        t.advantages(batch)
        batches.append(batch)
    last, per_turn = batches
    assert torch.equal(last.sequences, per_turn.sequences)  # the same episodes (same seed)
    assert last.turn_rewards is None
    torch.testing.assert_close(per_turn.turn_rewards.sum(-1), per_turn.terms["env"], rtol=0, atol=1e-6)
    assert torch.equal(last.rewards, per_turn.rewards) and torch.equal(last.advantages, per_turn.advantages)


def test_grpo_sees_the_episode_total_under_both_placements(policy, tmp_path):
    run_distributed(_grpo_both, policy, str(tmp_path / "run"), world_size=1)


def test_per_turn_with_reward_clip_is_refused_naming_the_keys(policy, tmp_path):
    cfg = ppo_config(policy, str(tmp_path), "per_turn")
    cfg.algo.reward_clip = 5.0
    with pytest.raises(ValueError, match=r"rollout.env.reward_placement=per_turn with algo.reward_clip=5.0"):
        check_episode_setup(cfg)
    with pytest.raises(ConfigError, match=r"rollout.env.reward_placement' must be one of \['last_token', 'per_turn'\]"):
        ppo_config(policy, str(tmp_path), "per_step")
