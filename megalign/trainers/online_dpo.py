"""Online DPO (Guo et al. 2024, arXiv 2402.04792; TRL's `OnlineDPOTrainer`) on the online step template:
`train_online_dpo(cfg)`.

    collect     G samples a prompt (default 2, the paper's), scored by the reward role [- algo.missing_eos_penalty
                for responses without EOS]
    score       one pair a prompt (`preference_pairs`: the best against the worst; a prompt whose rewards all tie
                gives none, counted as `pairs/tied`) and, for a loss against the reference, the reference's summed
                log-probs of both
    update      `ppo_epochs` x `mini_batches` updates of the offline trainer's pairwise loss (`algo` is its
                `PreferenceAlgoConfig`: any `PAIR_LOSSES` entry), one unit a pair (the mean over the global pairs)
    metrics     TRL's names: rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies, logps/chosen,
                logps/rejected, objective/scores_margin, val/contain_eos_token

Design choices:

- Log-probs are the offline trainer's (`megalign.roles.sequence_logps`: the fused head on the response tokens,
  EOS included) at temperature 1, as TRL computes them: DPO's implicit reward is about the policy itself and the
  loss has no ratio to the sampler, so `rollout.temperature` shapes only the sampling (and `old_logprobs` is
  unused).
- Ties are dropped where TRL makes the first sample the chosen one. At actor.pp > 1 a 1F1B micro-batch holds
  whole pairs (chosen and rejected rows interleaved) of one fixed shape, so every prompt keeps its pair, a tied
  one with weight 0 (no loss, no gradient, not in the metrics).
- Differences from TRL 1.16: its "ipo" takes the margin on summed log-probs, megalign's on token averages (as
  TRL's offline DPOTrainer and IPO's eq. 17); its temperature default is 0.9, the online family's 1.0.
"""
from __future__ import annotations

import dataclasses
from typing import Literal, Optional

import torch

from megalign.algos.preference import PairLogps, PreferenceAlgoConfig, pair_losses
from megalign.algos.registry import algorithm_option
from megalign.config import option, set_defaults
from megalign.data import IGNORE_INDEX
from megalign.parallel import Pipeline
from megalign.parallel.collectives import all_reduce_count
from megalign.rollout import RolloutBatch
from megalign.trainers.base import MetricSums, TrainResult
from megalign.trainers.online import OnlineTrainer
from megalign.trainers.updates import RoleLoss
from megalign.trainers.online_config import OnlineConfig, RolloutConfig, UpdateSchedule, check_pipeline_batch
from megalign.trainers.preference import check_reference_used
from megalign.roles.sequence_logps import PairBatch, hidden_sequence_logps, interleaved_pairs, sequence_logps


@dataclasses.dataclass
class OnlineDPOAlgoConfig(PreferenceAlgoConfig, UpdateSchedule):
    """The pairwise loss on fresh pairs (the offline trainer's losses and defaults, as TRL's OnlineDPOConfig) and the
    update schedule over the pairs."""

    missing_eos_penalty: Optional[float] = option(
        None, doc="subtracted from the reward of responses cut at max_response_length before pairing (TRL's); null: off")
    micro_batch_size: int = option(32, doc="pairs per forward on each rank (gradient accumulation)")

    def __post_init__(self):
        UpdateSchedule.__post_init__(self)
        PreferenceAlgoConfig.__post_init__(self)
        if self.loss_agg != "token-mean":
            raise ValueError(f"loss_agg={self.loss_agg!r}: online DPO has one loss per pair and takes their mean "
                             f"(token-mean over one unit a pair); leave loss_agg at token-mean")
        if self.missing_eos_penalty is not None and self.missing_eos_penalty < 0:
            raise ValueError(f"missing_eos_penalty must be >= 0 (it is subtracted), got {self.missing_eos_penalty}")
        if self.use_weighting:
            raise ValueError("use_weighting: online DPO does not compute WPO's weights (the offline DPO trainer does); "
                             "leave it false")


@dataclasses.dataclass
@set_defaults(run_dir="runs/online_dpo_arith", steps=200, save_every=50)
class OnlineDPOConfig(OnlineConfig):
    """One online DPO run (`launch/train_online_dpo.py --config ... key.sub=value`)."""

    algorithm: Literal["online_dpo"] = algorithm_option("online_dpo")
    rollout: RolloutConfig = option(RolloutConfig(group_size=2), doc="sampling (G = 2 samples per prompt: one pair)")
    algo: OnlineDPOAlgoConfig = option(OnlineDPOAlgoConfig(), doc="objective")

    def __post_init__(self):
        super().__post_init__()
        check_reference_used(self.reference, self.algo)


