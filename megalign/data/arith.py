"""The embedded default task: small integer arithmetic, generated in code, verifiable exactly.

A problem is `a op b` with `a, b` in [0, max_operand] and `op` in + - *. The prompt is the bare
expression `"12+7="`; the answer is the integer result (negative for some differences); the SFT
target and the format the reward verifies is `"\\boxed{19}"` (read by the `math_accuracy` reward,
`megalign.rewards.math`).

Why this difficulty (defaults max_operand=20, ops "+-*"; 3 * 21 * 21 = 1323 problems, 265 held out):

- It must be learnable *partially* by a tiny character-level model in well under a minute of CPU
  SFT, and leave room for GRPO to add 20+ points of held-out accuracy. Sums and differences of
  numbers up to 20 have a digit structure a small model picks up from ~1000 examples; products up to
  400 have to be largely memorised. After the short SFT the right answer is usually among the G
  samples even when the greedy one is wrong (held-out pass@16 ~69% against ~16% pass@1 at
  temperature 1), which is exactly the signal GRPO sharpens.
- The response is `\\boxed{N}`, not `<answer>N</answer>`: 11 tokens with EOS instead of 20, so
  sampling and the update are about twice as fast, and the loss is not spread over 17 characters of
  fixed format. Measured end to end on 2 CPU processes (`launch/run_embedded.sh`): SFT 300 steps
  18.1% held-out -> GRPO 300 steps 45.3% (+27.2 points) in under 4 minutes for both stages, where
  the `<answer>` format reached +14.3 in 8.5 minutes (numbers and settings in examples/*.yaml).
- Keep the warm start short: SFT run to 900 steps memorises the training split (75% train / 38%
  held-out with the `<answer>` format) and GRPO on the same prompts then adds only a few points.
- Raising `max_operand` or dropping `*` moves the task harder or easier without other changes.

The split is fixed by `seed`: all problems are enumerated, shuffled once and cut, so train and
held-out never share a problem (`3+4` and `4+3` are different problems: getting the held-out one
right from the train one is the kind of generalisation we want to measure).
"""
from __future__ import annotations

import dataclasses
import json
import operator
import os
from typing import Literal, Sequence

import numpy as np

from megalign.config import atomic_write_text, option

Op = Literal["+", "-", "*"]
_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@dataclasses.dataclass(frozen=True)
class ArithProblem:
    """One problem `a op b`."""

    a: int
    op: Op
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}{self.op}{self.b}="

    @property
    def answer(self) -> int:
        return _APPLY[self.op](self.a, self.b)

    @property
    def response(self) -> str:
        """The SFT target: the answer in the task's answer format."""
        return f"\\boxed{{{self.answer}}}"


@dataclasses.dataclass
class ArithTaskConfig:
    """Size and split of the arithmetic task (difficulty reasoning in `megalign.data.arith`)."""

    max_operand: int = option(20, doc="operands are drawn from 0..max_operand inclusive")
    ops: list[Op] = option(["+", "-", "*"], doc="operators to use")
    held_out_fraction: float = option(0.2, doc="fraction of all problems held out for evaluation")
    seed: int = option(0, doc="seed of the train/held-out split")

    def __post_init__(self):
        if self.max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {self.max_operand}")
        if not self.ops or len(set(self.ops)) != len(self.ops):
            raise ValueError(f"ops must be non-empty and distinct, got {self.ops}")
        if not 0.0 < self.held_out_fraction < 1.0:
            raise ValueError(f"held_out_fraction must be in (0, 1), got {self.held_out_fraction}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")


def make_splits(cfg: ArithTaskConfig) -> tuple[list[ArithProblem], list[ArithProblem]]:
    """(train, held_out): every problem of `cfg` exactly once, split by a fixed-seed shuffle."""
    problems = [
        ArithProblem(a, op, b)
        for op in cfg.ops
        for a in range(cfg.max_operand + 1)
        for b in range(cfg.max_operand + 1)
    ]
    order = np.random.default_rng(cfg.seed).permutation(len(problems))
    n_held_out = max(1, round(cfg.held_out_fraction * len(problems)))
    held_out = [problems[i] for i in order[:n_held_out]]
    train = [problems[i] for i in order[n_held_out:]]
    return train, held_out


def write_jsonl(problems: Sequence[ArithProblem], path: str | os.PathLike) -> None:
    """Write prompt rows (`prompt`, `answer`, and the SFT `response`, kept as metadata) atomically.

    The same file feeds the GRPO prompt loader (`load_prompts`) and the SFT stage.
    """
    rows = ({"prompt": p.prompt, "answer": p.answer, "response": p.response} for p in problems)
    atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in rows))
