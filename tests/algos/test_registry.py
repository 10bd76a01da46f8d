"""The registry of algorithms: each entry against the trainer it names, the launch entry points that read it,
and how a YAML's algorithm is found (its key, the override, or the one config class that loads it)."""
import glob
import json
import os
import runpy
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megalign.algos.registry import ALGORITHMS, get, load
from megalign.config import ConfigError, load_config
from megalign.trainers.grpo import GRPOTrainer
from megalign.trainers.kto import KTOObjective
from megalign.trainers.online_dpo import OnlineDPOTrainer
from megalign.trainers.ppo import PPOTrainer
from megalign.trainers.preference import PairwiseObjective, RewardModelObjective
from megalign.trainers.prm import PRMObjective
from megalign.trainers.sft import SFTObjective

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH = os.path.join(ROOT, "launch")
# where each trainer decides whether it builds the reference: its online trainer or its supervised objective
DECIDES = {"sft": SFTObjective, "dpo": PairwiseObjective, "kto": KTOObjective, "rm": RewardModelObjective,
           "prm": PRMObjective, "grpo": GRPOTrainer, "ppo": PPOTrainer, "online_dpo": OnlineDPOTrainer}
VARIANTS = {"dpo": [["algo.loss=orpo"], ["algo.loss=ipo"]],
            "ppo": [["algo.kl_coef=0"], ["algo.kl_coef=0", "algo.kl_target=6"]],
            "online_dpo": [["algo.loss=simpo"], ["algo.loss=ipo"]],
            "grpo": [["algo.kl_coef=0.04"], ["algo.advantage=reinforce_plus_plus"],
                     ["algo.advantage=reinforce_plus_plus", "algo.kl_coef=0"]]}


def test_every_trainer_is_registered_once():
    assert sorted(DECIDES) == sorted(ALGORITHMS)
    assert len({a.config for a in ALGORITHMS.values()}) == len(ALGORITHMS)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_entry_matches_its_trainer(name):
    algo = get(name)
    assert algo.config_class()().algorithm == name  # the config declares its own name: a YAML's key selects it
    assert callable(algo.train_fn())
    for overrides in [[], *VARIANTS.get(name, [])]:
        cfg = load_config(algo.config_class(), None, overrides)
        builds = DECIDES[name].needs_reference(SimpleNamespace(cfg=cfg))
        assert algo.needs_reference(cfg) == builds, overrides


def test_needs_reference_in_the_default_and_variant_configs():
    grpo, ppo, dpo = (get(n) for n in ("grpo", "ppo", "dpo"))
    assert not grpo.needs_reference(load_config(grpo.config_class(), None, []))
    assert grpo.needs_reference(load_config(grpo.config_class(), None, ["algo.advantage=reinforce_plus_plus"]))
    assert not ppo.needs_reference(load_config(ppo.config_class(), None, ["algo.kl_coef=0"]))
    assert ppo.critic and ppo.reward and not (grpo.critic or dpo.reward)
    assert not dpo.needs_reference(load_config(dpo.config_class(), None, ["algo.loss=simpo"]))


def test_unknown_algorithm_names_the_registered_ones():
    with pytest.raises(ConfigError, match="algorithm 'sfft' is not registered; registered: sft, dpo"):
        get("sfft")


def test_load_by_key_override_or_the_one_config_that_loads_it(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("steps: 3\nalgorithm: kto\n")
    algo, cfg = load(str(path))
    assert (algo.name, type(cfg).__name__, cfg.steps) == ("kto", "KTOConfig", 3)
    path.write_text("steps: 3\n")  # every config has steps
    with pytest.raises(ConfigError, match="names no algorithm and it loads as each of sft, dpo, kto, rm, prm, grpo"):
        load(str(path))
    assert load(str(path), ["algorithm=rm"])[0].name == "rm"
    path.write_text("critic: {lam: 0.9}\n")
    with pytest.raises(ConfigError, match="no algorithm's config loads it"):
        load(str(path))
    path.write_text("critic: {path: /x}\n")  # only PPO has a critic
    assert load(str(path))[0].name == "ppo"
    path.write_text("steps: 3\nalgorithm: sfft\n")
    with pytest.raises(ConfigError, match=r"line 2: algorithm 'sfft' is not registered"):
        load(str(path))
    with pytest.raises(ConfigError, match="cannot read config file"):
        load(str(tmp_path / "missing.yaml"))
    path.write_text("algorithm: sft\nactor: {path: /x}\n")  # the named algorithm's own checks, with the line
    with pytest.raises(ConfigError, match="line 2: unknown config key 'actor'"):
        load(str(path))


def test_each_launch_file_runs_its_algorithm(monkeypatch, capsys):
    files = sorted(glob.glob(os.path.join(LAUNCH, "train_*.py")))
    assert sorted(os.path.basename(f)[len("train_"):-len(".py")] for f in files) == sorted(ALGORITHMS)
    monkeypatch.syspath_prepend(LAUNCH)  # as `python launch/train_x.py` has it
    for file in files:
        name = os.path.basename(file)[len("train_"):-len(".py")]
        monkeypatch.setattr(sys, "argv", [file, "--help"])
        with pytest.raises(SystemExit) as exit_:
            runpy.run_path(file, run_name="__main__")
        out = capsys.readouterr().out
        assert exit_.value.code == 0 and f"config keys of {get(name).config_class().__name__}:" in out
        assert f"algorithm (Literal['{name}'], default '{name}')" in out
    monkeypatch.setattr(sys, "argv", [os.path.join(LAUNCH, "train.py"), "--help"])
    with pytest.raises(SystemExit):
        runpy.run_path(os.path.join(LAUNCH, "train.py"), run_name="__main__")
    listed = [line.split()[0] for line in capsys.readouterr().out.split("algorithms (")[1].splitlines()[1:]]
    assert listed == list(ALGORITHMS)


def test_generic_entry_trains_the_algorithm_the_yaml_names(tmp_path):
    tiny = ["steps=1", "batch_size=4", "model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1",
            "model.num_heads=2", "model.num_kv_heads=1", "eval.max_samples=0", "export_hf=false", "save_every=0",
            "tensorboard=false", "device=cpu", f"run_dir={tmp_path / 'run'}"]
    done = subprocess.run([sys.executable, os.path.join(LAUNCH, "train.py"), "--config",
                           os.path.join(ROOT, "examples", "sft_arith.yaml"), *tiny],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1]
    done = subprocess.run([sys.executable, os.path.join(LAUNCH, "train.py"), "steps=1"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.startswith("error: the command line names no algorithm")
