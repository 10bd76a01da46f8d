"""Pairwise preference training on the supervised trainer: the DPO family, SimPO, CPO and ORPO (`train_dpo`),
and Bradley-Terry reward models (`train_rm`).

One objective covers every pairwise loss of `megalign.algos.preference`, chosen by `algo.loss`; the
trainer (`megalign.trainers.supervised`) provides the rest of the run. A step:

    B pairs from the sampler -> the reference's summed log-probs (DPO family only: cached before
    training or scored on the fly, `reference.mode`) -> one forward of the B chosen and B rejected
    sequences ([2B, T], as TRL's `concatenated_forward`), rows interleaved chosen 0, rejected 0,
    chosen 1, ... (`inputs`) so a pipeline micro-batch holds whole pairs -> summed response log-probs
    through the fused vocab-parallel LM head on the response positions only
    (`megalign.roles.sequence_logps`: no `[tokens, V]` logits, no vocabulary gather at tp > 1)
    -> per-pair losses (`pair_losses`; a reward model's Bradley-Terry loss on its scalar head)
    summed and divided by the global pair count.

Design choices:

- The loss of the global batch is the mean over its pairs whatever the dp split or pp micro-batches
  (the trainer all-reduces the pair count before the forward and sums gradients), so dp = 2 and
  pp = 2 equal dp = 1.
- Metrics are TRL's (`rewards/chosen`, `rewards/rejected`, `rewards/accuracies`, `rewards/margins`,
  `logps/*`, and `nll_loss` / `log_odds_*` where the loss has them), as means over the global batch.
- The reference stays at pp = 1 and scores the batch on every rank of the policy's pp group; the
  reward model's held-out pairs are scored through `SupervisedTrainer.forward_scores` at every pp.
- The embedded task (data.path null): pairs of the arithmetic training problems, the correct
  `\\boxed{}` answer against a wrong one near it (`megalign.data.arith`), and held-out greedy
  accuracy on the arithmetic held-out split, so a DPO run continues the SFT warm start.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Literal, Optional, Sequence

import torch
import torch.distributed as dist

from megalign.algos import platt_fit, reward_model_loss
from megalign.algos.preference import REFERENCE_FREE, PairLogps, PreferenceAlgoConfig, pair_losses, wpo_weights
from megalign.algos.registry import algorithm_option
from megalign.config import option, set_defaults
from megalign.data import (PreferenceExample, PromptExample, collate_preferences, encode_sft, load_preferences,
                           load_prompts, make_splits, write_preference_jsonl)
from megalign.models import CausalLM
from megalign.parallel import ParallelLayout
from megalign.roles.reward_exports import write_reward_stats
from megalign.roles.sequence_logps import (PairBatch, hidden_sequence_logps, interleaved_pairs, sequence_logps,
                                           wpo_sequence_sums)
from megalign.trainers.base import DataConfig, MetricSums, TrainResult
from megalign.trainers.optim import OptimConfig
from megalign.trainers.evaluation import eval_count
from megalign.trainers.supervised import (Objective, PolicyModelConfig, ReferenceConfig, SupervisedConfig,
                                          SupervisedTrainer)


@dataclasses.dataclass
class PreferenceDataConfig(DataConfig):
    """Preference pairs: the embedded arithmetic pairs, or TRL-format files (prompt / chosen / rejected [/ margin])."""

    path: Optional[str] = option(None, doc="pairs: .jsonl, .parquet or a datasets folder (explicit or implicit prompt, strings or messages); null: the arithmetic pairs")
    max_length: int = option(64, doc="prompt + the longer response, in tokens, at most")
    truncation: Literal["drop", "truncate_prompt"] = option(
        "drop", doc="longer pairs: dropped, or their prompt cut from the left to fit (both counted)")
    seed: int = option(0, doc="embedded pairs: seed of the wrong answers")

    def __post_init__(self):
        if self.max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {self.max_length}")


@dataclasses.dataclass
@set_defaults(run_dir="runs/dpo_arith", steps=200, batch_size=32, save_every=100,
              model=PolicyModelConfig(path="runs/sft_arith/hf"),
              optim=OptimConfig(lr=5e-5, warmup_steps=10, schedule="constant"))
class DPOConfig(SupervisedConfig):
    """One pairwise preference run (`launch/train_dpo.py --config ... key.sub=value`)."""

    algorithm: Literal["dpo"] = algorithm_option("dpo")
    reference: ReferenceConfig = option(ReferenceConfig(), doc="the frozen reference (DPO family only)")
    data: PreferenceDataConfig = option(PreferenceDataConfig(), doc="the pairs")
    algo: PreferenceAlgoConfig = option(PreferenceAlgoConfig(), doc="the loss")

    def __post_init__(self):
        super().__post_init__()
        check_reference_used(self.reference, self.algo)


def check_reference_used(reference: object, algo: PreferenceAlgoConfig) -> None:
    """ValueError naming every `reference.*` key set away from its default when `algo.loss` is reference-free
    (simpo, cpo, orpo, ...): such a run never builds the reference, so the setting would be ignored without a word.
    `reference` is the run config's reference section (a dataclass; its defaults are those of its class)."""
    if algo.uses_reference:
        return
    default = type(reference)()
    changed = [f"reference.{f.name}={getattr(reference, f.name)!r}" for f in dataclasses.fields(reference)
               if getattr(reference, f.name) != getattr(default, f.name)]
    if changed:
        raise ValueError(f"{', '.join(changed)} {'is' if len(changed) == 1 else 'are'} set but algo.loss={algo.loss!r} uses no reference model, so the "
                         f"run never builds one and would ignore it: remove the reference keys or choose a loss "
                         f"that compares with a reference")


