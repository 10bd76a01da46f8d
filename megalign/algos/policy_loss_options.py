"""The policy-loss choice shared by the GRPO and PPO configs: `algo.policy_loss: ppo | cispo | gspo`.

`PolicyLossOptions` is a dataclass mixin of both trainers' `algo` sections (`AlgoConfig`,
`PPOAlgoConfig`, which keep their own `eps_low`, `eps_high`, `dual_clip` for the ppo surrogate);
`actor_policy_loss` calls the chosen variant of `megalign.algos.policy_losses` with its clip range,
so each trainer's micro-batch loss stays one call whatever the choice. The fused
`megalign.ops.policy_loss` serves "ppo". Defaults are the papers': CISPO with no lower bound on the
weight and 1 + 0.28 above (MiniMax-M1 tunes only the upper bound; 0.28 is DAPO's clip-higher, which
its comparison starts from; SkyRL, citing ScaleRL's recipe, clips the weight at 5 instead), GSPO
with 3e-4 / 4e-4.
"""
from __future__ import annotations

import dataclasses
from typing import Literal, Optional

import torch

from megalign.algos.policy_losses import POLICY_LOSSES, select_policy_loss
from megalign.config import option
from megalign.ops.policy_loss import PolicyLossStats

GSPO_AGGREGATION = "seq-mean-token-mean"


@dataclasses.dataclass
class PolicyLossOptions:
    """Which policy loss the actor trains with, and the clip ranges of the cispo / gspo variants."""

    policy_loss: Literal["ppo", "cispo", "gspo"] = option(
        "ppo", doc="ppo: clipped surrogate (eps_low / eps_high / dual_clip); cispo: clipped stop-gradient IS weight "
                   "x log pi (MiniMax-M1); gspo: one clipped sequence ratio (Qwen; needs loss_agg=seq-mean-token-mean)")
    cispo_eps_low: Optional[float] = option(None, doc="cispo: IS weight >= 1 - cispo_eps_low; null: no lower bound (the paper)")
    cispo_eps_high: float = option(0.28, doc="cispo: IS weight <= 1 + cispo_eps_high")
    gspo_eps_low: float = option(3e-4, doc="gspo: sequence ratio >= 1 - gspo_eps_low (the paper's 3e-4)")
    gspo_eps_high: float = option(4e-4, doc="gspo: sequence ratio <= 1 + gspo_eps_high (the paper's 4e-4)")

    def check_policy_loss(self) -> None:
        """Cross-field checks (called from the section's `__post_init__`); errors name the bad value."""
        select_policy_loss(self.policy_loss)
        for name in ("cispo_eps_low", "cispo_eps_high", "gspo_eps_low", "gspo_eps_high"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.policy_loss != "ppo" and self.dual_clip is not None:
            raise ValueError(f"dual_clip={self.dual_clip} bounds the ppo surrogate only; policy_loss={self.policy_loss!r} "
                             f"needs dual_clip=null")
        if self.policy_loss == "gspo" and self.loss_agg != GSPO_AGGREGATION:
            raise ValueError(f"policy_loss='gspo' is a sequence-level objective: it needs loss_agg={GSPO_AGGREGATION!r}, "
                             f"got loss_agg={self.loss_agg!r}")

    def clip_range(self) -> tuple[Optional[float], Optional[float]]:
        """(eps_low, eps_high) of the chosen variant."""
        return {"ppo": (self.eps_low, self.eps_high), "cispo": (self.cispo_eps_low, self.cispo_eps_high),
                "gspo": (self.gspo_eps_low, self.gspo_eps_high)}[self.policy_loss]

    def actor_policy_loss(self, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                          mask: torch.Tensor, beta: float = 0.0, ref_logp: Optional[torch.Tensor] = None
                          ) -> tuple[torch.Tensor, PolicyLossStats]:
        """Per-token loss [b, R] and PolicyLossStats of the chosen variant (`megalign.algos.policy_losses`)."""
        eps_low, eps_high = self.clip_range()
        return POLICY_LOSSES[self.policy_loss](logp, old_logp, advantages, mask, eps_low, eps_high, self.dual_clip,
                                               beta, ref_logp)
