"""Process reward model trainer (reward tokens on the LM head) and its Monte-Carlo labelling / best-of-N tools.

The step logits are the full model's logits at the step positions; the loss is the published step
cross-entropy computed by hand from those; dp=2 and tp=2 equal one rank; a run learns the embedded
chains' exact labels and exports a causal LM with `prm.json`; an ORM run supervises only the last
step; the labelling tool's rows are valid stepwise rows whose last label is the outcome; best-of-N
ranks by the aggregated step scores.
"""
import json
import os
from types import SimpleNamespace

import pytest
import torch
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import tiny_policy
from trainers.helpers import assert_rows_close, metric_rows

from megalign.algos import IGNORE_INDEX, prm_loss
from megalign.config import load_config
from megalign.data import CharTokenizer, collate_stepwise, encode_steps, load_stepwise
from megalign.models import from_pretrained
from megalign.tools.best_of_n import (BestOfNConfig, LabelStepsConfig, _vote, best_of_n, best_of_n_table,
                                      label_steps, split_steps, verifier_scores)
from megalign.roles.reward import step_logits, step_probs
from megalign.roles.reward_exports import load_prm_info
from megalign.trainers.prm import PRMConfig, outcome_only, reward_token_ids, train_prm

TOK = CharTokenizer()
CPU = SimpleNamespace(device=torch.device("cpu"))  # verifier_scores reads only the layout's device
CHAIN = ["chain.max_ops=2", "chain.max_operand=4", "chain.num_problems=60"]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("policy") / "hf")


def prm_config(policy, run_dir, *overrides) -> PRMConfig:
    return load_config(PRMConfig, None, [
        f"run_dir={run_dir}", f"model.path={policy}", "steps=2", "batch_size=8", *(f"data.{c}" for c in CHAIN),
        "data.max_length=60", "optim.lr=1e-3", "optim.warmup_steps=0", "eval.max_samples=0", "tensorboard=false",
        "export_hf=false", "save_every=0", *overrides])


def _examples():
    rows = [("1+2*3=", ["2*3=6", "1+6=7", "\\boxed{7}"], [1.0, 0.25, 0.0]),
            ("4-1=", ["4-1=3", "\\boxed{3}"], [0.5, 1.0])]
    return [encode_steps(TOK.encode(p, add_bos=True), s, y, TOK) for p, s, y in rows]


def test_reward_token_ids_checks_the_texts():
    assert reward_token_ids(TOK, "+", "-") == (TOK.encode("-")[0], TOK.encode("+")[0])
    with pytest.raises(ValueError, match="algo.positive_token='ok' must encode to exactly one token"):
        reward_token_ids(TOK, "ok", "-")
    with pytest.raises(ValueError, match="encode to the same token"):
        reward_token_ids(TOK, "+", "+")


def test_outcome_only_keeps_each_rows_last_label():
    labels = torch.tensor([[-100.0, 1.0, -100.0, 0.5, -100.0], [0.0, -100.0, -100.0, -100.0, -100.0]])
    expected = torch.tensor([[-100.0, -100.0, -100.0, 0.5, -100.0], [0.0, -100.0, -100.0, -100.0, -100.0]])
    assert torch.equal(outcome_only(labels), expected)


def test_step_logits_and_loss_match_the_full_forward_by_hand(policy):
    model = from_pretrained(policy)
    batch = collate_stepwise(_examples(), TOK.pad_id)
    where = batch["step_labels"] != IGNORE_INDEX
    neg, pos = reward_token_ids(TOK, "+", "-")
    ours = step_logits(model, batch["input_ids"], batch["attention_mask"], where, (neg, pos))
    full = model(batch["input_ids"], batch["attention_mask"])  # [B, T, V]
    torch.testing.assert_close(ours, full[where][:, [neg, pos]], rtol=1e-5, atol=1e-5)
    # the published step cross-entropy -(y log p+ + (1 - y) log p-), p the softmax over the two reward tokens
    y = batch["step_labels"][where].double()
    two = full[where][:, [neg, pos]].double()
    p_pos = torch.exp(two[:, 1]) / torch.exp(two).sum(-1)
    expected = -(y * torch.log(p_pos) + (1 - y) * torch.log(1 - p_pos)).sum()
    loss, stats = prm_loss(ours[None], y.float()[None])
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)
    assert int(stats.num_steps) == 5
    torch.testing.assert_close(step_probs(model, batch["input_ids"], batch["attention_mask"], where, (neg, pos)),
                               p_pos.float(), rtol=1e-5, atol=1e-6)


def _train(policy, run_dir, *overrides):
    train_prm(prm_config(policy, run_dir, *overrides))


def test_dp2_and_tp2_equal_one_rank(policy, tmp_path):
    run_distributed(_train, policy, f"{tmp_path}/one", world_size=1)
    run_distributed(_train, policy, f"{tmp_path}/dp2", world_size=2)
    run_distributed(_train, policy, f"{tmp_path}/tp2", "model.tp=2", world_size=2)
    one, dp2, tp2 = (metric_rows(f"{tmp_path}/{n}") for n in ("one", "dp2", "tp2"))
    assert any("step_accuracy" in r for r in one)
    for a, b, c in zip(one, dp2, tp2):
        assert_rows_close(a, b)
        assert_rows_close(a, c)


def _learns_and_exports(policy, run_dir):
    result = train_prm(prm_config(policy, run_dir, "steps=40", "optim.lr=3e-3", "eval.max_samples=12",
                                  "export_hf=true"))
    assert result.accuracy is not None and 0 <= result.accuracy <= 1
    orm = train_prm(prm_config(policy, f"{run_dir}/orm", "algo.supervise=outcome", "steps=1"))
    return result, orm


