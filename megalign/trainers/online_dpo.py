"""Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback", arXiv 2402.04792)
on the online trainer (`megalign.trainers.online`): `train_online_dpo(cfg)`.

The same trainer as GRPO, a different objective. One step (every rank, after
`megalign.trainers.cli.init_distributed`):

    sample prompts -> actor generates G responses each (`rollout.group_size`, default 2 as in the paper
    and TRL's `OnlineDPOTrainer`) -> reward role scores them (verifiers and / or a reward model)
    [- algo.missing_eos_penalty for responses without EOS] -> one pair per prompt (`preference_pairs`:
    chosen = the highest reward, rejected = the lowest; a prompt whose rewards are all equal carries no
    preference and is dropped, counted as `pairs/tied`) -> the reference's summed log-probs of both ->
    `algo.ppo_epochs` x `algo.mini_batches` updates of the DPO loss of the offline trainer
    (`megalign.algos.dpo_loss`, any of `DPO_LOSSES`: sigmoid, robust, hinge, ipo) on the actor's summed
    log-probs -> metrics.

Design choices:

- Sequence log-probs are the offline DPO trainer's `megalign.trainers.preference.sequence_logps` (the
  fused vocab-parallel LM head on the response positions only) applied to the rollout's rows
  (`pair_batch` lays the chosen and rejected rows out as its `PairBatch`): log pi(y|x) is the sum over
  the response tokens, EOS included, of log softmax(logits)[y_t].
- Temperature: `rollout.temperature` shapes only the sampling distribution; the loss's log-probs
  (actor and reference) are of softmax(logits), temperature 1, as TRL's `OnlineDPOTrainer._forward`
  (log_softmax of the raw logits) and the offline DPO trainer compute them. DPO's implicit reward
  beta log(pi / pi_ref) is about the policy itself, and the loss has no ratio to the sampler (GRPO and
  PPO divide by the temperature because their ratio is against the sampling distribution).
- G >= 2: the best and the worst response of each prompt form its pair (the first among equals, in
  sampling order); G = 2 is the paper's and TRL's setting. Ties are dropped where TRL (`first_half >=
  second_half`) makes the first sample the chosen one: a pair with equal rewards has no preference.
- The update is `OnlineTrainer.train_role` with one unit per pair (`units` [pairs, 1] ones, token-mean
  aggregation): the loss is the sum of the per-pair losses over micro-batches and dp ranks divided by
  the global number of pairs, so dp = 2 equals dp = 1 on the same global batch. TRL averages per
  device batch instead.
- Pipeline stages (`actor.pp > 1`, `reference.pp > 1`): a 1F1B micro-batch holds whole pairs (the
  chosen and rejected rows interleaved, `train_role`'s `unit_inputs`), and the loss runs on the last
  stage's hidden states (`hidden_sequence_logps`). The pipeline's micro-batches have one shape, so at
  actor.pp > 1 every prompt keeps its pair, a tied one with weight 0 (no loss, no gradient, not in the
  metrics; its compute is the price of the fixed shape): each rank's prompts must split into
  `algo.mini_batches` x at least pp micro-batches of `algo.micro_batch_size` pairs (checked at
  start-up). The reference at pp > 1 scores the pairs by the forward-only schedule.
- `rollout.old_logprobs` is unused: the loss has no importance ratio, only the reference.
- A step in which no rank has a pair (every prompt tied) skips its update (warned, counted as
  `empty_updates`): an optimizer step on zero gradients would still move AdamW's weights.
- Differences from TRL 1.16 besides ties: its "ipo" takes h on summed log-probs, while `DPO_LOSSES`
  "ipo" takes it on token averages (as TRL's offline DPOTrainer and IPO's eq. 17); label smoothing,
  "robust", "hinge" and RPO's `nll_coef` come with the offline loss. Its defaults kept here: beta 0.1,
  "sigmoid", 2 samples, no missing-EOS penalty; its temperature default is 0.9, the online family's 1.0.
- Metrics are TRL's names where they exist: `rewards/chosen`, `rewards/rejected`, `rewards/margins`,
  `rewards/accuracies`, `logps/chosen`, `logps/rejected` (means over the trained pairs of every update),
  `objective/scores_margin` (reward of chosen minus rejected), `val/contain_eos_token`.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Literal, Optional

import torch

from megalign.algos import DPO_LOSSES, dpo_loss
from megalign.algos.registry import algorithm_option
from megalign.config import option
from megalign.data import IGNORE_INDEX
from megalign.parallel import Pipeline
from megalign.parallel.collectives import all_reduce_count
from megalign.trainers.base import TrainResult
from megalign.trainers.online import OnlineConfig, OnlineTrainer, RolloutBatch, RolloutConfig
from megalign.trainers.optim import lr_at
from megalign.trainers.preference import PairBatch, hidden_sequence_logps, interleaved_pairs, sequence_logps


@dataclasses.dataclass
class OnlineDPOAlgoConfig:
    """The DPO loss on fresh pairs (defaults as TRL's OnlineDPOConfig) and how the update is split."""

    loss: str = option("sigmoid", doc=f"DPO loss: {', '.join(DPO_LOSSES)} (megalign.algos.preference)")
    beta: float = option(0.1, doc="beta of the DPO loss (IPO's tau)")
    label_smoothing: float = option(0.0, doc="sigmoid / robust: assumed rate of flipped labels eps in [0, 0.5)")
    nll_coef: float = option(0.0, doc="weight of the chosen response's per-token NLL (RPO)")
    missing_eos_penalty: Optional[float] = option(
        None, doc="subtracted from the reward of responses cut at max_response_length before pairing (TRL's); null: off")
    mini_batches: int = option(1, doc="optimizer updates per epoch over the step's pairs")
    ppo_epochs: int = option(1, doc="passes over the step's pairs")
    micro_batch_size: int = option(32, doc="pairs per forward on each rank (gradient accumulation)")

    loss_agg = "token-mean"
    """Not a setting: `train_role` aggregates one unit per pair, so the token mean is the mean over pairs."""

    def __post_init__(self):
        if self.missing_eos_penalty is not None and self.missing_eos_penalty < 0:
            raise ValueError(f"missing_eos_penalty must be >= 0 (it is subtracted), got {self.missing_eos_penalty}")
        for name in ("mini_batches", "ppo_epochs", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        one = torch.zeros(1)  # the loss checks loss / beta / label_smoothing / nll_coef itself, with its messages
        dpo_loss(one, one, one, one, loss_type=self.loss, beta=self.beta, label_smoothing=self.label_smoothing,
                 nll_coef=self.nll_coef, chosen_lengths=torch.ones(1), rejected_lengths=torch.ones(1))


@dataclasses.dataclass
class OnlineDPOConfig(OnlineConfig):
    """One online DPO run (`launch/train_online_dpo.py --config ... key.sub=value`)."""

    algorithm: Literal["online_dpo"] = algorithm_option("online_dpo")
    run_dir: str = option("runs/online_dpo_arith", doc="output folder: config.yaml, metrics.jsonl, tensorboard/, checkpoints/, hf/")
    steps: int = option(200, doc="training steps (one rollout + its updates each)")
    save_every: int = option(50, doc="checkpoint every N steps (and after the last); 0: only after the last")
    rollout: RolloutConfig = option(RolloutConfig(group_size=2), doc="sampling (G = 2 samples per prompt: one pair)")
    algo: OnlineDPOAlgoConfig = option(OnlineDPOAlgoConfig(), doc="objective")


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
        return True  # every DPO_LOSSES entry is against the reference

    def __init__(self, cfg: OnlineDPOConfig):
        super().__init__(cfg)
        self.check_pipeline_batch("actor", self.layout, trained=True, per_prompt=1, unit="pairs")

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

    def actor_loss(self, batch: RolloutBatch, chosen: torch.Tensor, rejected: torch.Tensor, ref: torch.Tensor,
                   weights: torch.Tensor):
        """The micro-batch loss `train_role` runs over pair indices: per-pair DPO losses [b, 1] and the sums of `STATS`
        over the pairs of weight 1 (`weights` [K]: 0 for the tied pairs kept at actor.pp > 1). At pp > 1 it gets the
        last stage's hidden states [2b, P + R - 1, H] of the interleaved pairs (`pipeline_pairs`)."""
        algo, layout = self.cfg.algo, self.actor.layout

        def loss(pairs, hidden=None):
            if hidden is None:
                logps = self.pair_logps(self.actor, batch, chosen[pairs], rejected[pairs])
            else:
                rows = pair_batch(batch, chosen[pairs], rejected[pairs], self.cfg.rollout.max_response_length)
                targets = rows.targets[interleaved_pairs(pairs.numel(), pairs.device)]
                logps = hidden_sequence_logps(self.actor.model, hidden, targets, layout).view(-1, 2)
            losses, stats = dpo_loss(logps[:, 0], logps[:, 1], ref[pairs, 0], ref[pairs, 1], loss_type=algo.loss,
                                     beta=algo.beta, label_smoothing=algo.label_smoothing, nll_coef=algo.nll_coef,
                                     chosen_lengths=batch.lengths[chosen[pairs]],
                                     rejected_lengths=batch.lengths[rejected[pairs]])
            values = stats.metrics(weights[pairs] > 0)
            return losses[:, None], [values[k].total for k in self.TRL_NAMES] + [values["rewards/chosen"].count]
        return loss

    def train_step(self) -> dict[str, float]:
        """One online DPO step (module doc); returns its metrics, reduced over ranks."""
        cfg, algo, dp = self.cfg, self.cfg.algo, self.layout.dp_group
        self.timer.reset()
        self.memory.clear()
        start = time.perf_counter()
        batch, generated, _ = self.collect()
        pipelined = self.layout.pp > 1
        chosen, rejected, tied = preference_pairs(batch.rewards, cfg.rollout.group_size, keep_tied=pipelined)
        weights = (~tied).float() if pipelined else torch.ones(chosen.numel(), device=self.layout.device)
        with self.phase("reference", reference=("weights",)), torch.no_grad():
            mb = algo.micro_batch_size if self.reference.layout.pp == 1 else max(chosen.numel(), 1)
            ref = torch.cat([self.pair_logps(self.reference, batch, chosen[s:s + mb], rejected[s:s + mb])
                             for s in range(0, chosen.numel(), mb)] or [torch.zeros(0, 2, device=self.layout.device)])
        lr = lr_at(cfg.optim, self.progress["step"], cfg.steps)
        sums = self.rollout_sums(generated)
        sums.add("tied", tied.sum())
        sums.add("score_margin", (batch.rewards[chosen] - batch.rewards[rejected]).double().sum())
        if all_reduce_count(int((~tied).sum()), self.layout.dp_group, self.layout.device) == 0:
            self.skip_update("empty_updates", "every prompt's responses have equal rewards on every rank: no pair")
            for name in ("loss",) + self.STATS:
                sums.add(f"actor/{name}", 0.0)
            norms = [torch.zeros(())]
        else:
            with self.phase("update", actor=("weights", "optimizer")):
                norms = self.train_role(self.actor, lr, batch, self.STATS,
                                        self.actor_loss(batch, chosen, rejected, ref, weights), sums, "actor",
                                        units=weights[:, None],
                                        unit_inputs=self.pipeline_pairs(batch, chosen, rejected) if pipelined else None)
        total = sums.reduce(dp, self.layout.device)
        pairs = max(total["actor/pairs"], 1.0)  # over every update's pass
        trained = total["actor/pairs"] / algo.ppo_epochs
        metrics = {
            "val/contain_eos_token": 1.0 - total["unfinished"] / max(total["responses"], 1.0),
            "pairs/trained": trained, "pairs/tied": total["tied"],
            "objective/scores_margin": total["score_margin"] / max(trained, 1.0),
            "actor/loss": total["actor/loss"] / (algo.ppo_epochs * algo.mini_batches),
            **{name: total[f"actor/{stat}"] / pairs for name, stat in zip(self.TRL_NAMES, self.STATS)},
            "actor/grad_norm": torch.stack(norms).mean(), "actor/lr": lr, "beta": algo.beta,
        }
        return self.step_metrics(total, generated.terms, metrics, start)


def train_online_dpo(cfg: OnlineDPOConfig) -> TrainResult:
    """Run online DPO as configured; every rank calls it after `init_distributed`."""
    return OnlineDPOTrainer(cfg).train()
