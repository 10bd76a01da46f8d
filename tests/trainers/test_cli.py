"""The launch helpers: argv parsing, `--help`, config errors as one line and exit status 2, the process group's lifetime."""
import dataclasses
import os
import subprocess
import sys
import tempfile

import pytest
import torch.distributed as dist

from megalign.checkpoint import RunDirLocked
from megalign.config import ConfigError, option
from megalign.trainers.base import SkippedUpdatesError
from megalign.trainers import cli
from megalign.trainers.cli import DEBUG_ENV, main, parse_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def launch_sft(*args, cwd):
    """`python launch/train_sft.py *args` in a fresh interpreter: (exit status, stdout, stderr)."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "train_sft.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout, done.stderr


def test_help_lists_every_config_key_and_exits_0(tmp_path):
    status, out, err = launch_sft("--help", cwd=tmp_path)
    assert status == 0, err
    assert out.startswith("usage: [-h] [--debug] [--config CONFIG.yaml] [key.sub=value ...]\n")
    # the trainer's own default (3e-3), not OptimConfig's (1e-3)
    assert "  optim.lr (float, default 0.003): peak learning rate, reached at the end of warm-up\n" in out
    assert "  data.arith.max_operand (int, default 20):" in out and "  resume (str, default 'auto'):" in out
    assert not os.listdir(tmp_path)  # nothing ran


def test_an_error_line_is_one_write_so_ranks_on_one_pipe_cannot_interleave(monkeypatch):
    """Two ranks failing together on torchrun's shared stderr once printed `...missingerror: ...` (CI, 2026-12-07):
    `print` wrote the text and its newline separately to the unbuffered stream."""
    writes = []

    class Stream:
        def write(self, text):
            writes.append(text)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", Stream())
    with pytest.raises(SystemExit) as stop:
        cli._fail("model.path: no   such\n directory")
    assert stop.value.code == 2 and writes == ["error: model.path: no such directory\n"]


def test_bad_key_in_yaml_is_one_line_naming_file_and_key_exit_2(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("steps: 3\noptim:\n  lrr: 0.1\n")
    status, out, err = launch_sft("--config", str(path), cwd=tmp_path)
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: config file '{path}' line 3: unknown config key 'optim.lrr' (did you mean 'optim.lr'?)")
    status, _, err = launch_sft("--config", str(path), "optim.lr=fast", cwd=tmp_path)  # the file is read first
    assert status == 2 and "'optim.lrr'" in err
    status, _, err = launch_sft("optim.lr=fast", cwd=tmp_path)
    assert (status, err) == (2, "error: override 'optim.lr=fast': config key 'optim.lr' expects float, got 'fast' (str)\n")


def test_parse_cli():
    assert parse_cli(["--config", "a.yaml", "x.y=1", "z=[1, 2]"]) == ("a.yaml", ["x.y=1", "z=[1, 2]"])
    assert parse_cli(["--config=b.yaml"]) == ("b.yaml", [])
    assert parse_cli(["steps=3"]) == (None, ["steps=3"])


@pytest.mark.parametrize("argv, message", [
    (["--lr", "3"], "unexpected argument '--lr'"), (["--config"], "--config needs a path"),
    (["--config", "a", "--config", "b"], "--config given twice"), (["loose"], "unexpected argument 'loose'"),
])
def test_parse_cli_usage_errors_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_cli(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"usage: [-h] [--debug] [--config CONFIG.yaml] [key.sub=value ...]\nerror: {message}\n"


@dataclasses.dataclass
class _LaunchConfig:
    """A launch config for the tests."""

    device: str = option("cpu", doc="device")
    steps: int = option(1, doc="steps")


def test_main_loads_config_runs_trainer_and_destroys_group(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the one-rank group's store left folders in /tmp
    seen = []

    def train(cfg):
        seen.append((cfg.steps, dist.get_world_size()))
        return "done"

    assert main(_LaunchConfig, train, ["steps=3"]) == "done"
    assert seen == [(3, 1)] and not dist.is_initialized() and os.listdir(tmp_path) == []

    def boom(cfg):
        raise RuntimeError("trainer failed")

    with pytest.raises(RuntimeError, match="trainer failed"):  # not a config error: raised as is
        main(_LaunchConfig, boom, [])
    assert not dist.is_initialized()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:  # an unknown key fails before any process group exists
        main(_LaunchConfig, train, ["nope=1"])
    assert exit_.value.code == 2 and not dist.is_initialized() and len(seen) == 1
    assert capsys.readouterr().err.startswith("error: override 'nope=1': unknown config key 'nope'")

    def refuse(cfg):
        raise ConfigError("resume: the config changed\n(two lines)", key="steps")

    with pytest.raises(SystemExit) as exit_:  # a ConfigError from the trainer (a refused resume) as well
        main(_LaunchConfig, refuse, [])
    assert exit_.value.code == 2 and not dist.is_initialized()
    assert capsys.readouterr().err == "error: resume: the config changed (two lines)\n"
    with pytest.raises(SystemExit) as exit_:
        main(_LaunchConfig, train, ["--help"])
    assert exit_.value.code == 0 and len(seen) == 1
    out = capsys.readouterr().out
    assert "A launch config for the tests." in out and "  steps (int, default 1): steps\n" in out


def test_data_and_model_errors_are_one_line_naming_the_file_and_row_unless_debugging(tmp_path):
    """They were a traceback (repeated by every rank under torchrun) where config errors get one line."""
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "1+1=", "response": "2"}\n{"prompt": 3}\n')
    common = ("device=cpu", "steps=1", f"run_dir={tmp_path / 'run'}")
    status, out, err = launch_sft(f"data.path={data}", *common, cwd=tmp_path)
    assert status == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: {data}:2: 'prompt' must be a non-empty string, got 3"), err
    status, _, err = launch_sft("--debug", f"data.path={data}", *common, cwd=tmp_path)
    assert status == 1 and "Traceback" in err and "DataError" in err, err
    status, _, err = launch_sft(f"model.path={tmp_path / 'nowhere'}", "device=cpu", f"run_dir={tmp_path / 'run2'}",
                                cwd=tmp_path)
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: model.path='{tmp_path / 'nowhere'}' does not exist: it must be an HF checkpoint"), err


@pytest.mark.parametrize("error", [RunDirLocked("runs/x is held by host h pid 12 (job 7)"),
                                   SkippedUpdatesError("SFT: the policy was never updated: ...")])
def test_a_locked_run_dir_or_a_run_that_never_updated_is_one_line_with_status_1(error, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv(DEBUG_ENV, raising=False)

    def fails(cfg):
        raise error

    with pytest.raises(SystemExit) as exit_:
        main(_LaunchConfig, fails, [])
    assert exit_.value.code == 1 and capsys.readouterr().err == f"error: {error}\n"
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(type(error)):
        main(_LaunchConfig, fails, [])
    assert not dist.is_initialized()
