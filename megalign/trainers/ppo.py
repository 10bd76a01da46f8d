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

The pure pieces are in `megalign.algos.ppo`; roles in `megalign.roles` (the critic in
`megalign.roles.critic`).

Design choices:

- Placement: all four roles live on every rank (colocated), and each phase (`generate`, `reward`,
  `old_logprobs`, `reference`, `values`, `critic_update`, `update`) brings in only what it uses; with
  the offload switches on, the rest waits in host memory. Memory per role and phase is logged
  (`memory/<phase>/<role>_mib`). Offload moves storage only, so results are identical on and off.
- Layouts: every role has its own tp x pp (`OnlineTrainer.role_layout`). At pp > 1 the actor rolls out
  and trains as GRPO's does (`pipeline_rollout`, forward-only scoring, 1F1B updates in `train_role`
  with `micro_loss(rows, hidden)` on the last stage), the reference scores with the forward-only
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
import json
import logging
import os
import time
from typing import Literal, Optional

import torch

from megalign.algos.aggregation import LOSS_AGGREGATIONS
from megalign.algos.ppo import (KL_IN_REWARD, AdaptiveKL, advantages_and_returns, normalize_scores, sequence_mean_kl,
                                token_rewards, value_loss, whiten)
from megalign.algos.policy_loss_options import PolicyLossOptions
from megalign.algos.reward_shaping import whiten_scores
from megalign.checkpoint import ModelState, OptimizerState, export_hf
from megalign.algos.registry import algorithm_option
from megalign.config import option
from megalign.models import ModelConfig, scalar_head_from_pretrained
from megalign.ops.kl_penalty import kl_penalty
from megalign.parallel import MixedPrecision
from megalign.roles import DTYPES, TOKEN_CLASSIFICATION, Critic, TrainedRoleConfig
from megalign.trainers.base import TrainResult, check_model_path, check_stages
from megalign.trainers.online import OnlineConfig, OnlineTrainer, RolloutBatch
from megalign.trainers.optim import OptimConfig, build_optimizer, lr_at

logger = logging.getLogger(__name__)

