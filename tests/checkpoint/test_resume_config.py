"""Resume with a changed config: the checkpoint's stored config, the key-by-key check, the run dir's config history."""
import logging
import os

import pytest
import torch
import yaml

from megalign.checkpoint import CheckpointManager, check_resume_config, config_changes, with_defaults, write_run_config
from megalign.config import ConfigError, load_config, to_dict
from megalign.trainers.sft import SFTConfig

SAVED = {"run_dir": "runs/a", "steps": 10, "resume": "auto", "optim": {"lr": 0.001, "betas": [0.9, 0.95]},
         "eval": {"batch_size": 8, "max_samples": None}, "eval_path": None, "spare": None}
FREE = ("run_dir", "resume", "eval")


def changed(**edits):
    """A copy of SAVED with dotted keys replaced (`optim__lr=...` sets optim.lr)."""
    cfg = yaml.safe_load(yaml.safe_dump(SAVED))
    for dotted, value in edits.items():
        *path, leaf = dotted.split("__")
        node = cfg
        for part in path:
            node = node[part]
        node[leaf] = value
    return cfg


def test_changes_are_found_leaf_by_leaf_and_free_prefixes_cover_whole_sections():
    assert config_changes(SAVED, changed(), FREE) == []
    # free: the key itself and everything inside a free section
    assert config_changes(SAVED, changed(run_dir="runs/b", resume="3", eval__batch_size=64), FREE) == []
    # "eval" does not cover "eval_path"; lists are one value; a section that appears is None -> dict
    assert config_changes(SAVED, changed(eval_path="x.jsonl", optim__betas=[0.9, 0.99], spare={"lr": 1.0}), FREE) == [
        ("optim.betas", [0.9, 0.95], [0.9, 0.99]), ("eval_path", None, "x.jsonl"), ("spare", None, {"lr": 1.0})]
    # a key on one side only (a field added in a newer version)
    newer = changed()
    newer["optim"]["eps"] = 1e-8
    assert config_changes(SAVED, newer, FREE) == [("optim.eps", "<absent>", 1e-8)]
    with pytest.raises(ValueError, match=r"free_keys \['evl'\] name no key of either config"):
        config_changes(SAVED, changed(), ("run_dir", "evl"))
    with pytest.raises(TypeError, match="not one string"):
        config_changes(SAVED, changed(), "eval")


def test_check_refuses_a_changed_config_naming_old_and_new_values():
    assert check_resume_config(SAVED, changed(run_dir="elsewhere"), FREE, allow=False) == []
    with pytest.raises(ConfigError, match=r"^resume from ckpt/step_00000004: the config differs from the one it was "
                                          r"written with: steps: 10 -> 20; optim\.lr: 0\.001 -> 0\.002 "
                                          r"\(set resume_changes=allow to resume") as err:
        check_resume_config(SAVED, changed(steps=20, optim__lr=0.002), FREE, allow=False, checkpoint="ckpt/step_00000004")
    assert err.value.key == "steps"


def test_check_allowed_returns_the_keys_and_warns(caplog):
    with caplog.at_level(logging.WARNING, "megalign.checkpoint.resume"):
        keys = check_resume_config(SAVED, changed(steps=20, optim__lr=0.002), FREE, allow=True)
    assert keys == ["steps", "optim.lr"]
    assert "with a changed config (resume_changes=allow): steps: 10 -> 20; optim.lr: 0.001 -> 0.002" in caplog.text


def test_check_of_a_checkpoint_without_config_warns_and_passes(caplog):
    with caplog.at_level(logging.WARNING, "megalign.checkpoint.resume"):
        assert check_resume_config(None, SAVED, FREE, allow=False, checkpoint="old/step_00000002") == []
    assert "old/step_00000002 holds no config" in caplog.text


def test_checkpoint_stores_the_resolved_config_and_it_round_trips_unchanged(tmp_path):
    cfg = load_config(SFTConfig, None, [f"run_dir={tmp_path}", "optim.lr=2e-3", "optim.betas=[0.8, 0.9]",
                                        "eval.max_samples=0", "data.arith.ops=['+']"])
    manager = CheckpointManager(tmp_path)
    manager.save(3, {"w": {"x": torch.ones(2)}}, config=to_dict(cfg))
    manager.save(4, {"w": {"x": torch.ones(2)}})  # no config given
    names = sorted(os.listdir(manager.path(3)))  # DCP's shard files: one per writer thread with data
    assert [n for n in names if not n.endswith(".distcp")] == [".metadata", "config.yaml"]
    assert any(n.startswith("__0_") for n in names)
    saved = manager.saved_config(3)
    assert saved == to_dict(cfg) and manager.saved_config(manager.path(3)) == saved
    assert check_resume_config(saved, to_dict(cfg), FREE, allow=False) == []  # YAML keeps every value's type
    assert manager.saved_config(4) is None
    with open(os.path.join(manager.path(4), "config.yaml"), "w") as f:
        f.write("- a list\n")
    with pytest.raises(ConfigError, match=r"step_00000004/config\.yaml' must hold a mapping, got list"):
        manager.saved_config(4)


def test_a_key_added_since_the_checkpoint_is_no_change_at_its_default(tmp_path):
    """A checkpoint written before `optim.fused` and `eval.batch_size` existed resumes while they keep
    their defaults; a non-default value is a change, shown against the default; a key that no longer
    exists still shows as removed."""
    current = to_dict(load_config(SFTConfig, None, [f"run_dir={tmp_path}"]))
    old = yaml.safe_load(yaml.safe_dump(current))
    del old["optim"]["fused"], old["eval"]["batch_size"]
    assert sorted(config_changes(old, current)) == [("eval.batch_size", "<absent>", current["eval"]["batch_size"]),
                                                    ("optim.fused", "<absent>", False)]
    assert config_changes(with_defaults(SFTConfig, old), current) == []
    assert check_resume_config(with_defaults(SFTConfig, old), current, FREE, allow=False) == []
    fused = to_dict(load_config(SFTConfig, None, [f"run_dir={tmp_path}", "optim.fused=true"]))
    assert config_changes(with_defaults(SFTConfig, old), fused) == [("optim.fused", False, True)]
    removed = dict(old, retired_key=3)  # no longer loads into SFTConfig: compared as saved
    assert with_defaults(SFTConfig, removed) is removed
    assert ("retired_key", 3, "<absent>") in config_changes(with_defaults(SFTConfig, removed), current)
    assert with_defaults(SFTConfig, None) is None


def test_run_config_keeps_every_earlier_config(tmp_path):
    first, second = dict(SAVED), changed(steps=20)
    path = write_run_config(tmp_path, first)
    assert path == os.path.join(tmp_path, "config.yaml") and os.listdir(tmp_path) == ["config.yaml"]
    write_run_config(tmp_path, first)  # a resume with the same config adds nothing
    assert os.listdir(tmp_path) == ["config.yaml"]
    write_run_config(tmp_path, second)
    write_run_config(tmp_path, changed(steps=30))
    assert sorted(os.listdir(tmp_path)) == ["config.1.yaml", "config.2.yaml", "config.yaml"]
    read = {name: yaml.safe_load((tmp_path / name).read_text()) for name in os.listdir(tmp_path)}
    assert read == {"config.1.yaml": first, "config.2.yaml": second, "config.yaml": changed(steps=30)}
    cfg = load_config(SFTConfig, None, ["steps=7"])  # a config dataclass is written like save_config writes it
    write_run_config(tmp_path, cfg)
    assert load_config(SFTConfig, tmp_path / "config.yaml") == cfg and (tmp_path / "config.3.yaml").exists()
