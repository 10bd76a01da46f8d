"""GRPO end to end on a tiny random policy: learning, exact resume, offload, bad data, broken rewards, NaN updates."""
import json
import os

import pytest
import torch
import torch.distributed as dist
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import HERE, digit_fraction, tiny_config, tiny_policy, write_rows
from trainers.helpers import ROUNDING_PROBES, NaNOnCalls, capture_warnings, checkpoint_params

from megalign.data import DataError
from megalign.trainers import online as online_mod
from megalign.trainers.grpo import train_grpo


def _deterministic(metrics):
    """The metrics that must not depend on timing or memory."""
    return {k: v for k, v in metrics.items() if not k.startswith(("time/", "memory/", "tokens_per_s"))}


def _read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {row["step"]: _deterministic(row) for row in rows if "reward/mean" in row}


def _train(policy, run_dir, *overrides):
    train_grpo(tiny_config(policy, run_dir, *overrides))


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("policy") / "hf")


def test_reward_rises_two_ranks(policy, tmp_path):
    # 2 dp ranks, 16 prompts x G=4 per step; the digit fraction of a random policy starts near 10/99
    run_distributed(_train, policy, str(tmp_path), "steps=12", "rollout.prompts_per_step=16", "export_hf=false")
    rewards = [m["reward/mean"] for _, m in sorted(_read_metrics(str(tmp_path)).items())]
    assert len(rewards) == 12
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.15, rewards


def _straight_then_resumed(policy, root):
    _train(policy, f"{root}/straight", "steps=4")
    _train(policy, f"{root}/resumed", "steps=2")
    _train(policy, f"{root}/resumed", "steps=4")  # resume=auto picks up the step-2 checkpoint


def test_resume_is_exact(policy, tmp_path):
    # dynamic sampling and a second epoch so the sampler, the generator and the optimizer state all matter
    run_distributed(_straight_then_resumed, policy, str(tmp_path))
    straight, resumed = _read_metrics(f"{tmp_path}/straight"), _read_metrics(f"{tmp_path}/resumed")
    assert sorted(straight) == sorted(resumed) == [1, 2, 3, 4]
    assert straight == resumed


def _offload_pair(policy, root):
    common = ("algo.kl_coef=0.05", "algo.ppo_epochs=2", "rollout.old_logprobs=recompute", "export_hf=false")
    _train(policy, f"{root}/resident", *common)
    _train(policy, f"{root}/offloaded", *common, "actor.offload_weights=true", "actor.offload_optimizer=true",
           "reference.offload_weights=true")


def test_offload_gives_identical_results(policy, tmp_path):
    run_distributed(_offload_pair, policy, str(tmp_path), world_size=1)
    resident, offloaded = _read_metrics(f"{tmp_path}/resident"), _read_metrics(f"{tmp_path}/offloaded")
    assert resident == offloaded
    assert resident[2]["actor/kl"] > 0  # the reference ran
    with open(os.path.join(tmp_path, "offloaded", "metrics.jsonl")) as f:
        row = json.loads(f.readline())
    # the idle roles held nothing: the reference during generation, the actor's optimizer outside the update
    assert row["memory/generate/reference_mib"] == 0
    assert row["memory/reference/actor_mib"] == 0 and row["memory/update/actor_mib"] > 0


def _bad_rows_and_broken_reward(policy, root, prompts):
    reward = f"reward.terms=[{{name: '{HERE}/grpo_helpers.py:raise_on_odd_length', weight: 1.0}}]"
    _train(policy, root, f"data.path={prompts}", "data.skip_invalid=true", reward,
           "reward.max_failure_fraction=1.0")  # about half the samples raise: keep training on the zeros
    if dist.get_rank() == 0:
        with pytest.raises(DataError, match=r"prompts.jsonl:2: .*skip_invalid"):
            train_grpo(tiny_config(policy, f"{root}/strict", f"data.path={prompts}"))


def test_bad_rows_are_counted_and_a_raising_reward_scores_zero(policy, tmp_path):
    prompts = write_rows(tmp_path / "prompts.jsonl", [
        {"prompt": "1+1=", "answer": 2}, "{not json", {"prompt": "2+2=", "answer": 4}, {"answer": 3},
        {"prompt": "3+1=", "answer": 4}, {"prompt": "0+2=", "answer": 2}])
    run_distributed(_bad_rows_and_broken_reward, policy, str(tmp_path / "run"), str(prompts), world_size=1)
    metrics = _read_metrics(str(tmp_path / "run"))
    assert sorted(metrics) == [1, 2]  # training went on
    name = "reward/raise_on_odd_length"  # the function name, never the file path
    errors, samples = metrics[2][f"{name}/errors"], metrics[2][f"{name}/samples"]
    assert samples == 2 * 16 and 0 < errors < samples
    assert metrics[2]["data/invalid"] == 2 and metrics[2]["data/kept"] == 4
    # a raising sample scores 0, every other one 1: the mean reward is the fraction that did not raise
    step1_errors, step1_samples = metrics[1][f"{name}/errors"], metrics[1][f"{name}/samples"]
    assert metrics[1]["reward/mean"] == pytest.approx(1 - step1_errors / step1_samples)