def arith_pairs(cfg: PreferenceDataConfig, run_dir: str) -> tuple[str, str]:
    """The embedded arithmetic pairs of the train and held-out splits, written to run_dir/data (atomic, so
    ranks may race); returns the two paths."""
    train, held_out = make_splits(cfg.arith)
    paths = os.path.join(run_dir, "data", "arith_pairs.jsonl"), os.path.join(run_dir, "data", "arith_pairs_held_out.jsonl")
    write_preference_jsonl(train, paths[0], seed=cfg.seed)
    write_preference_jsonl(held_out, paths[1], seed=cfg.seed)
    return paths


def held_out_prompts(data: PreferenceDataConfig, tokenizer) -> list[PromptExample]:
    """Held-out prompts with answers for greedy evaluation: data.eval_path, or the arithmetic held-out split when
    the training data is the embedded task, else none."""
    if data.eval_path is not None:
        return list(load_prompts(data.eval_path, tokenizer, data.max_length, data.skip_invalid, data.template_prompts))
    if data.path is None:
        _, problems = make_splits(data.arith)
        return [PromptExample(encode_sft(p.prompt, p.response, tokenizer, data.template_prompts).prompt_ids,
                              p.prompt, p.answer, {}, f"arith held-out {i}") for i, p in enumerate(problems)]
    return []


