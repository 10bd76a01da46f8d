"""`RolloutBatch`: one step's scored responses, the record every online algorithm reads and extends.

It lives beside the engine that fills it, below the trainers: the online trainers
(`megalign.trainers.online`) build it from the engine's output and the reward, and the algorithms add
their per-token tensors (old and reference log-probs, values, returns, advantages) to it.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch


@dataclasses.dataclass
class RolloutBatch:
    """N scored responses in whole groups of `group_size` adjacent members, and what the update adds.

    Shapes: `sequences` / `attention_mask` [N, P + R] (left-padded prompt, right-padded response);
    [N, R]: `response_mask` (fp32 1 for response tokens that train), `rollout_logp` (sampling
    log-probs), and later `old_logp`, `ref_logp`, `values`, `returns`, `advantages`; [N]: `lengths`
    (fp32 response tokens), `finished` (ended with EOS), `rewards` (fp32 total), `terms` {term: [N]
    values}, `group` (int64: the group, one prompt's G samples, of each response: numbered in the order
    the step sampled them); `token_rewards` [N, R] fp32: the process reward models' step rewards (None
    without any); `turn_rewards` [N, R] fp32: with multi-turn episodes and
    `rollout.env.reward_placement=per_turn`, each turn's environment reward at that turn's last policy token
    (0 elsewhere; already inside `rewards`, which stays the episode's total; None otherwise); `routing`
    [N, P + R, L, k] int16: an MoE actor's experts per token and MoE layer while sampling
    (`megalign.rollout.routing`, -1: none), what routing replay reuses (None when not recorded).
    """

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    rollout_logp: torch.Tensor
    lengths: torch.Tensor
    finished: torch.Tensor
    rewards: torch.Tensor
    terms: dict[str, torch.Tensor]
    group: torch.Tensor
    group_size: int
    old_logp: Optional[torch.Tensor] = None
    ref_logp: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    returns: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    token_rewards: Optional[torch.Tensor] = None
    turn_rewards: Optional[torch.Tensor] = None
    routing: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return self.rewards.numel()

    def placed_rewards(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(scores [N], per-token rewards [N, R] or None) for an algorithm with token-level credit (PPO's
        `megalign.algos.ppo.token_rewards`: the score at each row's last valid token, the per-token rewards added
        where they sit): `rewards` and the process rewards `token_rewards`; with `turn_rewards` (episodes, which
        have no process rewards) the turns' rewards where they sit and the rest of the total (the final-turn
        reward terms, after any shaping of `rewards`) at the last token."""
        if self.turn_rewards is None:
            return self.rewards, self.token_rewards
        return self.rewards - self.turn_rewards.sum(-1), self.turn_rewards

    def to(self, device) -> "RolloutBatch":
        """The batch with every tensor on `device` (rows sent between ranks travel on the CPU)."""
        def move(value):
            if isinstance(value, dict):
                return {t: v.to(device) for t, v in value.items()}
            return value.to(device) if isinstance(value, torch.Tensor) else value
        return RolloutBatch(**{f.name: move(getattr(self, f.name)) for f in dataclasses.fields(self)})

    def select(self, rows) -> "RolloutBatch":
        """The rows `rows` (indices, a slice or a bool mask) of every per-response tensor; whole groups stay whole
        only when `rows` picks whole groups (as `OnlineTrainer.collect` does)."""
        def pick(value):
            if isinstance(value, dict):
                return {t: v[rows] for t, v in value.items()}
            return value[rows] if isinstance(value, torch.Tensor) else value
        return RolloutBatch(**{f.name: pick(getattr(self, f.name)) for f in dataclasses.fields(self)})

    @staticmethod
    def concat(batches: list["RolloutBatch"]) -> "RolloutBatch":
        """Batches of one run (fixed shapes, one group size) concatenated along the response dim 0."""
        out = {}
        for f in dataclasses.fields(RolloutBatch):
            values = [getattr(b, f.name) for b in batches]
            if isinstance(values[0], dict):
                out[f.name] = {t: torch.cat([v[t] for v in values]) for t in values[0]}
            elif isinstance(values[0], torch.Tensor):
                out[f.name] = torch.cat(values)
            else:
                out[f.name] = values[0]
        return RolloutBatch(**out)
