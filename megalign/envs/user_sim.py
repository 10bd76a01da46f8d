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
    numbers still hidden, an answer      e -= premature_penalty, and the next number is revealed ("Wait, ...")
    all numbers known, correct answer    e += correct_bonus    and the user is done
    all numbers known, wrong answer      e -= wrong_penalty    "That is wrong. Check again."
    all numbers known, no answer         e -= stall_penalty    "Just tell me the answer."

e is clipped to [0, 100] after each update and starts at `initial_score`; e <= 0 ends the dialogue. The turn
that ends the episode earns e_T / 100, every other turn 0; an episode the rollout truncates (turn or token
limits) earns the score it reached (`finish`). Deterministic: the seed is kept but not needed.

The user's messages are short ("Add up my numbers; I will tell you one at a time. First: 12.", "Next: 7.",
"Last: 5.") because the embedded demonstration's policy is a character-level model: every character is a token
of the episode. In a trainer the row's extra columns arrive under `metadata` (`megalign.data.prompts`), so
`reset` reads `numbers` / `op` from the row or from `row["metadata"]`. `answer_accuracy` is the matching
`eval.metric`: 1 when the last `answer: N` of a turn's visible reply is the row's answer.
"""
from __future__ import annotations

import math
import re
from typing import Any, Mapping, Optional

from .base import Environment, StepResult

THINK_SAY = re.compile(r"\s*<think>(.*?)</think>(.*)", re.DOTALL)
ANSWER = re.compile(r"answer\s*[:=]\s*(-?\d+)", re.IGNORECASE)
_OPS = {"+": ("Add up", sum), "*": ("Multiply", math.prod)}


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
            raise ValueError(f"ArithmeticUser rows must be mappings with 'numbers' and 'op' (or a 'metadata' mapping "
                             f"holding them), got {type(row).__name__}")
        fields = row if "numbers" in row else row.get("metadata") or {}
        numbers, op = fields.get("numbers"), fields.get("op", "+")
        if not isinstance(numbers, (list, tuple)) or not numbers or not all(
                isinstance(n, int) and not isinstance(n, bool) for n in numbers):
            raise ValueError(f"ArithmeticUser row needs 'numbers', a non-empty list of integers, got {numbers!r}")
        if op not in _OPS:
            raise ValueError(f"ArithmeticUser row 'op' must be one of {sorted(_OPS)}, got {op!r}")
        self.numbers, self.op, self.seed = list(numbers), op, seed
        self.revealed = 1
        self.scores = [float(self.initial_score)]
        first = "; I will tell you one at a time. First" if len(numbers) > 1 else ". The only one"
        return [{"role": "user", "content": f"{_OPS[op][0]} my numbers{first}: {numbers[0]}."}]

    def _next_number(self) -> str:
        self.revealed += 1
        which = "Last" if self.revealed == len(self.numbers) else "Next"
        return f"{which}: {self.numbers[self.revealed - 1]}."

    def step(self, conversation: list[dict], turn: str) -> StepResult:
        if split_think_say(turn) is None:
            return self._update(-self.score, None, {"format_errors": 1})
        answer = visible_answer(turn)  # the visible reply only: the thinking part is hidden from the user
        if self.revealed < len(self.numbers):
            if answer is None:
                return self._update(self.reveal_bonus, self._next_number(), {})
            return self._update(-self.premature_penalty, "Wait, there is more. " + self._next_number(),
                                {"premature_answers": 1})
        if answer == self.goal:
            return self._update(self.correct_bonus, None, {"solved": 1})
        if answer is None:
            return self._update(-self.stall_penalty, "Just tell me the answer.", {})
        return self._update(-self.wrong_penalty, "That is wrong. Check again.", {"wrong_answers": 1})

    def _update(self, change: float, message: Optional[str], info: dict) -> StepResult:
        """Move e by `change` (clipped to [0, 100]); the dialogue ends without a `message` or at e <= 0."""
        self.scores.append(min(100.0, max(0.0, self.score + change)))
        done = message is None or self.score <= 0
        reward = self.score / 100 if done else 0.0
        observation = () if done else [{"role": "user", "content": message}]
        return StepResult(observation, reward, done, {"format_ok": 0 if "format_errors" in info else 1, **info})

    def finish(self, conversation: list[dict], reason: str) -> float:
        return self.score / 100


def visible_answer(turn: str) -> Optional[int]:
    """The last `answer: N` of the visible reply of a think-then-say turn; None when the turn breaks the format or
    gives no answer (the thinking part is never read)."""
    parts = split_think_say(turn)
    answers = ANSWER.findall(parts[1]) if parts is not None else []
    return int(answers[-1]) if answers else None


def answer_accuracy(prompt: str, response: str, answer: Any, metadata: Mapping[str, Any]) -> float:
    """`eval.metric` of the simulated-user runs (a user reward function): 1.0 when the last turn's visible
    `answer: N` equals the row's `answer`, else 0.0."""
    given = visible_answer(response)
    return float(given is not None and str(given) == str(answer).strip())
