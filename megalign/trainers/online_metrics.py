"""The metrics every online algorithm logs beside its own (`OnlineMetrics`, a mixin of `OnlineTrainer`): the
rollout's reward, term, length and truncation means over every generated response, the reward's error counts,
the data, timer, memory and throughput figures.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from megalign.parallel.collectives import all_reduce
from megalign.rewards.ranking import ranking_pairs
from megalign.rollout import RolloutBatch
from megalign.trainers.base import MetricSums
from megalign.trainers.logging import memory_report


class OnlineMetrics:
    """`rollout_sums` and `step_metrics` for an `OnlineTrainer`."""

    def rollout_sums(self, generated: RolloutBatch) -> MetricSums:
        """The sums over every generated response that `step_metrics` turns into means (reward, terms, lengths) and,
        with `reward.check_with`, each outcome reward model's ranking pairs (`pairwise_sums`)."""
        sums = self.pairwise_sums(generated)
        rewards = generated.rewards.double()
        sums.add("reward", rewards.sum())
        sums.add("reward_sq", (rewards ** 2).sum())
        for name, values in generated.terms.items():  # NaN: the term does not apply (a rubric category absent)
            known = ~torch.isnan(values.double())
            sums.add(f"term/{name}", values.double()[known].sum())
            sums.add(f"count/{name}", known.sum())
        sums.add("length", generated.lengths.sum())
        sums.add("unfinished", (~generated.finished).sum())
        sums.add("responses", len(generated))
        return sums

    def pairwise_sums(self, generated: RolloutBatch) -> MetricSums:
        """Per outcome reward model, the same-prompt pairs of this step's samples that the `reward.check_with`
        verifier separates (right vs wrong) and the U of those the model orders the same way, ties half
        (`megalign.rewards.ranking`): the model's held-out pairwise accuracy on the current policy's samples."""
        sums, check = MetricSums(), self.cfg.reward.check_with
        if check is None:
            return sums
        right = (generated.terms[check] >= 0.5).tolist()
        for model in self.reward.outcome:
            u, pairs = ranking_pairs(generated.terms[model.name].tolist(), right, generated.group_size)
            sums.add(f"pairs_u/{model.name}", u)
            sums.add(f"pairs/{model.name}", pairs)
        return sums

    def reward_error_metrics(self) -> dict[str, float]:
        """The reward's cumulative error and verdict counts summed over dp (a collective); on a disaggregated run's
        training ranks the rollout side's, which came with the step's batch (`remote_errors`)."""
        if self.remote_errors is not None:
            return dict(self.remote_errors)
        counts = self.reward.error_counts()
        if not counts:
            return {}
        errors = torch.tensor(list(counts.values()), dtype=torch.float64)
        errors = all_reduce(errors.to(self.layout.device), self.layout.dp_group).cpu()
        return dict(zip(counts, errors.tolist()))

    def step_metrics(self, total: dict[str, float], terms, algorithm: dict[str, Any], start: float) -> dict[str, float]:
        """A step's metrics: the rollout's means (from `rollout_sums`, reduced into `total`; `terms`: the reward
        term names), the algorithm's own, reward error counts over dp, data, timer, memory and throughput."""
        n = max(total["responses"], 1.0)
        mean = total["reward"] / n
        metrics = {
            "reward/mean": mean, "reward/std": max(total["reward_sq"] / n - mean ** 2, 0.0) ** 0.5,
            **{f"reward/{name}/mean": total[f"term/{name}"] / total[f"count/{name}"] if total[f"count/{name}"]
               else float("nan") for name in terms},
            "response_length/mean": total["length"] / n, "response_length/clip_ratio": total["unfinished"] / n,
            **algorithm,
            "tokens_per_s": total["length"] / max(self.timer.seconds.get("generate", 0.0), 1e-9),
        }
        for model in self.reward.outcome if self.cfg.reward.check_with is not None else ():
            pairs = total[f"pairs/{model.name}"]
            metrics[f"reward/{model.name}/pairs"] = pairs
            metrics[f"reward/{model.name}/pairwise_acc"] = total[f"pairs_u/{model.name}"] / pairs if pairs else float("nan")
        if self.cfg.eval.metric in terms:
            metrics["accuracy"] = metrics[f"reward/{self.cfg.eval.metric}/mean"]
        metrics.update(self.reward_error_metrics())
        metrics.update(self.train_set.stats.as_dict())  # rows left out at load (invalid, too long), every step
        metrics.update(self.timer.metrics())
        metrics.update(self.memory)
        metrics.update(self.rollout_metrics)
        metrics.update(memory_report())
        metrics["time/step"] = time.perf_counter() - start
        return {k: float(v) for k, v in metrics.items()}
