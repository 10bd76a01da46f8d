"""Supervised fine-tuning examples: token ids with a per-token loss mask, from (prompt, response) pairs or chats.

Rows of an SFT dataset (`.jsonl`, `.parquet` or a `datasets` save_to_disk folder, read by
`prompts.read_rows`): either `{"prompt": str, "response": str, ...}` or
`{"messages": [{"role", "content"}, ...], ...}`; other fields (such as the `answer` that
`arith.write_jsonl` adds) are ignored. A malformed row raises `DataError` naming `file:line` or
`file row i`, or is skipped and counted with `skip_invalid`. A row longer than `max_length` tokens
is dropped and counted, never truncated: a cut response would teach the model to stop mid-answer.

Tokenisation matches what the policy sees later in RL:

- A pair: the prompt is encoded exactly as `load_prompts` encodes a `prompt` row (BOS + text, or
  the chat template with `template_prompts`), and the response is followed by EOS so the model
  learns to stop (generation stops at EOS). The loss is on the response and its EOS.
- A chat: the ids are exactly `tokenizer.apply_chat_template(messages, add_generation_prompt=False)`
  and the loss is on the assistant turns only. Assistant turn k's tokens are found by rendering
  prefixes: they start after `apply_chat_template(messages[:k], add_generation_prompt=True)` (the
  context up to and including the assistant header) and end with
  `apply_chat_template(messages[:k+1], add_generation_prompt=False)`, so they are the content and
  whatever the template closes the turn with (`<eos>` for `CharTokenizer`, `<|im_end|>\\n` for
  ChatML). A template whose prefixes are not prefixes of the whole rendering (one that rewrites
  earlier turns, e.g. drops past reasoning) cannot be masked this way and its rows are errors.
  Roles are system, user, assistant and tool; an assistant turn must not be empty nor come first
  (it would have no context), and a chat needs at least one.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Sequence

import torch

from megalign.data.prompts import DataError, DatasetStats, read_rows
from megalign.data.tokenizer import Message, Tokenizer, check_messages

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
"""Target id of positions that carry no loss (prompt, user turns and padding), as in `token_logprob`."""

ROLES = ("system", "user", "assistant", "tool")


@dataclasses.dataclass(frozen=True)
class SFTExample:
    """One training sequence `ids` [T] with `loss_mask` [T]: True where the token is trained on (predicted).

    The first token is never trained on (nothing predicts it) and at least one token is.
    """

    ids: list[int]
    loss_mask: list[bool]

    def __post_init__(self):
        if len(self.ids) != len(self.loss_mask):
            raise ValueError(f"SFTExample: {len(self.ids)} ids but {len(self.loss_mask)} loss_mask entries")
        if not any(self.loss_mask):
            raise ValueError("SFTExample: no token carries loss")
        if self.loss_mask[0]:
            raise ValueError("SFTExample: the first token cannot carry loss (nothing predicts it)")

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def prompt_ids(self) -> list[int]:
        """The ids before the first trained token: a pair's prompt, a chat's context of its first assistant turn."""
        return self.ids[:self.loss_mask.index(True)]

    @property
    def response_ids(self) -> list[int]:
        """The ids from the first trained token on: a pair's response and EOS (in a chat, later turns too)."""
        return self.ids[self.loss_mask.index(True):]


def encode_sft(prompt: str, response: str, tokenizer: Tokenizer, template_prompts: bool = False) -> SFTExample:
    """Tokenise one pair (module doc); ValueError when the tokenizer cannot encode a character."""
    if template_prompts:
        prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    else:
        prompt_ids = tokenizer.encode(prompt, add_bos=True)
    response_ids = tokenizer.encode(response) + [tokenizer.eos_id]
    return SFTExample(prompt_ids + response_ids, [False] * len(prompt_ids) + [True] * len(response_ids))