class PairwiseObjective(Objective[PreferenceExample]):
    """Every pairwise loss of `megalign.algos.preference` on a policy (module doc)."""

    num_scores = 2
    count_name = "pairs"

    def needs_reference(self) -> bool:
        return self.cfg.algo.uses_reference

    def examples(self) -> tuple[list[PreferenceExample], list[PromptExample]]:
        data = self.cfg.data
        path = data.path if data.path is not None else arith_pairs(data, self.cfg.run_dir)[0]
        train, _ = load_preferences(path, self.tokenizer, data.max_length, data.truncation, data.skip_invalid,
                                    data.template_prompts)
        return train, held_out_prompts(data, self.tokenizer)

    def max_length(self) -> int:
        return self.cfg.data.max_length

    def collate(self, examples: Sequence[PreferenceExample], device: torch.device) -> PairBatch:
        return PairBatch(**{k: v.to(device) for k, v in collate_preferences(examples, self.tokenizer.pad_id).items()})

    def count(self, batch: PairBatch) -> torch.Tensor:
        return torch.tensor(batch.margin.numel(), device=batch.margin.device)

    def scores(self, model: CausalLM, batch: PairBatch, layout: ParallelLayout) -> torch.Tensor:
        return sequence_logps(model, batch, layout).view(2, -1).t()  # [B, 2]

    def inputs(self, batch: PairBatch) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Rows reordered chosen 0, rejected 0, chosen 1, ... (`interleaved_pairs`): a micro-batch (consecutive rows,
        an even number since the per-rank pairs split into the micro-batches) then holds whole pairs."""
        order = interleaved_pairs(batch.margin.numel(), batch.input_ids.device)
        rows = {"targets": batch.targets[order], "lengths": batch.response_lengths.float()[order]}
        if batch.ref_scores is not None:
            rows["ref"] = batch.ref_scores.flatten()  # [B, 2] (chosen, rejected) -> the same interleaved order
        return batch.input_ids[order], batch.attention_mask[order], rows

    def loss(self, model: CausalLM, hidden: torch.Tensor, rows: dict[str, torch.Tensor],
             layout: ParallelLayout) -> tuple[torch.Tensor, dict]:
        logps, lengths = hidden_sequence_logps(model, hidden, rows["targets"], layout), rows["lengths"]
        ref = (rows["ref"][0::2], rows["ref"][1::2]) if "ref" in rows else (None, None)
        weights = None
        if self.cfg.algo.use_weighting:
            adjusted = wpo_sequence_sums(model, hidden, rows["targets"], layout)
            weights = wpo_weights(adjusted[0::2], adjusted[1::2], lengths[0::2], lengths[1::2])
        losses, pair_stats = self.pair_losses(logps[0::2], logps[1::2], lengths[0::2], lengths[1::2], *ref, weights)
        return losses.sum(), pair_stats.metrics()

    def pair_losses(self, chosen: torch.Tensor, rejected: torch.Tensor, chosen_len: torch.Tensor,
                    rejected_len: torch.Tensor, ref_chosen: Optional[torch.Tensor], ref_rejected: Optional[torch.Tensor],
                    weights: Optional[torch.Tensor] = None):
        """(per-pair losses [B], statistics) of `algo.loss` from the policy's summed log-probs [B] of the chosen and
        rejected responses, their lengths [B], (reference-based losses) the reference's summed log-probs [B] and
        (algo.use_weighting) WPO's per-pair weights [B]."""
        return pair_losses(self.cfg.algo, PairLogps(chosen, rejected, chosen_len, rejected_len, ref_chosen, ref_rejected,
                                                    weights))


@dataclasses.dataclass
class RewardAlgoConfig:
    """The Bradley-Terry loss of a scalar reward model."""

    margin: bool = option(True, doc="subtract the pairs' margin column in the loss (Llama 2); false: plain Bradley-Terry")
    center_coef: float = option(0.0, doc="c of the centring term c (r_c + r_r)^2 (TRL's center_rewards_coefficient)")

    def __post_init__(self):
        if self.center_coef < 0:
            raise ValueError(f"center_coef must be >= 0, got {self.center_coef}")


@dataclasses.dataclass
@set_defaults(run_dir="runs/rm_arith", steps=200, batch_size=32, save_every=100,
              model=PolicyModelConfig(path="runs/sft_arith/hf"),
              optim=OptimConfig(lr=1e-4, warmup_steps=10, schedule="cosine"))