def test_learns_exact_chain_labels_and_exports_a_causal_lm(policy, tmp_path):
    run_distributed(_learns_and_exports, policy, str(tmp_path), world_size=1)
    rows = [r for r in metric_rows(str(tmp_path)) if "loss" in r]
    assert sum(r["loss"] for r in rows[-5:]) < sum(r["loss"] for r in rows[:5])
    info = load_prm_info(os.path.join(tmp_path, "hf"))
    assert (info["negative_token_id"], info["positive_token_id"]) == reward_token_ids(TOK, "+", "-")
    assert info["separator"] == "\n" and info["supervise"] == "steps"
    from transformers import AutoModelForCausalLM
    assert AutoModelForCausalLM.from_pretrained(os.path.join(tmp_path, "hf")) is not None
    # an ORM labels one step per solution: as many labels as solutions in its batch
    orm_rows = [r for r in metric_rows(f"{tmp_path}/orm") if "loss" in r]
    assert orm_rows[0]["step_labels"] == 8
    assert rows[0]["step_labels"] > 8


def test_prompt_window_of_the_tools():
    cfg = load_config(LabelStepsConfig, None, ["first_prompt=2", "num_prompts=3"])
    assert cfg.prompts(list("abcdef")) == ["c", "d", "e"]
    assert load_config(LabelStepsConfig, None, ["first_prompt=4"]).prompts(list("abcdef")) == ["e", "f"]
    with pytest.raises(ValueError, match="first_prompt=6 leaves no prompt of the 6"):
        load_config(LabelStepsConfig, None, ["first_prompt=6"]).prompts(list("abcdef"))


def test_split_steps_and_vote():
    assert split_steps("1+2=3\n\\boxed{3}", "\n") == ["1+2=3", "\\boxed{3}"]
    assert split_steps("1+2=3\n\n\\boxed{3}", "\n") is None
    assert _vote(["\\boxed{3}", "\\boxed{4}", "\\boxed{4}"], 4) == 1.0
    assert _vote(["\\boxed{3}", "\\boxed{3}", "\\boxed{4}"], 4) == 0.0
    assert _vote(["no answer"], 4) == 0.0


def test_verifier_scores_aggregate_the_step_probabilities(policy):
    model = from_pretrained(policy)
    info = {"negative_token_id": TOK.encode("-")[0], "positive_token_id": TOK.encode("+")[0], "separator": "\n"}
    prompt = TOK.encode("1+2*3=", add_bos=True)
    steps = [["2*3=6", "1+6=7", "\\boxed{7}"], None, ["2*3=5", "\\boxed{6}"]]
    scores = {agg: verifier_scores(model, info, TOK, [prompt] * 3, steps, CPU, 2, agg) for agg in ("min", "prod", "last")}
    for j in (0, 2):
        example = encode_steps(prompt, steps[j], [0.0] * len(steps[j]), TOK)
        batch = collate_stepwise([example], TOK.pad_id)
        p = step_probs(model, batch["input_ids"], batch["attention_mask"], batch["step_labels"] != IGNORE_INDEX,
                       (info["negative_token_id"], info["positive_token_id"])).double()
        assert scores["min"][j] == pytest.approx(float(p.min()), rel=1e-5)
        assert scores["prod"][j] == pytest.approx(float(p.prod()), rel=1e-5)
        assert scores["last"][j] == pytest.approx(float(p[-1]), rel=1e-5)
    assert all(scores[agg][1] == float("-inf") for agg in scores)


def _label_and_rank(policy, tmp):
    out = f"{tmp}/mc.jsonl"
    summary = label_steps(load_config(LabelStepsConfig, None, [
        f"policy={policy}", f"out={out}", *CHAIN, "num_prompts=6", "samples=2", "completions=2",
        "sampling.max_new_tokens=20", "device=cpu"]))
    prm = os.path.join(tmp, "prm")
    train_prm(prm_config(policy, prm, f"data.path={out}", "steps=1", "export_hf=true"))
    result = best_of_n(load_config(BestOfNConfig, None, [
        f"policy={policy}", f"prm={prm}/hf", f"orm={prm}/hf", f"out={tmp}/bon.json", *CHAIN, "num_prompts=4", "n=3",
        "sampling.max_new_tokens=20", "device=cpu"]))
    return summary, result


def test_label_steps_and_best_of_n_run_end_to_end(policy, tmp_path):
    run_distributed(_label_and_rank, policy, str(tmp_path), world_size=2)
    with open(tmp_path / "mc.jsonl") as f:
        rows = [json.loads(line) for line in f]
    # the random policy's samples: each kept one is a valid stepwise row (one label in [0, 1] per step)
    examples, _ = load_stepwise(tmp_path / "mc.jsonl", TOK, max_length=200)
    assert len(examples) == len(rows) <= 12
    from megalign.rewards.math import math_accuracy
    for row in rows:
        assert len(row["labels"]) == len(row["completions"]) and all(0 <= y <= 1 for y in row["labels"])
        assert row["labels"][-1] == float(math_accuracy("\n".join(row["completions"]), row["answer"]) > 0.5)
    with open(tmp_path / "bon.json") as f:
        summary = json.load(f)
    assert summary["prompts"] == 4 and summary["n"] == 3
    for key in ("greedy", "vote", "prm", "orm", "sample_mean"):
        assert 0 <= summary[key] <= summary["pass"] or key == "greedy"
    assert best_of_n_table(summary).splitlines()[-1].strip().startswith("change")
    for key in ("auc", "auc_within_prompt"):
        assert set(summary[key]) == {"prm", "orm"}
        assert all(auc is None or 0 <= auc <= 1 for auc in summary[key].values())
