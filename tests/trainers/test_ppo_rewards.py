"""Reward sources of the online trainer: several named reward models (each its own term, against
transformers), Llama 2's gate and a min-ensemble inside the reward, a PRM's step rewards at the step ends with
the PRM's own `step_probs` on the stepwise encoding it was trained on, and PPO runs with per-model normalisation or
Platt calibration, the whitened gated score, TRL's missing-EOS penalty and PRM step rewards."""
import json
import math
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
import transformers
from parallel.dist_utils import RankFailure, run_distributed
from trainers.grpo_helpers import HERE, tiny_policy, write_rows
from trainers.helpers import metric_rows, prompt_response_batch
from trainers.test_ppo_trainer import tiny_ppo_config

from megalign.algos import IGNORE_INDEX
from megalign.algos.grpo import informative_groups
from megalign.config import ConfigError, load_config
from megalign.data import CharTokenizer, collate_stepwise, encode_steps
from megalign.models import RewardModel, from_pretrained
from megalign.roles.reward import (
    OutcomeReward,
    ProcessReward,
    Reward,
    RewardConfig,
    RewardModelConfig,
    step_probs,
)
from megalign.trainers.ppo import PPOTrainer, train_ppo
from megalign.trainers.prm import PRMConfig, train_prm

TOK = CharTokenizer()
CPU = SimpleNamespace(device=torch.device("cpu"), pp=1)  # the roles read only the layout's device and pp


def tiny_reward_model(path, seed, stats=None):
    """A 2-layer random Llama reward model (sequence classification) at `path`, [with reward_stats.json]."""
    tiny_policy(path, seed, model_cls=RewardModel, std=0.3)
    if stats is not None:
        with open(os.path.join(path, "reward_stats.json"), "w") as f:
            json.dump({"reward_mean": stats[0], "reward_std": stats[1]}, f)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"policy": tiny_policy(root / "policy"),
            **{name: tiny_reward_model(root / name, seed, stats) for name, seed, stats in
               (("a", 1, (0.2, 0.5)), ("b", 2, (-0.1, 2.0)), ("s", 3, None), ("h", 4, None))}}


def test_each_reward_model_is_a_term_and_the_gate_picks_per_row(models):
    cfg = load_config(RewardConfig, None, [
        f"terms=[{{name: '{HERE}/grpo_helpers.py:digit_fraction', weight: 1.0}}]",
        f"model.path={models['a']}", "model_weight=2.0",
        f"models=[{{name: b, path: {models['b']}, weight: -1.0}}, {{name: s, path: {models['s']}}}, "
        f"{{name: h, path: {models['h']}}}]",
        "gated={safety: s, helpful: h, weight: 3.0}"])
    roles = [OutcomeReward(m, from_pretrained(m.path, kind="reward"), CPU) for _, m in cfg.reward_models()]
    reward = Reward(cfg, roles)
    prompts = [TOK.encode(t, add_bos=True) for t in ("1+1=", "2+3=", "4+4=", "9-1=")]
    texts = ["2", "5a", "x", "8"]
    ids, att, _ = prompt_response_batch(prompts, [TOK.encode(t) + [TOK.eos_id] for t in texts])
    metadata = [{"is_safety": v} for v in (True, False, False, False)]
    # the threshold between the non-safety rows' 2nd and 3rd safety probabilities, so both branches are taken
    p = torch.sigmoid(roles[2].score(ids, att)[1:]).sort().values
    cfg.gated.threshold = float(p[1:].mean())
    total, terms = reward.score(["p"] * 4, texts, [0] * 4, metadata, ids, att)
    # each model's score is its own term: transformers' sequence classifier at the last real token
    for name in ("reward_model", "b", "s", "h"):
        path = models["a" if name == "reward_model" else name]
        hf = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
        with torch.no_grad():
            expected = torch.stack([hf(input_ids=ids[n:n + 1, att[n] == 1]).logits[0, 0] for n in range(4)])
        torch.testing.assert_close(terms[name], expected, rtol=1e-5, atol=1e-5)
    s, h = terms["s"], terms["h"]
    safety = torch.tensor([True, False, False, False]) | (torch.sigmoid(s) < cfg.gated.threshold)
    assert safety.tolist().count(True) == 3
    torch.testing.assert_close(terms["gated"], torch.where(safety, s, h))
    assert terms["gated_safety_branch"].tolist() == safety.float().tolist()
    digits = torch.tensor([1.0, 0.5, 0.0, 1.0])
    # the gated models enter the total only through the gated term
    torch.testing.assert_close(total, digits + 2 * terms["reward_model"] - terms["b"] + 3 * terms["gated"])
    with pytest.raises(ValueError, match="has no boolean 'is_safety'"):
        reward.score(["p"] * 4, texts, [0] * 4, [{}] * 4, ids, att)


