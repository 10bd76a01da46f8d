"""KTO (Ethayarajh et al. 2024) on the supervised trainer: unpaired desirable / undesirable examples (`train_kto`).

A step: B labelled (prompt, completion) examples and their B mismatched pairs -> the reference's
summed completion log-probs of the 2B rows (cached or scored) -> the policy's of the B mismatched
rows, without gradient -> z0, the mean log-ratio of the mismatched pairs over all dp ranks (clamped
at 0; `kto_reference_point`) -> the B labelled rows' summed log-probs (vocab-parallel) ->
`megalign.algos.kto_loss_at` at z0, per-example losses summed over the global batch.

Design choices:

- The mismatched pair of training example i is fixed for the run: prompt i with the completion of
  example i + 1 (mod N) of the loaded data. TRL and OpenRLHF rotate the completions inside each
  device's batch instead, which makes z0 depend on how the batch is split over ranks and the pairs'
  reference log-probs on which examples share a batch; fixed pairs keep dp = 2 equal to dp = 1 and
  let the reference scores be cached per example like DPO's (`reference.mode`).
- The paper's balance rule is checked once on the training data: a warning when
  w_D n_D / (w_U n_U) lies outside [1, 4/3].
- z0 is a mean over the whole batch, which no pipeline micro-batch sees, and the mismatched rows get
  no gradient (z0 is detached), so they are scored first without gradient (`prepare`:
  `SupervisedTrainer.forward_scores`, the forward-only schedule at pp > 1), z0 is reduced over dp,
  and only the B labelled rows run the forward + backward (`kto_loss_at` with that z0): the loss and
  gradients of the concatenated forward, with the mismatched rows' activations never held for a
  backward, at every pp.
- Metrics are TRL's KTOTrainer's: `rewards/chosen` / `rewards/rejected` (implicit rewards of the
  desirable / undesirable examples), `logps/chosen` / `logps/rejected`, and `kl` (z0).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Literal, Optional, Sequence

import torch

from megalign.algos import check_kto_weight_ratio, kto_loss_at, kto_reference_point
from megalign.algos.registry import algorithm_option
from megalign.config import option, set_defaults
from megalign.data import (PromptExample, UnpairedExample, collate_replies, load_unpaired, make_splits,
                           write_unpaired_jsonl)
from megalign.models import CausalLM
from megalign.parallel import ParallelLayout
from megalign.roles.sequence_logps import hidden_sequence_logps, sequence_logps
from megalign.trainers.base import TrainResult
from megalign.trainers.optim import OptimConfig
from megalign.trainers.preference import PreferenceDataConfig, held_out_prompts
from megalign.trainers.supervised import (Objective, PolicyModelConfig, ReferenceConfig, SupervisedConfig,
                                          SupervisedTrainer)


@dataclasses.dataclass
class KTOAlgoConfig:
    """KTO's coefficients (TRL's defaults)."""

    beta: float = option(0.1, doc="beta > 0")
    desirable_weight: float = option(1.0, doc="w_D > 0")
    undesirable_weight: float = option(1.0, doc="w_U > 0")

    def __post_init__(self):
        for name in ("beta", "desirable_weight", "undesirable_weight"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclasses.dataclass
@set_defaults(run_dir="runs/kto_arith", steps=300, batch_size=64, save_every=100,
              model=PolicyModelConfig(path="runs/sft_arith/hf"),
              optim=OptimConfig(lr=5e-5, warmup_steps=10, schedule="cosine"))
class KTOConfig(SupervisedConfig):
    """One KTO run (`launch/train_kto.py --config ... key.sub=value`)."""

    algorithm: Literal["kto"] = algorithm_option("kto")
    reference: ReferenceConfig = option(ReferenceConfig(), doc="the frozen reference")
    data: PreferenceDataConfig = option(PreferenceDataConfig(), doc="unpaired rows: prompt, completion, label (path null: the arithmetic rows)")
    algo: KTOAlgoConfig = option(KTOAlgoConfig(), doc="the loss")


@dataclasses.dataclass(frozen=True)
class KTOExample:
    """A labelled example and the completion of its mismatched pair (module doc)."""

    example: UnpairedExample
    kl_completion_ids: list[int]


@dataclasses.dataclass
class UnpairedBatch:
    """B labelled rows then their B mismatched pairs, [2B, T] (`collate_unpaired` halves concatenated);
    `labels` [B] bool (desirable); `ref_scores` [B, 2] reference log-probs (labelled, mismatched); `z0` (0-d) the
    reference point, from `KTOObjective.prepare`."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    labels: torch.Tensor
    ref_scores: Optional[torch.Tensor] = None
    z0: Optional[torch.Tensor] = None


