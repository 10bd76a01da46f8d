"""MetricsLogger output, PhaseTimer accumulation, memory_report and the LR schedule (the launch helpers: test_cli.py)."""
import json
import logging
import math
import sys

import pytest
import torch

from megalign.trainers import logging as logging_mod
from megalign.trainers.logging import MetricsLogger, PhaseTimer, memory_report
from megalign.trainers.optim import OptimConfig, lr_at


def test_metrics_logger_writes_valid_jsonl(tmp_path):
    with MetricsLogger(tmp_path, rank=0, tensorboard=True, progress_total=3) as log:
        log.log(1, {"loss": torch.tensor(2.5), "lr": 1e-3, "tokens": 7})
        log.log(2, {"loss": float("nan"), "grad_norm": torch.tensor([float("inf")])})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "loss": 2.5, "lr": 1e-3, "tokens": 7.0},
        {"step": 2, "loss": None, "grad_norm": None},  # JSON has no NaN / inf
    ]
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tensorboard").iterdir())
    with MetricsLogger(tmp_path, rank=0, tensorboard=False) as log:  # a resumed run appends
        log.log(3, {"loss": 1.0})
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_progress_bar_is_current_at_the_last_step(tmp_path, capsys):
    # what the bar shows after the last row: that step's loss, reward and accuracy, and the final eval
    with MetricsLogger(tmp_path, rank=0, tensorboard=False, progress_total=2) as log:
        log.log(1, {"actor/loss": 0.5, "reward/mean": 0.25, "accuracy": 0.125, "time/step": 1.0})
        log.log(2, {"actor/loss": 0.75, "reward/mean": 0.5, "accuracy": 0.375, "time/step": 1.0})
        log.log(2, {"eval/accuracy": 0.625})
        shown = log._bar.postfix
    assert shown == "actor/loss=0.75, reward/mean=0.5, accuracy=0.375, eval/accuracy=0.625"
    last_line = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert "2/2" in last_line and "actor/loss=0.75" in last_line and "eval/accuracy=0.625" in last_line


def test_metrics_logger_other_ranks_write_nothing(tmp_path):
    with MetricsLogger(tmp_path / "run", rank=1, progress_total=5) as log:
        log.log(1, {"loss": 1.0})
    assert not (tmp_path / "run").exists()


def test_metrics_logger_rejects_non_scalars(tmp_path):
    with MetricsLogger(tmp_path, rank=0, tensorboard=False) as log:
        with pytest.raises(ValueError, match="metric 'x' must be a scalar"):
            log.log(1, {"x": torch.ones(2)})
        with pytest.raises(ValueError, match="metric 'y' must be a number"):
            log.log(1, {"y": "high"})


def test_missing_tensorboard_warns_and_continues(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import raises ImportError
    with caplog.at_level(logging.WARNING, logger=logging_mod.__name__):
        with MetricsLogger(tmp_path, rank=0, tensorboard=True) as log:
            log.log(1, {"loss": 1.0})
    assert [r.message for r in caplog.records if "tensorboard is not installed" in r.message]
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "loss": 1.0}


def test_phase_timer_accumulates_per_phase(monkeypatch):
    clock = iter([0.0, 1.5, 10.0, 10.25, 20.0, 22.0])
    monkeypatch.setattr(logging_mod.time, "perf_counter", lambda: next(clock))
    timer = PhaseTimer()
    with timer("update"):
        pass
    with timer("data"):
        pass
    with pytest.raises(RuntimeError):
        with timer("update"):  # time is counted even when the phase raises
            raise RuntimeError
    assert timer.metrics() == {"time/update": 3.5, "time/data": 0.25}
    timer.reset()
    assert timer.metrics() == {}


def test_memory_report_reports_host_memory():
    report = memory_report()
    assert report["memory/cpu_peak_rss_gib"] >= report["memory/cpu_rss_gib"] > 0
    assert all(k.startswith("memory/") for k in report)


def test_lr_schedule_hand_values():
    cfg = OptimConfig(lr=1.0, warmup_steps=3, schedule="cosine", min_lr_ratio=0.1)
    # warm-up: (step + 1) / (warmup + 1)
    assert [lr_at(cfg, s, 13) for s in range(3)] == [0.25, 0.5, 0.75]
    # cosine over steps 3..12 (9 intervals): peak, midpoint, floor
    assert lr_at(cfg, 3, 13) == 1.0
    assert math.isclose(lr_at(cfg, 3 + 4.5, 13), 0.55)  # half-way: floor + (1 - floor) / 2
    assert math.isclose(lr_at(cfg, 12, 13), 0.1) and math.isclose(lr_at(cfg, 50, 13), 0.1)
    constant = OptimConfig(lr=2.0, warmup_steps=0, schedule="constant")
    assert [lr_at(constant, s, 5) for s in (0, 4)] == [2.0, 2.0]
