"""The reward model, KTO and the PRM at model.pp = 2 (2 gloo ranks, one decoder layer a stage) against their
pp = 1 runs on the same batches: loss, gradient norm, the objective's statistics and the updated weights after
each of 2 steps (the RM's scalar head on the last stage; KTO's z0 from the forward-only schedule before the
1F1B update of the labelled rows); and held-out scoring through the forward-only schedule (the RM's pairwise
accuracy and the reward statistics written beside its export, the PRM's step accuracy), the pp = 2 HF
export reloaded in transformers equal to pp = 1's, on a held-out count
that does not split into the micro-batches (the PRM's chunks of 5 rows are padded to 6: the copy must not count)."""
import json
import os

import pytest
import torch
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import tiny_policy
from trainers.helpers import compare_runs, metric_rows
from trainers.test_kto_trainer import kto_config
from trainers.test_prm_trainer import prm_config
from trainers.test_rm import rm_config
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from megalign.trainers.kto import train_kto
from megalign.trainers.preference import train_rm
from megalign.trainers.prm import train_prm

RUNS = {
    "rm": (rm_config, train_rm, ("loss", "grad_norm", "pairs", "accuracy", "margin", "rewards/chosen",
                                 "rewards/rejected")),
    "kto": (kto_config, train_kto, ("loss", "grad_norm", "examples", "rewards/chosen", "rewards/rejected",
                                    "logps/chosen", "logps/rejected", "kl")),
    "prm": (prm_config, train_prm, ("loss", "grad_norm", "step_labels", "step_accuracy")),
}
# Adam's eps above the summation-order rounding of near-cancelling gradient elements, which Adam divides by their
# own root mean square: measured, the RM's worst weight is 1.6e-5 from pp = 1 at eps 1e-6 (one element of a
# down_proj), 2.5e-6 at 1e-5; KTO's and the PRM's <= 1.2e-7 at either
STEP = ("optim.eps=1e-5", "save_every=1", "keep_last=10")


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("policy") / "hf")


def _train(objective, policy, run_dir, *overrides):
    config, train, _ = RUNS[objective]
    train(config(policy, run_dir, *overrides))


@pytest.mark.parametrize("objective", sorted(RUNS))
def test_pp2_step_equals_unpipelined(policy, tmp_path, objective):
    run_distributed(_train, objective, policy, str(tmp_path / "ref"), *STEP, world_size=1)
    run_distributed(_train, objective, policy, str(tmp_path / "pp2"), "model.pp=2", *STEP, world_size=2)
    ref = metric_rows(tmp_path / "ref")
    metrics = [name for name in RUNS[objective][2] if name in ref[0]]
    assert len(metrics) >= 4, (metrics, sorted(ref[0]))  # the names above are the objective's, not silently none
    compare_runs(tmp_path / "ref", tmp_path / "pp2", 2, 1, 2, metrics)


@pytest.mark.parametrize("objective", ["rm", "prm"])
def test_pp2_held_out_scores_equal_unpipelined(policy, tmp_path, objective):
    held_out = ("steps=1", "eval.max_samples=7", "eval.batch_size=5", "export_hf=true")
    run_distributed(_train, objective, policy, str(tmp_path / "ref"), *held_out, world_size=1)
    run_distributed(_train, objective, policy, str(tmp_path / "pp2"), "model.pp=2", *held_out, world_size=2)
    ref, pp2 = metric_rows(tmp_path / "ref")[-1], metric_rows(tmp_path / "pp2")[-1]
    assert 0 < ref["eval/accuracy"] <= 1 and pp2["eval/accuracy"] == pytest.approx(ref["eval/accuracy"], abs=1e-9)
    kind = AutoModelForSequenceClassification if objective == "rm" else AutoModelForCausalLM
    exports = [kind.from_pretrained(tmp_path / run / "hf").eval() for run in ("ref", "pp2")]
    ids = torch.tensor([[1, 5, 9, 14, 3, 7]])
    with torch.no_grad():
        torch.testing.assert_close(exports[1](ids).logits, exports[0](ids).logits, rtol=1e-5, atol=1e-5)
    if objective == "rm":
        stats = [json.load(open(os.path.join(tmp_path, run, "hf", "reward_stats.json"))) for run in ("ref", "pp2")]
        assert stats[0]["held_out_responses"] == stats[1]["held_out_responses"] == 14
        for key in ("reward_mean", "reward_std"):
            assert stats[1][key] == pytest.approx(stats[0][key], rel=1e-5, abs=1e-6), key