def test_tensor_parallel_actor_with_a_smaller_reference(policy, tmp_path):
    # actor tp=2 (hybrid-engine generation on the shards), reference tp=1 on each rank: its own layout. One step on
    # the same global batch as one process at tp=1 (dp=1 both times: the same sampler and generator), one update (a
    # second one would start from weights AdamW moved by lr in near-zero gradient elements, where the tp sums' rounding
    # decides the sign)
    common = ("steps=1", "algo.kl_coef=0.1", "algo.mini_batches=1", "export_hf=false")
    run_distributed(_train, policy, str(tmp_path / "tp2"), *common, "actor.tp=2", "reference.tp=1")
    run_distributed(_train, policy, str(tmp_path / "tp1"), *common, world_size=1)
    (tp2,), (tp1,) = _read_metrics(str(tmp_path / "tp2")).values(), _read_metrics(str(tmp_path / "tp1")).values()
    assert tp2.keys() == tp1.keys() and "actor/kl" in tp1  # the reference ran
    for key in tp1:
        # a clip fraction counts tokens on either side of a threshold: float noise of the tp sums may move one
        # of the ~120 tokens across it
        tol = 0.02 if key.endswith("clip_frac") else 1e-5
        if not key.startswith(ROUNDING_PROBES):
            assert tp2[key] == pytest.approx(tp1[key], rel=1e-4, abs=tol), key


def _nan_updates_are_skipped(policy, run_dir):
    warnings = capture_warnings("megalign.trainers")
    # tiny_config's step: 16 responses in 2 mini-batches of one micro-batch each, so 2 loss calls per step.
    # Calls 3, 4 are both updates of step 2; call 5 is the first update of step 3, whose second update is clean.
    online_mod.aggregate_loss = NaNOnCalls(online_mod.aggregate_loss, nan_calls={3, 4, 5})
    _train(policy, run_dir, "steps=4", "save_every=1", "keep_last=4", "export_hf=false")
    skips = [w for w in warnings if "non-finite loss" in w and "skipping the update" in w]
    assert [w.split(":")[0] for w in skips] == ["step 2", "step 2", "step 3"], warnings
    metrics = _read_metrics(run_dir)
    assert [metrics[s]["nan_skips"] for s in (1, 2, 3, 4)] == [0, 2, 3, 3]
    assert metrics[2]["actor/loss"] is None  # NaN is written as null
    params = {s: checkpoint_params(run_dir, s, role="actor") for s in (1, 2, 3, 4)}
    assert params[1].keys() == params[2].keys() and params[1]
    for name in params[1]:
        assert all(torch.isfinite(params[s][name]).all() for s in (2, 3, 4)), name
        torch.testing.assert_close(params[2][name], params[1][name], rtol=0, atol=0, msg=name)  # step 2 changed nothing
    # step 3's clean mini-batch still updated the weights, and step 4 trained normally
    assert any(not torch.equal(params[3][n], params[2][n]) for n in params[2])
    assert any(not torch.equal(params[4][n], params[3][n]) for n in params[3])


def test_nan_loss_skips_only_its_update_and_never_reaches_a_checkpoint(policy, tmp_path):
    """A blown-up mini-batch must not touch the weights (nor the checkpoints), nor cost the step's other updates."""
    run_distributed(_nan_updates_are_skipped, policy, str(tmp_path), world_size=1)


def _rollout_batch_lines_up(policy, run_dir):
    """One step's training batch, checked against what was generated: the invariants GRPO's update relies on."""
    import torch

    from megalign.algos.grpo import response_advantages
    from megalign.data import CharTokenizer
    from megalign.trainers.grpo import GRPOTrainer

    trainer = GRPOTrainer(tiny_config(policy, run_dir, "rollout.max_response_length=16", "rollout.prompts_per_step=8"))
    tok, group, width = CharTokenizer(), trainer.cfg.rollout.group_size, trainer.prompt_width
    batch, _, _ = trainer.collect()
    mask = batch.response_mask
    assert batch.rewards.numel() == 4 * group and batch.rewards.std() > 0
    # old log-probs recorded while sampling are those a fresh forward gives: the first ratio is exactly 1
    recomputed = trainer.score_logprobs(trainer.actor, batch, 64)
    torch.testing.assert_close(recomputed * mask, batch.rollout_logp * mask, rtol=0, atol=1e-5)
    assert not (batch.rollout_logp * (1 - mask)).any()
    answers = {e.prompt_text: e.answer for e in trainer.train_set.examples}
    for row, row_mask, reward, finished in zip(batch.sequences.tolist(), mask.tolist(), batch.rewards.tolist(),
                                               batch.finished.tolist()):
        n = int(sum(row_mask))
        # the mask covers exactly the generated tokens, EOS included, then padding
        assert row_mask == [1.0] * n + [0.0] * (len(row_mask) - n)
        response = row[width:]
        assert all(t == tok.pad_id for t in response[n:]) and tok.eos_id not in response[:n - 1]
        assert finished == (n > 0 and response[n - 1] == tok.eos_id)
        # the reward is the reward function's on this very response and prompt
        prompt = tok.decode(row[:width])
        assert reward == pytest.approx(digit_fraction(prompt, tok.decode(response[:n]), answers[prompt], {}))
    # advantages are per group of G consecutive responses of the same prompt
    prompts = batch.sequences[:, :width].view(-1, group, width)
    assert (prompts == prompts[:, :1]).all()
    expected = response_advantages(batch.rewards, mask, group)
    rewards = batch.rewards.view(-1, group)
    by_hand = (rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(expected, by_hand.reshape(-1, 1) * (mask != 0), rtol=1e-5, atol=1e-6)


def test_rollout_batch_lines_up(policy, tmp_path):
    run_distributed(_rollout_batch_lines_up, policy, str(tmp_path))
