"""A resumed run's metrics.jsonl holds one trajectory (issue 32 item 10).

A run killed after logging steps it had not checkpointed left their rows in the file, and the resumed run logged
those steps again: two rows per step, the first from weights the run no longer has, and a plot showed both. Now the
resume removes the rows of steps after its checkpoint (and a line the kill cut short) and logs how many.
"""
import json
import logging
import os
import shutil

import pytest
from parallel.dist_utils import run_distributed
from trainers.helpers import metric_rows
from trainers.test_sft import tiny_config

from megalign.checkpoint import CheckpointManager
from megalign.trainers.logging import MetricsLogger
from megalign.trainers.sft import train_sft


def _write(path, steps, tail=""):
    path.write_text("".join(json.dumps({"step": s, "loss": float(s)}) + "\n" for s in steps) + tail)


def _steps(path):
    with open(path) as f:
        return [json.loads(line)["step"] for line in f]


def test_resume_drops_later_rows_and_a_cut_line_and_says_how_many(tmp_path, caplog):
    _write(tmp_path / "metrics.jsonl", [1, 2, 3, 4, 5], tail='{"step": 6, "lo')  # killed while writing step 6
    with caplog.at_level(logging.WARNING, logger="megalign.trainers.logging"):
        with MetricsLogger(tmp_path, rank=0, tensorboard=False, initial_step=3, resumed=True) as log:
            log.log(4, {"loss": 40.0})
    assert _steps(tmp_path / "metrics.jsonl") == [1, 2, 3, 4]
    assert [json.loads(line)["loss"] for line in open(tmp_path / "metrics.jsonl")] == [1.0, 2.0, 3.0, 40.0]
    assert "resuming at step 3, dropped 2 rows of later steps logged by the interrupted run and 1 unreadable " \
           "lines; kept 3 rows" in caplog.text
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]  # the temporary file was renamed, none left behind


def test_a_fresh_start_or_another_rank_keeps_the_file(tmp_path):
    _write(tmp_path / "metrics.jsonl", [1, 2, 3])
    with MetricsLogger(tmp_path, rank=0, tensorboard=False, initial_step=1) as log:  # not resumed: appends
        log.log(2, {"loss": 0.0})
    with MetricsLogger(tmp_path, rank=1, tensorboard=False, initial_step=1, resumed=True):
        pass  # only rank 0 touches the file
    assert _steps(tmp_path / "metrics.jsonl") == [1, 2, 3, 2]


def test_tensorboard_hides_the_interrupted_runs_later_events(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, rank=0, tensorboard=True) as log:  # the killed run: steps 1-3, checkpoint at 1
        for step in (1, 2, 3):
            log.log(step, {"loss": float(step)})
    with MetricsLogger(tmp_path, rank=0, tensorboard=True, initial_step=1, resumed=True) as log:
        log.log(2, {"loss": 20.0})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0), (2, 20.0)]
    assert _steps(tmp_path / "metrics.jsonl") == [1, 2]


def _sft(run_dir, *overrides):
    train_sft(tiny_config(run_dir, *overrides))


def test_a_run_killed_after_unsaved_steps_resumes_to_the_uninterrupted_runs_rows(tmp_path):
    run_dir = tmp_path / "killed"
    run_distributed(_sft, str(run_dir), world_size=1)  # steps 1-4, checkpoints at 2 and 4
    shutil.rmtree(CheckpointManager(str(run_dir)).path(4))  # as if killed after logging step 4, before its save
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')  # and mid-way through a line
    run_distributed(_sft, str(run_dir), world_size=1)  # resume=auto: from step 2, steps 3 and 4 again
    run_distributed(_sft, str(tmp_path / "straight"), world_size=1)
    assert [r["step"] for r in metric_rows(run_dir)] == [1, 2, 3, 4]
    assert metric_rows(run_dir) == metric_rows(tmp_path / "straight")