class KTOObjective(Objective[KTOExample]):
    """KTO on a policy (module doc)."""

    num_scores = 2
    count_name = "examples"

    def needs_reference(self) -> bool:
        return True

    def examples(self) -> tuple[list[KTOExample], list[PromptExample]]:
        data, algo = self.cfg.data, self.cfg.algo
        path = data.path
        if path is None:
            path = os.path.join(self.cfg.run_dir, "data", "arith_unpaired.jsonl")
            write_unpaired_jsonl(make_splits(data.arith)[0], path, seed=data.seed)  # atomic: ranks may race
        train, _ = load_unpaired(path, self.tokenizer, data.max_length, data.truncation, data.skip_invalid,
                                 data.template_prompts)
        if len(train) < 2:
            raise ValueError(f"KTO needs at least 2 training examples to mismatch prompts and completions, got {len(train)}")
        desirable = sum(e.label for e in train)
        check_kto_weight_ratio(desirable, len(train) - desirable, algo.desirable_weight, algo.undesirable_weight)
        paired = [KTOExample(e, train[(i + 1) % len(train)].completion_ids) for i, e in enumerate(train)]
        return paired, held_out_prompts(data, self.tokenizer)

    def max_length(self) -> int:
        return self.cfg.data.max_length

    def collate(self, examples: Sequence[KTOExample], device: torch.device) -> UnpairedBatch:
        prompts = [e.example.prompt_ids for e in examples]
        both = collate_replies(prompts * 2, [e.example.completion_ids for e in examples]
                               + [e.kl_completion_ids for e in examples], self.tokenizer.pad_id)
        labels = torch.tensor([e.example.label for e in examples], dtype=torch.bool)
        return UnpairedBatch(both["input_ids"].to(device), both["attention_mask"].to(device), both["targets"].to(device),
                             labels.to(device))

    def count(self, batch: UnpairedBatch) -> torch.Tensor:
        return torch.tensor(batch.labels.numel(), device=batch.labels.device)

    def scores(self, model: CausalLM, batch: UnpairedBatch, layout: ParallelLayout) -> torch.Tensor:
        return sequence_logps(model, batch, layout).view(2, -1).t()  # [B, 2]: labelled, mismatched

    def prepare(self, model: CausalLM, batch: UnpairedBatch, layout: ParallelLayout, forward_scores) -> None:
        """z0 of the batch's mismatched rows (module doc), on every rank."""
        n = batch.labels.numel()
        kl_logps = forward_scores(batch.input_ids[n:], batch.attention_mask[n:],
                                  lambda hidden, rows: hidden_sequence_logps(model, hidden, rows["targets"], layout),
                                  {"targets": batch.targets[n:]})
        batch.z0 = kto_reference_point(kl_logps - batch.ref_scores[:, 1], layout.dp_group)

    def inputs(self, batch: UnpairedBatch) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """The B labelled rows only (the mismatched ones are in `batch.z0`)."""
        n = batch.labels.numel()
        return batch.input_ids[:n], batch.attention_mask[:n], {
            "targets": batch.targets[:n], "ref": batch.ref_scores[:, 0], "desirable": batch.labels,
            "z0": batch.z0.expand(n)}

    def loss(self, model: CausalLM, hidden: torch.Tensor, rows: dict[str, torch.Tensor],
             layout: ParallelLayout) -> tuple[torch.Tensor, dict]:
        algo = self.cfg.algo
        losses, kto_stats = kto_loss_at(hidden_sequence_logps(model, hidden, rows["targets"], layout), rows["ref"],
                                        rows["desirable"], rows["z0"][0], beta=algo.beta,
                                        desirable_weight=algo.desirable_weight,
                                        undesirable_weight=algo.undesirable_weight)
        return losses.sum(), kto_stats.metrics()


def train_kto(cfg: KTOConfig) -> TrainResult:
    """Run KTO as configured; every rank calls it after `init_distributed`."""
    return SupervisedTrainer(cfg, KTOObjective, "KTO").train()
