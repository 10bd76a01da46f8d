"""Small deterministic environments for the multi-turn trainer tests (`tests/trainers/test_multiturn_trainer.py`),
loaded by the trainers as `path/to/multiturn_envs.py:Class`."""
from megalign.envs.base import Environment, StepResult

OBSERVATION = " ok: "
"""Every observation: a fixed text (5 characters, 5 tokens of the character tokenizer)."""


def digit_share(text):
    return sum(ch.isdigit() for ch in text) / max(1, len(text))


class DigitEnv(Environment):
    """The prompt as text; turn k earns the fraction of its characters that are digits; each turn is answered with
    OBSERVATION; done after `turns` turns (the episode's reward: the sum)."""

    def __init__(self, turns=2):
        self.turns = turns

    def reset(self, row, seed):
        self.k = 0
        return row["prompt"]

    def step(self, conversation, turn):
        self.k += 1
        return StepResult(OBSERVATION, digit_share(turn), self.k >= self.turns, {"digits": sum(c.isdigit() for c in turn)})


class FlakyEnv(DigitEnv):
    """DigitEnv whose `where` method ("step" or "reset") raises in the episodes whose seed is in the `fraction` share
    of seeds (seed % 100 < 100 * fraction): 1.0 raises in every episode."""

    def __init__(self, turns=2, fraction=1.0, where="step"):
        super().__init__(turns)
        self.fraction, self.where = fraction, where

    def check(self, where):
        if where == self.where and self.seed % 100 < 100 * self.fraction:
            raise RuntimeError("the environment broke")

    def reset(self, row, seed):
        self.seed = seed
        self.check("reset")
        return super().reset(row, seed)

    def step(self, conversation, turn):
        self.check("step")
        return super().step(conversation, turn)
