"""The reward role: rule-based verifiers and user functions (`megalign.rewards`), plus an optional reward model.

Verifiers and user functions run on the host on decoded text, each sample isolated by `SafeReward`
(a raising function scores 0 and is counted). A reward model is an HF sequence-classification
checkpoint loaded as `RewardModel` (`models.from_pretrained(kind="reward")`) on the role's own
layout and dtype; it reads the last real token of prompt + response, and its score enters the
total with `model_weight`. Only the reward model holds device memory ("weights", offloadable).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, Sequence

import torch

from megalign.config import option
from megalign.models import RewardModel
from megalign.parallel import ParallelLayout
from megalign.parallel.collectives import all_reduce
from megalign.rewards import RewardTerm, build_reward
from megalign.roles.base import ModelRoleConfig, Role, module_slots


@dataclasses.dataclass
class RewardConfig:
    """The total reward: a weighted sum of verifier / user-function terms and an optional reward model."""

    terms: list[RewardTerm] = option([RewardTerm("math_accuracy", 1.0)],
                                     doc="verifier or user-function terms ('module:function' or 'file.py:function')")
    model: Optional[ModelRoleConfig] = option(None, doc="a reward-model role (HF sequence-classification checkpoint)")
    model_weight: float = option(1.0, doc="weight of the reward model's score in the total")
    max_failure_fraction: float = option(
        0.5, doc="stop the run when a term fails (raises, non-number) on more than this fraction of a step's samples")

    def __post_init__(self):
        if not self.terms and self.model is None:
            raise ValueError("the reward needs at least one term or a reward model")
        if self.model is not None and self.model.path is None:
            raise ValueError("reward.model.path is required for a reward-model role")
        if not math.isfinite(self.model_weight):
            raise ValueError(f"model_weight must be finite, got {self.model_weight}")
        if not 0 <= self.max_failure_fraction <= 1:
            raise ValueError(f"max_failure_fraction must be in [0, 1], got {self.max_failure_fraction}")


class Reward(Role):
    """Scores a batch of responses: `score(...) -> (total [N] fp32, per-term means)`."""

    def __init__(self, cfg: RewardConfig, model: Optional[RewardModel], layout: Optional[ParallelLayout]):
        offload = cfg.model is not None and cfg.model.offload_weights
        super().__init__("reward", layout, {"weights": offload})
        self.functions = build_reward(cfg.terms) if cfg.terms else None
        self.model = model
        self.model_weight = cfg.model_weight
        self.max_failure_fraction = cfg.max_failure_fraction
        if model is not None:
            model.requires_grad_(False).eval()

    def parts(self):
        return {"weights": module_slots(self.model)} if self.model is not None else {}

    @torch.no_grad()
    def score(self, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[Any],
              metadata: Sequence[Mapping[str, Any]], sequences: torch.Tensor,
              attention_mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Total rewards [N] fp32 and {term name: [N] values} for N responses.

        Text inputs feed the verifier terms; `sequences` / `attention_mask` [N, P + R] (prompt +
        response token ids) feed the reward model.
        """
        total = torch.zeros(len(responses))
        terms: dict[str, torch.Tensor] = {}
        if self.functions is not None:
            breakdown = self.functions.score(prompts, responses, answers, metadata)
            total += torch.tensor(breakdown.total)
            terms = {name: torch.tensor(values) for name, values in breakdown.terms.items()}
        if self.model is not None:
            device = self.layout.device
            scores = self.model(sequences.to(device), attention_mask.to(device)).float().cpu()
            terms["reward_model"] = scores
            total += self.model_weight * scores
        return total, terms

    def error_counts(self) -> dict[str, float]:
        """Cumulative per-term error and sample counters (`SafeReward.metrics`)."""
        return self.functions.metrics() if self.functions is not None else {}

    def counters(self) -> dict[str, list[int]]:
        """{term name: [failed samples, scored samples]}, cumulative."""
        return {name: [fn.errors, fn.samples] for name, fn, _ in self.functions.terms} if self.functions else {}

    def check_failures(self, since: Mapping[str, Sequence[int]], group, device: torch.device) -> None:
        """Raise when a term failed on more than `max_failure_fraction` of the samples scored after `counters()`
        returned `since` (summed over `group`, so every rank raises together), chaining the term's last error.

        A verifier that fails on most samples is a bug in the verifier or the data, not noise: training
        on its zeros would finish "successfully" and learn nothing.
        """
        names = list(since)
        if not names:
            return
        now = self.counters()
        local = torch.tensor([[now[n][0] - since[n][0], now[n][1] - since[n][1]] for n in names], dtype=torch.float64)
        total = all_reduce(local.to(device), group).cpu()
        for name, (errors, samples) in zip(names, total.tolist()):
            if samples and errors / samples > self.max_failure_fraction:
                last = dict((n, fn) for n, fn, _ in self.functions.terms)[name].last_error
                raise RuntimeError(
                    f"reward term {name!r} failed on {int(errors)} of {int(samples)} samples this step, more than "
                    f"reward.max_failure_fraction={self.max_failure_fraction}; its last error: {last!r}") from last

    def state_dict(self) -> dict[str, list[int]]:
        """The cumulative error/sample counters of each term, so a resumed run keeps counting."""
        return self.counters()

    def load_state_dict(self, state: Mapping[str, Sequence[int]]) -> None:
        for name, fn, _ in self.functions.terms if self.functions else []:
            fn.errors, fn.samples = (int(v) for v in state[name])
