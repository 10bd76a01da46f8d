"""Process reward models on the supervised trainer (`train_prm`): a correctness probability for every step.

The model is a policy checkpoint (an SFT export) whose LM head is read at each step's marking token
(`megalign.data.stepwise`: the separator after the step) through two "reward tokens", as in
Math-Shepherd (Wang et al. 2024, arXiv 2312.08935) and OpenRLHF's PRM: p(correct) is the softmax
over just the logits of `algo.positive_token` and `algo.negative_token` ("+" / "-" by default) at
that position, and the loss is `megalign.algos.prm_loss`'s step cross-entropy with hard or soft
labels (the fraction of Monte-Carlo completions from the step that reach the right answer). A step:

    B stepwise examples -> one forward of the trunk [B, T, H] -> the hidden states of the S labelled
    positions [S, H] -> the LM head on those rows only (vocab-parallel, then the two columns
    gathered: never [B, T, V]) -> [S, 2] logits -> step losses summed, divided by the global step count.

Design choices:

- Reward tokens rather than a fresh classifier head: the PRM starts from the policy's own head, its
  export is an ordinary causal LM any loader reads, and `prm.json` beside the weights
  (`megalign.roles.reward_exports`) names the two tokens and the separator, so a later stage (best-of-N
  reranking, PPO's step rewards) scores solutions with `megalign.roles.reward.step_probs` without guessing.
- `algo.supervise: outcome` trains an outcome reward model on the same rows: only each solution's
  last step (its final answer, whose Monte-Carlo label is the outcome itself) is labelled, which is
  Lightman et al.'s ORM (arXiv 2305.20050) read at the same token, so PRM and ORM differ in nothing
  but the supervision.
- Held-out evaluation is step accuracy (prediction p > 1/2 against label > 1/2) on held-out stepwise
  rows, the metric TRL's PRMTrainer reports.
- The embedded task (data.path null): the multi-step arithmetic chains (`megalign.data.arith`),
  half of them corrupted at one step with exact hard labels; Monte-Carlo labels from a policy's own
  samples come from `megalign.tools.best_of_n.label_steps` (`launch/prm_tools.py label`).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Literal, Optional, Sequence

import torch

from megalign.algos import IGNORE_INDEX, prm_loss
from megalign.algos.registry import algorithm_option
from megalign.config import option, set_defaults
from megalign.data import ArithChainConfig, StepwiseExample, collate_stepwise, load_stepwise, make_chain_splits
from megalign.data.arith import write_stepwise_jsonl
from megalign.data.tokenizer import Tokenizer
from megalign.models import CausalLM
from megalign.parallel import ParallelLayout
from megalign.roles.reward import hidden_step_logits
from megalign.roles.reward_exports import write_prm_info
from megalign.trainers.base import DataConfig, MetricSums, TrainResult
from megalign.trainers.evaluation import eval_count
from megalign.trainers.optim import OptimConfig
from megalign.trainers.supervised import Objective, PolicyModelConfig, SupervisedConfig, SupervisedTrainer


@dataclasses.dataclass
class StepDataConfig(DataConfig):
    """Stepwise rows (TRL's format: prompt / completions / labels), or the embedded arithmetic chains."""

    path: Optional[str] = option(None, doc="stepwise rows: .jsonl, .parquet or a datasets folder; null: the arithmetic chains' train split (half corrupted, exact labels)")
    eval_path: Optional[str] = option(None, doc="held-out stepwise rows; null: the chains' held-out split when path is null, else no evaluation")
    chain: ArithChainConfig = option(ArithChainConfig(), doc="the embedded multi-step arithmetic task (path null)")
    max_length: int = option(96, doc="prompt + steps + separators, in tokens, at most")
    truncation: Literal["drop", "truncate_prompt"] = option(
        "drop", doc="longer rows: dropped, or their prompt cut from the left to fit (both counted)")
    separator: str = option("\n", doc="the text after every step; its last token carries the step's label")
    seed: int = option(0, doc="embedded rows: seed of the corruptions")

    def __post_init__(self):
        if self.max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {self.max_length}")
        if not self.separator:
            raise ValueError("separator must be a non-empty string")


@dataclasses.dataclass
class PRMAlgoConfig:
    """How steps are scored and which labels are learnt."""

    positive_token: str = option("+", doc="the reward token meaning 'correct so far' (one token of the tokenizer)")
    negative_token: str = option("-", doc="the reward token meaning 'wrong' (one token, not the positive one)")
    supervise: Literal["steps", "outcome"] = option(
        "steps", doc="'steps': every step's label (a PRM); 'outcome': only each solution's last step (an ORM)")


@dataclasses.dataclass
@set_defaults(run_dir="runs/prm_chain", steps=300, batch_size=64, save_every=100,
              model=PolicyModelConfig(path="runs/sft_chain/hf"),
              optim=OptimConfig(lr=1e-4, warmup_steps=10, schedule="cosine"))
class PRMConfig(SupervisedConfig):
    """One process (or outcome) reward model run (`launch/train_prm.py --config ... key.sub=value`)."""

    algorithm: Literal["prm"] = algorithm_option("prm")
    data: StepDataConfig = option(StepDataConfig(), doc="the stepwise rows")
    algo: PRMAlgoConfig = option(PRMAlgoConfig(), doc="reward tokens and supervision")


def reward_token_ids(tokenizer: Tokenizer, positive: str, negative: str) -> tuple[int, int]:
    """(negative id, positive id): each text must encode to exactly one token, and the two must differ."""
    ids = []
    for name, text in (("algo.negative_token", negative), ("algo.positive_token", positive)):
        encoded = tokenizer.encode(text)
        if len(encoded) != 1:
            raise ValueError(f"{name}={text!r} must encode to exactly one token, got {encoded}")
        ids.append(encoded[0])
    if ids[0] == ids[1]:
        raise ValueError(f"algo.positive_token and algo.negative_token encode to the same token {ids[0]}")
    return ids[0], ids[1]


def outcome_only(step_labels: torch.Tensor) -> torch.Tensor:
    """[B, T] labels keeping only each row's last labelled position (IGNORE_INDEX elsewhere)."""
    labelled = step_labels != IGNORE_INDEX
    positions = torch.arange(step_labels.shape[1], device=step_labels.device)
    last = torch.where(labelled, positions, -1).amax(-1, keepdim=True)  # [B, 1]
    return torch.where(positions == last, step_labels, torch.full_like(step_labels, IGNORE_INDEX))


@dataclasses.dataclass
class StepBatch:
    """B solutions `input_ids` / `attention_mask` [B, T] (right-padded) and `step_labels` [B, T] float:
    the label at each supervised step's marking position, IGNORE_INDEX elsewhere."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    step_labels: torch.Tensor


def embedded_step_rows(data: StepDataConfig, run_dir: str) -> tuple[str, str]:
    """The embedded chains' stepwise rows of the train and held-out splits, written to run_dir/data (atomic, so
    ranks may race); returns the two paths."""
    train, held_out = make_chain_splits(data.chain)
    paths = os.path.join(run_dir, "data", "chain_steps.jsonl"), os.path.join(run_dir, "data", "chain_steps_held_out.jsonl")
    write_stepwise_jsonl(train, paths[0], seed=data.seed)
    write_stepwise_jsonl(held_out, paths[1], seed=data.seed)
    return paths


class PRMObjective(Objective[StepwiseExample]):
    """Step cross-entropy of the reward tokens at every labelled step (module doc)."""

    count_name = "step_labels"

    def __init__(self, cfg: PRMConfig, tokenizer: Tokenizer):
        super().__init__(cfg, tokenizer)
        self.token_ids = reward_token_ids(tokenizer, cfg.algo.positive_token, cfg.algo.negative_token)

    def examples(self) -> tuple[list[StepwiseExample], list[StepwiseExample]]:
        data = self.cfg.data
        paths = (data.path, data.eval_path) if data.path is not None else embedded_step_rows(data, self.cfg.run_dir)
        load = dict(tokenizer=self.tokenizer, max_length=data.max_length, truncation=data.truncation,
                    skip_invalid=data.skip_invalid, template_prompts=data.template_prompts, separator=data.separator)
        train, _ = load_stepwise(paths[0], **load)
        held_out = load_stepwise(paths[1], **load)[0] if paths[1] is not None else []
        return train, held_out

    def max_length(self) -> int:
        return self.cfg.data.max_length

    def collate(self, examples: Sequence[StepwiseExample], device: torch.device) -> StepBatch:
        batch = collate_stepwise(examples, self.tokenizer.pad_id)
        labels = batch["step_labels"]
        if self.cfg.algo.supervise == "outcome":
            labels = outcome_only(labels)
        return StepBatch(batch["input_ids"].to(device), batch["attention_mask"].to(device), labels.to(device))

    def count(self, batch: StepBatch) -> torch.Tensor:
        return (batch.step_labels != IGNORE_INDEX).sum()

    def inputs(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        return batch.input_ids, batch.attention_mask, {"labels": batch.step_labels}

    def loss(self, model: CausalLM, hidden: torch.Tensor, rows: dict[str, torch.Tensor],
             layout: ParallelLayout) -> tuple[torch.Tensor, dict]:
        where = rows["labels"] != IGNORE_INDEX
        loss_sum, step_stats = prm_loss(hidden_step_logits(model, hidden, where, self.token_ids)[None],
                                        rows["labels"][where][None])
        return loss_sum, step_stats.metrics()

    def _held_out_logits(self, trainer: SupervisedTrainer, batch: StepBatch) -> torch.Tensor:
        """[B, T, 2] fp32 reward-token logits at the labelled positions of `batch` (0 elsewhere), at any pp."""
        model = trainer.policy.model

        def head(hidden: torch.Tensor, rows: dict[str, torch.Tensor]) -> torch.Tensor:
            where = rows["labels"] != IGNORE_INDEX
            out = hidden.new_zeros(*where.shape, 2, dtype=torch.float32)
            out[where] = hidden_step_logits(model, hidden, where, self.token_ids).float()
            return out

        return trainer.forward_scores(batch.input_ids, batch.attention_mask, head, {"labels": batch.step_labels},
                                      (batch.input_ids.shape[1], 2))

    @torch.no_grad()
    def evaluate(self, trainer: SupervisedTrainer) -> Optional[float]:
        """Step accuracy over the held-out rows' supervised steps (each dp rank scores its share; at pp > 1 through
        the forward-only schedule)."""
        cfg, layout = self.cfg.eval, trainer.layout
        n = eval_count(cfg, trainer.held_out)
        if not n:
            return None
        mine = [trainer.held_out[i] for i in range(layout.dp_rank, n, layout.dp)]
        model = trainer.policy.model
        was_training = model.training
        model.eval()
        sums = MetricSums()
        sums.add("correct", 0.0)  # a rank without held-out rows still joins the reduction with the same names
        sums.add("steps", 0.0)
        for start in range(0, len(mine), cfg.batch_size):
            batch = self.collate(mine[start:start + cfg.batch_size], layout.device)
            _, step_stats = prm_loss(self._held_out_logits(trainer, batch), batch.step_labels)
            sums.add("correct", step_stats.num_correct)
            sums.add("steps", step_stats.num_steps)
        model.train(was_training)
        totals = sums.reduce(layout.dp_group, layout.device)
        return totals["correct"] / max(totals["steps"], 1.0)

    def eval_label(self, count: int) -> str:
        what = "final steps" if self.cfg.algo.supervise == "outcome" else "steps"
        return f"held-out step accuracy ({count} solutions, {what}, p(correct) > 1/2 against label > 1/2)"

    def after_export(self, trainer: SupervisedTrainer, path: str) -> None:
        if trainer.rank == 0:
            algo = self.cfg.algo
            write_prm_info(path, self.token_ids, (algo.negative_token, algo.positive_token), self.cfg.data.separator,
                           algo.supervise)


def train_prm(cfg: PRMConfig) -> TrainResult:
    """Train the process (or outcome) reward model as configured; every rank calls it after `init_distributed`."""
    return SupervisedTrainer(cfg, PRMObjective, "ORM" if cfg.algo.supervise == "outcome" else "PRM").train()
