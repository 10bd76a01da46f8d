"""Per-rank state of an online run that a checkpoint holds beside the models: the rollout and update generators and
the reward's error counters (`RankState`)."""
from __future__ import annotations

from typing import Any

import torch

from megalign.roles import Reward


class RankState:
    """Per-rank trainer state for the checkpoint: the rollout generator (engine seeds), the update generator
    (mini-batch order) and the reward error counters.

    Resumed on another dp size, a rank that has no saved entry keeps its fresh generator (seeded by
    seed and dp rank, as at step 0) and zero error counters; entries of ranks that no longer exist
    are not read, so the cumulative error counts restart from the remaining ranks' counts.
    """

    def __init__(self, rank: int, rollout_generator: torch.Generator, generator: torch.Generator, reward: Reward):
        self.key, self.rollout_generator, self.generator, self.reward = f"rank{rank}", rollout_generator, generator, reward

    def state_dict(self) -> dict[str, Any]:
        return {self.key: {"rollout_generator": self.rollout_generator.get_state(),
                           "generator": self.generator.get_state(), "reward": self.reward.state_dict()}}

    def load_target(self, name: str, saved) -> dict[str, Any]:
        """What to read from checkpoint `saved` (`megalign.checkpoint.state.Reshardable`): this rank's entry, if any."""
        return self.state_dict() if self.key in {k.split(".")[0] for k in saved.under(name)} else {}

    def load_state_dict(self, state) -> None:
        if not state:
            return  # a rank new to this dp size (class doc)
        self.rollout_generator.set_state(state[self.key]["rollout_generator"])
        self.generator.set_state(state[self.key]["generator"])
        self.reward.load_state_dict(state[self.key]["reward"])