def test_an_ensemble_is_one_term_of_its_members_standardised_scores(models, tmp_path):
    # a (mean 0.2, std 0.5) and b (mean -0.1, std 2) in a min-ensemble of weight 2, beside the digit verifier
    cfg = load_config(RewardConfig, None, [
        f"terms=[{{name: '{HERE}/grpo_helpers.py:digit_fraction', weight: 1.0}}]", f"model.path={models['a']}",
        f"models=[{{name: b, path: {models['b']}}}]", "ensemble={models: [reward_model, b], weight: 2.0}"])
    roles = [OutcomeReward(m, from_pretrained(m.path, kind="reward"), CPU) for _, m in cfg.reward_models()]
    prompts = [TOK.encode(t, add_bos=True) for t in ("1+1=", "2+3=", "4+4=")]
    texts = ["2", "5a", "x"]
    ids, att, _ = prompt_response_batch(prompts, [TOK.encode(t) + [TOK.eos_id] for t in texts])
    total, terms = Reward(cfg, roles).score(["p"] * 3, texts, [0] * 3, [{}] * 3, ids, att)
    za, zb = (terms["reward_model"] - 0.2) / 0.5, (terms["b"] + 0.1) / 2.0
    torch.testing.assert_close(terms["ensemble"], torch.minimum(za, zb))
    torch.testing.assert_close(terms["ensemble_spread"], (za - zb).abs() / 2)
    # the members enter the total only through the ensemble's term
    torch.testing.assert_close(total, torch.tensor([1.0, 0.5, 0.0]) + 2 * terms["ensemble"])
    # a member without reward_stats.json is named with the option that needs it
    bad = load_config(RewardConfig, None, [f"model.path={models['a']}", f"models=[{{name: s, path: {models['s']}}}]",
                                           "ensemble={models: [reward_model, s]}"])
    with pytest.raises(FileNotFoundError, match="reward.ensemble needs .*s/reward_stats.json"):
        Reward(bad, [OutcomeReward(m, from_pretrained(m.path, kind="reward"), CPU) for _, m in bad.reward_models()])


def test_reward_config_checks():
    with pytest.raises(ConfigError, match="must name an outcome reward model"):
        load_config(RewardConfig, None, ["models=[{name: s, path: x}]", "gated={safety: s, helpful: nope}"])
    with pytest.raises(ConfigError, match="names must be unique"):
        load_config(RewardConfig, None, ["model.path=x", "models=[{name: reward_model, path: y}]"])
    with pytest.raises(ConfigError, match="is reserved"):
        load_config(RewardConfig, None, ["models=[{name: gated, path: y}]"])
    with pytest.raises(ConfigError, match="path .* is required"):
        load_config(RewardConfig, None, ["models=[{name: m}]"])
    two = "models=[{name: s, path: x}, {name: h, path: y}]"
    with pytest.raises(ConfigError, match=r"ensemble.models\[1\]='nope' must name an outcome reward model"):
        load_config(RewardConfig, None, [two, "ensemble={models: [s, nope]}"])
    with pytest.raises(ConfigError, match="two or more different reward models"):
        load_config(RewardConfig, None, [two, "ensemble={models: [s, s]}"])
    with pytest.raises(ConfigError, match="through reward.gated or reward.ensemble, not both"):
        load_config(RewardConfig, None, [two, "ensemble={models: [s, h]}", "gated={safety: s, helpful: h}"])
    with pytest.raises(ConfigError, match="clash with a reward model's"):
        load_config(RewardConfig, None, [two, "ensemble={models: [s, h], name: h}"])


