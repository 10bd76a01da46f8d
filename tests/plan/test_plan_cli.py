"""The planner's command line: the 70B examples and their recorded reports, run configs, JSON, bad input."""
import glob
import importlib.util
import json
import os

import pytest

from megalign.plan.__main__ import main
from megalign.plan.runconfig import detect_trainer

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


@pytest.mark.parametrize("name, trainer", [("grpo_arith.yaml", "grpo"), ("sft_arith.yaml", "sft"),
                                           ("dpo_arith.yaml", "dpo"), ("rm_arith.yaml", "rm"), ("kto_arith.yaml", "kto")])
def test_run_configs_of_every_trainer_are_read(name, trainer, capsys):
    path = os.path.join(ROOT, "examples", name)
    assert detect_trainer(path) == trainer
    model = [] if trainer == "sft" else ["--model", "llama3-8b"]  # the arith checkpoints are not built here
    main(["--run-config", path, "--gpus", "8", *model, "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["algorithm"] == trainer and report["layout"]["actor"]["dp"] == 8


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


def test_a_critic_section_is_read_as_ppo_where_the_trainer_exists(tmp_path, capsys):
    path = tmp_path / "ppo.yaml"
    path.write_text("actor: {path: /none, tp: 1}\ncritic: {path: /none, tp: 1}\n")
    assert detect_trainer(str(path)) == "ppo"
    rc = main(["--run-config", str(path), "--gpus", "8", "--model", "llama3-8b", "--json"])
    out = capsys.readouterr()
    if importlib.util.find_spec("megalign.trainers.ppo") is None:  # the PPO trainer is on another branch
        assert rc == 2 and "PPO trainer" in out.err
    else:
        assert json.loads(out.out)["layout"]["critic"]["dp"] == 8