KL_IN_LOSS = ("k3", "low_var_kl")


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
class PPOAlgoConfig(PolicyLossOptions):
    """The objective: policy loss, rewards, KL, GAE, clipping, entropy bonus, warm-up, epochs."""

    gamma: float = option(1.0, doc="GAE discount")
    lam: float = option(0.95, doc="GAE lambda (InstructGPT / TRL; verl and OpenRLHF now default 1.0)")
    whiten_advantages: bool = option(True, doc="whiten the advantages over the whole batch of every dp rank")
    eps_low: float = option(0.2, doc="policy clip: ratio >= 1 - eps_low")
    eps_high: Optional[float] = option(None, doc="upper policy clip (clip-higher); null: eps_low")
    dual_clip: Optional[float] = option(None, doc="dual-clip bound c > 1 for negative advantages; null: off")
    cliprange_value: Optional[float] = option(0.2, doc="value clip around the old values; null: unclipped value loss")
    entropy_coef: float = option(0.0, doc="entropy bonus: loss -= entropy_coef * entropy per token")
    kl_coef: float = option(0.05, doc="beta: initial KL coefficient; 0 with no kl_target: no KL and no reference role")
    kl_target: Optional[float] = option(None, doc="adaptive KL controller target (Ziegler et al. 2019); null: fixed beta")
    kl_horizon: float = option(10000.0, doc="adaptive KL controller horizon (samples)")
    kl_in: Literal["reward", "loss"] = option("reward", doc="KL penalty in the per-token reward or as a loss term")
    kl_estimator: str = option("k1", doc=f"reward: one of {KL_IN_REWARD}; loss: one of {KL_IN_LOSS}")
    reward_normalize: bool = option(False, doc="normalise each outcome reward model's score with its own reward_stats.json "
                                               "(not the gated pair's, module doc)")
    reward_clip: Optional[float] = option(None, doc="clip the sequence score to +-reward_clip (e.g. 10); null: off")
    critic_warmup: int = option(0, doc="first steps that train only the critic (the actor waits), as verl's critic_warmup")
    loss_agg: str = option("token-mean", doc=f"loss aggregation of both roles: {', '.join(LOSS_AGGREGATIONS)}")
    mini_batches: int = option(1, doc="optimizer updates per epoch over the step's responses (each role)")
    ppo_epochs: int = option(1, doc="passes over the step's responses")
    micro_batch_size: int = option(64, doc="responses per forward on each rank (gradient accumulation)")

    def __post_init__(self):
        if self.loss_agg not in LOSS_AGGREGATIONS:
            raise ValueError(f"loss_agg must be one of {list(LOSS_AGGREGATIONS)}, got {self.loss_agg!r}")
        allowed = KL_IN_REWARD if self.kl_in == "reward" else KL_IN_LOSS
        if self.kl_estimator not in allowed:
            raise ValueError(f"kl_estimator must be one of {list(allowed)} with kl_in={self.kl_in!r}, got {self.kl_estimator!r}")
        for name in ("kl_coef", "eps_low", "entropy_coef", "critic_warmup"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.eps_high is not None and self.eps_high < 0:
            raise ValueError(f"eps_high must be >= 0, got {self.eps_high}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip}")
        if self.cliprange_value is not None and not self.cliprange_value > 0:
            raise ValueError(f"cliprange_value must be > 0 or null, got {self.cliprange_value}")
        if self.reward_clip is not None and not self.reward_clip > 0:
            raise ValueError(f"reward_clip must be > 0 or null, got {self.reward_clip}")
        if self.kl_target is not None and not self.kl_target > 0:
            raise ValueError(f"kl_target must be > 0 or null, got {self.kl_target}")
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            raise ValueError(f"gamma and lam must be in [0, 1], got {self.gamma}, {self.lam}")
        for name in ("mini_batches", "ppo_epochs", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        self.check_policy_loss()

    @property
    def uses_kl(self) -> bool:
        return self.kl_coef > 0 or self.kl_target is not None


@dataclasses.dataclass
class PPOConfig(OnlineConfig):
    """One PPO run (`launch/train_ppo.py --config ... key.sub=value`)."""

    algorithm: Literal["ppo"] = algorithm_option("ppo")
    run_dir: str = option("runs/ppo_arith", doc="output folder: config.yaml, metrics.jsonl, tensorboard/, checkpoints/, hf/, critic_hf/")
    steps: int = option(60, doc="training steps (one rollout + the critic's and the actor's updates each)")
    save_every: int = option(20, doc="checkpoint every N steps (and after the last); 0: only after the last")
    critic: CriticConfig = option(CriticConfig(), doc="the value model")
    algo: PPOAlgoConfig = option(PPOAlgoConfig(), doc="objective")

    def __post_init__(self):
        super().__post_init__()
        if self.algo.critic_warmup >= self.steps:
            raise ValueError(f"algo.critic_warmup={self.algo.critic_warmup} >= steps={self.steps}: the actor would "
                             f"never be trained (the warm-up steps train only the critic)")


def reward_stats(path: str) -> tuple[float, float]:
    """(mean, std) from a reward-model export's reward_stats.json (`megalign.trainers.preference`)."""
    file = os.path.join(path, "reward_stats.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"algo.reward_normalize=true needs {file} (written by the RM trainer's export); "
                                f"train the RM with megalign or set algo.reward_normalize=false")
    with open(file) as f:
        stats = json.load(f)
    if not stats.get("reward_std", 0) > 0:
        raise ValueError(f"{file}: reward_std must be > 0, got {stats.get('reward_std')!r}")
    return float(stats["reward_mean"]), float(stats["reward_std"])


class PPOTrainer(OnlineTrainer):
    """PPO on the online trainer with a critic (module doc)."""

    name = "PPO"
    token_level_rewards = True
    ACTOR_STATS = ("clipped", "approx_kl", "kl", "entropy", "tokens")
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
        self.check_pipeline_batch("actor", self.layout, trained=True)
        if self.reference is not None:
            self.check_pipeline_batch("reference", self.reference.layout, trained=False)
        self.check_pipeline_batch("critic", layout, trained=True)
        self.kl = AdaptiveKL(algo.kl_coef, algo.kl_target, algo.kl_horizon)
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

    def _values(self, batch: RolloutBatch) -> torch.Tensor:
        """[N, R] no-grad critic values of the batch, in micro-batches (pipelined at critic.pp > 1)."""
        return self.score_responses(self.critic, batch, self.cfg.algo.micro_batch_size, self.critic.values,
                                    self.critic.pipeline_values)

    def train_step(self) -> dict[str, float]:
        """One PPO step (module doc); returns its metrics, reduced over ranks."""
        cfg, algo, dp = self.cfg, self.cfg.algo, self.layout.dp_group
        self.timer.reset()
        self.memory.clear()
        start = time.perf_counter()
        step = self.progress["step"]
        batch, generated, _ = self.collect()
        mask = batch.response_mask
        if cfg.rollout.old_logprobs == "recompute":
            with self.phase("old_logprobs", actor=("weights",)):
                batch.old_logp = self.score_logprobs(self.actor, batch, algo.micro_batch_size)
        else:
            batch.old_logp = batch.rollout_logp
        if self.reference is not None:
            with self.phase("reference", reference=("weights",)):
                batch.ref_logp = self.score_logprobs(self.reference, batch, algo.micro_batch_size)
        with self.phase("values", critic=("weights",)):
            old_values = self._values(batch)
        beta = self.kl.beta
        kl = torch.zeros_like(mask)
        if self.reference is not None:
            kl = kl_penalty(batch.old_logp, batch.ref_logp, algo.kl_estimator).float() * mask
        in_reward = algo.kl_in == "reward" and self.reference is not None
        rewards, _ = token_rewards(batch.rewards, mask, batch.old_logp if in_reward else None,
                                   batch.ref_logp if in_reward else None, beta, algo.kl_estimator,
                                   step_rewards=batch.token_rewards)
        advantages, returns = advantages_and_returns(rewards, old_values, mask, algo.gamma, algo.lam)
        batch.advantages = whiten(advantages, mask, dp) if algo.whiten_advantages else advantages

        # hidden: the last pipeline stage's output for `rows` when the role is at pp > 1 (`train_role`)
        def critic_loss(rows, hidden=None):
            values = self.critic.values_with_grad(*self.logprob_inputs(batch, rows), hidden=hidden)
            loss, stats = value_loss(values, old_values[rows], returns[rows], mask[rows], algo.cliprange_value)
            return loss, [stats.clipped, (values.detach() * mask[rows]).sum(), stats.count]

        def actor_loss(rows, hidden=None):
            logp, entropy = self.actor.logprobs_with_grad(*self.logprob_inputs(batch, rows), cfg.rollout.temperature,
                                                          hidden=hidden)
            m = mask[rows]
            loss, stats = algo.actor_policy_loss(logp, batch.old_logp[rows], batch.advantages[rows], m)
            kl_now = torch.zeros((), device=logp.device)
            if algo.kl_in == "loss" and self.reference is not None:
                kl_tok = kl_penalty(logp, batch.ref_logp[rows], algo.kl_estimator) * m
                loss = loss + beta * kl_tok
                kl_now = kl_tok.detach().sum()
            if algo.entropy_coef:
                loss = loss - algo.entropy_coef * entropy * m
            count = stats.count
            return loss, [stats.clip_frac * count, stats.approx_kl * count, kl_now, (entropy.detach() * m).sum(), count]

        sums = self.rollout_sums(generated)
        with self.phase("critic_update", critic=("weights", "optimizer")):
            critic_norms = self.train_role(self.critic, lr_at(cfg.critic.optim, step, cfg.steps), batch,
                                            self.CRITIC_STATS, critic_loss, sums, "critic")
        lr = lr_at(cfg.optim, step, cfg.steps)
        if step >= algo.critic_warmup:
            with self.phase("update", actor=("weights", "optimizer")):
                actor_norms = self.train_role(self.actor, lr, batch, self.ACTOR_STATS, actor_loss, sums, "actor")
        else:
            sums.add("actor/loss", 0.0)
            for name in self.ACTOR_STATS:
                sums.add(f"actor/{name}", 0.0)
            actor_norms = [torch.zeros(())]
        rollout_kl = sequence_mean_kl(kl, mask, dp)
        self.kl.update(float(rollout_kl), cfg.rollout.prompts_per_step * cfg.rollout.group_size)

        valid = mask.double()
        for name, value in (("return", (returns.double() * valid).sum()), ("old_value", (old_values.double() * valid).sum()),
                            ("kl_tokens", (kl.double() * valid).sum()), ("valid_tokens", valid.sum())):
            sums.add(name, value)
        total = sums.reduce(dp, self.layout.device)
        tokens = max(total["valid_tokens"], 1.0)
        actor_tokens, critic_tokens = max(total["actor/tokens"], 1.0), max(total["critic/tokens"], 1.0)
        updates = algo.ppo_epochs * algo.mini_batches
        metrics = {
            "actor/loss": total["actor/loss"] / updates, "actor/clip_frac": total["actor/clipped"] / actor_tokens,
            "actor/approx_kl": total["actor/approx_kl"] / actor_tokens,
            "actor/entropy": total["actor/entropy"] / actor_tokens,
            "actor/grad_norm": torch.stack(actor_norms).mean(), "actor/lr": lr,
            "actor/kl_coef": beta, "actor/rollout_kl": float(rollout_kl), "actor/token_kl": total["kl_tokens"] / tokens,
            "critic/loss": total["critic/loss"] / updates, "critic/clip_frac": total["critic/clipped"] / critic_tokens,
            "critic/value_mean": total["critic/value"] / critic_tokens, "critic/old_value_mean": total["old_value"] / tokens,
            "critic/return_mean": total["return"] / tokens, "critic/grad_norm": torch.stack(critic_norms).mean(),
            "critic/lr": lr_at(cfg.critic.optim, step, cfg.steps),
        }
        if algo.kl_in == "loss":
            metrics["actor/loss_kl"] = total["actor/kl"] / actor_tokens
        return self.step_metrics(total, generated.terms, metrics, start)

    def export(self) -> Optional[str]:
        path = super().export()
        self.critic.need("weights")
        export_hf(self.critic.model, os.path.join(self.cfg.run_dir, "critic_hf"), self.critic.layout,
                  tokenizer=self.tokenizer, architecture=TOKEN_CLASSIFICATION[self.critic.model.config.model_type])
        return path


def train_ppo(cfg: PPOConfig) -> TrainResult:
    """Run PPO as configured; every rank calls it after `init_distributed`."""
    return PPOTrainer(cfg).train()