def test_process_reward_places_the_prm_step_probs_at_step_ends(models):
    model = from_pretrained(models["policy"])
    neg, pos = TOK.encode("-")[0], TOK.encode("+")[0]
    sep = TOK.encode("\n")
    prm = ProcessReward(RewardModelConfig(name="prm", kind="process", path=models["policy"], weight=1.0), model, CPU,
                        (neg, pos), sep, TOK.eos_id)
    prompts = [TOK.encode("1+2*3=", add_bos=True), TOK.encode("4-1=", add_bos=True)]
    solutions = [["2*3=6", "1+6=7", "\\boxed{7}"], ["4-1=3", "\\boxed{3}"]]
    # finished (EOS after the last step) and truncated (the last step cut short: not scored)
    responses = [TOK.encode("\n".join(solutions[0])) + [TOK.eos_id], TOK.encode("4-1=3\n\\box")]
    ids, att, width = prompt_response_batch(prompts, responses)
    rewards, ends = prm.score(ids, att, width)
    # the reference: the PRM trainer's own encoding of the same steps (each step + "\n", right-padded)
    scored = [solutions[0], solutions[1][:1]]
    examples = [encode_steps(p, s, [0.0] * len(s), TOK) for p, s in zip(prompts, scored)]
    batch = collate_stepwise(examples, TOK.pad_id)
    expected = step_probs(model, batch["input_ids"], batch["attention_mask"], batch["step_labels"] != IGNORE_INDEX,
                          (neg, pos))
    positions = [[len(solutions[0][0]), len(solutions[0][0]) + 1 + len(solutions[0][1]), len(responses[0]) - 1],
                 [len(solutions[1][0])]]
    assert [torch.nonzero(row)[:, 0].tolist() for row in ends] == positions
    torch.testing.assert_close(rewards[ends], expected, rtol=1e-5, atol=1e-6)
    assert int((rewards != 0).sum()) == 4


def _prm_export(policy, run_dir):
    train_prm(load_config(PRMConfig, None, [
        f"run_dir={run_dir}", f"model.path={policy}", "steps=1", "batch_size=8", "data.chain.max_ops=2",
        "data.chain.max_operand=4", "data.chain.num_problems=20", "data.max_length=60", "optim.warmup_steps=0",
        "eval.max_samples=0", "tensorboard=false", "save_every=0"]))


def _ppo(policy, run_dir, *overrides):
    train_ppo(tiny_ppo_config(policy, run_dir, "export_hf=false", "steps=1", *overrides))


def _prm_runs(policy, root):
    _prm_export(policy, f"{root}/prm")
    common = ("rollout.max_response_length=16", "rollout.prompts_per_step=8", "algo.kl_coef=0.01")
    _ppo(policy, f"{root}/outcome", *common)
    _ppo(policy, f"{root}/process", *common, f"reward.models=[{{name: prm, kind: process, path: {root}/prm/hf}}]")


def test_ppo_with_prm_step_rewards_runs(models, tmp_path):
    run_distributed(_prm_runs, models["policy"], str(tmp_path), world_size=1, timeout_s=300)
    outcome, process = (metric_rows(str(tmp_path / name))[-1] for name in ("outcome", "process"))
    assert process["reward/prm_steps/mean"] > 0 and 0 < process["reward/prm/mean"]
    # step 1 samples the same responses: the outcome (the digit fraction) is the same, the returns are not
    assert process["reward/mean"] == outcome["reward/mean"]
    assert process["critic/return_mean"] != pytest.approx(outcome["critic/return_mean"], abs=1e-6)


