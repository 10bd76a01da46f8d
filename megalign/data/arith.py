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
right from the train one is the kind of generalisation we want to measure). A large task (e.g.
`max_operand=999` with `*`: a million problems) sets `num_problems`: that many distinct problems are
drawn by index (`Generator.choice` without replacement, never enumerating the rest) and the first
drawn are held out, so the prompt files stay a few thousand rows and train and held-out stay disjoint.

Offline alignment data comes from the same problems (give it `make_splits(cfg)[0]`, the training
split). A pair's rejected answer and a stepwise row are fixed by (seed, problem) whatever list the
problem comes in; the unpaired labels by the seed and the list:

- preference pairs (`preference_rows`, `write_preference_jsonl`): chosen is the SFT response
  `\\boxed{answer}`, rejected a wrong answer in the same format (`wrong_answer`): with probability
  1/2 a wrong-operator slip (`a op' b` for another of + - *, when that differs from the answer),
  otherwise, and when no slip differs, the answer off by a nonzero offset in -3..3.
  `margin = log1p(|wrong - right|)` (`preference_margin`): at least log 2 for an off-by-one, at most
  log1p(max(3, max_operand**2)), since a slip is off by at most max_operand**2 (a*b against a-b at
  a = b = max_operand).
- unpaired KTO rows (`unpaired_rows`, `write_unpaired_jsonl`): one row per problem, desirable (the
  correct response) for ceil(N/2) of N problems chosen by a permutation seeded by `seed`, otherwise
  undesirable with the pair's rejected answer; so n_D / n_U is 1 for even N and within KTO's
  recommended [1, 4/3] for every N >= 6 at unit weights.
- stepwise PRM rows (`ArithChain`, `make_chain_splits`, `stepwise_rows`, `write_stepwise_jsonl`):
  expressions of several operations such as `3+4*2-1=`, solved one operation per step with `*`
  before `+` and `-` and each left to right ("4*2=8", "3+8=11", "11-1=10"), then "\\boxed{10}".
  A corrupted solution gets a wrong result (off by a nonzero offset) at operation step k and
  carries it on faithfully; its hard labels are True before k and False from k on, the boxed step
  included. `make_chain_splits` draws operands from 1..max_operand (no 0): the error of step k
  then reaches the final answer unchanged through `+` and `-` and multiplied, through each later
  `*`, by its other operand, a product of operands and so at least 1; a corrupted solution always
  ends with a wrong answer. `stepwise_rows` keeps a corrupted product >= 0, so no step reads `5--1`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import operator
