"""GRPO and its DAPO / Dr. GRPO variants on the online trainer (`megalign.trainers.online`): `train_grpo(cfg)`.

One step (every rank, after `megalign.trainers.cli.init_distributed`):

    sample prompts -> actor generates G responses each -> reward role scores them -> [overlong
    penalty] -> [dynamic sampling: drop groups of equal rewards, generate more rounds] -> old
    log-probs (from the rollout, or recomputed) -> reference log-probs (only with a KL, `algo.kl_coef` > 0,
    in the loss or, for the reinforce_plus_plus* estimators, in the reward; otherwise the reference role does
    not exist) -> advantages
    (`algo.advantage`, one of `megalign.algos.advantages.ADVANTAGE_ESTIMATORS`: grpo, dr_grpo, rloo,
    reinforce_plus_plus, reinforce_plus_plus_baseline) -> ppo_epochs x mini-batches of the policy
    loss (`algo.policy_loss`: ppo, cispo, gspo; `megalign.algos.policy_loss_options`, shared with PPO
    through `megalign.trainers.policy_gradient`) + loss aggregation -> metrics (then checkpoint / eval cadence
    from the skeleton). `GRPOTrainer` fills in the online step template: `shape_rewards`, `advantages`,
    `update`, `metrics`; `keep_groups` and `sampling_rounds` are dynamic sampling's, shared with PPO
    (`megalign.trainers.dynamic_sampling`).

Design choices:

- Losses are normalised by mini-batch counts all-reduced over dp and gradients are summed
  (`megalign.algos.aggregation`); every mini-batch runs its collectives on every rank, with empty parts
  skipped, since ranks may hold different numbers of kept groups.
- A step whose loss or gradient norm is non-finite on any rank skips that update (warned and
  counted as `nan_skips`); a step where dynamic sampling kept no informative group on any rank
  skips its updates (warned and counted as `empty_updates`): an optimizer step on zero gradients
  would still move AdamW's weights through its momentum.
- Held-out accuracy (greedy, `eval.metric`) is measured before training, every `eval.every` steps
  and at the end; the run ends with a before/after table.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Literal

import torch

from megalign.algos.advantages import ADVANTAGE_ESTIMATORS, estimator
from megalign.algos.grpo import overlong_mask, overlong_penalty
from megalign.algos.policy_loss_options import PolicyLossOptions
from megalign.algos.registry import algorithm_option
from megalign.config import option, set_defaults
from megalign.rollout import RolloutBatch
from megalign.trainers.base import MetricSums, TrainResult
from megalign.trainers.dynamic_sampling import DynamicSampling, DynamicSamplingOptions
from megalign.trainers.online import OnlineTrainer
from megalign.trainers.online_config import OnlineConfig, UpdateSchedule
from megalign.trainers.policy_gradient import PolicyGradient

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class AlgoConfig(PolicyLossOptions, DynamicSamplingOptions, UpdateSchedule):
    """The objective: the update schedule, policy loss and KL (shared with PPO), advantages, dynamic sampling,
    overlong handling."""

    advantage: str = option("grpo", doc=f"advantage estimator: {', '.join(ADVANTAGE_ESTIMATORS)}")
    advantage_eps: float = option(1e-6, doc="added to the group std (grpo mode)")
    gamma: float = option(1.0, doc="reinforce_plus_plus*: discount of the returns G_t = r_t + gamma G_t+1")
    overlong: Literal["none", "mask", "penalty"] = option(
        "none", doc="responses cut at max_response_length: keep, mask out of the loss, or DAPO's soft length penalty")
    overlong_buffer: int = option(4, doc="penalty: tokens before the limit over which the penalty ramps to -1")

    def __post_init__(self):
        UpdateSchedule.__post_init__(self)
        self.check_policy_loss(token_rewards=estimator(self.advantage).token_kl)
        self.check_dynamic_sampling()
        if not 0 <= self.gamma <= 1:
            raise ValueError(f"gamma must be in [0, 1], got {self.gamma}")
        if self.overlong_buffer < 1:
            raise ValueError(f"overlong_buffer must be >= 1, got {self.overlong_buffer}")

    @property
    def uses_reference(self) -> bool:
        """Whether a run builds the reference: any KL, in the loss or the reward (the registry reads this too)."""
        return self.kl_beta > 0


@dataclasses.dataclass
@set_defaults(run_dir="runs/grpo_arith", steps=60, save_every=20)
class GRPOConfig(OnlineConfig):
    """One GRPO run (`launch/train_grpo.py --config ... key.sub=value`)."""

    algorithm: Literal["grpo"] = algorithm_option("grpo")
    algo: AlgoConfig = option(AlgoConfig(), doc="objective")


class GRPOTrainer(DynamicSampling, PolicyGradient, OnlineTrainer):
    """GRPO on the online trainer (module doc)."""

    name = "GRPO"

    def needs_reference(self) -> bool:
        return self.cfg.algo.uses_reference

    def shape_rewards(self, batch: RolloutBatch) -> None:
        algo = self.cfg.algo
        if algo.overlong == "penalty":
            batch.rewards = batch.rewards + overlong_penalty(batch.lengths, self.cfg.rollout.max_response_length,
                                                             algo.overlong_buffer)
        elif algo.overlong == "mask":
            batch.response_mask = overlong_mask(batch.response_mask, batch.finished)

    def advantages(self, batch: RolloutBatch) -> None:
        algo = self.cfg.algo
        in_reward = algo.kl_where == "reward" and self.reference is not None
        batch.advantages = estimator(algo.advantage).fn(
            batch.rewards, batch.response_mask, batch.group_size, eps=algo.advantage_eps,
            logp=batch.old_logp if in_reward else None, ref_logp=batch.ref_logp if in_reward else None,
            kl_coef=algo.kl_beta, kl_estimator=algo.kl_kind, gamma=algo.gamma, group=self.layout.dp_group)

    def update(self, batch: RolloutBatch, sums: MetricSums, counts: dict[str, float]) -> dict[str, list[torch.Tensor]]:
        skip = self.sampling_sums(sums, counts)
        return {"actor": self.update_actor(batch, sums, self.policy_loss(batch, self.cfg.algo.kl_beta), skip)}

    def metrics(self, total: dict[str, float], norms: dict[str, list[torch.Tensor]],
                counts: dict[str, float]) -> dict[str, float]:
        return {**self.sampling_metrics(total, counts), **self.policy_metrics(total, norms["actor"], self.lr())}


def train_grpo(cfg: GRPOConfig) -> TrainResult:
    """Run GRPO as configured; every rank calls it after `init_distributed`."""
    return GRPOTrainer(cfg).train()
