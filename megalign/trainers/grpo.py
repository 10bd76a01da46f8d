"""GRPO and its DAPO / Dr. GRPO variants on the online trainer (`megalign.trainers.online`): `train_grpo(cfg)`.

One step (every rank, after `megalign.trainers.cli.init_distributed`):

    sample prompts -> actor generates G responses each -> reward role scores them -> [overlong
    penalty] -> [dynamic sampling: drop groups of equal rewards, generate more rounds] -> old
    log-probs (from the rollout, or recomputed) -> reference log-probs (only when beta > 0 or the
    estimator puts the KL in the reward; otherwise the reference role does not exist) -> advantages
    (`algo.advantage`, one of `megalign.algos.advantages.ADVANTAGE_ESTIMATORS`: grpo, dr_grpo, rloo,
    reinforce_plus_plus, reinforce_plus_plus_baseline) -> ppo_epochs x mini-batches of the policy
    loss (`algo.policy_loss`: ppo, cispo, gspo; `megalign.algos.policy_loss_options`) + loss
    aggregation -> metrics (then checkpoint / eval cadence from the skeleton).

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
import time
from typing import Literal, Optional

import torch

from megalign.algos.advantages import ADVANTAGE_ESTIMATORS, estimator
from megalign.algos.aggregation import LOSS_AGGREGATIONS
from megalign.algos.grpo import informative_groups, overlong_mask, overlong_penalty
from megalign.algos.ppo import KL_IN_REWARD
from megalign.algos.policy_loss_options import PolicyLossOptions
from megalign.algos.registry import algorithm_option
from megalign.config import option
from megalign.parallel.collectives import all_reduce_count
from megalign.trainers.base import TrainResult
from megalign.trainers.online import OnlineConfig, OnlineTrainer, RolloutBatch
from megalign.trainers.optim import lr_at

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class AlgoConfig(PolicyLossOptions):
    """The objective: policy loss, clipping, KL, loss aggregation, advantages, dynamic sampling, overlong handling, epochs."""

    eps_low: float = option(0.2, doc="lower clip: ratio >= 1 - eps_low")
    eps_high: Optional[float] = option(None, doc="upper clip, ratio <= 1 + eps_high (DAPO's clip-higher, e.g. 0.28); null: eps_low")
    dual_clip: Optional[float] = option(None, doc="dual-clip bound c > 1 for negative advantages (Ye et al. 2020); null: off")
    beta: float = option(0.0, doc="k3 KL coefficient against the reference (a loss term); 0 with no reward KL skips the reference role")
    loss_agg: str = option("token-mean", doc=f"loss aggregation: {', '.join(LOSS_AGGREGATIONS)}")
    advantage: str = option("grpo", doc=f"advantage estimator: {', '.join(ADVANTAGE_ESTIMATORS)}")
    advantage_eps: float = option(1e-6, doc="added to the group std (grpo mode)")
    kl_coef: float = option(0.01, doc="reinforce_plus_plus*: -kl_coef * KL_t in the per-token reward (OpenRLHF's "
                                      "default); 0: no reference for it; the group estimators ignore it")
    kl_estimator: str = option("k1", doc=f"reinforce_plus_plus*: the KL_t of the reward, one of {', '.join(KL_IN_REWARD)}")
    gamma: float = option(1.0, doc="reinforce_plus_plus*: discount of the returns G_t = r_t + gamma G_t+1")
    dynamic_sampling: bool = option(False, doc="drop groups whose rewards are all equal and generate more (DAPO)")
    max_sampling_rounds: int = option(3, doc="dynamic sampling: generation rounds per step at most")
    overlong: Literal["none", "mask", "penalty"] = option(
        "none", doc="responses cut at max_response_length: keep, mask out of the loss, or DAPO's soft length penalty")
    overlong_buffer: int = option(4, doc="penalty: tokens before the limit over which the penalty ramps to -1")
    mini_batches: int = option(1, doc="optimizer updates per epoch over the step's responses")
    ppo_epochs: int = option(1, doc="passes over the step's responses")
    micro_batch_size: int = option(64, doc="responses per forward on each rank (gradient accumulation)")

    def __post_init__(self):
        if self.loss_agg not in LOSS_AGGREGATIONS:
            raise ValueError(f"loss_agg must be one of {list(LOSS_AGGREGATIONS)}, got {self.loss_agg!r}")
        if self.beta < 0 or self.eps_low < 0 or (self.eps_high is not None and self.eps_high < 0):
            raise ValueError("beta, eps_low and eps_high must be >= 0")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip}")
        estimator(self.advantage)
        if self.kl_estimator not in KL_IN_REWARD:
            raise ValueError(f"kl_estimator must be one of {list(KL_IN_REWARD)}, got {self.kl_estimator!r}")
        if not self.kl_coef >= 0 or not 0 <= self.gamma <= 1:
            raise ValueError(f"kl_coef must be >= 0 and gamma in [0, 1], got kl_coef={self.kl_coef}, gamma={self.gamma}")
        self.check_policy_loss()
        for name in ("max_sampling_rounds", "overlong_buffer", "mini_batches", "ppo_epochs", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def reward_kl(self) -> bool:
        """Whether the advantage estimator puts -kl_coef * KL_t in the per-token reward."""
        return estimator(self.advantage).token_kl and self.kl_coef > 0

    @property
    def uses_reference(self) -> bool:
        """Whether a run builds the reference: the k3 loss term (beta) or the reward's KL (the registry reads this too)."""
        return self.beta > 0 or self.reward_kl


