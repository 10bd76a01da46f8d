"""DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476, section 3.2), declared once for GRPO and PPO: drop each
sampling round's groups whose G rewards are all equal (`megalign.algos.grpo.informative_groups`) and generate more
rounds until the step has `rollout.prompts_per_step` groups or `algo.max_sampling_rounds` is reached.

`DynamicSamplingOptions` is a dataclass mixin of both trainers' `algo` sections; `DynamicSampling` a mixin of their
trainers that fills the online template's `keep_groups` / `sampling_rounds` hooks (`megalign.trainers.online`),
counts the kept and dropped groups and says when a step kept none on any rank (its updates are then skipped: an
optimizer step on zero gradients would still move AdamW's weights through its momentum).

Why it applies to PPO too, for another reason. Under GRPO a group of equal rewards has advantage exactly
0, so dropping it only stops it diluting the batch. Under PPO the critic gives such a group nonzero GAE advantages,
R - V(s_t): for a prompt the policy always solves, 1 - V pushes the already certain answers further up, for one it
never solves, -V pushes the sampled wrong answers down; neither carries a contrast the step measured, only the
critic's error, and the first accelerates the entropy collapse the embedded run shows (BENCHMARKS.md, "PPO with the
verifier at GRPO's budget"). Filtering makes PPO's actor train, as GRPO's does, on the prompts where sampling found
both outcomes; the critic trains on the same kept groups, the prompts whose baseline the actor's update uses. VAPO
(arXiv 2504.05118), PPO with a value model, samples G responses per prompt ("group-sampling"); the filter here is
DAPO's, and it is an option of both algorithms, off by default, and BENCHMARKS.md records what it does for PPO.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megalign.algos.grpo import informative_groups
from megalign.config import option
from megalign.parallel.collectives import all_reduce_count
from megalign.rollout import RolloutBatch
from megalign.trainers.base import MetricSums


@dataclasses.dataclass
class DynamicSamplingOptions:
    """Whether a step drops groups of equal rewards and samples more (DAPO), and how many rounds it may take."""

    dynamic_sampling: bool = option(False, doc="drop groups whose rewards are all equal and generate more (DAPO)")
    max_sampling_rounds: int = option(3, doc="dynamic sampling: generation rounds per step at most")

    def check_dynamic_sampling(self) -> None:
        if self.max_sampling_rounds < 1:
            raise ValueError(f"max_sampling_rounds must be >= 1, got {self.max_sampling_rounds}")


class DynamicSampling:
    """`keep_groups`, `sampling_rounds` and the group counts for an `OnlineTrainer` whose `algo` section is a
    `DynamicSamplingOptions` (module doc)."""

    def keep_groups(self, batch: RolloutBatch) -> torch.Tensor:
        if self.cfg.algo.dynamic_sampling:
            return informative_groups(batch.rewards, batch.group_size)
        return super().keep_groups(batch)

    def sampling_rounds(self) -> int:
        return self.cfg.algo.max_sampling_rounds if self.cfg.algo.dynamic_sampling else 1

    def sampling_sums(self, sums: MetricSums, counts: dict[str, float]) -> Optional[str]:
        """Add this rank's kept / dropped group counts to `sums`; return why the step's updates are skipped (no rank
        kept an informative group: a collective over dp), else None."""
        sums.add("dropped_groups", counts["dropped_groups"])
        sums.add("kept_groups", counts["kept_groups"])
        empty = self.cfg.algo.dynamic_sampling and all_reduce_count(counts["kept_groups"], self.layout.dp_group,
                                                                    self.layout.device) == 0
        return "dynamic sampling kept no group with unequal rewards on any rank" if empty else None

    def sampling_metrics(self, total: dict[str, float], counts: dict[str, float]) -> dict[str, float]:
        """`sampling/rounds` and the kept and dropped groups over every rank."""
        return {"sampling/rounds": counts["rounds"], "sampling/dropped_groups": total["dropped_groups"],
                "sampling/kept_groups": total["kept_groups"]}