class RMConfig(SupervisedConfig):
    """One reward-model run (`launch/train_rm.py --config ... key.sub=value`); `model.path` is an SFT export (a fresh
    reward head) or a reward model (continued)."""

    algorithm: Literal["rm"] = algorithm_option("rm")
    data: PreferenceDataConfig = option(PreferenceDataConfig(), doc="the pairs (held-out pairs: data.eval_path, or the arithmetic held-out split)")
    algo: RewardAlgoConfig = option(RewardAlgoConfig(), doc="the loss")


@dataclasses.dataclass
class RewardBatch:
    """B pairs as full sequences [2B, T] (rows 0..B-1 prompt + chosen, B..2B-1 prompt + rejected, right-padded)
    for the reward head, which reads each row's last real token; `margin` [B]."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    margin: torch.Tensor


class RewardModelObjective(Objective[PreferenceExample]):
    """Bradley-Terry reward model on pairs (`megalign.algos.reward_model_loss`); held-out pairwise accuracy.

    At export the reward mean and std over the held-out responses (chosen and rejected) are written
    beside the weights (`megalign.roles.reward_exports.write_reward_stats`), so a later stage (PPO) can
    normalise the rewards, as OpenRLHF stores them with its reward models, with the Platt scaling of the same
    scores (chosen 1, rejected 0: `megalign.algos.platt_fit`) for PPO's calibrated reward. Without held-out pairs to score
    (no eval_path, or eval.max_samples=0) they come from the training pairs, scored once more by the
    final model, and the file says so (`source`: "train").
    """

    model_kind = "reward"
    count_name = "pairs"

    def examples(self) -> tuple[list[PreferenceExample], list[PreferenceExample]]:
        data = self.cfg.data
        paths = (data.path, data.eval_path) if data.path is not None else arith_pairs(data, self.cfg.run_dir)
        load = dict(tokenizer=self.tokenizer, max_length=data.max_length, truncation=data.truncation,
                    skip_invalid=data.skip_invalid, template_prompts=data.template_prompts)
        train, _ = load_preferences(paths[0], **load)
        held_out = load_preferences(paths[1], **load)[0] if paths[1] is not None else []
        return train, held_out

    def max_length(self) -> int:
        return self.cfg.data.max_length

    def collate(self, examples: Sequence[PreferenceExample], device: torch.device) -> RewardBatch:
        rows = [e.prompt_ids + e.chosen_ids for e in examples] + [e.prompt_ids + e.rejected_ids for e in examples]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row)
            mask[i, :len(row)] = 1
        margin = torch.tensor([float(e.margin) for e in examples])
        return RewardBatch(ids.to(device), mask.to(device), margin.to(device))

    def count(self, batch: RewardBatch) -> torch.Tensor:
        return torch.tensor(batch.margin.numel(), device=batch.margin.device)

    def inputs(self, batch: RewardBatch) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Rows interleaved chosen 0, rejected 0, chosen 1, ... as `PairwiseObjective.inputs`: a micro-batch holds
        whole pairs."""
        order = interleaved_pairs(batch.margin.numel(), batch.input_ids.device)
        mask = batch.attention_mask[order]
        return batch.input_ids[order], mask, {"mask": mask, "margin": batch.margin.repeat_interleave(2)}

    def loss(self, model, hidden: torch.Tensor, rows: dict[str, torch.Tensor],
             layout: ParallelLayout) -> tuple[torch.Tensor, dict]:
        """Bradley-Terry losses of the micro-batch's pairs from the scalar head at each row's last real token."""
        rewards = model.head(hidden, rows["mask"]).float()  # [b]
        losses, pair_stats = reward_model_loss(rewards[0::2], rewards[1::2],
                                               margin=rows["margin"][0::2] if self.cfg.algo.margin else None,
                                               center_coef=self.cfg.algo.center_coef)
        return losses.sum(), pair_stats.metrics()

    _scored: Optional[tuple[int, Optional[tuple[dict[str, float], torch.Tensor]]]] = None
    """(step, (sums, scores)) of the last held-out pass: the export and the closing evaluation at the same step
    share it."""

    @torch.no_grad()
    def _held_out_scores(self, trainer: "SupervisedTrainer") -> Optional[tuple[dict[str, float], torch.Tensor]]:
        """`_score_pairs` of the held-out pairs (dp-split), None when there are none to score."""
        step = trainer.progress["step"]
        if self._scored is None or self._scored[0] != step:
            n = eval_count(self.cfg.eval, trainer.held_out)
            self._scored = (step, self._score_pairs(trainer, trainer.held_out[:n]) if n else None)
        return self._scored[1]

    def _score_pairs(self, trainer: "SupervisedTrainer",
                     pairs: Sequence[PreferenceExample]) -> tuple[dict[str, float], torch.Tensor]:
        """Sums over `pairs` (the same list on every rank, dp-split; every rank calls this): correct pairs (chosen
        scored above rejected) and pairs; and this rank's scores, [n, 2] float64 on the CPU (chosen, rejected)."""
        cfg, layout = self.cfg.eval, trainer.layout
        sums, scores = MetricSums(), [torch.zeros(0, 2, dtype=torch.float64)]
        mine = [pairs[i] for i in range(layout.dp_rank, len(pairs), layout.dp)]
        model = trainer.policy.model
        was_training = model.training
        model.eval()
        for start in range(0, max(len(mine), 1), cfg.batch_size):
            chunk = mine[start:start + cfg.batch_size]
            if chunk:
                batch = self.collate(chunk, layout.device)
                rewards = trainer.forward_scores(batch.input_ids, batch.attention_mask,
                                                 lambda hidden, rows: model.head(hidden, rows["mask"]),
                                                 {"mask": batch.attention_mask})
                chosen, rejected = rewards[:len(chunk)], rewards[len(chunk):]
                values = ((chosen > rejected).sum(), len(chunk))
                scores.append(torch.stack([chosen, rejected], dim=1).double().cpu())
            else:
                values = (0, 0)
            for name, value in zip(("correct", "pairs"), values):
                sums.add(name, value)
        model.train(was_training)
        return sums.reduce(layout.dp_group, layout.device), torch.cat(scores)

    def evaluate(self, trainer: "SupervisedTrainer") -> Optional[float]:
        scored = self._held_out_scores(trainer)
        return None if scored is None else scored[0]["correct"] / max(scored[0]["pairs"], 1.0)

    def eval_label(self, count: int) -> str:
        return f"held-out pairwise accuracy ({count} pairs, chosen scored above rejected)"

    def after_export(self, trainer: "SupervisedTrainer", path: str) -> None:
        scored, source = self._held_out_scores(trainer), "held_out"
        if scored is None:  # no held-out pairs scored: the training pairs instead (class doc)
            scored, source = self._score_pairs(trainer, trainer.train_set), "train"
        parts = [None] * trainer.layout.dp
        dist.all_gather_object(parts, scored[1], group=trainer.layout.dp_group)
        scores = torch.cat(parts)  # [pairs, 2]: chosen, rejected, every rank's
        if trainer.rank == 0:
            platt = platt_fit(scores.flatten(), torch.tensor([1.0, 0.0]).repeat(len(scores))) if len(scores) else None
            write_reward_stats(path, float(scores.sum()), float((scores ** 2).sum()), scores.numel(), source, platt)


def train_rm(cfg: RMConfig) -> TrainResult:
    """Train the reward model as configured; every rank calls it after `init_distributed`."""
    return SupervisedTrainer(cfg, RewardModelObjective, "RM").train()


def train_dpo(cfg: DPOConfig) -> TrainResult:
    """Run the configured pairwise preference objective; every rank calls it after `init_distributed`."""
    return SupervisedTrainer(cfg, PairwiseObjective, cfg.algo.loss.upper() if cfg.algo.loss in REFERENCE_FREE
                             else f"DPO ({cfg.algo.loss})").train()
