"""Online DPO (Guo et al. 2024) on the online trainer: pairing against hand-worked rewards, one step's loss and
gradients against the DPO formula on a plain transformers forward, dp=2 equals dp=1 on the same global batch,
exact resume, and learning on the arithmetic prompts.

The reference of the loss test is -log sigma(beta h) with h = (log pi(y_w) - log pi(y_l)) - (log pi_ref(y_w) -
log pi_ref(y_l)) (Rafailov et al. 2023, eq. 7), the log-probs summed over the response tokens of
`LlamaForCausalLM`'s log_softmax at temperature 1 (as TRL's OnlineDPOTrainer), with a reference checkpoint
different from the actor so that h != 0.
"""
import os
import re
import subprocess
import sys

import pytest
import torch
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import HERE, tiny_overrides, tiny_policy
from trainers.helpers import checkpoint_params, metric_rows

from megalign.config import load_config
from megalign.models import from_pretrained
from megalign.trainers.base import SkippedUpdatesError
from megalign.trainers.online_dpo import OnlineDPOConfig, OnlineDPOTrainer, preference_pairs, train_online_dpo

VOLATILE = ("time/", "memory/", "tokens_per_s")


def _config(policy, run_dir, *overrides):
    base = [o for o in tiny_overrides(policy, run_dir) if not o.startswith(("algo.", "rollout.group_size"))]
    return load_config(OnlineDPOConfig, None, [*base, "rollout.group_size=2", *overrides])


def _rows(run_dir):
    return {row["step"]: row for row in metric_rows(run_dir, VOLATILE) if "reward/mean" in row}


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("policy") / "hf")


@pytest.fixture(scope="module")
def other_policy(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("reference") / "hf", seed=1)


def test_pairs_take_the_best_and_worst_and_drop_ties():
    # G = 2: rewards (1, 0) -> rows 0 > 1; (0.5, 0.5) tie; (0, 1) -> 5 > 4; (0.2, 0.7) -> 7 > 6
    chosen, rejected, tied = preference_pairs(torch.tensor([1.0, 0.0, 0.5, 0.5, 0.0, 1.0, 0.2, 0.7]), 2)
    assert chosen.tolist() == [0, 5, 7] and rejected.tolist() == [1, 4, 6]
    assert tied.tolist() == [False, True, False, False]
    # G = 3: (0, 1, 1) -> best row 1 (first of the two 1s), worst row 0; (2, 2, 2) tie; (3, 1, 2) -> 6 > 7
    chosen, rejected, tied = preference_pairs(torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 2.0, 3.0, 1.0, 2.0]), 3)
    assert chosen.tolist() == [1, 6] and rejected.tolist() == [0, 7]
    assert tied.tolist() == [False, True, False]
    with pytest.raises(ValueError, match="group_size"):
        preference_pairs(torch.zeros(5), 2)


def test_config_errors_name_the_setting(policy, tmp_path):
    with pytest.raises(ValueError, match="loss must be one of"):
        _config(policy, tmp_path, "algo.loss=dpo")
    with pytest.raises(ValueError, match="loss_agg"):
        _config(policy, tmp_path, "algo.loss_agg=seq-mean-token-sum-norm")
    # the offline trainer's losses and coefficients: a reference-free one builds no reference
    assert not _config(policy, tmp_path, "algo.loss=simpo").algo.uses_reference
    with pytest.raises(ValueError, match="beta"):
        _config(policy, tmp_path, "algo.beta=0")
    with pytest.raises(ValueError, match="label_smoothing"):
        _config(policy, tmp_path, "algo.loss=ipo", "algo.label_smoothing=0.1")
    with pytest.raises(ValueError, match="missing_eos_penalty"):
        _config(policy, tmp_path, "algo.missing_eos_penalty=-1")
    run_distributed(_pipeline_split_error, policy, str(tmp_path / "pp2"), world_size=2)


def _pipeline_split_error(policy, run_dir):
    with pytest.raises(ValueError, match=r"actor.pp=2: each rank's 3 pairs \(rollout.prompts_per_step=3 x 1 / dp=1\) "
                                         r"must split into algo.mini_batches=1 mini-batches of at least pp=2"):
        OnlineDPOTrainer(_config(policy, run_dir, "actor.pp=2", "rollout.prompts_per_step=3", "algo.micro_batch_size=2"))


