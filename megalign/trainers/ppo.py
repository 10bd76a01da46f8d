"""PPO with four colocated roles (actor, critic, reference, reward) on the online trainer: `train_ppo(cfg)`.

One step (every rank, after `megalign.trainers.cli.init_distributed`):

    sample prompts -> actor generates G responses each -> reward scores them (verifiers and / or
    reward models; [each RM's score normalised with its own stored mean / std]; [Llama 2's gated
    score whitened over the global batch]; [the total clipped]; [process RMs' step rewards]) -> old
    log-probs (rollout or recomputed) -> reference log-probs (when a KL term is on) -> critic values
    [N, R] -> per-token rewards (score at the last response token, [a process reward at the end of
    each step], [-beta * KL_t]) -> GAE -> advantages whitened
    over the whole batch of every dp rank -> critic update (ppo_epochs x mini-batches of the clipped
    value loss) -> actor update (clipped policy loss [+ beta * KL_t] [- entropy bonus]; skipped during
    the critic warm-up) -> KL coefficient update (fixed, or Ziegler et al.'s adaptive controller).
    `PPOTrainer` fills in the online step template (`advantages`: values, token rewards, GAE; `update`: the
    two roles; `metrics`); the KL is `algo.kl_coef` / `kl_in` / `kl_estimator` as in GRPO.

The pure pieces are in `megalign.algos.ppo`; roles in `megalign.roles` (the critic in
`megalign.roles.critic`).

Design choices:

- Placement: all four roles live on every rank (colocated), and each phase (`generate`, `reward`,
  `old_logprobs`, `reference`, `values`, `critic_update`, `update`) brings in only what it uses; with
  the offload switches on, the rest waits in host memory. Memory per role and phase is logged
  (`memory/<phase>/<role>_mib`). Offload moves storage only, so results are identical on and off.
- Layouts: every role has its own tp x pp (`OnlineTrainer.role_layout`). At pp > 1 the actor rolls out
  and trains as GRPO's does (`pipeline_rollout`, forward-only scoring, 1F1B updates in `train_role`
  with the `RoleLoss` on the last stage's hidden states), the reference scores with the forward-only
  schedule, and the critic is a pipeline stage too (its value head on the last stage; old values by
  `Critic.pipeline_values`, the value loss inside 1F1B). The critic's layout is independent of the
  actor's within `check_same_batch`: e.g. critic.pp=1 beside actor.pp=2 (each rank holds its actor
  replica's batch; the critic's two dp replicas there train on the same rows and its summed gradient
  is divided by 2, `TrainableRole.batch_copies`), or critic.pp=2. Each rank's responses must split
  into at least pp micro-batches of `algo.micro_batch_size` per mini-batch (checked at start-up,
  naming the keys); pipelined forwards run padded (`rollout.pack` packs only the pp = 1 roles).
  Checkpoints hold each stage's shards under its tp x pp coordinates and resume at the same layout;
  the critic's HF export (critic_hf/) from stages is a sharded checkpoint.
- The critic's update runs before the actor's, one after the other on the same ranks (as verl's
  colocated workers do): it costs the critic's forward + backward per mini-batch on top of the
  actor's, and with offload each update phase also pays the copies of its role's weights and
  optimizer state (measured in BENCHMARKS.md). The two updates are independent (both read only the
  rollout's old values, advantages and returns), so their order does not change the result.
- Losses use the shared aggregation with global counts (`megalign.algos.aggregation.loss_normalizer`)
  and summed gradients over dp, for both roles; each role clips its own gradient norm.
- The KL coefficient is checkpointed with the run, so a resumed adaptive controller goes on where it was.
- Rewards (`shape_rewards`, `megalign.algos.reward_shaping`): `algo.reward_normalize` normalises every
  outcome reward model with its own `reward_stats.json`, except the two of `reward.gated`, whose
  gate reads their raw scores as logits (a normalised score would move the 0.15 threshold); their
  gated score LOGIT(R_c) is whitened over the responses of every dp rank instead (Llama 2's
  WHITEN(LOGIT(R_c)), before the KL term). `algo.reward_clip` then clips the sequence total. A
  process reward model's step rewards (`RolloutBatch.token_rewards`) are added to the token rewards
  unnormalised and unclipped, each at the token that ends its step; the sequence score stays at the
  last token, so outcome and process rewards combine.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Literal, Optional

import torch

from megalign.algos.ppo import (AdaptiveKL, advantages_and_returns, normalize_scores, sequence_mean_kl,
                                token_rewards, value_loss, whiten)
from megalign.algos.policy_loss_options import PolicyLossOptions
from megalign.algos.reward_shaping import whiten_scores
from megalign.checkpoint import ModelState, OptimizerState, export_hf
from megalign.algos.registry import algorithm_option
from megalign.config import option, set_defaults
from megalign.models import ModelConfig, scalar_head_from_pretrained
from megalign.ops.kl_penalty import kl_penalty
from megalign.parallel import MixedPrecision
from megalign.roles import DTYPES, TOKEN_CLASSIFICATION, Critic, TrainedRoleConfig
from megalign.roles.reward_exports import reward_stats
from megalign.rollout import RolloutBatch
from megalign.trainers.base import MetricSums, TrainResult, check_model_path, check_stages
from megalign.trainers.online import OnlineTrainer
from megalign.trainers.updates import RoleLoss
from megalign.trainers.online_config import OnlineConfig, UpdateSchedule, check_pipeline_batch
from megalign.trainers.policy_gradient import PolicyGradient
from megalign.trainers.optim import OptimConfig, build_optimizer

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class CriticConfig(TrainedRoleConfig):
    """The critic: its checkpoint, layout, dtype, offload switches and its own optimizer (`megalign.roles.critic`)."""

    path: Optional[str] = option(
        None, doc="HF checkpoint folder: a reward-model export (head read) or a policy export (head fresh); "
                  "null: the first outcome reward model's path when the reward has one, else actor.path")
    offload_optimizer: bool = option(False, doc="move the optimizer state to host memory outside the critic update")
    optim: OptimConfig = option(OptimConfig(lr=1e-4, schedule="constant", warmup_steps=0),
                                doc="the critic's AdamW, learning-rate schedule (per step) and gradient clip")


@dataclasses.dataclass
class PPOAlgoConfig(PolicyLossOptions, UpdateSchedule):
    """The objective: the update schedule, policy loss and KL (shared with GRPO), rewards, GAE, value clip,
    adaptive KL, warm-up."""

    gamma: float = option(1.0, doc="GAE discount")
    lam: float = option(0.95, doc="GAE lambda (InstructGPT / TRL; verl and OpenRLHF now default 1.0)")
    whiten_advantages: bool = option(True, doc="whiten the advantages over the whole batch of every dp rank")
    cliprange_value: Optional[float] = option(0.2, doc="value clip around the old values; null: unclipped value loss")
    kl_coef: float = option(0.05, doc="beta: initial KL coefficient (module doc); 0 with no kl_target: no KL and no "
                                      "reference role")
    kl_target: Optional[float] = option(None, doc="adaptive KL controller target (Ziegler et al. 2019); null: fixed beta")
    kl_horizon: float = option(10000.0, doc="adaptive KL controller horizon (samples)")
    reward_normalize: bool = option(False, doc="normalise each outcome reward model's score with its own reward_stats.json "
                                               "(not the gated pair's, module doc)")
    reward_clip: Optional[float] = option(None, doc="clip the sequence score to +-reward_clip (e.g. 10); null: off")
    critic_warmup: int = option(0, doc="first steps that train only the critic (the actor waits), as verl's critic_warmup")

    def __post_init__(self):
        UpdateSchedule.__post_init__(self)
        self.check_policy_loss(token_rewards=True)
        if self.critic_warmup < 0:
            raise ValueError(f"critic_warmup must be >= 0, got {self.critic_warmup}")
        for name in ("cliprange_value", "reward_clip", "kl_target"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or null, got {value}")
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            raise ValueError(f"gamma and lam must be in [0, 1], got {self.gamma}, {self.lam}")

    @property
    def uses_kl(self) -> bool:
        return self.kl_beta > 0 or self.kl_target is not None


@dataclasses.dataclass
@set_defaults(run_dir="runs/ppo_arith", steps=60, save_every=20)
class PPOConfig(OnlineConfig):
    """One PPO run (`launch/train_ppo.py --config ... key.sub=value`)."""

    algorithm: Literal["ppo"] = algorithm_option("ppo")
    critic: CriticConfig = option(CriticConfig(), doc="the value model")
    algo: PPOAlgoConfig = option(PPOAlgoConfig(), doc="objective")

    def __post_init__(self):
        super().__post_init__()
        if self.algo.critic_warmup >= self.steps:
            raise ValueError(f"algo.critic_warmup={self.algo.critic_warmup} >= steps={self.steps}: the actor would "
                             f"never be trained (the warm-up steps train only the critic)")


class PPOTrainer(PolicyGradient, OnlineTrainer):
    """PPO on the online trainer with a critic (module doc)."""

    name = "PPO"
    token_level_rewards = True
    CRITIC_STATS = ("clipped", "value", "tokens")

    def needs_reference(self) -> bool:
        return self.cfg.algo.uses_kl

    def free_keys(self) -> tuple[str, ...]:
        return super().free_keys() + ("critic.offload_weights", "critic.offload_optimizer")

    def critic_path(self) -> str:
        """The critic's initial weights: critic.path, else the first outcome reward model, else the actor."""
        outcome = [m for _, m in self.cfg.reward.reward_models() if m.kind == "outcome"]
        return self.cfg.critic.path or (outcome[0].path if outcome else self.cfg.actor.path)

    def trained_models(self) -> list[tuple[str, Optional[str]]]:
        return super().trained_models() + [("critic.path", self.critic_path())]

    def __init__(self, cfg: PPOConfig):
        algo = cfg.algo
        gated = {cfg.reward.gated.safety, cfg.reward.gated.helpful} if cfg.reward.gated is not None else set()
        outcome = [m for _, m in cfg.reward.reward_models() if m.kind == "outcome"]
        normalized = [m for m in outcome if m.name not in gated]
        if algo.reward_normalize and not normalized:
            raise ValueError("algo.reward_normalize=true needs a reward model (reward.model or an outcome model of "
                             "reward.models outside reward.gated)")
        self.score_stats = {m.name: reward_stats(m.path) for m in normalized} if algo.reward_normalize else {}
        super().__init__(cfg)
        path = self.critic_path()
        check_model_path(path, "critic.path")
        layout = self.role_layout("critic", cfg.critic)
        if layout.pp > 1:
            check_stages(ModelConfig.from_hf(path).num_hidden_layers, layout.pp, "critic", f"critic.path {path!r}")
        model, fresh = scalar_head_from_pretrained(path, "value", layout, cfg.seed,
                                                   activation_checkpointing=cfg.critic.activation_checkpointing)
        self.check_model(model, "critic.path", path, *self.longest)
        precision = MixedPrecision(DTYPES[cfg.critic.dtype] if cfg.critic.dtype != "fp32" else None)
        self.critic = Critic(model, layout, precision, cfg.critic.offload_weights, cfg.critic.offload_optimizer,
                             build_optimizer(model, cfg.critic.optim, layout), cfg.critic.optim.grad_clip,
                             self.batch_copies(layout), **self.packing("critic", layout))
        logger.info("critic from %s (%s head)", path, "fresh" if fresh else "its")
        self.roles.append(self.critic)
        check_pipeline_batch(self.cfg, self.layout.dp, "actor", self.layout, trained=True)
        if self.reference is not None:
            check_pipeline_batch(self.cfg, self.layout.dp, "reference", self.reference.layout, trained=False)
        check_pipeline_batch(self.cfg, self.layout.dp, "critic", layout, trained=True)
        self.kl = AdaptiveKL(algo.kl_beta, algo.kl_target, algo.kl_horizon)
        self.register_state("critic", ModelState(model, layout))
        self.register_state("critic_optim", OptimizerState(model, self.critic.optimizer, layout))
        self.register_state("kl_controller", self.kl.state)

    def prepare_checkpoint_io(self) -> None:
        self.place("checkpoint", actor=("weights", "optimizer"), critic=("weights", "optimizer"))

    def shape_rewards(self, batch: RolloutBatch) -> None:
        """The sequence score PPO trains on (module doc): each normalised RM's share swapped for its normalised
        score, the gated share for its whitened score (a collective over dp), then the total clipped."""
        algo = self.cfg.algo
        for model in self.reward.outcome:
            if model.name in self.score_stats:
                raw = batch.terms[model.name]
                batch.rewards = batch.rewards + model.weight * (normalize_scores(raw, *self.score_stats[model.name]) - raw)
        if self.reward.gated is not None:
            raw = batch.terms["gated"]
            batch.rewards = batch.rewards + self.reward.gated.weight * (whiten_scores(raw, self.layout.dp_group) - raw)
        if algo.reward_clip is not None:
            batch.rewards = normalize_scores(batch.rewards, clip=algo.reward_clip)

    def advantages(self, batch: RolloutBatch) -> None:
        """The critic's values, the per-token rewards (the score at the last token, -beta * KL_t with the KL in the
        reward, the PRMs' step rewards), GAE's advantages (whitened over dp) and returns (module doc)."""
        algo, mask = self.cfg.algo, batch.response_mask
        with self.phase("values", critic=("weights",)):
            batch.values = self.score_responses(self.critic, batch, algo.micro_batch_size, self.critic.values,
                                                self.critic.pipeline_values)
        self.rollout_kl = torch.zeros_like(mask)
        if self.reference is not None:
            self.rollout_kl = kl_penalty(batch.old_logp, batch.ref_logp, algo.kl_kind).float() * mask
        in_reward = algo.kl_where == "reward" and self.reference is not None
        rewards, _ = token_rewards(batch.rewards, mask, batch.old_logp if in_reward else None,
                                   batch.ref_logp if in_reward else None, self.kl.beta, algo.kl_kind,
                                   step_rewards=batch.token_rewards)
        advantages, batch.returns = advantages_and_returns(rewards, batch.values, mask, algo.gamma, algo.lam)
        batch.advantages = whiten(advantages, mask, self.layout.dp_group) if algo.whiten_advantages else advantages

    def critic_loss(self, batch: RolloutBatch) -> RoleLoss:
        """The critic's clipped value loss against the returns, and its sums."""
        def fn(rows, hidden=None):
            values = self.critic.values_with_grad(*self.logprob_inputs(batch, rows), hidden=hidden)
            mask = batch.response_mask[rows]
            loss, stats = value_loss(values, batch.values[rows], batch.returns[rows], mask, self.cfg.algo.cliprange_value)
            return loss, {"clipped": stats.clipped, "value": (values.detach() * mask).sum(), "tokens": stats.count}
        return RoleLoss(fn, self.CRITIC_STATS)

    def update(self, batch: RolloutBatch, sums: MetricSums, counts: dict[str, float]) -> dict[str, list[torch.Tensor]]:
        """The critic's update, then the actor's (after `critic_warmup` steps); then the adaptive KL controller."""
        cfg, mask = self.cfg, batch.response_mask
        with self.phase("critic_update", critic=("weights", "optimizer")):
            norms = {"critic": self.train_role(self.critic, self.lr(cfg.critic.optim), batch, self.critic_loss(batch),
                                               sums, "critic")}
        warming_up = self.progress["step"] < cfg.algo.critic_warmup
        norms["actor"] = self.update_actor(batch, sums, self.policy_loss(batch, self.kl.beta),
                                           "critic warm-up" if warming_up else None, counter="")
        self.step_kl = (self.kl.beta, float(sequence_mean_kl(self.rollout_kl, mask, self.layout.dp_group)))
        self.kl.update(self.step_kl[1], cfg.rollout.prompts_per_step * cfg.rollout.group_size)
        valid = mask.double()
        for name, value in (("return", batch.returns), ("old_value", batch.values), ("kl_tokens", self.rollout_kl)):
            sums.add(name, (value.double() * valid).sum())
        sums.add("valid_tokens", valid.sum())
        return norms

    def metrics(self, total: dict[str, float], norms: dict[str, list[torch.Tensor]],
                counts: dict[str, float]) -> dict[str, float]:
        cfg = self.cfg
        tokens, critic_tokens = max(total["valid_tokens"], 1.0), max(total["critic/tokens"], 1.0)
        return {
            **self.policy_metrics(total, norms["actor"], self.lr()),
            "actor/kl_coef": self.step_kl[0], "actor/rollout_kl": self.step_kl[1],
            "actor/token_kl": total["kl_tokens"] / tokens,
            "critic/loss": total["critic/loss"] / cfg.algo.updates, "critic/clip_frac": total["critic/clipped"] / critic_tokens,
            "critic/value_mean": total["critic/value"] / critic_tokens, "critic/old_value_mean": total["old_value"] / tokens,
            "critic/return_mean": total["return"] / tokens, "critic/grad_norm": torch.stack(norms["critic"]).mean(),
            "critic/lr": self.lr(cfg.critic.optim),
        }

    def export(self) -> Optional[str]:
        path = super().export()
        self.critic.need("weights")
        export_hf(self.critic.model, os.path.join(self.cfg.run_dir, "critic_hf"), self.critic.layout,
                  tokenizer=self.tokenizer, architecture=TOKEN_CLASSIFICATION[self.critic.model.config.model_type])
        return path


def train_ppo(cfg: PPOConfig) -> TrainResult:
    """Run PPO as configured; every rank calls it after `init_distributed`."""
    return PPOTrainer(cfg).train()