def _prefix_length(tokenizer: Tokenizer, ids: list[int], messages: Sequence[Message], add_generation_prompt: bool) -> int:
    """len(rendering of `messages`), which must be a prefix of the whole conversation's `ids`."""
    prefix = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    if ids[:len(prefix)] != prefix:
        raise ValueError(f"the chat template does not render messages[:{len(messages)}] as a prefix of the whole "
                         "conversation, so the assistant turns cannot be masked (see megalign.data.sft)")
    return len(prefix)


def encode_messages(messages: Any, tokenizer: Tokenizer) -> SFTExample:
    """Tokenise one chat with the loss on its assistant turns (module doc); ValueError says what is wrong."""
    check_messages(messages)
    for i, m in enumerate(messages):
        if m["role"] not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m['role']!r}")
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise ValueError("messages have no assistant turn to train on")
    if turns[0] == 0:
        raise ValueError("messages[0] is an assistant turn: it has no context to answer")
    for i in turns:
        if not messages[i]["content"]:
            raise ValueError(f"messages[{i}].content must not be empty for an assistant turn")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    mask = [False] * len(ids)
    for i in turns:
        start = _prefix_length(tokenizer, ids, messages[:i], add_generation_prompt=True)
        end = _prefix_length(tokenizer, ids, messages[:i + 1], add_generation_prompt=False)
        mask[start:end] = [True] * (end - start)
    return SFTExample(ids, mask)


def _encode_row(row: Any, tokenizer: Tokenizer, template_prompts: bool) -> SFTExample:
    """The example of one parsed row; ValueError says what is wrong with it."""
    if isinstance(row, ValueError):
        raise row
    if not isinstance(row, dict):
        raise ValueError(f"a row must be an object with prompt and response, or messages, got {type(row).__name__}")
    has_messages = row.get("messages") is not None
    if has_messages == (row.get("prompt") is not None or row.get("response") is not None):
        raise ValueError("a row needs either 'prompt' and 'response', or 'messages' "
                         f"(fields: {', '.join(k for k in sorted(row) if row[k] is not None)})")
    if has_messages:
        return encode_messages(row["messages"], tokenizer)
    for key in ("prompt", "response"):
        if not isinstance(row.get(key), str) or not row[key]:
            raise ValueError(f"'{key}' must be a non-empty string, got {row.get(key)!r}")
    return encode_sft(row["prompt"], row["response"], tokenizer, template_prompts)


def load_sft(path: str | os.PathLike, tokenizer: Tokenizer, max_length: int, skip_invalid: bool = False,
             template_prompts: bool = False) -> tuple[list[SFTExample], DatasetStats]:
    """Validated, tokenised examples of an SFT dataset (file or `datasets` folder), in row order, and the row counts."""
    path = os.fspath(path)
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2 (context and one trained token), got {max_length}")
    stats, examples = DatasetStats(), []
    for source, row in read_rows(path, "SFT"):
        stats.rows += 1
        try:
            example = _encode_row(row, tokenizer, template_prompts)
        except ValueError as exc:
            if not skip_invalid:
                raise DataError(f"{source}: {exc} (set skip_invalid to skip and count such rows)") from None
            stats.invalid += 1
            continue
        if len(example) > max_length:
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
    """Right-padded next-token batch of B examples, T = longest example - 1.

    Returns `input_ids` [B, T] (sequence without its last token), `attention_mask` [B, T] (1 = real),
    and `targets` [B, T]: position j holds token j + 1 where that token carries loss, else IGNORE_INDEX.
    """
    t = max(len(e) for e in examples) - 1
    input_ids = torch.full((len(examples), t), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), t), dtype=torch.long)
    targets = torch.full((len(examples), t), IGNORE_INDEX, dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e) - 1
        input_ids[i, :n] = torch.tensor(e.ids[:-1])
        attention_mask[i, :n] = 1
        next_ids = torch.tensor(e.ids[1:])
        targets[i, :n] = torch.where(torch.tensor(e.loss_mask[1:]), next_ids, torch.full_like(next_ids, IGNORE_INDEX))
    return {"input_ids": input_ids, "attention_mask": attention_mask, "targets": targets}
