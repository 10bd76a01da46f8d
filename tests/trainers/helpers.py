"""Pieces shared by the trainer tests: NaN injection into a loss, warning capture, checkpointed weights (also of
pipeline x tensor-parallel runs, as whole-model tensors).

Every trainer promises the same thing about a numerical blow-up (a non-finite loss skips the update,
is warned and counted, and never reaches a checkpoint), so its tests use the same tools.
"""
import json
import logging
import os
import re

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


# metrics that measure the rounding between two computations of the same numbers (the rollout engine's log-probs
# against the trainer's recomputation): another tp / pp / dp layout rounds differently, so runs on different layouts
# must both log them but need not agree on their values
ROUNDING_PROBES = ("rollout/logprob_",)


def assert_rows_close(a, b, tol=1e-5, across_layouts=False):
    """Two metric rows with the same keys and values equal to `tol` (relative and absolute); `across_layouts` leaves
    the rounding probes' values out."""
    assert a.keys() == b.keys()
    for k in a:
        if not (across_layouts and k.startswith(ROUNDING_PROBES)):
            assert a[k] == pytest.approx(b[k], rel=tol, abs=tol), k


def whole_model(run_dir, step, pp, tp, layers, role="model"):
    """Checkpoint `step`'s `role` tensors of a run at `tp` x `pp` over `layers` decoder layers under whole-model
    names (global layer index), read by this process alone: {name: [tensor of each tp rank]}; a tied model's
    last-stage LM-head copy is there as `lm_head.proj.weight`."""
    reader = dcp.FileSystemReader(CheckpointManager(run_dir).path(step))
    meta = reader.read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items() if k.startswith(f"{role}.")}
    dcp.load(state, storage_reader=reader, no_dist=True)
    per_stage = layers // pp
    shards: dict[str, list] = {}
    for key, value in state.items():
        t, s, name = re.match(rf"{role}\.tp(\d+)_pp(\d+)\.(.*)", key).groups()
        name = re.sub(r"^model\.layers\.(\d+)\.", lambda m: f"model.layers.{int(m[1]) + int(s) * per_stage}.", name)
        shards.setdefault(name, [None] * tp)[int(t)] = value
    return shards


def gathered(parts, like):
    """The whole tensor shaped like `like` from its tp `parts`: one copy when replicated, else the shards
    concatenated along the dim where they are smaller (Megatron's vocabulary padding rows dropped)."""
    if parts[0].shape == like.shape:
        return parts[0]
    dim = next(d for d in range(like.dim()) if parts[0].shape[d] != like.shape[d])
    return torch.cat(parts, dim).narrow(dim, 0, like.shape[dim])


def compare_runs(ref_dir, run_dir, pp, tp, layers, metrics, steps=2, role="model", atol=1e-5, metric_atol=1e-6):
    """Run `run_dir` (at `tp` x `pp`) equals the tp=1 x pp=1 run `ref_dir` on the same global batches: the `metrics`
    of every metrics.jsonl row to 1e-5 relative or `metric_atol` absolute, the checkpointed `role` weights after each of `steps` steps to `atol` absolute
    (Adam divides a near-zero gradient element's rounding by its own tiny root mean square)."""
    for a, b in zip(metric_rows(ref_dir), metric_rows(run_dir), strict=True):
        for key in metrics:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=metric_atol), (key, a, b)
    for step in range(1, steps + 1):
        ref = {k: v[0] for k, v in whole_model(ref_dir, step, 1, 1, layers, role).items()}
        got = whole_model(run_dir, step, pp, tp, layers, role)
        copy = got.pop("lm_head.proj.weight", None) if "lm_head.proj.weight" not in ref else None
        assert sorted(got) == sorted(ref)
        for name, value in ref.items():
            torch.testing.assert_close(gathered(got[name], value), value, rtol=1e-4, atol=atol,
                                       msg=lambda m, step=step, name=name: f"step {step} {name}: {m}")
        if copy is not None:  # tied: the last stage's LM-head copy stays equal to the embedding
            torch.testing.assert_close(gathered(copy, ref["model.embed.weight"]), ref["model.embed.weight"],
                                       rtol=1e-5, atol=1e-6)


def prompt_response_batch(prompts, responses):
    """Left-padded prompt + right-padded response ids [N, P + R] and attention, R = the longest response."""
    p, r = max(map(len, prompts)), max(map(len, responses))
    ids = torch.zeros(len(prompts), p + r, dtype=torch.long)
    att = torch.zeros_like(ids)
    for n, (a, b) in enumerate(zip(prompts, responses)):
        ids[n, p - len(a):p], att[n, p - len(a):p] = torch.tensor(a), 1
        ids[n, p:p + len(b)], att[n, p:p + len(b)] = torch.tensor(b), 1
    return ids, att, r