def _one_step(policy, reference, run_dir, out):
    """One step at dp=1; saves the step's batch, its metrics and the actor's gradient at the optimizer step."""
    trainer = OnlineDPOTrainer(_config(policy, run_dir, f"reference.path={reference}", "rollout.prompts_per_step=8",
                                       "optim.grad_clip=null"))
    seen = {}
    collect = trainer.collect

    def recording_collect():
        out = collect()
        seen["batch"] = out[0]
        return out

    step = trainer.actor.optimizer.step

    def recording_step(*args, **kwargs):
        seen["grads"] = {n: p.grad.clone() for n, p in trainer.actor.model.named_parameters()}
        return step(*args, **kwargs)

    trainer.collect, trainer.actor.optimizer.step = recording_collect, recording_step
    seen["metrics"] = trainer.train_step()
    torch.save({"batch": seen["batch"], "metrics": seen["metrics"], "grads": seen["grads"]}, out)


def _hf_logps(model, batch, rows, response_len):
    """Summed log-probs of the responses of `rows` under a transformers model (temperature 1)."""
    ids, mask = batch.sequences[rows], batch.attention_mask[rows]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -response_len - 1:-1]
    token = logits.log_softmax(-1).gather(-1, ids[:, -response_len:, None])[..., 0]
    return (token * batch.response_mask[rows]).sum(-1)


def test_one_step_loss_and_gradient_equal_the_dpo_formula_on_transformers(policy, other_policy, tmp_path):
    from transformers import LlamaForCausalLM

    out = str(tmp_path / "step.pt")
    run_distributed(_one_step, policy, other_policy, str(tmp_path / "run"), out, world_size=1)
    saved = torch.load(out, weights_only=False)
    batch, metrics, grads = saved["batch"], saved["metrics"], saved["grads"]
    rewards = batch.rewards.view(-1, 2)
    keep = rewards[:, 0] != rewards[:, 1]
    first_wins = rewards[:, 0] > rewards[:, 1]
    starts = torch.arange(rewards.shape[0]) * 2
    chosen = torch.where(first_wins, starts, starts + 1)[keep]
    rejected = torch.where(first_wins, starts + 1, starts)[keep]
    assert chosen.numel() >= 2, rewards  # the step must train on something
    assert metrics["pairs/trained"] == chosen.numel() and metrics["pairs/tied"] == int((~keep).sum())

    actor = LlamaForCausalLM.from_pretrained(policy, torch_dtype=torch.float32)
    ref = LlamaForCausalLM.from_pretrained(other_policy, torch_dtype=torch.float32)
    R = batch.response_mask.shape[1]
    with torch.no_grad():
        ref_w, ref_l = _hf_logps(ref, batch, chosen, R), _hf_logps(ref, batch, rejected, R)
    pi_w, pi_l = _hf_logps(actor, batch, chosen, R), _hf_logps(actor, batch, rejected, R)
    beta = 0.1
    h = (pi_w - pi_l) - (ref_w - ref_l)
    loss = -torch.nn.functional.logsigmoid(beta * h).mean()
    loss.backward()

    assert float(h.detach().abs().min()) > 1e-3  # a different reference: the loss is not log 2 at every pair
    assert metrics["actor/loss"] == pytest.approx(float(loss.detach()), rel=1e-5, abs=1e-6)
    assert metrics["logps/chosen"] == pytest.approx(float(pi_w.detach().mean()), rel=1e-5)
    assert metrics["logps/rejected"] == pytest.approx(float(pi_l.detach().mean()), rel=1e-5)
    assert metrics["rewards/margins"] == pytest.approx(float((beta * h).detach().mean()), rel=1e-4, abs=1e-6)
    vocab = actor.config.vocab_size
    torch.testing.assert_close(grads["lm_head.proj.weight"][:vocab], actor.lm_head.weight.grad, rtol=1e-4, atol=1e-6)
    # transformers' nn.Embedding(padding_idx=pad) never gives the pad row a gradient; a random policy samples
    # the pad token as a response token, whose embedding megalign trains: every other row is compared
    rows = torch.arange(vocab) != actor.config.pad_token_id
    torch.testing.assert_close(grads["model.embed.weight"][:vocab][rows], actor.model.embed_tokens.weight.grad[rows],
                               rtol=1e-4, atol=1e-6)


