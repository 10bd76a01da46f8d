"""Pieces shared by the trainer tests: NaN injection into a loss, warning capture, checkpointed weights.

Every trainer promises the same thing about a numerical blow-up (a non-finite loss skips the update,
is warned and counted, and never reaches a checkpoint), so its tests use the same tools.
"""
import json
import logging
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megalign.checkpoint import CheckpointManager


class NaNOnCalls:
    """Wraps a loss function: its calls numbered in `nan_calls` (1-based) return NaN, like a numerical blow-up."""

    def __init__(self, real, nan_calls):
        self.calls, self.nan_calls, self.real = 0, set(nan_calls), real

    def __call__(self, *args, **kwargs):
        self.calls += 1
        loss = self.real(*args, **kwargs)
        return loss * float("nan") if self.calls in self.nan_calls else loss


def capture_warnings(logger_name: str) -> list[str]:
    """A list that receives the message of every warning (or worse) logged to `logger_name` from now on."""
    messages = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger(logger_name).addHandler(handler)
    return messages


def checkpoint_params(run_dir, step, role="model"):
    """The `role` tensors of checkpoint `step` of a tp=1 run (keys `<role>.tp0_pp0.<name>`), read by this rank alone."""
    reader = dcp.FileSystemReader(CheckpointManager(run_dir).path(step))
    meta = reader.read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items() if k.startswith(f"{role}.")}
    dcp.load(state, storage_reader=reader, no_dist=True)  # only the caller reads
    return state


def metric_rows(run_dir, volatile=("time/", "memory/", "tokens_per_s", "pairs_per_s", "examples_per_s",
                                     "step_labels_per_s")):
    """The rows of run_dir/metrics.jsonl without the metrics that depend on timing or memory."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(volatile)} for line in f]


def assert_rows_close(a, b, tol=1e-5):
    """Two metric rows with the same keys and values equal to `tol` (relative and absolute)."""
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=tol, abs=tol), k
