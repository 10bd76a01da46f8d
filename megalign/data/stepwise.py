"""Stepwise supervision for process reward models: a prompt, its solution steps, and a label per step.

Rows (`.jsonl`, `.parquet` or a `datasets` folder, read by `prompts.read_rows`) follow TRL's
stepwise-supervision format: `{"prompt": str, "completions": [step str, ...], "labels": [label, ...]}`,
one label per step, each a boolean (hard: is the solution still correct after this step) or a number
in [0, 1] (soft, e.g. Math-Shepherd's Monte-Carlo estimate, `megalign.algos.math_shepherd_labels`).
Other fields are ignored. A malformed row raises `DataError` naming `file:line` or `file row i`, or is
skipped and counted with `skip_invalid`: no steps, as many labels as steps not given, an empty step,
a step that contains the separator (it would hold an unmarked step boundary), a bad label.

The sequence is the prompt's ids (`encode_prompt`: BOS + text, or one templated user turn with
`template_prompts`, as every other stage encodes a `prompt` string) followed, for each step, by
`tokenizer.encode(step) + tokenizer.encode(separator)` (default separator "\\n"). As in TRL's
PRMTrainer the step and the separator are encoded apart, so the separator is always the same tokens
whatever the step ends with (a BPE merge never hides it), and steps are encoded one by one, so no
token spans two steps. The token that marks step k is the last token of its step + separator
encoding: the separator's last token (for `CharTokenizer` and "\\n", the newline itself). No EOS is
appended: a PRM classifies, it does not generate.

Layout for `megalign.algos.prm_loss(logits [B, T, 2], labels [B, T])`: the label of step k sits at
the marking token's position itself, not shifted as next-token targets are, because a classifier
head's logits at position t come from the hidden state of token t, which has read the whole step and
its separator (TRL puts the labels there too). `collate_stepwise` therefore returns the whole
sequences as `input_ids` [B, T] (not ids[:-1] as `collate_sft` does) with `step_labels` [B, T]:
IGNORE_INDEX everywhere but the marking positions.

Length: `max_length` bounds the whole sequence; a longer row is dropped, or with
`truncation="truncate_prompt"` has its prompt cut from the left (first token kept), exactly as
`megalign.data.preference` does, counted in the returned `OfflineDataStats`.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Sequence

import torch

from megalign.data.preference import (
    Draft,
    OfflineDataStats,
    Truncation,
    check_row,
    encode_prompt,
    load_examples,
)
from megalign.data.sft import IGNORE_INDEX
from megalign.data.tokenizer import Tokenizer

DEFAULT_SEPARATOR = "\n"


@dataclasses.dataclass(frozen=True)
class StepwiseExample:
    """One solution `ids` [T]; `step_positions` [S] index the marking token of each step, `labels` [S] in [0, 1]."""

    ids: list[int]
    step_positions: list[int]
    labels: list[float]

    def __post_init__(self):
        if not self.step_positions or len(self.step_positions) != len(self.labels):
            raise ValueError(f"StepwiseExample: {len(self.step_positions)} step positions and {len(self.labels)} "
                             "labels; needs at least one step and one label per step")
        if any(b <= a for a, b in zip(self.step_positions, self.step_positions[1:])):
            raise ValueError(f"StepwiseExample: step_positions must increase, got {self.step_positions}")
        if self.step_positions[0] < 1 or self.step_positions[-1] >= len(self.ids):
            raise ValueError(f"StepwiseExample: step_positions {self.step_positions} must lie in [1, {len(self.ids)})")
        if not all(0.0 <= y <= 1.0 for y in self.labels):
            raise ValueError(f"StepwiseExample: labels must lie in [0, 1], got {self.labels}")

    def __len__(self) -> int:
        return len(self.ids)


def _label(value: Any, k: int) -> float:
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 <= value <= 1:
        raise ValueError(f"labels[{k}] must be a boolean or a number in [0, 1], got {value!r}")
    return float(value)


def encode_steps(prompt_ids: list[int], steps: Sequence[str], labels: Sequence[Any], tokenizer: Tokenizer,
                 separator: str = DEFAULT_SEPARATOR) -> StepwiseExample:
    """The example of a tokenised prompt and its steps (module doc); ValueError says what is wrong."""
    if not isinstance(steps, (list, tuple)) or not steps:
        raise ValueError(f"'completions' must be a non-empty list of step strings, got {steps!r}")
    if not isinstance(labels, (list, tuple)) or len(labels) != len(steps):
        raise ValueError(f"'labels' must be a list of one label per step ({len(steps)} steps), got {labels!r}")
    separator_ids = tokenizer.encode(separator)
    if not separator_ids:
        raise ValueError(f"the step separator {separator!r} encodes to no token")
    ids, positions = list(prompt_ids), []
    for k, step in enumerate(steps):
        if not isinstance(step, str) or not step:
            raise ValueError(f"completions[{k}] must be a non-empty string, got {step!r}")
        if separator in step:
            raise ValueError(f"completions[{k}] contains the step separator {separator!r}: {step!r}")
        ids += tokenizer.encode(step) + separator_ids
        positions.append(len(ids) - 1)
    return StepwiseExample(ids, positions, [_label(y, k) for k, y in enumerate(labels)])


def load_stepwise(path: str | os.PathLike, tokenizer: Tokenizer, max_length: int, truncation: Truncation = "drop",
                  skip_invalid: bool = False, template_prompts: bool = False,
                  separator: str = DEFAULT_SEPARATOR) -> tuple[list[StepwiseExample], OfflineDataStats]:
    """Validated, tokenised stepwise examples of a file or `datasets` folder, in row order, and counts (module doc)."""
    if not isinstance(separator, str) or not separator:
        raise ValueError(f"separator must be a non-empty string, got {separator!r}")

    def encode_row(row: Any) -> Draft:
        row = check_row(row, ("prompt", "completions", "labels"))
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise ValueError(f"'prompt' must be a non-empty string, got {row['prompt']!r}")
        prompt_ids = encode_prompt(row["prompt"], tokenizer, template_prompts)
        if not prompt_ids:
            raise ValueError("'prompt' encodes to no token")
        full = encode_steps(prompt_ids, row["completions"], row["labels"], tokenizer, separator)
        body = full.ids[len(prompt_ids):]
        offsets = [p - len(prompt_ids) for p in full.step_positions]
        return prompt_ids, len(body), lambda ids: StepwiseExample(ids + body, [len(ids) + o for o in offsets],
                                                                  full.labels)

    return load_examples(path, "stepwise", encode_row, max_length, truncation, skip_invalid)


def collate_stepwise(examples: Sequence[StepwiseExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch of B examples, T = the longest sequence (module doc for the layout).

    Returns `input_ids` [B, T] long, `attention_mask` [B, T] long (1 = real token) and `step_labels`
    [B, T] float32: the step's label at its marking position, IGNORE_INDEX (-100) elsewhere.
    """
    if not examples:
        raise ValueError("collate_stepwise needs at least one example")
    t = max(len(e) for e in examples)
    input_ids = torch.full((len(examples), t), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), t), dtype=torch.long)
    step_labels = torch.full((len(examples), t), float(IGNORE_INDEX), dtype=torch.float32)
    for i, e in enumerate(examples):
        input_ids[i, :len(e)] = torch.tensor(e.ids)
        attention_mask[i, :len(e)] = 1
        step_labels[i, e.step_positions] = torch.tensor(e.labels, dtype=torch.float32)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "step_labels": step_labels}
