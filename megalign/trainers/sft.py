"""Supervised fine-tuning: the first stage of SFT -> RL, and the warm start of the embedded GRPO task.

`train_sft(cfg)` runs the SFT objective on the supervised trainer (`megalign.trainers.supervised`,
itself on the one trainer lifecycle of `megalign.trainers.base`) on an initialised process group
(`megalign.trainers.cli.init_distributed`): builds or loads the model over a tp x dp layout, trains
on (prompt, response) pairs with the loss on response tokens only, checkpoints and resumes, exports
the final model to `run_dir/hf` and measures held-out accuracy by greedy generation.

Design choices:

- Loss: the mean negative log-likelihood per response token over the *global* batch (all dp ranks):
  each rank sums its tokens' -log p and divides by the global token count (the objective's `count`,
  all-reduced by the trainer before the forward), and gradients are summed over dp. Every token
  weighs the same whatever the padding or the split over ranks, so the loss and the update do not
  depend on dp. Log-probs come from the fused LM head (`LMHead.token_logprob`:
  `fused_linear_token_logprob`, vocab-parallel, chunks of tokens) on the response tokens only, so
  neither the `[B, T, V/tp]` logits nor their gradient exist (no collective at tp = 1).
- A non-finite loss or gradient norm (on any rank) skips the update with a warning and is counted
  (`nan_skips`); the step still consumes its batch and counts, so the schedule stays aligned with the data.
- The embedded default (`examples/sft_arith.yaml`, the defaults here) is sized to land at *partial*
  held-out accuracy on the arithmetic task in a few CPU minutes, leaving room for GRPO to improve it.
"""
from __future__ import annotations

import dataclasses
from typing import Literal, Optional, Sequence

import torch

from megalign.algos.registry import algorithm_option
from megalign.config import option, set_defaults
from megalign.data import PromptExample, Tokenizer, load_prompts, make_splits
from megalign.data.sft import IGNORE_INDEX, SFTExample, collate_sft, encode_sft, load_sft
from megalign.models import CausalLM
from megalign.parallel import ParallelLayout
from megalign.roles.sequence_logps import target_logps
from megalign.trainers.base import DataConfig, TrainResult
from megalign.trainers.optim import OptimConfig
from megalign.trainers.supervised import Objective, SupervisedConfig, SupervisedTrainer


@dataclasses.dataclass
class SFTDataConfig(DataConfig):
    """Training pairs and held-out prompts: the embedded arithmetic task, or files."""

    path: Optional[str] = option(None, doc="SFT data: .jsonl, .parquet or a datasets save_to_disk folder (rows: prompt + response, or messages with the loss on assistant turns); null: the arithmetic task's train split")
    max_length: int = option(64, doc="rows with more prompt + response + EOS tokens are dropped and counted")

    def __post_init__(self):
        if self.max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {self.max_length}")


@dataclasses.dataclass
@set_defaults(run_dir="runs/sft_arith", steps=900, save_every=300, optim=OptimConfig(lr=3e-3, warmup_steps=20))
class SFTConfig(SupervisedConfig):
    """One SFT run (`launch/train_sft.py --config ... key.sub=value`)."""

    algorithm: Literal["sft"] = algorithm_option("sft")
    data: SFTDataConfig = option(SFTDataConfig(), doc="the data")


@dataclasses.dataclass
class SFTBatch:
    """`collate_sft` tensors: `input_ids`, `attention_mask` [B, T] and `targets` [B, T] (IGNORE_INDEX: no loss)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor


def build_data(cfg: SFTDataConfig, tokenizer: Tokenizer, max_prompt_length: int) -> tuple[list[SFTExample], list[PromptExample]]:
    """(training pairs, held-out prompts with answers) as the config says."""
    if cfg.path is not None:
        train, _ = load_sft(cfg.path, tokenizer, cfg.max_length, cfg.skip_invalid, cfg.template_prompts)
        held_out = [] if cfg.eval_path is None else list(
            load_prompts(cfg.eval_path, tokenizer, max_prompt_length, cfg.skip_invalid, cfg.template_prompts))
        return train, held_out
    train_problems, held_problems = make_splits(cfg.arith)
    train = [encode_sft(p.prompt, p.response, tokenizer, cfg.template_prompts) for p in train_problems]
    too_long = sum(len(e) > cfg.max_length for e in train)
    if too_long:
        raise ValueError(f"data.max_length={cfg.max_length} is shorter than {too_long} arithmetic examples; raise it")
    if cfg.eval_path is not None:
        held_out = list(load_prompts(cfg.eval_path, tokenizer, max_prompt_length, cfg.skip_invalid, cfg.template_prompts))
    else:
        held_out = [PromptExample(encode_sft(p.prompt, p.response, tokenizer, cfg.template_prompts).prompt_ids,
                                  p.prompt, p.answer, {}, f"arith held-out {i}") for i, p in enumerate(held_problems)]
    return train, held_out


def sft_loss(model: CausalLM, hidden: torch.Tensor, targets: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    """Summed -log p of the `targets` [B, T] (IGNORE_INDEX: left out) from the trunk's output `hidden` [B, T, H]
    (on a pipeline, the last stage's), 0-dim fp32: the fused head on the target positions only (`target_logps`),
    so the [B, T, V_local] logits never exist. The trainer divides it by the global response-token count."""
    return -target_logps(model, hidden, targets, layout)[1].sum()


class SFTObjective(Objective[SFTExample]):
    """Next-token NLL on the response tokens of (prompt, response) pairs, normalised by the global token count."""

    def examples(self) -> tuple[list[SFTExample], list[PromptExample]]:
        return build_data(self.cfg.data, self.tokenizer, self.cfg.data.max_length)

    def max_length(self) -> int:
        return self.cfg.data.max_length

    def collate(self, examples: Sequence[SFTExample], device: torch.device) -> SFTBatch:
        return SFTBatch(**{k: v.to(device) for k, v in collate_sft(examples, self.tokenizer.pad_id).items()})

    def count(self, batch: SFTBatch) -> torch.Tensor:
        return (batch.targets != IGNORE_INDEX).sum()

    def inputs(self, batch: SFTBatch) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        return batch.input_ids, batch.attention_mask, {"targets": batch.targets}

    def loss(self, model: CausalLM, hidden: torch.Tensor, rows: dict[str, torch.Tensor],
             layout: ParallelLayout) -> tuple[torch.Tensor, dict]:
        return sft_loss(model, hidden, rows["targets"], layout), {}


def train_sft(cfg: SFTConfig) -> TrainResult:
    """Run SFT as configured (module doc); every rank calls it after `init_distributed`."""
    return SupervisedTrainer(cfg, SFTObjective, "SFT").train()
