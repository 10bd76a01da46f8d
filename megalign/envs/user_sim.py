"""A simulated user in the RLVER shape (Wang et al. 2025, arXiv 2507.03112), as a Python simulator.

RLVER trains a policy against a user simulator that keeps an emotion score e_t in [0, 100], updates it after
each assistant turn and writes the next user message; the dialogue ends early when e_t <= 0 and the reward is
e_T / 100. Replies follow the think-then-say template: `<think>...</think>` and then the visible reply; a
reply that breaks it scores 0, and the thinking part is never shown to the user.

`ArithmeticUser` is that shape with a hidden goal a tiny model can learn: the user wants a sum or product of
numbers computed (`row = {"numbers": [12, 7, 5], "op": "+"}`) but reveals one number per message. After each
assistant turn (its visible reply only; `answer: N` anywhere in it is an answer, the last one counts):

    format broken (no `<think>...</think>` first, an empty reply, or a second think tag)   e = 0 (ends, reward 0)
    numbers still hidden, no answer      e += reveal_bonus     and the next number is revealed
    numbers still hidden, an answer      e -= premature_penalty, and the next number is revealed
    all numbers known, correct answer    e += correct_bonus    and the user is done
    all numbers known, wrong answer      e -= wrong_penalty    "That is not right. Please check again."
    all numbers known, no answer         e -= stall_penalty    "Please just tell me the answer."

e is clipped to [0, 100] after each update and starts at `initial_score`; e <= 0 ends the dialogue. The turn
that ends the episode earns e_T / 100, every other turn 0; an episode the rollout truncates (turn or token
limits) earns the score it reached (`finish`). Deterministic: the seed is kept but not needed.
"""
from __future__ import annotations

import math
import re
from typing import Any, Mapping, Optional

from .base import Environment, StepResult

THINK_SAY = re.compile(r"\s*<think>(.*?)</think>(.*)", re.DOTALL)
ANSWER = re.compile(r"answer\s*[:=]\s*(-?\d+)", re.IGNORECASE)
_OPS = {"+": ("sum", sum), "*": ("product", math.prod)}


def split_think_say(turn: str) -> Optional[tuple[str, str]]:
    """(thought, visible reply) of a turn in the think-then-say format, or None when it breaks it: the turn must
    open with `<think>`, close it once, and follow it with a non-empty reply holding no further think tag."""
    match = THINK_SAY.fullmatch(turn)
    if match is None:
        return None
    thought, reply = match.group(1), match.group(2).strip()
    if not reply or "<think>" in reply or "</think>" in reply or "<think>" in thought:
        return None
    return thought, reply


class ArithmeticUser(Environment):
    """The simulated user of the module doc; `scores` holds e_0, e_1, ... of the current episode."""

    def __init__(self, initial_score: float = 50.0, reveal_bonus: float = 5.0, premature_penalty: float = 20.0,
                 correct_bonus: float = 40.0, wrong_penalty: float = 30.0, stall_penalty: float = 10.0):
        if not 0 < initial_score <= 100:
            raise ValueError(f"initial_score must be in (0, 100], got {initial_score}")
        for name, value in (("reveal_bonus", reveal_bonus), ("premature_penalty", premature_penalty),
                            ("correct_bonus", correct_bonus), ("wrong_penalty", wrong_penalty),
                            ("stall_penalty", stall_penalty)):
            if not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        self.initial_score, self.reveal_bonus, self.premature_penalty = initial_score, reveal_bonus, premature_penalty
        self.correct_bonus, self.wrong_penalty, self.stall_penalty = correct_bonus, wrong_penalty, stall_penalty
        self.numbers: list[int] = []
        self.revealed = 0
        self.scores: list[float] = []

    @property
    def score(self) -> float:
        return self.scores[-1]

    @property
    def goal(self) -> int:
        return _OPS[self.op][1](self.numbers)

    def reset(self, row: Mapping[str, Any], seed: int) -> list[dict]:
        if not isinstance(row, Mapping):
            raise ValueError(f"ArithmeticUser rows must be mappings with 'numbers' and 'op', got {type(row).__name__}")
        numbers, op = row.get("numbers"), row.get("op", "+")
        if not isinstance(numbers, (list, tuple)) or not numbers or not all(
                isinstance(n, int) and not isinstance(n, bool) for n in numbers):
            raise ValueError(f"ArithmeticUser row needs 'numbers', a non-empty list of integers, got {numbers!r}")
        if op not in _OPS:
            raise ValueError(f"ArithmeticUser row 'op' must be one of {sorted(_OPS)}, got {op!r}")
        self.numbers, self.op, self.seed = list(numbers), op, seed
        self.revealed = 1
        self.scores = [float(self.initial_score)]
        more = " I will tell you them one at a time." if len(numbers) > 1 else ""
        return [{"role": "user", "content": f"Please help me compute the {_OPS[op][0]} of some numbers.{more} "
                                            f"The first number is {numbers[0]}."}]

    def _next_number(self) -> str:
        self.revealed += 1
        last = " That is the last one." if self.revealed == len(self.numbers) else ""
        return f"The next number is {self.numbers[self.revealed - 1]}.{last}"

    def step(self, conversation: list[dict], turn: str) -> StepResult:
        parts = split_think_say(turn)
        if parts is None:
            return self._update(-self.score, None, {"format_errors": 1})
        answers = ANSWER.findall(parts[1])  # the visible reply only: the thinking part is hidden from the user
        answer = int(answers[-1]) if answers else None
        if self.revealed < len(self.numbers):
            if answer is None:
                return self._update(self.reveal_bonus, self._next_number(), {})
            return self._update(-self.premature_penalty, "Wait, I have not told you everything. " + self._next_number(),
                                {"premature_answers": 1})
        if answer == self.goal:
            return self._update(self.correct_bonus, None, {"solved": 1})
        if answer is None:
            return self._update(-self.stall_penalty, "Please just tell me the answer.", {})
        return self._update(-self.wrong_penalty, "That is not right. Please check again.", {"wrong_answers": 1})

    def _update(self, change: float, message: Optional[str], info: dict) -> StepResult:
        """Move e by `change` (clipped to [0, 100]); the dialogue ends without a `message` or at e <= 0."""
        self.scores.append(min(100.0, max(0.0, self.score + change)))
        done = message is None or self.score <= 0
        reward = self.score / 100 if done else 0.0
        observation = () if done else [{"role": "user", "content": message}]
        return StepResult(observation, reward, done, {"format_ok": 0 if "format_errors" in info else 1, **info})

    def finish(self, conversation: list[dict], reason: str) -> float:
        return self.score / 100
