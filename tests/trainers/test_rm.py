"""Reward-model trainer on the embedded arithmetic pairs, from a tiny policy checkpoint (fresh reward head).

dp=2 and tp=2 equal dp=1 / tp=1 on the same global batch; training ranks the chosen responses first,
and a run from the export continues its head; the export is an
HF sequence-classification model that transformers scores exactly as megalign does, with the
held-out reward statistics beside it.
"""
import json
import math
import os

import pytest
import torch
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import tiny_policy
from trainers.helpers import assert_rows_close, metric_rows

from megalign.config import load_config
from megalign.trainers.preference import RMConfig, train_rm


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("policy") / "hf")


def rm_config(policy, run_dir, *overrides) -> RMConfig:
    return load_config(RMConfig, None, [
        f"run_dir={run_dir}", f"model.path={policy}", "steps=2", "batch_size=8", "data.arith.max_operand=4",
        "data.max_length=40", "optim.lr=1e-3", "optim.warmup_steps=0", "eval.max_samples=0", "tensorboard=false",
        "export_hf=false", "save_every=0", *overrides])


def _train(policy, run_dir, *overrides):
    train_rm(rm_config(policy, run_dir, *overrides))


def test_dp2_and_tp2_equal_one_rank(policy, tmp_path):
    run_distributed(_train, policy, f"{tmp_path}/one", world_size=1)
    run_distributed(_train, policy, f"{tmp_path}/dp2", world_size=2)
    run_distributed(_train, policy, f"{tmp_path}/tp2", "model.tp=2", world_size=2)
    one, dp2, tp2 = (metric_rows(f"{tmp_path}/{n}") for n in ("one", "dp2", "tp2"))
    for a, b, c in zip(one, dp2, tp2):
        assert_rows_close(a, b)
        assert_rows_close(a, c)


def _learns_exports_and_continues(policy, run_dir):
    result = train_rm(rm_config(policy, run_dir, "steps=60", "optim.lr=2e-3", "eval.max_samples=16", "export_hf=true",
                                "algo.margin=false"))
    assert result.accuracy is not None and 0 <= result.accuracy <= 1
    # a checkpoint with a reward head is continued, not given a fresh head: its first step already ranks the pairs
    again = train_rm(rm_config(result.hf_path, f"{run_dir}/again", "steps=1", "optim.lr=1e-9", "algo.margin=false"))
    assert again.metrics[0]["loss"] < result.metrics[0]["loss"] - 0.2  # a fresh head starts where the first run did


def test_learns_the_pairs_and_exports_a_sequence_classifier(policy, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from megalign.data import CharTokenizer
    from megalign.models import from_pretrained

    run_distributed(_learns_exports_and_continues, policy, str(tmp_path), world_size=1)
    rows = [r for r in metric_rows(str(tmp_path)) if "loss" in r]
    first, last = rows[:10], rows[-10:]
    assert sum(r["loss"] for r in last) < sum(r["loss"] for r in first)
    assert sum(r["rewards/accuracies"] for r in last) / 10 >= 0.7
    hf = os.path.join(tmp_path, "hf")
    with open(os.path.join(hf, "reward_stats.json")) as f:
        stats = json.load(f)
    assert 0 < stats["held_out_responses"] <= 2 * 16 and math.isfinite(stats["reward_mean"]) and stats["reward_std"] > 0
    tok = CharTokenizer()
    ids = torch.tensor([tok.encode("1+2=\\boxed{3}", add_bos=True) + [tok.eos_id]])
    theirs = AutoModelForSequenceClassification.from_pretrained(hf).eval()(ids).logits[0, 0]
    ours = from_pretrained(hf, kind="reward").eval()(ids)[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