@dataclasses.dataclass
class GRPOConfig(OnlineConfig):
    """One GRPO run (`launch/train_grpo.py --config ... key.sub=value`)."""

    algorithm: Literal["grpo"] = algorithm_option("grpo")
    run_dir: str = option("runs/grpo_arith", doc="output folder: config.yaml, metrics.jsonl, tensorboard/, checkpoints/, hf/")
    steps: int = option(60, doc="training steps (one rollout + its updates each)")
    save_every: int = option(20, doc="checkpoint every N steps (and after the last); 0: only after the last")
    algo: AlgoConfig = option(AlgoConfig(), doc="objective")


class GRPOTrainer(OnlineTrainer):
    """GRPO on the online trainer (module doc)."""

    name = "GRPO"

    def needs_reference(self) -> bool:
        return self.cfg.algo.uses_reference

    def shape_rewards(self, batch: RolloutBatch) -> None:
        if self.cfg.algo.overlong == "penalty":
            batch.rewards = batch.rewards + overlong_penalty(batch.lengths, self.cfg.rollout.max_response_length,
                                                             self.cfg.algo.overlong_buffer)

    def keep_groups(self, batch: RolloutBatch) -> torch.Tensor:
        if self.cfg.algo.dynamic_sampling:
            return informative_groups(batch.rewards, self.cfg.rollout.group_size)
        return super().keep_groups(batch)

    def sampling_rounds(self) -> int:
        return self.cfg.algo.max_sampling_rounds if self.cfg.algo.dynamic_sampling else 1

    ACTOR_STATS = ("clipped", "approx_kl", "kl", "entropy", "tokens")

    def actor_loss(self, batch: RolloutBatch):
        """The micro-batch loss `train_role` runs: GRPO's clipped policy loss [+ beta * KL] and its sums."""
        cfg, algo = self.cfg, self.cfg.algo

        def loss(rows, hidden=None):  # hidden: the last pipeline stage's output for `rows` at actor.pp > 1
            logp, entropy = self.actor.logprobs_with_grad(*self.logprob_inputs(batch, rows), cfg.rollout.temperature,
                                                          hidden=hidden)
            mask = batch.response_mask[rows]
            per_token, stats = algo.actor_policy_loss(logp, batch.old_logp[rows], batch.advantages[rows], mask,
                                                      algo.beta, batch.ref_logp[rows] if batch.ref_logp is not None else None)
            count = stats.count
            return per_token, [stats.clip_frac * count, stats.approx_kl * count, stats.kl_mean * count,
                               (entropy.detach() * mask).sum(), count]
        return loss

    def train_step(self) -> dict[str, float]:
        """One GRPO step (module doc); returns its metrics, reduced over ranks."""
        cfg, algo, dp = self.cfg, self.cfg.algo, self.layout.dp_group
        self.timer.reset()
        self.memory.clear()
        start = time.perf_counter()
        batch, generated, counts = self.collect()
        if algo.overlong == "mask":
            batch.response_mask = overlong_mask(batch.response_mask, batch.finished)
        if cfg.rollout.old_logprobs == "recompute":
            with self.phase("old_logprobs", actor=("weights",)):
                batch.old_logp = self.score_logprobs(self.actor, batch, algo.micro_batch_size)
        else:
            batch.old_logp = batch.rollout_logp
        if self.reference is not None:
            with self.phase("reference", reference=("weights",)):
                batch.ref_logp = self.score_logprobs(self.reference, batch, algo.micro_batch_size)
        in_reward = self.cfg.algo.reward_kl
        batch.advantages = estimator(algo.advantage).fn(
            batch.rewards, batch.response_mask, cfg.rollout.group_size, eps=algo.advantage_eps,
            logp=batch.old_logp if in_reward else None, ref_logp=batch.ref_logp if in_reward else None,
            kl_coef=algo.kl_coef, kl_estimator=algo.kl_estimator, gamma=algo.gamma, group=dp)
        lr = lr_at(cfg.optim, self.progress["step"], cfg.steps)
        sums = self.rollout_sums(generated)
        sums.add("dropped_groups", counts["dropped_groups"])
        sums.add("kept_groups", counts["kept_groups"])
        if algo.dynamic_sampling and all_reduce_count(counts["kept_groups"], self.layout.dp_group, self.layout.device) == 0:
            self.skip_update("empty_updates", "dynamic sampling kept no group with unequal rewards on any rank")
            for name in ("loss",) + self.ACTOR_STATS:
                sums.add(f"actor/{name}", 0.0)
            norms = [torch.zeros(())]
        else:
            with self.phase("update", actor=("weights", "optimizer")):
                norms = self.train_role(self.actor, lr, batch, self.ACTOR_STATS, self.actor_loss(batch), sums, "actor")
        total = sums.reduce(dp, self.layout.device)
        tokens = max(total["actor/tokens"], 1.0)
        updates = algo.ppo_epochs * algo.mini_batches
        metrics = {
            "sampling/rounds": counts["rounds"], "sampling/dropped_groups": total["dropped_groups"],
            "sampling/kept_groups": total["kept_groups"],
            "actor/loss": total["actor/loss"] / updates, "actor/clip_frac": total["actor/clipped"] / tokens,
            "actor/approx_kl": total["actor/approx_kl"] / tokens, "actor/entropy": total["actor/entropy"] / tokens,
            "actor/grad_norm": torch.stack(norms).mean(), "actor/lr": lr,
        }
        if self.reference is not None:
            metrics["actor/kl"] = total["actor/kl"] / tokens
        return self.step_metrics(total, generated.terms, metrics, start)


def train_grpo(cfg: GRPOConfig) -> TrainResult:
    """Run GRPO as configured; every rank calls it after `init_distributed`."""
    return GRPOTrainer(cfg).train()