def preference_pairs(rewards: torch.Tensor, group_size: int,
                     keep_tied: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen rows [K], rejected rows [K], tied [U] bool) of N = U x G rewards in groups of G adjacent rows.

    The chosen row of a group is its highest reward, the rejected row its lowest (the first among
    equals); a group whose highest and lowest rewards are equal is tied and gives no pair, so K = U -
    tied.sum(), unless `keep_tied` (K = U; a tied group's pair is its first row twice). Rows index the
    batch (0..N-1).
    """
    if rewards.dim() != 1 or rewards.numel() % group_size or group_size < 2:
        raise ValueError(f"rewards must be [N] with N a multiple of group_size={group_size} >= 2, "
                         f"got {tuple(rewards.shape)}")
    groups = rewards.view(-1, group_size)
    base = torch.arange(groups.shape[0], device=rewards.device) * group_size
    tied = groups.amax(-1) == groups.amin(-1)
    keep = torch.ones_like(tied) if keep_tied else ~tied
    return (base + groups.argmax(-1))[keep], (base + groups.argmin(-1))[keep], tied


def pair_batch(batch: RolloutBatch, chosen: torch.Tensor, rejected: torch.Tensor, response_len: int) -> PairBatch:
    """The pairs (`chosen`, `rejected` rows [b] of `batch`) as the offline trainer's `PairBatch` [2b, P + R - 1].

    Rows 0..b-1 chosen, b..2b-1 rejected; inputs are the rollout rows without their last column and
    targets the next token where it is a response token (`batch.response_mask`), else IGNORE_INDEX,
    as `collate_preferences` lays them out, so `sequence_logps` sums each response's log-probs.
    """
    rows = torch.cat([chosen, rejected])
    sequences, attention = batch.sequences[rows], batch.attention_mask[rows]
    response = batch.response_mask[rows] != 0
    targets = torch.full_like(sequences[:, 1:], IGNORE_INDEX)
    targets[:, -response_len:] = torch.where(response, sequences[:, -response_len:], IGNORE_INDEX)
    return PairBatch(input_ids=sequences[:, :-1], attention_mask=attention[:, :-1], targets=targets,
                     response_lengths=response.sum(-1), margin=torch.zeros(chosen.numel(), device=sequences.device))


class OnlineDPOTrainer(OnlineTrainer):
    """Online DPO on the online trainer (module doc)."""

    name = "Online DPO"

    def needs_reference(self) -> bool:
        return self.cfg.algo.uses_reference

    def __init__(self, cfg: OnlineDPOConfig):
        super().__init__(cfg)
        check_pipeline_batch(self.cfg, self.layout.dp, "actor", self.layout, trained=True, per_prompt=1, unit="pairs")

    def shape_rewards(self, batch: RolloutBatch) -> None:
        if self.cfg.algo.missing_eos_penalty is not None:
            batch.rewards = batch.rewards - self.cfg.algo.missing_eos_penalty * (~batch.finished).to(batch.rewards.dtype)

    def pair_logps(self, role, batch: RolloutBatch, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
        """[b, 2] summed (chosen, rejected) log-probs of the pairs under `role` (actor or reference), as `sequence_logps`;
        at `role.layout.pp > 1` by the forward-only schedule (no gradient), micro-batches of `algo.micro_batch_size`
        pairs, the result on every rank of its pp group."""
        pairs = pair_batch(batch, chosen, rejected, self.cfg.rollout.max_response_length)
        with role.precision.autocast(self.layout.device):
            if role.layout.pp == 1:
                return sequence_logps(role.model, pairs, role.layout).view(2, -1).t()
            order = interleaved_pairs(chosen.numel(), pairs.input_ids.device)
            micro = max(role.layout.pp, -(-chosen.numel() // self.cfg.algo.micro_batch_size))
            logps = Pipeline(role.model.model, role.layout, micro).score_broadcast(
                pairs.input_ids[order], lambda hidden, rows: hidden_sequence_logps(role.model, hidden, rows["targets"],
                                                                                   role.layout),
                attention_mask=pairs.attention_mask[order], batch={"targets": pairs.targets[order]})
        return logps.view(-1, 2)

    def pipeline_pairs(self, batch: RolloutBatch, chosen: torch.Tensor, rejected: torch.Tensor):
        """`train_role`'s `unit_inputs` at actor.pp > 1: the (input ids, attention mask) [2b, P + R - 1] of pairs
        [b], chosen and rejected rows interleaved (module doc)."""
        def inputs(pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            rows = pair_batch(batch, chosen[pairs], rejected[pairs], self.cfg.rollout.max_response_length)
            order = interleaved_pairs(pairs.numel(), pairs.device)
            return rows.input_ids[order], rows.attention_mask[order]
        return inputs

    TRL_NAMES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected")
    STATS = tuple(name.replace("/", "_") for name in TRL_NAMES) + ("pairs",)
    """The sums `train_role` keeps: each TRL metric's total over the pairs, and the pair count."""

    def score(self, batch: RolloutBatch) -> None:
        """The step's pairs and, for a loss against the reference, the reference's summed log-probs [K, 2] of each
        (`self.pairs`); the old log-probs are not read (the loss has no importance ratio)."""
        algo, pipelined = self.cfg.algo, self.layout.pp > 1
        chosen, rejected, tied = preference_pairs(batch.rewards, batch.group_size, keep_tied=pipelined)
        weights = (~tied).float() if pipelined else torch.ones(chosen.numel(), device=self.layout.device)
        ref = None
        if self.reference is not None:
            with self.phase("reference", reference=("weights",)), torch.no_grad():
                mb = algo.micro_batch_size if self.reference.layout.pp == 1 else max(chosen.numel(), 1)
                ref = torch.cat([self.pair_logps(self.reference, batch, chosen[s:s + mb], rejected[s:s + mb])
                                 for s in range(0, chosen.numel(), mb)] or [torch.zeros(0, 2, device=self.layout.device)])
        self.pairs = (chosen, rejected, tied, weights, ref)

    def advantages(self, batch: RolloutBatch) -> None:
        """Nothing: the DPO loss compares the pairs' log-ratios directly."""

    def actor_loss(self, batch: RolloutBatch) -> RoleLoss:
        """The loss `train_role` runs over pair indices: per-pair DPO losses [b, 1] and the sums of `STATS` over the
        pairs of weight 1 (0 for the tied pairs kept at actor.pp > 1). At pp > 1 it gets the last stage's hidden
        states [2b, P + R - 1, H] of the interleaved pairs (`pipeline_pairs`)."""
        algo, layout = self.cfg.algo, self.actor.layout
        chosen, rejected, _, weights, ref = self.pairs

        def fn(pairs, hidden=None):
            if hidden is None:
                logps = self.pair_logps(self.actor, batch, chosen[pairs], rejected[pairs])
            else:
                rows = pair_batch(batch, chosen[pairs], rejected[pairs], self.cfg.rollout.max_response_length)
                targets = rows.targets[interleaved_pairs(pairs.numel(), pairs.device)]
                logps = hidden_sequence_logps(self.actor.model, hidden, targets, layout).view(-1, 2)
            losses, stats = pair_losses(algo, PairLogps(logps[:, 0], logps[:, 1], batch.lengths[chosen[pairs]],
                                                        batch.lengths[rejected[pairs]],
                                                        *(ref[pairs].unbind(1) if ref is not None else ())))
            values = stats.metrics(weights[pairs] > 0)
            return losses[:, None], {**{stat: values[name].total for name, stat in zip(self.TRL_NAMES, self.STATS)},
                                     "pairs": values["rewards/chosen"].count}
        return RoleLoss(fn, self.STATS, units=weights[:, None],
                        unit_inputs=self.pipeline_pairs(batch, chosen, rejected) if layout.pp > 1 else None)

    def update(self, batch: RolloutBatch, sums: MetricSums, counts: dict[str, float]) -> dict[str, list[torch.Tensor]]:
        chosen, rejected, tied, _, _ = self.pairs
        sums.add("tied", tied.sum())
        sums.add("score_margin", (batch.rewards[chosen] - batch.rewards[rejected]).double().sum())
        empty = all_reduce_count(int((~tied).sum()), self.layout.dp_group, self.layout.device) == 0
        return {"actor": self.update_actor(batch, sums, self.actor_loss(batch),
                                           "every prompt's responses have equal rewards on every rank: no pair"
                                           if empty else None)}

    def metrics(self, total: dict[str, float], norms: dict[str, list[torch.Tensor]],
                counts: dict[str, float]) -> dict[str, float]:
        algo = self.cfg.algo
        pairs = max(total["actor/pairs"], 1.0)  # over every update's pass
        trained = total["actor/pairs"] / algo.ppo_epochs
        return {
            "val/contain_eos_token": 1.0 - total["unfinished"] / max(total["responses"], 1.0),
            "pairs/trained": trained, "pairs/tied": total["tied"],
            "objective/scores_margin": total["score_margin"] / max(trained, 1.0),
            "actor/loss": total["actor/loss"] / algo.updates,
            **{name: total[f"actor/{stat}"] / pairs for name, stat in zip(self.TRL_NAMES, self.STATS)},
            "actor/grad_norm": torch.stack(norms["actor"]).mean(), "actor/lr": self.lr(), "beta": algo.beta_value,
        }


def train_online_dpo(cfg: OnlineDPOConfig) -> TrainResult:
    """Run online DPO as configured; every rank calls it after `init_distributed`."""
    return OnlineDPOTrainer(cfg).train()
