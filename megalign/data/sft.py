"""Supervised fine-tuning examples: (prompt, response) pairs tokenised with the loss on the response only.

Rows of an SFT JSONL file: `{"prompt": str, "response": str, ...}` (other fields, such as the
`answer` that `arith.write_jsonl` adds, are ignored). A malformed row raises `DataError` naming
`file:line`, or is skipped and counted with `skip_invalid`. A row longer than `max_length` tokens
(prompt + response + EOS) is dropped and counted, never truncated: a cut response would teach the
model to stop mid-answer.

Tokenisation matches what the policy sees later in RL: the prompt is encoded exactly as
`load_prompts` encodes a `prompt` row (BOS + text, or the chat template with `template_prompts`),
and the response is followed by EOS so the model learns to stop (generation stops at EOS).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Sequence

import torch

from megalign.data.prompts import DataError, DatasetStats, _read_jsonl
from megalign.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
"""Target id of positions that carry no loss (prompt and padding), as in `token_logprob`."""


@dataclasses.dataclass(frozen=True)
class SFTExample:
    """One training sequence: `prompt_ids` [P] then `response_ids` [R] (EOS last); loss on the response only."""

    prompt_ids: list[int]
    response_ids: list[int]


def encode_sft(prompt: str, response: str, tokenizer: Tokenizer, template_prompts: bool = False) -> SFTExample:
    """Tokenise one pair (module doc); ValueError when the tokenizer cannot encode a character."""
    if template_prompts:
        prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    else:
        prompt_ids = tokenizer.encode(prompt, add_bos=True)
    return SFTExample(prompt_ids, tokenizer.encode(response) + [tokenizer.eos_id])


def load_sft_jsonl(path: str | os.PathLike, tokenizer: Tokenizer, max_length: int, skip_invalid: bool = False,
                   template_prompts: bool = False) -> tuple[list[SFTExample], DatasetStats]:
    """Validated, tokenised examples of an SFT JSONL file, in file order, and the row counts."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataError(f"{path}: SFT file does not exist")
    stats, examples = DatasetStats(), []
    for source, row in _read_jsonl(path):
        stats.rows += 1
        try:
            if isinstance(row, ValueError):
                raise row
            if not isinstance(row, dict):
                raise ValueError(f"a row must be an object with prompt and response, got {type(row).__name__}")
            for key in ("prompt", "response"):
                if not isinstance(row.get(key), str) or not row[key]:
                    raise ValueError(f"'{key}' must be a non-empty string, got {row.get(key)!r}")
            example = encode_sft(row["prompt"], row["response"], tokenizer, template_prompts)
        except ValueError as exc:
            if not skip_invalid:
                raise DataError(f"{source}: {exc} (set skip_invalid to skip and count such rows)") from None
            stats.invalid += 1
            continue
        if len(example.prompt_ids) + len(example.response_ids) > max_length:
            stats.too_long += 1
            continue
        examples.append(example)
    stats.kept = len(examples)
    if stats.invalid or stats.too_long:
        logger.warning("%s: kept %d of %d rows; skipped %d invalid and dropped %d longer than %d tokens",
                       path, stats.kept, stats.rows, stats.invalid, stats.too_long, max_length)
    if not examples:
        raise DataError(f"{path}: no usable SFT rows ({stats})")
    return examples, stats


def collate_sft(examples: Sequence[SFTExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded next-token batch of B examples, T = longest (prompt + response) - 1.

    Returns `input_ids` [B, T] (sequence without its last token), `attention_mask` [B, T] (1 = real),
    and `targets` [B, T]: the next token where it is a response token, else IGNORE_INDEX.
    """
    seqs = [e.prompt_ids + e.response_ids for e in examples]
    t = max(len(s) for s in seqs) - 1
    input_ids = torch.full((len(seqs), t), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), t), dtype=torch.long)
    targets = torch.full((len(seqs), t), IGNORE_INDEX, dtype=torch.long)
    for i, (e, s) in enumerate(zip(examples, seqs)):
        n = len(s) - 1
        input_ids[i, :n] = torch.tensor(s[:-1])
        attention_mask[i, :n] = 1
        # position j predicts s[j + 1]; the first response token is predicted at j = P - 1
        start = len(e.prompt_ids) - 1
        targets[i, start:n] = torch.tensor(s[start + 1:])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "targets": targets}
