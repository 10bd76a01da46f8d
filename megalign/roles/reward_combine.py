"""Reward models combined into one term of the total: Llama 2's gated pair (`reward.gated`) and an ensemble's
mean or minimum (`reward.ensemble`), their configs and the checks of the names they refer to.

The models they combine enter the total only through the combined term (`megalign.roles.reward.Reward.score`),
and PPO's per-model normalisation or calibration (`algo.reward_normalize`, `algo.reward_calibrate`) leaves them
alone: the gated term is whitened, the ensemble's members are standardised inside it
(`megalign.algos.reward_shaping`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Literal, Optional

from megalign.algos.reward_shaping import ENSEMBLE_REDUCTIONS
from megalign.config import option

GATED_TERMS = ("gated", "gated_safety_branch")
"""Term names of the gated reward; no reward model may take them."""


@dataclasses.dataclass
class GatedRewardConfig:
    """Llama 2's gated pair (Touvron et al. 2023, §3.2.2 / §3.2.4; `megalign.algos.reward_shaping`)."""

    safety: str = option(doc="name of the safety reward model (an outcome model of reward.models)")
    helpful: str = option(doc="name of the helpfulness reward model (an outcome model of reward.models)")
    threshold: float = option(0.15, doc="the safety branch is taken when sigmoid(safety score) < threshold (Llama 2: 0.15)")
    safety_field: str = option("is_safety", doc="the prompt rows' boolean field marking a safety prompt (always the safety branch)")
    weight: float = option(1.0, doc="weight of the gated score LOGIT(R_c) in the total")

    def __post_init__(self):
        if self.safety == self.helpful:
            raise ValueError(f"safety and helpful must name two different reward models, both are {self.safety!r}")
        if not 0 < self.threshold < 1:
            raise ValueError(f"threshold must be in (0, 1) (a probability), got {self.threshold}")
        if not self.safety_field:
            raise ValueError("safety_field must name a field of the prompt rows")
        if not math.isfinite(self.weight):
            raise ValueError(f"weight must be finite, got {self.weight}")


@dataclasses.dataclass
class EnsembleRewardConfig:
    """A reward-model ensemble (Coste et al. 2024; `megalign.algos.reward_shaping.ensemble_reward`): its members'
    scores, each standardised with its own `reward_stats.json`, reduced to one term `name` (and `<name>_spread`, the
    members' disagreement)."""

    models: list[str] = option(doc="names of two or more outcome reward models of reward.model / reward.models, each "
                                   "exported by the megalign RM trainer (reward_stats.json beside it)")
    reduce: Literal["mean", "min"] = option("min", doc=f"one of {ENSEMBLE_REDUCTIONS}: the members' mean, or their "
                                                       "minimum (worst-case, the conservative choice)")
    name: str = option("ensemble", doc="the term's name (metrics reward/<name>/mean and reward/<name>_spread/mean)")
    weight: float = option(1.0, doc="weight of the ensemble's term in the total")

    def __post_init__(self):
        if len(self.models) < 2 or len(set(self.models)) != len(self.models):
            raise ValueError(f"models must name two or more different reward models, got {self.models}")
        if not self.name or "/" in self.name or ":" in self.name or "[" in self.name:
            raise ValueError(f"name {self.name!r} must be non-empty without '/', ':' or '['")
        if not math.isfinite(self.weight):
            raise ValueError(f"weight must be finite, got {self.weight}")

    def terms(self) -> tuple[str, str]:
        return self.name, f"{self.name}_spread"


def check_combined(gated: Optional[GatedRewardConfig], ensemble: Optional[EnsembleRewardConfig],
                   kinds: dict[str, str]) -> None:
    """The names `reward.gated` and `reward.ensemble` refer to against `kinds` {model name: kind} of every reward
    model: each an outcome model, none in both, the ensemble's terms clashing with no model."""
    outcome = [n for n, k in kinds.items() if k == "outcome"]
    refs = [(f"gated.{key}", getattr(gated, key)) for key in ("safety", "helpful")] if gated is not None else []
    refs += [(f"ensemble.models[{i}]", name) for i, name in enumerate(ensemble.models)] if ensemble is not None else []
    for key, name in refs:
        if kinds.get(name) != "outcome":
            raise ValueError(f"reward.{key}={name!r} must name an outcome reward model of reward.models; "
                             f"outcome models: {outcome}")
    if gated is not None and ensemble is not None and {gated.safety, gated.helpful} & set(ensemble.models):
        raise ValueError("a reward model may enter the total through reward.gated or reward.ensemble, not both")
    if ensemble is not None and set(ensemble.terms()) & (set(kinds) | set(GATED_TERMS)):
        raise ValueError(f"reward.ensemble.name={ensemble.name!r}: its terms {list(ensemble.terms())} clash with a "
                         f"reward model's or the gated terms' names")


def combined_members(gated: Optional[GatedRewardConfig], ensemble: Optional[EnsembleRewardConfig]) -> set[str]:
    """Names of the reward models that enter the total only through a combined term."""
    members = {gated.safety, gated.helpful} if gated is not None else set()
    return members | set(ensemble.models) if ensemble is not None else members