def _fixed_batch_step(policy, run_dir, batch_file, out, *overrides):
    """One step on this rank's share of a saved global batch (8 prompts x G=2); every rank saves its metrics and its
    grads under whole-model names (a pipeline stage's layers at their global index) to `out`.<rank>."""
    trainer = OnlineDPOTrainer(_config(policy, run_dir, "rollout.prompts_per_step=8", "algo.micro_batch_size=1",
                                       *overrides))
    full = torch.load(batch_file, weights_only=False)
    per_rank = len(full) // trainer.layout.dp
    mine = full.select(slice(trainer.layout.dp_rank * per_rank, (trainer.layout.dp_rank + 1) * per_rank))
    trainer.collect = lambda: (mine, mine, {"rounds": 1, "dropped_groups": 0, "kept_groups": per_rank // 2})
    seen = {}
    step = trainer.actor.optimizer.step

    def recording_step(*args, **kwargs):
        first = trainer.actor.model.model.layer_range[0]
        seen["grads"] = {re.sub(r"layers\.(\d+)\.", lambda m: f"layers.{int(m[1]) + first}.", n): p.grad.clone()
                         for n, p in trainer.actor.model.named_parameters()}
        return step(*args, **kwargs)

    trainer.actor.optimizer.step = recording_step
    metrics = trainer.train_step()
    torch.save({"metrics": metrics, "grads": seen["grads"]}, f"{out}.{trainer.rank}")


def _global_batch(policy, run_dir, out):
    trainer = OnlineDPOTrainer(_config(policy, run_dir, "rollout.prompts_per_step=8"))
    torch.save(trainer.collect()[0], out)


def test_two_ranks_equal_one_on_the_same_global_batch(policy, tmp_path):
    batch_file = str(tmp_path / "batch.pt")
    run_distributed(_global_batch, policy, str(tmp_path / "sample"), batch_file, world_size=1)
    batch = torch.load(batch_file, weights_only=False)
    tied = preference_pairs(batch.rewards, 2)[2]
    assert (~tied[:4]).any() and (~tied[4:]).any(), batch.rewards  # both ranks' halves hold a pair
    run_distributed(_fixed_batch_step, policy, str(tmp_path / "dp1"), batch_file, str(tmp_path / "dp1.pt"), world_size=1)
    run_distributed(_fixed_batch_step, policy, str(tmp_path / "dp2"), batch_file, str(tmp_path / "dp2.pt"), world_size=2)
    one, two = torch.load(str(tmp_path / "dp1.pt.0")), torch.load(str(tmp_path / "dp2.pt.0"))
    _same_step(one, two)
    for name, grad in one["grads"].items():
        torch.testing.assert_close(two["grads"][name], grad, rtol=1e-5, atol=1e-7)


def _same_step(one, two):
    for name in ("actor/loss", "actor/grad_norm", "rewards/chosen", "rewards/margins", "rewards/accuracies",
                 "logps/chosen", "logps/rejected", "pairs/trained", "pairs/tied", "objective/scores_margin",
                 "reward/mean"):
        assert one["metrics"][name] == pytest.approx(two["metrics"][name], rel=1e-5, abs=1e-7), name


@pytest.mark.parametrize("reference_pp", [1, 2])
def test_pp2_equals_pp1_on_the_same_batch(policy, tmp_path, reference_pp):
    """actor.pp=2 keeps the tied prompts' pairs at weight 0 (fixed micro-batch shapes): the same loss, metrics and
    gradients as pp=1, which drops them, on a batch that has ties; the reference on the actor's layout or at pp=1."""
    batch_file = str(tmp_path / "batch.pt")
    run_distributed(_global_batch, policy, str(tmp_path / "sample"), batch_file, world_size=1)
    tied = preference_pairs(torch.load(batch_file, weights_only=False).rewards, 2)[2]
    assert tied.any() and (~tied).any(), tied
    run_distributed(_fixed_batch_step, policy, str(tmp_path / "pp1"), batch_file, str(tmp_path / "pp1.pt"),
                    world_size=1)
    run_distributed(_fixed_batch_step, policy, str(tmp_path / "pp2"), batch_file, str(tmp_path / "pp2.pt"),
                    "actor.pp=2", f"reference.pp={reference_pp}", world_size=2)
    one = torch.load(str(tmp_path / "pp1.pt.0"))
    stages = [torch.load(str(tmp_path / f"pp2.pt.{rank}")) for rank in (0, 1)]
    _same_step(one, stages[0])
    _same_step(one, stages[1])
    got = {**stages[0]["grads"], **stages[1]["grads"]}
    assert sorted(got) == sorted(one["grads"])
    for name, grad in one["grads"].items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def _train(policy, run_dir, *overrides):
    train_online_dpo(_config(policy, run_dir, *overrides))


def _straight_then_resumed(policy, root, *overrides):
    _train(policy, f"{root}/straight", "steps=4", *overrides)
    _train(policy, f"{root}/resumed", "steps=2", *overrides)
    _train(policy, f"{root}/resumed", "steps=4", *overrides)  # resume=auto picks up the step-2 checkpoint


def test_resume_is_exact(policy, tmp_path):
    # two mini-batches and two epochs, so the sampler, the generator (rollouts and the pair order) and the
    # optimizer state all matter
    run_distributed(_straight_then_resumed, policy, str(tmp_path), "algo.mini_batches=2", "algo.ppo_epochs=2")
    straight, resumed = _rows(f"{tmp_path}/straight"), _rows(f"{tmp_path}/resumed")
    assert sorted(straight) == sorted(resumed) == [1, 2, 3, 4]
    assert straight == resumed


def test_reward_rises_two_ranks(policy, tmp_path):
    # 2 dp ranks, 16 arithmetic prompts x G=2 per step, the digit-fraction reward (a random policy starts near 0.1)
    run_distributed(_train, policy, str(tmp_path), "steps=12", "rollout.prompts_per_step=16", "export_hf=false")
    rows = _rows(str(tmp_path))
    rewards = [rows[s]["reward/mean"] for s in sorted(rows)]
    assert len(rewards) == 12
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.15, rewards


def _train_never_updating(policy, run_dir, *overrides):
    with pytest.raises(SkippedUpdatesError, match=r"the policy was never updated: updated in 0 of 2 steps \(2 skipped: "
                                                  r"nan_skips 0, empty_updates 2\)"):
        _train(policy, run_dir, *overrides)


def test_all_tied_steps_skip_the_update_and_fail_the_run(policy, tmp_path):
    # every response scores 1: no prompt has a preference, so no optimizer step may move the weights, and a run
    # that never moved its policy fails (issue 32) after its checkpoints
    run_distributed(_train_never_updating, policy, str(tmp_path), "save_every=1", "algo.missing_eos_penalty=0.0",
                    f"reward.terms=[{{name: '{HERE}/grpo_helpers.py:constant_one', weight: 1.0}}]", world_size=1)
    rows = _rows(str(tmp_path))
    assert [rows[s]["empty_updates"] for s in sorted(rows)] == [1, 2]
    assert all(r["pairs/trained"] == 0 and r["pairs/tied"] == 4 for r in rows.values())
    first, second = checkpoint_params(str(tmp_path), 1, role="actor"), checkpoint_params(str(tmp_path), 2, role="actor")
    initial = dict(from_pretrained(policy).named_parameters())
    for key, value in second.items():
        assert torch.equal(value, first[key]) and torch.equal(value, initial[key.split(".", 2)[2]].detach()), key


def test_missing_eos_penalty_breaks_ties_against_unfinished_responses(policy, tmp_path):
    # a constant reward minus TRL's penalty: a pair exists exactly where one response ended with EOS and the other not
    run_distributed(_train, policy, str(tmp_path), "steps=1", "algo.missing_eos_penalty=1.0",
                    "rollout.prompts_per_step=8", "rollout.max_response_length=4",
                    f"reward.terms=[{{name: '{HERE}/grpo_helpers.py:constant_one', weight: 1.0}}]", world_size=1)
    row = _rows(str(tmp_path))[1]
    eos = row["val/contain_eos_token"]
    assert row["reward/mean"] == pytest.approx(1.0 - (1.0 - eos))
    assert row["pairs/trained"] >= 1 and row["pairs/trained"] + row["pairs/tied"] == 8
    assert row["objective/scores_margin"] == 1.0  # every pair: a finished response over an unfinished one


@pytest.mark.slow  # a fresh interpreter importing torch and transformers: ~15-60 s on the shared 2 cores
def test_launcher_runs_a_step(policy, tmp_path):
    # the shim as a user runs it: plain python, one process, the tiny config on the command line
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    base = [o for o in tiny_overrides(policy, tmp_path / "run") if not o.startswith(("algo.", "rollout.group_size"))]
    argv = [sys.executable, os.path.join(root, "launch", "train_online_dpo.py"), *base, "steps=1",
            "rollout.group_size=2", "export_hf=false"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": root})
    assert done.returncode == 0, done.stderr[-2000:]
    rows = _rows(str(tmp_path / "run"))
    assert sorted(rows) == [1] and rows[1]["pairs/trained"] + rows[1]["pairs/tied"] == 4
