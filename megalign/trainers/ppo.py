"""PPO with four colocated roles (actor, critic, reference, reward) on the online step template: `train_ppo(cfg)`.

`PPOTrainer` adds the critic (`megalign.roles.critic`, its own tp x pp, dtype, optimizer and offload switches;
exported to run_dir/critic_hf as HF `*ForTokenClassification`) and fills in the step:

    keep_groups    with `algo.dynamic_sampling`, DAPO's filter of groups of equal rewards and more sampling rounds,
                   shared with GRPO (`megalign.trainers.dynamic_sampling`, which says why it applies to PPO); with
                   `algo.dynamic_sampling_by=verdict` the test is the reward model's predicted pass / fail instead
                   (its Platt-calibrated probability >= 1/2): a learned RM's continuous scores are never all equal,
                   so DAPO's test would keep every group, among them those the RM itself judges all wrong, where
                   the only signal left is its unconstrained order among wrong answers

    shape_rewards  each outcome RM's score (not those combined by reward.gated or reward.ensemble) normalised
                   with its own `reward_stats.json` (`algo.reward_normalize`) or read as its Platt-calibrated
                   probability sigmoid(a * s + b) from the same file (`algo.reward_calibrate`: flat where the RM is
                   sure, so its arbitrary order among the responses it ranks far below the boundary barely moves the
                   reward), Llama 2's gated score WHITEN(LOGIT(R_c)) over dp, with `algo.reward_group_center` less
                   its group's mean (a Bradley-Terry RM is trained on differences only, so its score carries a
                   constant per prompt that no pair constrains; centred, the critic need not learn it), less
                   `algo.missing_eos_penalty` for a response cut before its EOS (TRL's; in the shaped score's
                   units), the total clipped
    advantages     the critic's values -> per-token rewards (the score at the last response token, the process
                   RMs' step rewards at the tokens that end each step, with `rollout.env.reward_placement=per_turn`
                   each episode turn's reward at the turn's last policy token, -beta * KL_t when `algo.kl_in` is
                   the reward) -> GAE (`megalign.algos.ppo`) -> advantages whitened over every dp rank
    update         the critic's clipped value loss, then the actor's policy loss (`PolicyGradient`: with the KL in
                   the loss when `algo.kl_in` says so, the entropy bonus; none during `algo.critic_warmup`) ->
                   the KL coefficient (fixed, or Ziegler et al.'s adaptive controller, checkpointed)
    metrics        actor, critic and KL metrics, and the critic's health as PPO users watch it (verl's names):
                   explained variance, value error, the advantages' mean / std before whitening

Design choices:

- Colocated placement: each phase (`generate`, `reward`, `old_logprobs`, `reference`, `values`,
  `critic_update`, `update`) brings in only the roles it uses; offload moves storage only, so results are
  identical on and off. The two updates run one after the other (critic first, as verl's colocated workers);
  both read only the rollout's values, advantages and returns, so their order does not change the result.
- `critic.lora` (`megalign.trainers.online_lora`): adapters on the critic's trunk (seeded with seed + 1, apart
  from the actor's), the value head trained whole; checkpoints hold both and the base's fingerprint.
- The critic's layout is independent of the actor's within `check_same_batch` (e.g. critic.pp=1 beside
  actor.pp=2: its two dp replicas train on the same rows, the summed gradient divided by 2); pipelined roles
  need each rank's responses to split into at least pp micro-batches per mini-batch (checked at start-up).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Literal, Optional

import torch

from megalign.algos.ppo import (AdaptiveKL, advantages_and_returns, critic_diagnostic_sums, critic_diagnostics,
                                normalize_scores, sequence_mean_kl, token_rewards, value_loss, whiten)
from megalign.algos.grpo import informative_groups
from megalign.algos.policy_loss_options import PolicyLossOptions
from megalign.algos.reward_shaping import missing_eos_penalty, whiten_scores
from megalign.checkpoint import ModelState, OptimizerState, export_hf
from megalign.algos.registry import algorithm_option
from megalign.config import option, set_defaults
from megalign.models import LoRAConfig, ModelConfig, scalar_head_from_pretrained
from megalign.ops.group_advantages import group_advantages
from megalign.ops.kl_penalty import kl_penalty
from megalign.parallel import MixedPrecision
from megalign.roles import DTYPES, TOKEN_CLASSIFICATION, Critic, RewardModelConfig, TrainedRoleConfig
from megalign.roles.reward_combine import combined_members
from megalign.roles.reward_exports import reward_calibration, reward_stats
from megalign.rollout import RolloutBatch
from megalign.trainers.base import MetricSums, TrainResult, check_model_path, check_stages
from megalign.trainers.dynamic_sampling import DynamicSampling, DynamicSamplingOptions
from megalign.trainers.model_checks import check_tokenizer
from megalign.trainers.online import OnlineTrainer
from megalign.trainers.updates import RoleLoss
from megalign.trainers.online_config import (MissingEOSPenalty, OnlineConfig, UpdateSchedule, check_online_lora,
                                             check_pipeline_batch)
from megalign.trainers.online_lora import apply_role_lora, base_fingerprint
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
    lora: Optional[LoRAConfig] = option(None, doc="LoRA adapters on the critic's trunk {rank, alpha, dropout (must be 0), "
                                                  "target_modules}; the value head trains whole; exported merged; "
                                                  "null: full fine-tuning")

    def __post_init__(self):
        super().__post_init__()
        check_online_lora("critic", self.lora)


@dataclasses.dataclass
class PPOAlgoConfig(PolicyLossOptions, DynamicSamplingOptions, MissingEOSPenalty, UpdateSchedule):
    """The objective: the update schedule, policy loss and KL, dynamic sampling (shared with GRPO), rewards, GAE,
    value clip, adaptive KL, warm-up."""

    gamma: float = option(1.0, doc="GAE discount")
    lam: float = option(0.95, doc="GAE lambda (InstructGPT / TRL; verl and OpenRLHF now default 1.0)")
    whiten_advantages: bool = option(True, doc="whiten the advantages over the whole batch of every dp rank")
    cliprange_value: Optional[float] = option(0.2, doc="value clip around the old values; null: unclipped value loss")
    kl_coef: float = option(0.05, doc="beta: initial KL coefficient (module doc); 0 with no kl_target: no KL and no "
                                      "reference role")
    kl_target: Optional[float] = option(None, doc="adaptive KL controller target (Ziegler et al. 2019); null: fixed beta")
    kl_horizon: float = option(10000.0, doc="adaptive KL controller horizon (samples)")
    reward_normalize: bool = option(False, doc="normalise each outcome reward model's score with its own reward_stats.json "
                                               "(not those of reward.gated or reward.ensemble, module doc)")
    reward_calibrate: bool = option(False, doc="score each outcome reward model (not those of reward.gated or "
                                               "reward.ensemble) as its Platt-calibrated probability sigmoid(a * s + "
                                               "b), (a, b) from its reward_stats.json (module doc); excludes "
                                               "reward_normalize")
    reward_clip: Optional[float] = option(None, doc="clip the sequence score to +-reward_clip (e.g. 10); null: off")
    reward_group_center: bool = option(False, doc="subtract each group's mean shaped score, before the missing-EOS "
                                                  "penalty and the clip (module doc)")
    critic_warmup: int = option(0, doc="first steps that train only the critic (the actor waits), as verl's critic_warmup")
    dynamic_sampling_by: Literal["reward", "verdict"] = option(
        "reward", doc="dynamic sampling's test of a group (module doc): 'reward', its rewards all equal (DAPO); "
                      "'verdict', the one outcome reward model's Platt verdicts sigmoid(a * s + b) >= 1/2 all equal, "
                      "(a, b) from its reward_stats.json")

    def __post_init__(self):
        UpdateSchedule.__post_init__(self)
        self.check_policy_loss(token_rewards=True)
        self.check_dynamic_sampling()
        self.check_missing_eos_penalty()
        if self.reward_normalize and self.reward_calibrate:
            raise ValueError("algo.reward_normalize and algo.reward_calibrate are two readings of the RM's score; "
                             "set one")
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
        normalized = self.normalized_models()
        if self.algo.dynamic_sampling_by == "verdict" and (not self.algo.dynamic_sampling or len(normalized) != 1):
            raise ValueError("algo.dynamic_sampling_by=verdict needs algo.dynamic_sampling=true and exactly one outcome "
                             "reward model outside reward.gated and reward.ensemble (whose verdicts it reads), got "
                             f"dynamic_sampling={self.algo.dynamic_sampling} and {len(normalized)} such models")
        for flag in ("reward_normalize", "reward_calibrate"):
            if getattr(self.algo, flag) and not normalized:
                raise ValueError(f"algo.{flag}=true needs a reward model (reward.model or an outcome model of "
                                 "reward.models outside reward.gated and reward.ensemble)")

    def normalized_models(self) -> list[RewardModelConfig]:
        """The outcome reward models whose scores `algo.reward_normalize` / `reward_calibrate` act on: those outside
        `reward.gated` and `reward.ensemble` (an ensemble standardises its members itself)."""
        combined = combined_members(self.reward.gated, self.reward.ensemble)
        return [m for _, m in self.reward.reward_models() if m.kind == "outcome" and m.name not in combined]


class PPOTrainer(DynamicSampling, PolicyGradient, OnlineTrainer):
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
        normalized = cfg.normalized_models()
        self.score_stats = {m.name: reward_stats(m.path) for m in normalized} if algo.reward_normalize else {}
        self.score_platt = {m.name: reward_calibration(m.path) for m in normalized} if algo.reward_calibrate else {}
        self.verdict = ((normalized[0].name, reward_calibration(normalized[0].path))
                        if algo.dynamic_sampling_by == "verdict" else None)
        super().__init__(cfg)
        if self.rollout_side:  # a disaggregated run's rollout ranks only generate and score
            return
        path = self.critic_path()
        check_model_path(path, "critic.path")
        check_tokenizer(self.tokenizer, "critic.path", path, "" if self.cfg.critic.path else
                        " (critic.path unset: the critic starts from the first outcome reward model, else the actor; "
                        "set critic.path)")
        layout = self.role_layout("critic", cfg.critic)
        if layout.pp > 1:
            check_stages(ModelConfig.from_hf(path).num_hidden_layers, layout.pp, "critic", f"critic.path {path!r}",
                         layout.stages)
        model, fresh = scalar_head_from_pretrained(path, "value", layout, cfg.seed,
                                                   activation_checkpointing=cfg.critic.activation_checkpointing)
        self.check_model(model, "critic.path", path, *self.longest)
        apply_role_lora(model, cfg.critic.lora, cfg.seed + 1)  # before its optimizer; A drawn apart from the actor's
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
        if cfg.critic.lora is not None:
            self.register_state("critic_base", base_fingerprint(self, "critic.path", path))
        self.register_state("kl_controller", self.kl.state)

    def prepare_checkpoint_io(self) -> None:
        self.place("checkpoint", actor=("weights", "optimizer"), critic=("weights", "optimizer"))

    def keep_groups(self, batch: RolloutBatch) -> torch.Tensor:
        """[N / G] bool: DAPO's test (`DynamicSampling`), or with `algo.dynamic_sampling_by=verdict` the groups whose
        responses the reward model does not judge all alike, a response passing when a * s + b >= 0 (module doc)."""
        if self.verdict is None:  # the config allows a verdict only with dynamic sampling
            return super().keep_groups(batch)
        name, (a, b) = self.verdict
        return informative_groups((a * batch.terms[name].float() + b >= 0).float(), batch.group_size)

    def shape_rewards(self, batch: RolloutBatch) -> None:
        """The sequence score PPO trains on (module doc): each normalised (calibrated) RM's share swapped for its
        normalised score (its probability), the gated share for its whitened score (a collective over dp), less its
        group's mean (`algo.reward_group_center`), less `algo.missing_eos_penalty` for a response cut before its EOS,
        then the total clipped."""
        algo = self.cfg.algo
        for model in self.reward.outcome:
            raw = batch.terms.get(model.name)
            if model.name in self.score_stats:
                batch.rewards = batch.rewards + model.weight * (normalize_scores(raw, *self.score_stats[model.name]) - raw)
            elif model.name in self.score_platt:
                a, b = self.score_platt[model.name]
                batch.rewards = batch.rewards + model.weight * (torch.sigmoid(a * raw.float() + b) - raw)
        if self.reward.gated is not None:
            raw = batch.terms["gated"]
            batch.rewards = batch.rewards + self.reward.gated.weight * (whiten_scores(raw, self.layout.dp_group) - raw)
        if algo.reward_group_center:  # Dr. GRPO's advantage: r - its group's mean
            batch.rewards = group_advantages(batch.rewards, group_size=batch.group_size, mode="dr_grpo")
        if algo.missing_eos_penalty is not None:
            batch.rewards = missing_eos_penalty(batch.rewards, batch.finished, algo.missing_eos_penalty)
        if algo.reward_clip is not None:
            batch.rewards = normalize_scores(batch.rewards, clip=algo.reward_clip)

    def advantages(self, batch: RolloutBatch) -> None:
        """The critic's values, the per-token rewards (the score at the last token, -beta * KL_t with the KL in the
        reward, the PRMs' step rewards or an episode's per-turn rewards: `RolloutBatch.placed_rewards`), GAE's
        advantages (whitened over dp) and returns (module doc)."""
        algo, mask = self.cfg.algo, batch.response_mask
        with self.phase("values", critic=("weights",)):
            batch.values = self.score_responses(self.critic, batch, algo.micro_batch_size, self.critic.values,
                                                self.critic.pipeline_values)
        self.rollout_kl = torch.zeros_like(mask)
        if self.reference is not None:
            self.rollout_kl = kl_penalty(batch.old_logp, batch.ref_logp, algo.kl_kind).float() * mask
        in_reward = algo.kl_where == "reward" and self.reference is not None
        scores, placed = batch.placed_rewards()
        rewards, _ = token_rewards(scores, mask, batch.old_logp if in_reward else None,
                                   batch.ref_logp if in_reward else None, self.kl.beta, algo.kl_kind,
                                   step_rewards=placed)
        advantages, batch.returns = advantages_and_returns(rewards, batch.values, mask, algo.gamma, algo.lam)
        self.diagnostic_sums = critic_diagnostic_sums(batch.values, batch.returns, advantages, mask)
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
        """The critic's update, then the actor's (after `critic_warmup` steps); then the adaptive KL controller. A step
        whose dynamic sampling kept no group on any rank updates neither (counted as `empty_updates`)."""
        cfg, mask = self.cfg, batch.response_mask
        skip, counter = self.sampling_sums(sums, counts), "empty_updates"
        if skip is None:
            with self.phase("critic_update", critic=("weights", "optimizer")):
                norms = {"critic": self.train_role(self.critic, self.lr(cfg.critic.optim), batch,
                                                   self.critic_loss(batch), sums, "critic")}
            if self.progress["step"] < cfg.algo.critic_warmup:
                skip, counter = "critic warm-up", ""
        else:
            norms = {"critic": self.left_out(self.critic_loss(batch), sums, "critic")}
        norms["actor"] = self.update_actor(batch, sums, self.policy_loss(batch, self.kl.beta), skip, counter=counter)
        self.step_kl = (self.kl.beta, float(sequence_mean_kl(self.rollout_kl, mask, self.layout.dp_group)))
        self.kl.update(self.step_kl[1], cfg.rollout.prompts_per_step * cfg.rollout.group_size)
        valid = mask.double()
        for name, value in (("return", batch.returns), ("old_value", batch.values), ("kl_tokens", self.rollout_kl)):
            sums.add(name, (value.double() * valid).sum())
        sums.add("valid_tokens", valid.sum())
        for name, value in self.diagnostic_sums.items():
            sums.add(f"diagnostic/{name}", value)
        return norms

    def metrics(self, total: dict[str, float], norms: dict[str, list[torch.Tensor]],
                counts: dict[str, float]) -> dict[str, float]:
        cfg = self.cfg
        tokens, critic_tokens = max(total["valid_tokens"], 1.0), max(total["critic/tokens"], 1.0)
        diagnostics = critic_diagnostics({k[len("diagnostic/"):]: v for k, v in total.items()
                                          if k.startswith("diagnostic/")})
        return {
            **diagnostics, **self.sampling_metrics(total, counts),
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
