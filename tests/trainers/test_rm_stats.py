"""An RM run without held-out pairs still exports `reward_stats.json` (issue 32 item 10).

It silently wrote none, so a later PPO run with `algo.reward_normalize=true` failed only then. Now the statistics
come from the training pairs, scored by the final model, and the file says so (`source: train`). The reference:
the exported sequence classifier scored by `transformers` on every training response, one row at a time, and the
population mean and std of those rewards written out here, and the Platt scaling fitted on them (chosen 1, rejected 0).
"""
import json
import math
import os

import pytest
import torch
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import tiny_policy

from megalign.config import load_config
from megalign.data import CharTokenizer, load_preferences
from megalign.algos import platt_fit
from megalign.roles.reward_exports import reward_calibration, reward_stats
from megalign.trainers.preference import RMConfig, train_rm

PAIRS = [("1+1=", "\\boxed{2}", "\\boxed{3}"), ("2*3=", "\\boxed{6}", "\\boxed{5}"), ("4-1=", "\\boxed{3}", "\\boxed{1}"),
         ("3+3=", "\\boxed{6}", "\\boxed{7}"), ("2+2=", "\\boxed{4}", "\\boxed{22}")]


def _train(policy, run_dir, data):
    train_rm(load_config(RMConfig, None, [
        f"run_dir={run_dir}", f"model.path={policy}", f"data.path={data}", "steps=2", "batch_size=4",
        "data.max_length=40", "optim.lr=1e-2", "optim.warmup_steps=0", "tensorboard=false", "export_hf=true",
        "save_every=0"]))


@pytest.mark.parametrize("world_size", [1, 2])
def test_stats_come_from_the_training_pairs_without_held_out_data(tmp_path, world_size):
    from transformers import AutoModelForSequenceClassification

    policy = tiny_policy(tmp_path / "policy")
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n" for p, c, r in PAIRS))
    run_distributed(_train, policy, str(tmp_path / "run"), str(data), world_size=world_size)

    hf = tmp_path / "run" / "hf"
    with open(hf / "reward_stats.json") as f:
        stats = json.load(f)
    assert stats["source"] == "train" and stats["train_responses"] == 2 * len(PAIRS)
    model = AutoModelForSequenceClassification.from_pretrained(hf).eval()
    examples, _ = load_preferences(data, CharTokenizer(), 40)
    with torch.no_grad():
        rewards = [model(torch.tensor([e.prompt_ids + reply])).logits[0, 0].double().item()
                   for e in examples for reply in (e.chosen_ids, e.rejected_ids)]
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    assert stats["reward_mean"] == pytest.approx(mean, abs=1e-5)
    assert stats["reward_std"] == pytest.approx(std, rel=1e-4) and std > 0
    assert reward_stats(str(hf)) == (stats["reward_mean"], stats["reward_std"])
    # Platt scaling over the same responses, chosen 1 and rejected 0, from transformers' rewards
    platt = platt_fit(torch.tensor(rewards), torch.tensor([1.0, 0.0] * len(PAIRS)))
    assert (stats["platt_a"], stats["platt_b"]) == pytest.approx(platt, rel=1e-3, abs=1e-4)
    assert reward_calibration(str(hf)) == (stats["platt_a"], stats["platt_b"])


def test_the_reader_takes_files_written_before_source_existed(tmp_path):
    (tmp_path / "reward_stats.json").write_text(json.dumps({"reward_mean": -0.5, "reward_std": 2.0,
                                                            "held_out_responses": 8}))
    assert reward_stats(str(tmp_path)) == (-0.5, 2.0)
    assert os.listdir(tmp_path) == ["reward_stats.json"]