import os
from typing import Literal, Optional, Sequence

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
    held_out_fraction: float = option(0.2, doc="fraction of the problems held out for evaluation")
    seed: int = option(0, doc="seed of the train/held-out split (and of the draw with num_problems)")
    num_problems: Optional[int] = option(None, doc="distinct problems to draw, train and held out together (the "
                                                   "first drawn are held out); null: every problem")

    def __post_init__(self):
        if self.max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {self.max_operand}")
        if not self.ops or len(set(self.ops)) != len(self.ops):
            raise ValueError(f"ops must be non-empty and distinct, got {self.ops}")
        if not 0.0 < self.held_out_fraction < 1.0:
            raise ValueError(f"held_out_fraction must be in (0, 1), got {self.held_out_fraction}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        possible = len(self.ops) * (self.max_operand + 1) ** 2
        if self.num_problems is not None and not (isinstance(self.num_problems, int)
                                                  and 2 <= self.num_problems <= possible):
            raise ValueError(f"num_problems must be null or an integer in [2, {possible}] (the distinct problems of "
                             f"max_operand={self.max_operand}, ops={self.ops}), got {self.num_problems!r}")
        n = possible if self.num_problems is None else self.num_problems
        if _held_out_count(self.held_out_fraction, n) >= n:
            raise ValueError(f"held_out_fraction={self.held_out_fraction} of {n} problems leaves no training problem")


def _held_out_count(fraction: float, n: int) -> int:
    return max(1, round(fraction * n))


def make_splits(cfg: ArithTaskConfig) -> tuple[list[ArithProblem], list[ArithProblem]]:
    """(train, held_out): every problem of `cfg` exactly once, split by a fixed-seed shuffle; with
    `num_problems`, that many distinct problems drawn with `seed` (the first drawn held out).

    A problem's index enumerates op, then a, then b (`op_index * side**2 + a * side + b`, side =
    max_operand + 1); only the chosen indices become problems."""
    side = cfg.max_operand + 1
    rng = np.random.default_rng(cfg.seed)
    total = len(cfg.ops) * side * side
    if cfg.num_problems is None:
        order = rng.permutation(total)
    else:
        order = rng.choice(total, size=cfg.num_problems, replace=False)
    problems = [ArithProblem(int(i) // side % side, cfg.ops[int(i) // (side * side)], int(i) % side) for i in order]
    n_held_out = _held_out_count(cfg.held_out_fraction, len(problems))
    return problems[n_held_out:], problems[:n_held_out]


def write_jsonl(problems: Sequence[ArithProblem], path: str | os.PathLike) -> None:
    """Write prompt rows (`prompt`, `answer`, and the SFT `response`, kept as metadata) atomically.

    The same file feeds the GRPO prompt loader (`load_prompts`) and the SFT stage.
    """
    rows = ({"prompt": p.prompt, "answer": p.answer, "response": p.response} for p in problems)
    atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in rows))


OFFSETS = (-3, -2, -1, 1, 2, 3)
"""The small slips of a wrong answer or a wrong intermediate result."""
_OP_INDEX = {"+": 0, "-": 1, "*": 2}


def _boxed(value: int) -> str:
    return f"\\boxed{{{value}}}"


def _check_seed(seed: int) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")


def wrong_answer(problem: ArithProblem, seed: int = 0) -> int:
    """A wrong answer near `problem`'s, fixed by (seed, problem): an operator slip or a small offset (module doc)."""
    _check_seed(seed)
    rng = np.random.default_rng([seed, problem.a, _OP_INDEX[problem.op], problem.b])
    right = problem.answer
    if rng.random() < 0.5:
        slips = sorted({apply(problem.a, problem.b) for op, apply in _APPLY.items() if op != problem.op} - {right})
        if slips:
            return int(rng.choice(slips))
    return right + int(rng.choice(OFFSETS))


def preference_margin(right: int, wrong: int) -> float:
    """log1p(|wrong - right|): how much worse a wrong answer is, for the reward model's margin (module doc)."""
    return math.log1p(abs(wrong - right))


def preference_rows(problems: Sequence[ArithProblem], seed: int = 0) -> list[dict]:
    """One pair per problem: `prompt`, `chosen` (the SFT response), `rejected`, `margin`, `answer` (module doc)."""
    rows = []
    for p in problems:
        wrong = wrong_answer(p, seed)
        rows.append({"prompt": p.prompt, "chosen": p.response, "rejected": _boxed(wrong),
                     "margin": preference_margin(p.answer, wrong), "answer": p.answer})
    return rows


_UNPAIRED_STREAM = 0x4B544F  # "KTO"


def unpaired_rows(problems: Sequence[ArithProblem], seed: int = 0) -> list[dict]:
    """One KTO row per problem: `prompt`, `completion`, `label`, `answer`; ceil(N/2) desirable (module doc)."""
    _check_seed(seed)
    # a stream of its own: `PromptSampler` shuffles with default_rng(seed), and the same permutation here
    # would put every desirable row in the first half of each epoch's order
    rng = np.random.default_rng([seed, _UNPAIRED_STREAM])
    desirable = set(rng.permutation(len(problems))[:(len(problems) + 1) // 2].tolist())
    return [{"prompt": p.prompt, "completion": p.response if i in desirable else _boxed(wrong_answer(p, seed)),
             "label": i in desirable, "answer": p.answer} for i, p in enumerate(problems)]


@dataclasses.dataclass(frozen=True)
class ArithChain:
    """An expression of several operations, e.g. operands (3, 4, 2, 1) and ops ("+", "*", "-") for `3+4*2-1`."""

    operands: tuple[int, ...]
    ops: tuple[Op, ...]

    def __post_init__(self):
        if not self.ops or len(self.operands) != len(self.ops) + 1:
            raise ValueError(f"ArithChain: needs at least one op and one more operand than ops, got "
                             f"{len(self.operands)} operands and {len(self.ops)} ops")
        if any(op not in _APPLY for op in self.ops):
            raise ValueError(f"ArithChain: ops must be + - *, got {self.ops}")

    @property
    def prompt(self) -> str:
        return "".join(f"{a}{op}" for a, op in zip(self.operands, self.ops)) + f"{self.operands[-1]}="

    @property
    def answer(self) -> int:
        return solve_chain(self)[-1][3]

    @property
    def response(self) -> str:
        """The correct step-by-step solution, steps joined by newlines (the stepwise separator)."""
        return "\n".join(chain_steps(self))


def solve_chain(chain: ArithChain, wrong_step: int | None = None, offset: int = 0) -> list[tuple[int, Op, int, int]]:
    """(left, op, right, result) per operation in evaluation order: `*` first, then `+` `-`, each left to right.

    With `wrong_step` k, the result of operation k is off by `offset` and later steps compute from it.
    """
    values, ops, steps = list(chain.operands), list(chain.ops), []
    while ops:
        i = ops.index("*") if "*" in ops else 0
        result = _APPLY[ops[i]](values[i], values[i + 1]) + (offset if len(steps) == wrong_step else 0)
        steps.append((values[i], ops[i], values[i + 1], result))
        values[i:i + 2] = [result]
        del ops[i]
    return steps


def _render(steps: list[tuple[int, Op, int, int]]) -> list[str]:
    return [f"{a}{op}{b}={r}" for a, op, b, r in steps] + [_boxed(steps[-1][3])]


def chain_steps(chain: ArithChain) -> list[str]:
    """The correct solution's steps: one per operation, then the boxed answer."""
    return _render(solve_chain(chain))


def corrupt_chain_steps(chain: ArithChain, wrong_step: int, offset: int) -> tuple[list[str], list[bool]]:
    """(steps, hard labels) of a solution whose operation `wrong_step` is off by `offset` (module doc).

    Labels are True for the steps before `wrong_step` and False from it on, the boxed answer included.
    """
    if not 0 <= wrong_step < len(chain.ops):
        raise ValueError(f"wrong_step must be in [0, {len(chain.ops)}), got {wrong_step}")
    if offset == 0:
        raise ValueError("offset must be nonzero: a zero offset corrupts nothing")
    steps = _render(solve_chain(chain, wrong_step, offset))
    return steps, [k < wrong_step for k in range(len(steps))]


@dataclasses.dataclass
class ArithChainConfig:
    """Size and split of the multi-step arithmetic task for process reward models (module doc)."""

    min_ops: int = option(2, doc="fewest operations in an expression")
    max_ops: int = option(3, doc="most operations in an expression")
    max_operand: int = option(9, doc="operands are drawn from 1..max_operand inclusive (no 0, see module doc)")
    ops: list[Op] = option(["+", "-", "*"], doc="operators to use")
    num_problems: int = option(2000, doc="distinct expressions to draw, train and held out together")
    held_out_fraction: float = option(0.2, doc="fraction of the expressions held out for evaluation")
    seed: int = option(0, doc="seed of the draw (the first ones drawn are held out)")

    def __post_init__(self):
        if not 1 <= self.min_ops <= self.max_ops:
            raise ValueError(f"need 1 <= min_ops <= max_ops, got min_ops={self.min_ops}, max_ops={self.max_ops}")
        if self.max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {self.max_operand}")
        if not self.ops or len(set(self.ops)) != len(self.ops) or any(op not in _APPLY for op in self.ops):
            raise ValueError(f"ops must be non-empty and distinct, from + - *, got {self.ops}")
        if not 0.0 < self.held_out_fraction < 1.0:
            raise ValueError(f"held_out_fraction must be in (0, 1), got {self.held_out_fraction}")
        _check_seed(self.seed)
        possible = sum(self.max_operand ** (n + 1) * len(self.ops) ** n for n in range(self.min_ops, self.max_ops + 1))
        if not 2 <= self.num_problems <= possible:
            raise ValueError(f"num_problems must be in [2, {possible}] (the distinct expressions of this config), "
                             f"got {self.num_problems}")
        if _num_held_out(self) >= self.num_problems:
            raise ValueError(f"held_out_fraction={self.held_out_fraction} of {self.num_problems} leaves no training "
                             "expression")


def _num_held_out(cfg: ArithChainConfig) -> int:
    return max(1, round(cfg.held_out_fraction * cfg.num_problems))


def make_chain_splits(cfg: ArithChainConfig) -> tuple[list[ArithChain], list[ArithChain]]:
    """(train, held_out): `num_problems` distinct expressions drawn with `seed`; the first drawn are held out."""
    rng = np.random.default_rng(cfg.seed)
    drawn: dict[ArithChain, None] = {}
    while len(drawn) < cfg.num_problems:
        n = int(rng.integers(cfg.min_ops, cfg.max_ops + 1))
        operands = tuple(int(x) for x in rng.integers(1, cfg.max_operand + 1, size=n + 1))
        ops = tuple(cfg.ops[int(i)] for i in rng.integers(len(cfg.ops), size=n))
        drawn.setdefault(ArithChain(operands, ops))
    chains = list(drawn)
    return chains[_num_held_out(cfg):], chains[:_num_held_out(cfg)]


def stepwise_rows(chains: Sequence[ArithChain], seed: int = 0, corrupt_fraction: float = 0.5) -> list[dict]:
    """One stepwise row per expression: `prompt`, `completions` (steps), `labels` (hard), `answer`.

    Each row is fixed by (seed, expression): corrupted with probability `corrupt_fraction`, at a step
    drawn uniformly from the operations, by an offset from OFFSETS (for a product, one that keeps it >= 0).
    """
    _check_seed(seed)
    if not 0.0 <= corrupt_fraction <= 1.0:
        raise ValueError(f"corrupt_fraction must be in [0, 1], got {corrupt_fraction}")
    rows = []
    for chain in chains:
        rng = np.random.default_rng([seed, *chain.operands, *(_OP_INDEX[op] for op in chain.ops)])
        if rng.random() < corrupt_fraction:
            k = int(rng.integers(len(chain.ops)))
            _, op, _, result = solve_chain(chain)[k]
            offsets = [d for d in OFFSETS if op != "*" or result + d >= 0]
            steps, labels = corrupt_chain_steps(chain, k, int(rng.choice(offsets)))
        else:
            steps = chain_steps(chain)
            labels = [True] * len(steps)
        rows.append({"prompt": chain.prompt, "completions": steps, "labels": labels, "answer": chain.answer})
    return rows


def _write_rows(rows: Sequence[dict], path: str | os.PathLike) -> None:
    atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in rows))


def write_preference_jsonl(problems: Sequence[ArithProblem], path: str | os.PathLike, seed: int = 0) -> None:
    """Write `preference_rows` atomically, for `load_preferences`."""
    _write_rows(preference_rows(problems, seed), path)


def write_unpaired_jsonl(problems: Sequence[ArithProblem], path: str | os.PathLike, seed: int = 0) -> None:
    """Write `unpaired_rows` atomically, for `load_unpaired`."""
    _write_rows(unpaired_rows(problems, seed), path)


def write_stepwise_jsonl(chains: Sequence[ArithChain], path: str | os.PathLike, seed: int = 0,
                         corrupt_fraction: float = 0.5) -> None:
    """Write `stepwise_rows` atomically, for `load_stepwise`."""
    _write_rows(stepwise_rows(chains, seed, corrupt_fraction), path)
