"""The planner's command line: the 70B examples and their recorded reports, run configs, JSON, bad input."""
import glob
import json
import os

import pytest

from megalign.algos.registry import ALGORITHMS
from megalign.plan.__main__ import main
from megalign.plan.runconfig import PLANNED_AS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "plan", "*.yaml")))


def test_there_are_70b_examples_for_grpo_ppo_dpo():
    names = {os.path.basename(p) for p in EXAMPLES}
    assert {"grpo_llama3_70b.yaml", "ppo_llama3_70b.yaml", "dpo_llama3_70b.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_example_fits_and_matches_its_recorded_report(path, capsys):
    assert main(["--config", path]) == 0
    with open(path[:-len(".yaml")] + ".txt") as f:
        assert capsys.readouterr().out == f.read()


def test_json_output_is_consistent_with_the_verdict(capsys):
    assert main(["--config", EXAMPLES[0], "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fits"] is True
    assert report["peak"]["total_bytes"] == max(s["total_bytes"] for s in report["steps"])
    assert report["peak"]["total_bytes"] <= report["gpu_memory_bytes"]
    for step in report["steps"]:
        assert step["total_bytes"] == pytest.approx(sum(r["total"] for r in step["roles"].values()))


def test_a_layout_that_does_not_fit_exits_1(capsys):
    # the GRPO example at today's trainer keys (no pp): the actor's states alone exceed 80 GiB
    assert main(["--config", os.path.join(ROOT, "examples", "plan", "grpo_llama3_70b.yaml"), "actor.pp=1",
                 "reference.pp=1"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


RUN_CONFIGS = sorted(glob.glob(os.path.join(ROOT, "examples", "*.yaml")))
# the roles each example's run builds (reference: GRPO's beta and REINFORCE++'s reward KL are off in grpo_arith,
# ORPO / SimPO / CPO have none; PPO's kl_coef > 0 builds one); the planner must see the same
EXAMPLE_ROLES = {"dpo_arith": {"actor", "reference"}, "grpo_arith": {"actor"}, "grpo_lora_arith": {"actor"},
                 "kto_arith": {"actor", "reference"},
                 "online_dpo_arith": {"actor", "reference"}, "ppo_arith": {"actor", "reference", "critic", "reward"},
                 "ppo_chain_prm": {"actor", "reference", "critic", "reward"}, "prm_chain": {"actor"},
                 "rm_arith": {"actor"}, "sft_arith": {"actor"}, "sft_chain": {"actor"},
                 "ppo_verifier_arith": {"actor", "critic"}, "grpo_tools_arith": {"actor"}, "judge_sft_arith": {"actor"},
                 # the run also builds the judge role of reward.judges, which the planner does not plan yet
                 "grpo_rubric_arith": {"actor"}, "sft_tools_arith": {"actor"},
                 "grpo_user_sim": {"actor", "reference"}, "sft_user_sim": {"actor"},  # user_sim: GRPO's beta 0.05
                 "sft_moe_arith": {"actor"}, "grpo_moe_arith": {"actor"}}


def test_every_registered_algorithm_has_a_phase_model():
    assert PLANNED_AS.keys() == ALGORITHMS.keys()


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=os.path.basename)
def test_every_example_run_config_is_planned(path, capsys):
    name = os.path.basename(path)[:-len(".yaml")]
    # the examples' checkpoints are not built here; the dense SFT ones build their model from scratch, the MoE ones
    # (ep = 2) start from a folder: an MoE preset stands in
    model = (["--model", "qwen3-30b-a3b"] if "_moe_" in name else [] if name.startswith("sft_")
             else ["--model", "llama3-8b"])
    assert main(["--run-config", path, "--gpus", "8", *model, "--json"]) in (0, 1)
    report = json.loads(capsys.readouterr().out)
    with open(path) as f:
        algorithm = next(line.split()[1] for line in f if line.startswith("algorithm:"))
    assert report["algorithm"] == PLANNED_AS[algorithm] and report["layout"]["actor"]["dp"] == 8
    assert set(report["layout"]) == EXAMPLE_ROLES[name]


@pytest.mark.parametrize("overrides, has_reference", [
    (["algo.advantage=reinforce_plus_plus"], True),  # -kl_coef * KL_t in the reward needs the reference
    (["algo.advantage=reinforce_plus_plus", "algo.kl_coef=0"], False),
    (["algo.kl_coef=0.04"], True)])
def test_grpo_plans_the_reference_exactly_when_the_trainer_builds_it(overrides, has_reference, capsys):
    path = os.path.join(ROOT, "examples", "grpo_arith.yaml")
    main(["--run-config", path, "--gpus", "8", "--model", "llama3-8b", "--json", *overrides])
    assert ("reference" in json.loads(capsys.readouterr().out)["layout"]) == has_reference


def test_reference_free_losses_plan_no_reference(capsys):
    path = os.path.join(ROOT, "examples", "dpo_arith.yaml")
    # dpo_arith's nll_coef is read by the DPO losses only, and a coefficient a loss ignores is refused
    assert main(["--run-config", path, "--gpus", "8", "--model", "llama3-8b", "--json", "algo.loss=orpo",
                 "algo.nll_coef=0"]) in (0, 1)
    assert "reference" not in json.loads(capsys.readouterr().out)["layout"]


def test_bad_input_names_the_problem(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: llama3-70b\nalgorithm: grpo\ngpus: 48\nactor: {tp: 8, pp: 3}\n")
    assert main(["--config", str(bad)]) == 2
    assert "divisible by pp" in capsys.readouterr().err
    bad.write_text("model: llama3-70b\nalgorithm: grpo\ngpus: 64\nactor: {tp: 8, ppp: 4}\n")
    assert main(["--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "actor.ppp" in err and "line 4" in err
    assert main(["--config", str(bad).replace("bad", "missing")]) == 2
    assert main(["--run-config", os.path.join(ROOT, "examples", "grpo_arith.yaml"), "--gpus", "2"]) == 2
    assert "actor.path" in capsys.readouterr().err


def test_a_file_without_the_algorithm_key_is_the_one_whose_config_loads_it(tmp_path, capsys):
    path = tmp_path / "ppo.yaml"
    path.write_text("actor: {path: /none, tp: 1}\ncritic: {path: /none, tp: 1}\n")  # only PPO has a critic
    assert main(["--run-config", str(path), "--gpus", "8", "--model", "llama3-8b", "--json"]) in (0, 1)
    assert json.loads(capsys.readouterr().out)["layout"]["critic"]["dp"] == 8
    path.write_text("actor: {path: /none, tp: 1}\n")  # GRPO, PPO and online DPO all have an actor
    assert main(["--run-config", str(path), "--gpus", "8", "--model", "llama3-8b"]) == 2
    err = capsys.readouterr().err
    assert "names no algorithm and it loads as each of grpo, ppo, online_dpo" in err and "algorithm: <name>" in err
    assert main(["--run-config", str(path), "--gpus", "8", "--model", "llama3-8b", "--json", "algorithm=online_dpo"]) in (0, 1)
    assert json.loads(capsys.readouterr().out)["layout"]["reference"]["dp"] == 8  # online DPO always has one
