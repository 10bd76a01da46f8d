"""The policy-gradient options GRPO and PPO share, declared once: the surrogate (`policy_loss: ppo | cispo |
gspo` and its clip ranges), the KL to the reference and the entropy bonus.

`PolicyLossOptions` is a dataclass mixin of both trainers' `algo` sections (`megalign.trainers.grpo.AlgoConfig`,
`megalign.trainers.ppo.PPOAlgoConfig`). `actor_policy_loss` calls the chosen variant of
`megalign.algos.policy_losses` with its clip range, so the actor's micro-batch loss is one call whatever the
choice; the fused `megalign.ops.policy_loss` serves "ppo" and, in the same pass, GRPO's k3 KL term.

The KL has one name and one path in every algorithm: `kl_coef` (beta) times a per-token estimate
`kl_estimator` of KL(pi || pi_ref), placed by `kl_in` either in the loss (GRPO's beta * k3; k3 or verl's
clamped low_var_kl) or in the per-token reward as -beta * KL_t (PPO, REINFORCE++; k1, abs or k3). The
placement defaults to the reward for PPO and the reinforce_plus_plus* estimators (which train on per-token
rewards) and to the loss for the group estimators, which have no per-token reward to put it in.

`positive_nll_coef` adds VAPO's positive-example LM loss (Yue et al. 2025, "VAPO", eq. 9: L = L_PPO + mu * L_NLL,
L_NLL the mean negative log-likelihood over the tokens of the step's right samples, here those whose reward is at
least `positive_reward`): an imitation term on the policy's own right answers that needs no baseline, which the
paper adds because a value model's noisy baseline wastes them. `positive_nll_weights` gives its per-token weights,
scaled so that the token-mean aggregation of the policy loss turns them into the mean over the positive tokens.

`off_policy` (`megalign.algos.offpolicy`) weighs the policy-gradient term by the proximal / behaviour importance
weight (TIS, MIS, sequence masking, AReaL's decoupled PPO); its default, none, leaves the loss untouched.

Defaults are the papers': CISPO with no lower bound on the weight and 1 + 0.28 above (MiniMax-M1 tunes only
the upper bound; 0.28 is DAPO's clip-higher; SkyRL, citing ScaleRL's recipe, clips the weight at 5 instead),
GSPO with 3e-4 / 4e-4.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal, Optional

import torch
import torch.distributed as dist

from megalign.algos.offpolicy import OffPolicyConfig, weighted_policy_loss
from megalign.algos.policy_losses import POLICY_LOSSES, select_policy_loss
from megalign.algos.ppo import KL_IN_REWARD
from megalign.config import option
from megalign.ops.kl_penalty import kl_penalty
from megalign.ops.policy_loss import PolicyLossStats

GSPO_AGGREGATION = "seq-mean-token-mean"
KL_ESTIMATORS = {"loss": ("k3", "low_var_kl"), "reward": KL_IN_REWARD}
"""Per-token KL estimators (`megalign.ops.kl_penalty` names) accepted in each place."""
REWARD_KL_COEF = 0.01
"""The KL coefficient in the reward when none is set (OpenRLHF's REINFORCE++ default)."""
FUSED_KL = "k3"
"""The loss-side estimator the fused policy loss computes in its own pass."""


@dataclasses.dataclass
class PolicyLossOptions:
    """Which policy loss the actor trains with, its clip ranges, the KL to the reference and the entropy bonus."""

    RENAMED: ClassVar[dict[str, str]] = {
        "beta": "use algo.kl_coef, the KL coefficient of GRPO, PPO and REINFORCE++ alike, with algo.kl_in=loss "
                "(GRPO's beta * k3 loss term)"}

    policy_loss: Literal["ppo", "cispo", "gspo"] = option(
        "ppo", doc="ppo: clipped surrogate (eps_low / eps_high / dual_clip); cispo: clipped stop-gradient IS weight "
                   "x log pi (MiniMax-M1); gspo: one clipped sequence ratio (Qwen; needs loss_agg=seq-mean-token-mean)")
    eps_low: float = option(0.2, doc="ppo surrogate: ratio >= 1 - eps_low")
    eps_high: Optional[float] = option(None, doc="ppo surrogate: ratio <= 1 + eps_high (DAPO's clip-higher, e.g. 0.28); null: eps_low")
    dual_clip: Optional[float] = option(None, doc="dual-clip bound c > 1 for negative advantages (Ye et al. 2020); null: off")
    cispo_eps_low: Optional[float] = option(None, doc="cispo: IS weight >= 1 - cispo_eps_low; null: no lower bound (the paper)")
    cispo_eps_high: float = option(0.28, doc="cispo: IS weight <= 1 + cispo_eps_high")
    gspo_eps_low: float = option(3e-4, doc="gspo: sequence ratio >= 1 - gspo_eps_low (the paper's 3e-4)")
    gspo_eps_high: float = option(4e-4, doc="gspo: sequence ratio <= 1 + gspo_eps_high (the paper's 4e-4)")
    kl_coef: Optional[float] = option(None, doc="beta: coefficient of the KL to the reference (module doc); 0: no KL "
                                                "and no reference role; null: 0.01 in the reward (OpenRLHF's REINFORCE++ "
                                                "default), 0 in the loss")
    kl_in: Optional[Literal["loss", "reward"]] = option(
        None, doc="where the KL goes: loss (a per-token loss term) or reward (-beta * KL_t in the per-token reward); "
                  "null: reward for PPO and the reinforce_plus_plus* estimators, else loss")
    kl_estimator: Optional[str] = option(None, doc=f"per-token KL: in the loss one of {', '.join(KL_ESTIMATORS['loss'])}, "
                                                   f"in the reward one of {', '.join(KL_ESTIMATORS['reward'])}; "
                                                   f"null: k3 in the loss, k1 in the reward")
    entropy_coef: float = option(0.0, doc="entropy bonus: loss -= entropy_coef * entropy per token")
    positive_nll_coef: float = option(0.0, doc="VAPO's positive-example LM loss: + coef x the mean NLL over the tokens "
                                               "of the samples whose reward is >= positive_reward (module doc; the "
                                               "paper's 0.1); 0: off")
    positive_reward: float = option(1.0, doc="the reward (after the algorithm's shaping) from which a sample is "
                                             "positive for positive_nll_coef; 1.0: a 0/1 verifier's right answers")
    off_policy: OffPolicyConfig = option(OffPolicyConfig(), doc="off-policy correction {mode: none|tis|mis|seq_mask|"
                                                                "decoupled, cap, band, seq_ratio} between the recomputed "
                                                                "and the rollout's log-probs (`megalign.algos.offpolicy`)")

    def check_policy_loss(self, token_rewards: bool) -> None:
        """Cross-field checks, and the KL as resolved from its null defaults: `kl_where` ("loss" or "reward"),
        `kl_beta` (the coefficient), `kl_kind` (the estimator). Called from the section's `__post_init__`;
        `token_rewards`: whether the algorithm has a per-token reward to put the KL in. Errors name the bad value."""
        select_policy_loss(self.policy_loss)
        # the KL as resolved (not fields: a null field stays null in config.yaml, so it means the same on resume)
        self.kl_where = self.kl_in or ("reward" if token_rewards else "loss")
        self.kl_beta = self.kl_coef if self.kl_coef is not None else (REWARD_KL_COEF if self.kl_where == "reward" else 0.0)
        self.kl_kind = self.kl_estimator or KL_ESTIMATORS[self.kl_where][0]
        for name in ("eps_low", "eps_high", "cispo_eps_low", "cispo_eps_high", "gspo_eps_low", "gspo_eps_high",
                     "kl_beta", "entropy_coef", "positive_nll_coef"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip}")
        if self.policy_loss != "ppo" and self.dual_clip is not None:
            raise ValueError(f"dual_clip={self.dual_clip} bounds the ppo surrogate only; policy_loss={self.policy_loss!r} "
                             f"needs dual_clip=null")
        if self.policy_loss == "gspo" and self.loss_agg != GSPO_AGGREGATION:
            raise ValueError(f"policy_loss='gspo' is a sequence-level objective: it needs loss_agg={GSPO_AGGREGATION!r}, "
                             f"got loss_agg={self.loss_agg!r}")
        if self.positive_nll_coef and self.loss_agg != "token-mean":
            raise ValueError(f"positive_nll_coef is VAPO's token-level NLL mean: it needs loss_agg='token-mean', got "
                             f"loss_agg={self.loss_agg!r}")
        if self.kl_where == "reward" and not token_rewards:
            raise ValueError("kl_in='reward' needs per-token rewards, which this advantage estimator does not use "
                             "(reinforce_plus_plus and reinforce_plus_plus_baseline do); use kl_in='loss'")
        if self.kl_kind not in KL_ESTIMATORS[self.kl_where]:
            raise ValueError(f"kl_estimator must be one of {list(KL_ESTIMATORS[self.kl_where])} with kl_in="
                             f"{self.kl_where!r}, got {self.kl_kind!r}")

    def clip_range(self) -> tuple[Optional[float], Optional[float]]:
        """(eps_low, eps_high) of the chosen variant."""
        return {"ppo": (self.eps_low, self.eps_high), "cispo": (self.cispo_eps_low, self.cispo_eps_high),
                "gspo": (self.gspo_eps_low, self.gspo_eps_high)}[self.policy_loss]

    def actor_policy_loss(self, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                          mask: torch.Tensor, beta: float = 0.0, ref_logp: Optional[torch.Tensor] = None,
                          weight: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, PolicyLossStats]:
        """Per-token loss [b, R] and PolicyLossStats of the chosen variant (`megalign.algos.policy_losses`), plus
        `beta` x the `kl_kind` KL to `ref_logp` [b, R] per token. k3 (and beta = 0, where the KL is only
        measured: `kl_mean`, k3, whenever `ref_logp` is given) runs in the variant's own pass; another estimator
        is added here, its mean then in `kl_mean`. `weight` [b, R]: the off-policy weight of the policy-gradient term
        (`megalign.algos.offpolicy.weighted_policy_loss`; None: no correction, the path above)."""
        eps_low, eps_high = self.clip_range()
        if weight is not None:
            return weighted_policy_loss(POLICY_LOSSES[self.policy_loss], weight, logp, old_logp, advantages, mask,
                                        eps_low, eps_high, self.dual_clip, beta, ref_logp, self.kl_kind)
        if ref_logp is None or not beta or self.kl_kind == FUSED_KL:
            return POLICY_LOSSES[self.policy_loss](logp, old_logp, advantages, mask, eps_low, eps_high, self.dual_clip,
                                                   beta, ref_logp)
        loss, stats = POLICY_LOSSES[self.policy_loss](logp, old_logp, advantages, mask, eps_low, eps_high,
                                                      self.dual_clip)
        kl = kl_penalty(logp, ref_logp, self.kl_kind) * mask
        return loss + beta * kl, stats._replace(kl_mean=kl.detach().sum() / stats.count.clamp(min=1))


def positive_nll_weights(rewards: torch.Tensor, mask: torch.Tensor, threshold: float, coef: float,
                         group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """[N, R] per-token weights of the positive-example NLL (module doc): coef * T / T_pos on the `mask` [N, R]
    tokens of the samples whose `rewards` [N] are >= `threshold`, 0 elsewhere, T and T_pos the step's masked and
    positive tokens summed over `group` (dp). Token-mean over T turns sum(w * -logp) into coef * the mean NLL over
    the positive tokens (VAPO's mu * L_NLL): exact with one mini-batch; with several, each takes the step's ratio.
    All zeros when no sample of the step is positive."""
    positive = (rewards >= threshold).to(mask.dtype)[:, None] * mask
    counts = torch.stack([mask.sum(), positive.sum()]).double()
    if group is not None and dist.is_initialized():
        dist.all_reduce(counts, group=group)
    if counts[1] == 0:
        return torch.zeros_like(mask)
    return positive * (coef * counts[0] / counts[1]).to(mask.dtype)
