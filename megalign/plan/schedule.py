"""Step time and device idle fraction of an online RL schedule, colocated or disaggregated at staleness k: a small
discrete-event simulation of `megalign.trainers.disaggregated`'s schedule (issue 29), to judge a placement at
cluster scale from costs measured on a few devices.

Cost model (`Costs`), per device:

    generating responses of lengths l_1..l_n   decode_step_s * max_i l_i + token_s * sum_i l_i
    training on T tokens (prompt + response)   train_fixed_s + train_token_s * T

The first generation term is the latency floor of a decode step, which every step of the longest response pays
however few rows are still running (the long tail: memory-bound decoding on a GPU, per-step overheads on a CPU);
the second is the throughput part. A step's batch is split over the dp devices of a side in contiguous whole
groups, as the trainers split it.

Schedules (`simulate`):

- colocated on D devices: every device generates its share, then every device trains on its share; a phase ends
  when its slowest device ends (the gradient all-reduce, the next phase's collectives), so a step takes
  max_d gen_d + max_d train_d;
- disaggregated, R rollout devices and D - R training devices at staleness k: step t's sampling starts when step
  t - 1's sampling ended and its weights version v(t) = max(0, t - k) reached the rollout devices (the end of
  training step v(t) - 1 and its weight broadcast); step t's training starts when its batch is ready and step t - 1's
  training ended; the training side then spends `sync_s` sending the new weights, when a later batch needs them.

Results: seconds per step, samples per second, and the idle fraction, 1 - busy device-seconds / (D x wall time).
"""
from __future__ import annotations

import dataclasses
from typing import Literal, Optional, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Costs:
    """Per-device costs (module doc), seconds."""

    decode_step_s: float
    token_s: float
    train_token_s: float
    train_fixed_s: float = 0.0
    sync_s: float = 0.0

    def generation_s(self, lengths: np.ndarray) -> float:
        """Generating responses of `lengths` [n] on one device."""
        return self.decode_step_s * float(lengths.max(initial=0)) + self.token_s * float(lengths.sum())

    def training_s(self, tokens: float) -> float:
        """Training on `tokens` (prompt + response) on one device."""
        return self.train_fixed_s + self.train_token_s * tokens


@dataclasses.dataclass(frozen=True)
class Placement:
    """`mode` on `devices` devices; disaggregated: `rollout_devices` of them generate, at staleness `k`."""

    mode: Literal["colocated", "disaggregated"]
    devices: int
    rollout_devices: int = 0
    k: int = 0

    def __post_init__(self) -> None:
        if self.mode == "disaggregated" and not 1 <= self.rollout_devices < self.devices:
            raise ValueError(f"a disaggregated placement needs 1 <= rollout_devices < devices, got "
                             f"{self.rollout_devices} of {self.devices}")
        if self.k < 0:
            raise ValueError(f"staleness k must be >= 0, got {self.k}")


def _shares(lengths: np.ndarray, parts: int, group: int) -> list[np.ndarray]:
    """A step's response lengths [n] split over `parts` devices in contiguous whole groups of `group`."""
    groups = lengths.reshape(-1, group)
    return [chunk.reshape(-1) for chunk in np.array_split(groups, parts)]


def _phase(costs: Costs, lengths: np.ndarray, kept: np.ndarray, parts: int, group: int,
           prompt_tokens: float) -> tuple[float, float, float, float]:
    """(slowest generation, summed generation, slowest training, summed training) seconds of one step on `parts`
    devices of each kind: generating `lengths`, training on the `kept` ones."""
    gen = [costs.generation_s(s) for s in _shares(lengths, parts, group)]
    train = [costs.training_s(float(s.sum()) + prompt_tokens * s.size) for s in _shares(kept, parts, group)]
    return max(gen), sum(gen), max(train), sum(train)


def simulate(placement: Placement, costs: Costs, lengths: Sequence[np.ndarray], group: int, prompt_tokens: float,
             kept: Optional[Sequence[np.ndarray]] = None) -> dict[str, float]:
    """Run the schedule (module doc) over steps whose generated response lengths are `lengths` (one array [n] per
    step, n a multiple of `group`) and whose trained ones are `kept` (default: all; fewer under dynamic sampling);
    `prompt_tokens` per response. Returns step_s, samples_per_s (generated), idle_fraction, wall_s."""
    steps = len(lengths)
    samples = sum(int(step.size) for step in lengths)
    kept = lengths if kept is None else kept
    if placement.mode == "colocated":
        wall = busy = 0.0
        for step, train in zip(lengths, kept):
            gen_max, gen_sum, train_max, train_sum = _phase(costs, step, train, placement.devices, group, prompt_tokens)
            wall += gen_max + train_max
            busy += gen_sum + train_sum
    else:
        rollout, trainers = placement.rollout_devices, placement.devices - placement.rollout_devices
        rolled, trained = np.zeros(steps), np.zeros(steps)
        busy = 0.0
        for t, (step, train) in enumerate(zip(lengths, kept)):
            gen_max, gen_sum, _, _ = _phase(costs, step, train, rollout, group, prompt_tokens)
            _, _, train_max, train_sum = _phase(costs, step, train, trainers, group, prompt_tokens)
            version = max(0, t - placement.k)
            weights_at = 0.0 if version == 0 else trained[version - 1]
            rolled[t] = max(rolled[t - 1] if t else 0.0, weights_at) + gen_max
            publish = costs.sync_s if t + 1 <= max(0, steps - 1 - placement.k) else 0.0  # a later batch needs it
            trained[t] = max(trained[t - 1] if t else 0.0, rolled[t]) + train_max + publish
            busy += gen_sum + train_sum
        wall = float(trained[-1]) if steps else 0.0
    return {"step_s": wall / max(steps, 1), "samples_per_s": samples / wall if wall else 0.0,
            "idle_fraction": 1.0 - busy / (placement.devices * wall) if wall else 0.0, "wall_s": wall}


def fit_costs(rows: Sequence[dict[str, float]]) -> Costs:
    """Costs fitted by least squares to measured phases: each row has `decode_steps` (the longest response's
    tokens), `tokens` (generated), `generate_s`, and `train_tokens`, `train_s` of one device and step (the
    trainers' metrics: `rollout/decode_steps`, `response_length/mean` x responses, `time/generate`, `time/update`
    + `time/old_logprobs` + `time/reference`). Negative fitted terms are clipped to 0."""
    gen = np.array([[r["decode_steps"], r["tokens"]] for r in rows], dtype=float)
    gen_y = np.array([r["generate_s"] for r in rows], dtype=float)
    (step_s, token_s), *_ = np.linalg.lstsq(gen, gen_y, rcond=None)
    train = np.array([[1.0, r["train_tokens"]] for r in rows], dtype=float)
    train_y = np.array([r["train_s"] for r in rows], dtype=float)
    (fixed_s, train_token_s), *_ = np.linalg.lstsq(train, train_y, rcond=None)
    return Costs(decode_step_s=max(float(step_s), 0.0), token_s=max(float(token_s), 0.0),
                 train_token_s=max(float(train_token_s), 0.0), train_fixed_s=max(float(fixed_s), 0.0))