def test_process_reward_needs_a_token_level_algorithm(models, tmp_path):
    from trainers.grpo_helpers import tiny_config

    from megalign.trainers.grpo import train_grpo
    cfg = tiny_config(models["policy"], str(tmp_path), f"reward.models=[{{name: p, kind: process, path: {models['policy']}}}]")
    with pytest.raises(RankFailure, match="is a process reward model"):
        run_distributed(train_grpo, cfg, world_size=1)


def _normalised_and_gated(models, data, run_dir):
    _ppo(models["policy"], run_dir, "reward.terms=[]", f"data.path={data}", "algo.reward_normalize=true",
         f"reward.model.path={models['a']}", "reward.model_weight=2.0",
         f"reward.models=[{{name: b, path: {models['b']}, weight: 0.5}}, {{name: s, path: {models['s']}}}, "
         f"{{name: h, path: {models['h']}}}]", "reward.gated={safety: s, helpful: h, weight: 4.0, threshold: 1.0e-6}")


def test_ppo_normalises_each_model_and_whitens_the_gated_score(models, tmp_path):
    # 4 prompts, 2 of them safety ones: a step's 4 prompts are one pass over the data (the sampler draws each row once
    # an epoch), and with the gate's threshold at 1e-6 no helpful prompt's score (|score| ~ 1) falls under it, so
    # exactly half of every step's responses take the safety branch
    data = write_rows(tmp_path / "prompts.jsonl", [{"prompt": f"{a}+1=", "answer": str(a + 1), "is_safety": a % 2 == 0}
                                                   for a in range(4)])
    run_distributed(_normalised_and_gated, models, data, str(tmp_path / "run"), world_size=1, timeout_s=120)
    row = metric_rows(str(tmp_path / "run"))[-1]
    # reward/mean is the shaped total: each RM normalised with its own stats, the whitened gated score averages 0
    expected = 2.0 * (row["reward/reward_model/mean"] - 0.2) / 0.5 + 0.5 * (row["reward/b/mean"] + 0.1) / 2.0
    assert row["reward/mean"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert row["reward/gated_safety_branch/mean"] == 0.5
    bad = write_rows(tmp_path / "bad.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    with pytest.raises(RankFailure, match="bad.jsonl:1: reward.gated.safety_field='is_safety' must be a boolean"):
        run_distributed(_ppo, models["policy"], str(tmp_path / "bad"), "reward.terms=[]", f"data.path={bad}",
                        f"reward.models=[{{name: s, path: {models['s']}}}, {{name: h, path: {models['h']}}}]",
                        "reward.gated={safety: s, helpful: h}", world_size=1)


def test_a_calibrated_reward_is_the_platt_probability_by_hand():
    # verifier term (weight 1) 1, 0, 1; RM "a" (weight 2) scores 0.5, -1, 2 with Platt (a, b) = (2, -1):
    # 1 + 2 sigmoid(0), 0 + 2 sigmoid(-3), 1 + 2 sigmoid(3), then clipped at 1.9
    raw = torch.tensor([0.5, -1.0, 2.0])
    batch = SimpleNamespace(terms={"check": torch.tensor([1.0, 0.0, 1.0]), "a": raw},
                            rewards=torch.tensor([1.0, 0.0, 1.0]) + 2 * raw)
    owner = SimpleNamespace(cfg=SimpleNamespace(algo=SimpleNamespace(reward_clip=1.9, missing_eos_penalty=None,
                                                                  reward_group_center=False)),
                            score_stats={},
                            score_platt={"a": (2.0, -1.0)},
                            reward=SimpleNamespace(outcome=[SimpleNamespace(name="a", weight=2.0)], gated=None))
    PPOTrainer.shape_rewards(owner, batch)
    sig = [1 / (1 + math.exp(-z)) for z in (0.0, -3.0, 3.0)]
    expected = [min(1 + 2 * sig[0], 1.9), 2 * sig[1], min(1 + 2 * sig[2], 1.9)]
    assert batch.rewards.tolist() == pytest.approx(expected, rel=1e-6)


def test_the_missing_eos_penalty_comes_after_the_normalised_score_and_before_the_clip_by_hand():
    # RM "a" (weight 1, stats mean 1, std 2) scores 3, -1, 9, 5; rows 2 and 4 were cut before their EOS; penalty 1.5:
    # normalised 1, -1, 4, 2 -> less the penalty 1, -2.5, 4, 0.5 -> clipped at 3: 1, -2.5, 3, 0.5 (TRL subtracts it
    # from the score it trains on)
    raw = torch.tensor([3.0, -1.0, 9.0, 5.0])
    batch = SimpleNamespace(terms={"a": raw}, rewards=raw.clone(), finished=torch.tensor([True, False, True, False]))
    owner = SimpleNamespace(cfg=SimpleNamespace(algo=SimpleNamespace(reward_clip=3.0, missing_eos_penalty=1.5,
                                                                  reward_group_center=False)),
                            score_stats={"a": (1.0, 2.0)}, score_platt={},
                            reward=SimpleNamespace(outcome=[SimpleNamespace(name="a", weight=1.0)], gated=None))
    PPOTrainer.shape_rewards(owner, batch)
    assert batch.rewards.tolist() == pytest.approx([1.0, -2.5, 3.0, 0.5], rel=1e-6)


def test_the_group_centred_score_comes_after_the_normalisation_and_before_the_penalty_by_hand():
    # the case above in 2 groups of G = 2: normalised 1, -1 | 4, 2 -> less each group's mean (0 | 3) 1, -1 | 1, -1 ->
    # less the penalty on rows 2 and 4: 1, -2.5 | 1, -2.5 -> clipped at 2: 1, -2 | 1, -2
    raw = torch.tensor([3.0, -1.0, 9.0, 5.0])
    batch = SimpleNamespace(terms={"a": raw}, rewards=raw.clone(), finished=torch.tensor([True, False, True, False]),
                            group_size=2)
    owner = SimpleNamespace(cfg=SimpleNamespace(algo=SimpleNamespace(reward_clip=2.0, missing_eos_penalty=1.5,
                                                                     reward_group_center=True)),
                            score_stats={"a": (1.0, 2.0)}, score_platt={},
                            reward=SimpleNamespace(outcome=[SimpleNamespace(name="a", weight=1.0)], gated=None))
    PPOTrainer.shape_rewards(owner, batch)
    assert batch.rewards.tolist() == pytest.approx([1.0, -2.0, 1.0, -2.0], rel=1e-6)


def test_ppo_subtracts_the_missing_eos_penalty_from_cut_responses(models, tmp_path):
    # a constant reward of 1 at 2-token responses: the step's mean reward is 1 - penalty x the fraction cut
    run_distributed(_ppo, models["policy"], str(tmp_path), "algo.missing_eos_penalty=0.75",
                    "rollout.max_response_length=2", f"reward.terms=[{{name: '{HERE}/grpo_helpers.py:constant_one', "
                    f"weight: 1.0}}]", world_size=1, timeout_s=120)
    row = metric_rows(str(tmp_path))[-1]
    assert 0 < row["response_length/clip_ratio"]
    assert row["reward/mean"] == pytest.approx(1.0 - 0.75 * row["response_length/clip_ratio"], rel=1e-6)
    with pytest.raises(ConfigError, match="missing_eos_penalty must be >= 0"):
        tiny_ppo_config(models["policy"], str(tmp_path / "bad"), "algo.missing_eos_penalty=-1")


def _calibrated(policy, path, run_dir):
    _ppo(policy, run_dir, "reward.terms=[]", "algo.reward_calibrate=true", f"reward.model.path={path}")


def test_ppo_reads_the_platt_scaling_of_the_export(models, tmp_path):
    # slope 0: every response's reward is sigmoid(b) whatever the RM scores, so the step's mean reward is exactly that
    path = tmp_path / "rm"
    shutil.copytree(models["a"], path)
    with pytest.raises(RankFailure, match="has no Platt scaling"):
        run_distributed(_calibrated, models["policy"], str(path), str(tmp_path / "none"), world_size=1)
    (path / "reward_stats.json").write_text(json.dumps({"reward_mean": 0.2, "reward_std": 0.5, "platt_a": 0.0,
                                                        "platt_b": 0.7}))
    run_distributed(_calibrated, models["policy"], str(path), str(tmp_path / "run"), world_size=1, timeout_s=120)
    row = metric_rows(str(tmp_path / "run"))[-1]
    assert row["reward/mean"] == pytest.approx(1 / (1 + math.exp(-0.7)), rel=1e-6)
    assert row["reward/reward_model/mean"] != pytest.approx(row["reward/mean"], rel=1e-3)  # the raw score is logged


def test_verdict_dynamic_sampling_keeps_the_groups_the_reward_model_judges_both_ways():
    # Platt (a, b) = (2, -1): a response passes when 2 s - 1 >= 0, s >= 1/2. Scores of 3 groups of G = 3: pass, fail,
    # fail | pass x 3 | fail x 3 -> only the first group is kept; DAPO's test (scores all equal) would keep all three
    scores = torch.tensor([1.0, 0.0, 0.2, 0.9, 0.7, 0.6, 0.1, 0.2, 0.4])
    batch = SimpleNamespace(terms={"a": scores}, rewards=scores.clone(), group_size=3)
    owner = SimpleNamespace(verdict=("a", (2.0, -1.0)), cfg=SimpleNamespace(algo=SimpleNamespace(dynamic_sampling=True)))
    assert PPOTrainer.keep_groups(owner, batch).tolist() == [True, False, False]
    assert informative_groups(batch.rewards, 3).tolist() == [True, True, True]


def _all_passing(policy, path, run_dir):
    _ppo(policy, run_dir, "reward.terms=[]", f"reward.model.path={path}", "steps=2", "algo.dynamic_sampling=true",
         "algo.dynamic_sampling_by=verdict", "algo.max_sampling_rounds=2", "save_every=1")


def test_ppo_drops_the_groups_its_reward_model_passes_whole(models, tmp_path):
    # Platt slope 0, intercept 0.7: every response's verdict is a pass however the random RM scores it, so every group
    # is dropped in both sampling rounds of both steps and the run fails as one that never updated; the same run with
    # DAPO's test keeps every group (the RM's scores are never all equal)
    path = tmp_path / "rm"
    shutil.copytree(models["a"], path)
    (path / "reward_stats.json").write_text(json.dumps({"reward_mean": 0.2, "reward_std": 0.5, "platt_a": 0.0,
                                                        "platt_b": 0.7}))
    with pytest.raises(RankFailure, match="PPO: the policy was never updated: updated in 0 of 2 steps"):
        run_distributed(_all_passing, models["policy"], str(path), str(tmp_path / "run"), world_size=1, timeout_s=120)
    rows = [row for row in metric_rows(str(tmp_path / "run")) if "sampling/kept_groups" in row]
    assert [(row["sampling/kept_groups"], row["sampling/dropped_groups"], row["sampling/rounds"]) for row in rows] == [
        (0, 8, 2), (0, 8, 2)]
    run_distributed(_ppo, models["policy"], str(tmp_path / "dapo"), "reward.terms=[]", f"reward.model.path={path}",
                    "algo.dynamic_sampling=true", world_size=1, timeout_s=120)
    assert metric_rows(str(tmp_path / "dapo"))[-1]["sampling/kept_groups"] == 4
    for bad in (("algo.dynamic_sampling_by=verdict", f"reward.model.path={path}"),  # no dynamic sampling
                ("algo.dynamic_sampling_by=verdict", "algo.dynamic_sampling=true")):  # no reward model
        with pytest.raises(ConfigError, match="dynamic_sampling_by=verdict needs algo.dynamic_sampling=true and "
                                              "exactly one outcome reward model"):
            tiny_ppo_config(models["policy"], str(tmp_path / "bad"), *bad)


def _pairwise_sums_on_a_rank():
    from megalign.trainers.online_metrics import OnlineMetrics
    # 2 prompts x G = 3; verifier (>= 1/2 is right): prompt 1 right, wrong, wrong; prompt 2 all right (no pair).
    # RM a: the right sample (0.5) above one wrong (0.1) and tied with the other (0.5): 1.5 of 2. RM b: below both: 0
    batch = SimpleNamespace(group_size=3, terms={
        "check": torch.tensor([1.0, 0.0, 0.4, 1.0, 0.9, 0.5]),
        "a": torch.tensor([0.5, 0.1, 0.5, 0.0, 0.0, 0.0]), "b": torch.tensor([-1.0, 2.0, 0.0, 1.0, 2.0, 3.0])})
    owner = SimpleNamespace(cfg=SimpleNamespace(reward=SimpleNamespace(check_with="check")),
                            reward=SimpleNamespace(outcome=[SimpleNamespace(name="a"), SimpleNamespace(name="b")]))
    totals = OnlineMetrics.pairwise_sums(owner, batch).reduce(None, torch.device("cpu"))
    assert totals == {"pairs_u/a": 1.5, "pairs/a": 2.0, "pairs_u/b": 0.0, "pairs/b": 2.0}
    owner.cfg.reward.check_with = None
    assert OnlineMetrics.pairwise_sums(owner, batch).reduce(None, torch.device("cpu")) == {}


def test_pairwise_sums_count_the_verifier_separated_pairs_of_each_prompt():
    run_distributed(_pairwise_sums_on_a_rank, world_size=1)


def test_check_with_names_a_term_and_needs_an_outcome_model():
    terms = "terms=[{name: math_accuracy, weight: 0.0}]"
    cfg = load_config(RewardConfig, None, [terms, "model.path=x", "check_with=math_accuracy"])
    assert cfg.check_with == "math_accuracy" and cfg.terms[0].weight == 0.0
    with pytest.raises(ConfigError, match="check_with='accuracy' names no term of reward.terms; their labels: "
                                          r"\['math_accuracy'\]"):
        load_config(RewardConfig, None, [terms, "model.path=x", "check_with=accuracy"])
    with pytest.raises(ConfigError, match="hold none"):
        load_config(RewardConfig, None, [terms, "check_with=math_accuracy"])


def test_ppo_logs_the_reward_models_pairwise_accuracy_on_its_samples(models, tmp_path):
    run_distributed(_ppo, models["policy"], str(tmp_path / "run"), f"reward.model.path={models['a']}",
                    f"reward.terms=[{{name: '{HERE}/grpo_helpers.py:digit_fraction', weight: 0.0}}]",
                    "reward.check_with=digit_fraction", world_size=1, timeout_s=120)
    row = metric_rows(str(tmp_path / "run"))[-1]
    # 4 prompts x G = 4: at most 4 separated pairs per prompt (2 right x 2 wrong)
    assert 0 <= row["reward/reward_model/pairs"] <= 16 and row["reward/reward_model/pairs"] == int(row["reward/reward_model/pairs"])
    if row["reward/reward_model/pairs"]:
        assert 0 <= row["reward/reward_model/pairwise_acc"] <= 1
    assert row["reward/mean"] == pytest.approx(row["reward/reward_model/mean"], rel=1e-5, abs=1e-6)  # weight 0
