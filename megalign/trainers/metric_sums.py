"""Metrics reduced over ranks by name: `MetricSums` (named sums, one all-reduce, then named means; no positional
`total[8]` that must line up with a tuple of names)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megalign.parallel.collectives import all_reduce


class MetricSums:
    """Named float64 sums reduced over a group in one all-reduce: `add` locally, `reduce` to totals.

        sums = MetricSums(); sums.add("reward", rewards.sum()); sums.add("count", rewards.numel())
        totals = sums.reduce(layout.dp_group, device)   # {"reward": ..., "count": ...} over dp
    """

    def __init__(self):
        self._values: dict[str, torch.Tensor] = {}

    def add(self, name: str, value) -> None:
        """Accumulate `value` (a number or a 0-d / 1-element tensor, left on its device: no host sync)."""
        value = torch.as_tensor(value, dtype=torch.float64).detach().reshape(())
        self._values[name] = self._values[name] + value if name in self._values else value

    def add_means(self, metrics) -> None:
        """Add {name: (total, count)} pairs (e.g. `megalign.algos` stats' `metrics()`), to log as total / count."""
        for name, (total, count) in metrics.items():
            self.add(f"{name}/total", total)
            self.add(f"{name}/count", count)

    @staticmethod
    def means(totals: dict[str, float]) -> dict[str, float]:
        """{name: total / count} of the reduced pairs `add_means` added."""
        names = [k[:-len("/total")] for k in totals if k.endswith("/total")]
        return {name: totals[f"{name}/total"] / max(totals[f"{name}/count"], 1.0) for name in names}

    def reduce(self, group: Optional[dist.ProcessGroup], device: torch.device) -> dict[str, float]:
        """{name: sum over the group's ranks}; every rank of the group must add the same names in the same order."""
        if not self._values:
            return {}
        total = all_reduce(torch.stack([v.to(device) for v in self._values.values()]), group).cpu()
        return dict(zip(self._values, total.tolist()))
