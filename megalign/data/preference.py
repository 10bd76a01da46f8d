"""Offline alignment data: preference pairs (reward model, DPO family, SimPO, CPO, ORPO) and unpaired KTO examples.

Rows (`.jsonl`, `.parquet` or a `datasets` save_to_disk folder, read by `prompts.read_rows`) follow
TRL's dataset formats:

- preference, explicit prompt: `{"prompt", "chosen", "rejected"}`, all plain strings, or
  conversational: `prompt` a message list and `chosen` / `rejected` message lists of the reply;
- preference, implicit prompt: `{"chosen", "rejected"}` only, both whole strings or whole
  conversations. The prompt is their longest common prefix (TRL's `extract_prompt`): for strings
  the common leading characters, less a space right before the point where they differ (the space
  goes with the replies: "The sky is| blue." / "The sky is| green."); for conversations the common
  leading messages. A pair with no common prefix, or where one side is all prompt, is a row error;
- an optional finite `margin` (number; absent or null = 0.0) for the reward model's margin loss,
  and an optional `answer` kept as is (for evaluation);
- unpaired (KTO): `{"prompt", "completion", "label"}` with `label` a boolean (true = desirable),
  strings or conversational like the explicit preference rows.

Other fields are ignored. A malformed row raises `DataError` naming `file:line` (JSONL, 1-based) or
`file row i` (Parquet and datasets folders, 0-based), or is skipped and counted with
`skip_invalid`: a missing or non-string field, a bad message list, a reply that is not assistant
turns only, an empty reply, chosen == rejected (an identical pair carries no preference), a margin
that is not a finite number, a label that is not a boolean.

Tokenisation is the SFT stage's (`megalign.data.sft`), so the policy sees the same prompt ids in
SFT, here and in RL:

- strings: the prompt is `tokenizer.encode(prompt, add_bos=True)`, or the chat template of one
  user message with `template_prompts` (as `load_prompts` and `encode_sft` encode it); each reply is
  `tokenizer.encode(reply) + [eos]`, so prompt + reply are exactly `encode_sft(prompt, reply)`'s ids;
- conversations: the prompt is `apply_chat_template(prompt, add_generation_prompt=True)` and a reply's
  ids are what `apply_chat_template(prompt + reply, add_generation_prompt=False)` adds after it
  (the turns' content and whatever the template closes them with), found by prefix rendering as
  `encode_messages` finds assistant turns; prompt + reply ids are exactly that whole rendering. A
  reply must be assistant messages only (their tokens all carry loss) with non-empty content.

Length: `max_length` bounds prompt + the longer reply (pairs) or prompt + completion (unpaired), the
longest sequence the pair puts in a batch. A longer row is, by `truncation`:

- "drop" (the default): dropped and counted in `stats.too_long`;
- "truncate_prompt": its prompt is cut from the LEFT to fit, keeping the prompt's first token (BOS
  where the tokenizer has one) and its last tokens, which hold the question's end and the assistant
  header the reply continues; counted in `stats.truncated` (the row is kept). A cut chat prompt
  loses its first turns' text, so prefer "drop" unless prompts are long documents. When the reply
  alone does not fit beside one prompt token, the row is dropped and counted in `stats.too_long`:
  a cut reply would teach the model to stop mid-answer.

Counts are in the returned `OfflineDataStats` and logged once at load. Batches (`collate_preferences`,
`collate_unpaired`) use `collate_sft`'s next-token layout: input = ids[:-1], target = ids[1:] where
that token is a reply token, IGNORE_INDEX elsewhere.

KTO's reference point z0 is estimated from mismatched pairs (`megalign.algos.kto`): `collate_unpaired`
builds them as TRL's `_get_kl_dataset` does, rotating the batch's completions by one: prompt i with
completion (i - kl_shift) mod B, so with the default kl_shift=1 prompt i meets completion i - 1 (TRL's
`[c[-1]] + c[:-1]`), and the mismatched completions are the same set as the matched ones (what TRL
recommends). A mismatched row can be longer than `max_length` (up to the longest prompt plus the
longest completion of the batch).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any, Callable, Literal, Optional, Sequence, TypeVar

import torch

from megalign.data.prompts import DataError, DatasetStats, read_rows
from megalign.data.sft import ROLES, SFTExample, _prefix_length, collate_sft
from megalign.data.tokenizer import Tokenizer, check_messages

logger = logging.getLogger(__name__)

Truncation = Literal["drop", "truncate_prompt"]
TRUNCATIONS = ("drop", "truncate_prompt")

E = TypeVar("E")


@dataclasses.dataclass
class OfflineDataStats(DatasetStats):
    """Row counts of one load: rows = kept + invalid + too_long; `truncated` of the kept rows had their prompt cut."""

    truncated: int = 0


@dataclasses.dataclass(frozen=True)
class PreferenceExample:
    """One pair: `prompt_ids` [P] and the reply ids of each side, each ending with EOS (or the template's turn end)."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    margin: float = 0.0
    prompt_text: Optional[str] = None
    """The prompt ids decoded, as `load_prompts` gives it (the rendered template for chats)."""
    answer: Any = None
    """The row's `answer` field, if any (for evaluating the policy on the prompts)."""

    def __post_init__(self):
        if not self.prompt_ids or not self.chosen_ids or not self.rejected_ids:
            raise ValueError(f"PreferenceExample: empty ids (prompt {len(self.prompt_ids)}, chosen "
                             f"{len(self.chosen_ids)}, rejected {len(self.rejected_ids)} tokens)")
        if self.chosen_ids == self.rejected_ids:
            raise ValueError("PreferenceExample: chosen and rejected are the same tokens")
        if not math.isfinite(self.margin):
            raise ValueError(f"PreferenceExample: margin must be finite, got {self.margin}")


@dataclasses.dataclass(frozen=True)
class UnpairedExample:
    """One KTO example: `prompt_ids` [P], `completion_ids` ending with EOS, and whether it is desirable."""

    prompt_ids: list[int]
    completion_ids: list[int]
    label: bool
    prompt_text: Optional[str] = None
    answer: Any = None

    def __post_init__(self):
        if not self.prompt_ids or not self.completion_ids:
            raise ValueError(f"UnpairedExample: empty ids (prompt {len(self.prompt_ids)}, completion "
                             f"{len(self.completion_ids)} tokens)")
        if not isinstance(self.label, bool):
            raise ValueError(f"UnpairedExample: label must be a bool, got {self.label!r}")


def encode_prompt(prompt: str, tokenizer: Tokenizer, template_prompts: bool = False) -> list[int]:
    """A `prompt` string's ids as `load_prompts` and `encode_sft` give them: BOS + text, or one templated user turn."""
    if template_prompts:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    return tokenizer.encode(prompt, add_bos=True)


def _check_chat(messages: Any, name: str, reply: bool) -> None:
    """ValueError naming the field unless `messages` is a valid prompt (reply=False) or reply (assistant turns only)."""
    try:
        check_messages(messages)
    except ValueError as exc:
        raise ValueError(f"'{name}': {exc}") from None
    for i, m in enumerate(messages):
        if m["role"] not in ROLES:
            raise ValueError(f"'{name}': messages[{i}].role must be one of {', '.join(ROLES)}, got {m['role']!r}")
        if reply and m["role"] != "assistant":
            raise ValueError(f"'{name}': messages[{i}].role is {m['role']!r}; a reply must be assistant turns only")
        if reply and not m["content"]:
            raise ValueError(f"'{name}': messages[{i}].content must not be empty")


def encode_prompt_and_replies(prompt: Any, replies: dict[str, Any], tokenizer: Tokenizer,
                              template_prompts: bool = False) -> tuple[list[int], list[list[int]]]:
    """(prompt ids, ids of each reply) of one row (module doc); `replies` maps field names (for errors) to replies.

    The prompt and replies are all strings or all message lists; ValueError says what is wrong.
    """
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("'prompt' must be a non-empty string")
        for name, reply in replies.items():
            if not isinstance(reply, str) or not reply:
                raise ValueError(f"'{name}' must be a non-empty string like 'prompt', got {reply!r}")
        prompt_ids = encode_prompt(prompt, tokenizer, template_prompts)
        out = [tokenizer.encode(reply) + [tokenizer.eos_id] for reply in replies.values()]
        return _check_nonempty(prompt_ids, replies, out)
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f"'prompt' must be a string or a message list, got {type(prompt).__name__}")
    _check_chat(prompt, "prompt", reply=False)
    for name, reply in replies.items():
        if isinstance(reply, str):
            raise ValueError(f"'{name}' must be a message list like 'prompt', got a string")
        _check_chat(reply, name, reply=True)
    prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
    out = []
    for reply in replies.values():
        ids = tokenizer.apply_chat_template(list(prompt) + list(reply), add_generation_prompt=False)
        out.append(ids[_prefix_length(tokenizer, ids, prompt, add_generation_prompt=True):])
    return _check_nonempty(prompt_ids, replies, out)


def _check_nonempty(prompt_ids: list[int], replies: dict[str, Any],
                    reply_ids: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """(prompt_ids, reply_ids), or ValueError when one of them has no token (a tokenizer or template quirk)."""
    if not prompt_ids:
        raise ValueError("'prompt' encodes to no token: nothing would precede the reply")
    for name, ids in zip(replies, reply_ids):
        if not ids:
            raise ValueError(f"'{name}' encodes to no token after the prompt")
    return prompt_ids, reply_ids


def _same_message(a: Any, b: Any) -> bool:
    return a["role"] == b["role"] and a["content"] == b["content"]


def extract_prompt(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """(prompt, chosen reply, rejected reply) of an implicit-prompt pair (module doc); ValueError when there is none."""
    if isinstance(chosen, str) != isinstance(rejected, str):
        raise ValueError("'chosen' and 'rejected' must both be strings or both message lists")
    if isinstance(chosen, str):
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        if 0 < n < min(len(chosen), len(rejected)) and chosen[n - 1] == " ":
            n -= 1  # TRL: the space before the divergence starts the replies
    else:
        _check_chat(chosen, "chosen", reply=False)
        _check_chat(rejected, "rejected", reply=False)
        n = 0
        while n < min(len(chosen), len(rejected)) and _same_message(chosen[n], rejected[n]):
            n += 1
    if n == 0:
        raise ValueError("'chosen' and 'rejected' share no prompt (no common prefix) and the row has no 'prompt'")
    for name, side in (("chosen", chosen), ("rejected", rejected)):
        if n == len(side):
            raise ValueError(f"'{name}' is all prompt: nothing of it follows the prefix it shares with the other side")
    return chosen[:n], chosen[n:], rejected[n:]


def _check_identical(a: Any, b: Any) -> None:
    if a == b:
        raise ValueError("'chosen' and 'rejected' are identical: the pair carries no preference")


def _margin(row: dict) -> float:
    margin = row.get("margin")
    if margin is None:
        return 0.0
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
        raise ValueError(f"'margin' must be a finite number, got {margin!r}")
    return float(margin)


def check_row(row: Any, required: Sequence[str]) -> dict:
    """`row` as a dict holding every `required` field (not null); ValueError names what is missing."""
    if isinstance(row, ValueError):
        raise row
    if not isinstance(row, dict):
        raise ValueError(f"a row must be an object with {', '.join(required)}, got {type(row).__name__}")
    missing = [k for k in required if row.get(k) is None]
    if missing:
        raise ValueError(f"a row needs {', '.join(repr(k) for k in required)}; missing {', '.join(missing)} "
                         f"(fields: {', '.join(k for k in sorted(row) if row[k] is not None)})")
    return row


def fit_prompt(prompt_ids: list[int], body_length: int, max_length: int, truncation: Truncation) -> Optional[list[int]]:
    """The prompt that fits beside `body_length` reply tokens in `max_length` (module doc), or None to drop the row."""
    if len(prompt_ids) + body_length <= max_length:
        return prompt_ids
    room = max_length - body_length
    if truncation == "drop" or room < 1:
        return None
    return prompt_ids[:1] + prompt_ids[len(prompt_ids) - room + 1:]


Draft = tuple[list[int], int, Callable[[list[int]], E]]
"""What a row encoder gives `load_examples`: (prompt ids, reply length, make(fitted prompt ids) -> example)."""


def load_examples(path: str | os.PathLike, what: str, encode_row: Callable[[Any], Draft], max_length: int,
                  truncation: Truncation, skip_invalid: bool) -> tuple[list[E], OfflineDataStats]:
    """The loading loop of the offline loaders: read, validate, fit to `max_length`, count and log (module doc).

    `encode_row(row)` raises ValueError for a malformed row; `what` names the dataset kind in messages.
    """
    path = os.fspath(path)
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2 (one prompt token and one trained token), got {max_length}")
    if truncation not in TRUNCATIONS:
        raise ValueError(f"truncation must be one of {', '.join(TRUNCATIONS)}, got {truncation!r}")
    stats, examples = OfflineDataStats(), []
    for source, row in read_rows(path, what):
        stats.rows += 1
        try:
            prompt_ids, body_length, make = encode_row(row)
        except ValueError as exc:
            if not skip_invalid:
                raise DataError(f"{source}: {exc} (set skip_invalid to skip and count such rows)") from None
            stats.invalid += 1
            continue
        fitted = fit_prompt(prompt_ids, body_length, max_length, truncation)
        if fitted is None:
            stats.too_long += 1
            continue
        stats.truncated += int(len(fitted) < len(prompt_ids))
        examples.append(make(fitted))
    stats.kept = len(examples)
    if stats.invalid or stats.too_long or stats.truncated:
        logger.warning("%s: kept %d of %d %s rows (%d with the prompt cut from the left); skipped %d invalid and "
                       "dropped %d longer than %d tokens", path, stats.kept, stats.rows, what, stats.truncated,
                       stats.invalid, stats.too_long, max_length)
    if not examples:
        raise DataError(f"{path}: no usable {what} rows ({stats})")
    return examples, stats


def load_preferences(path: str | os.PathLike, tokenizer: Tokenizer, max_length: int, truncation: Truncation = "drop",
                     skip_invalid: bool = False,
                     template_prompts: bool = False) -> tuple[list[PreferenceExample], OfflineDataStats]:
    """Validated, tokenised preference pairs of a file or `datasets` folder, in row order, and counts (module doc)."""

    def encode_row(row: Any) -> Draft:
        row = check_row(row, ("chosen", "rejected"))
        prompt, chosen, rejected = row.get("prompt"), row["chosen"], row["rejected"]
        _check_identical(chosen, rejected)
        names = ("chosen", "rejected")
        if prompt is None:
            prompt, chosen, rejected = extract_prompt(chosen, rejected)
            names = ("chosen after the shared prompt", "rejected after the shared prompt")
        margin = _margin(row)
        prompt_ids, (chosen_ids, rejected_ids) = encode_prompt_and_replies(
            prompt, dict(zip(names, (chosen, rejected))), tokenizer, template_prompts)
        _check_identical(chosen_ids, rejected_ids)
        return prompt_ids, max(len(chosen_ids), len(rejected_ids)), lambda ids: PreferenceExample(
            ids, chosen_ids, rejected_ids, margin, tokenizer.decode(ids), row.get("answer"))

    return load_examples(path, "preference", encode_row, max_length, truncation, skip_invalid)


def load_unpaired(path: str | os.PathLike, tokenizer: Tokenizer, max_length: int, truncation: Truncation = "drop",
                  skip_invalid: bool = False,
                  template_prompts: bool = False) -> tuple[list[UnpairedExample], OfflineDataStats]:
    """Validated, tokenised KTO examples of a file or `datasets` folder, in row order, and the counts (module doc)."""

    def encode_row(row: Any) -> Draft:
        row = check_row(row, ("prompt", "completion", "label"))
        if not isinstance(row["label"], bool):
            raise ValueError(f"'label' must be a boolean (true = desirable), got {row['label']!r}")
        prompt_ids, (completion_ids,) = encode_prompt_and_replies(
            row["prompt"], {"completion": row["completion"]}, tokenizer, template_prompts)
        return prompt_ids, len(completion_ids), lambda ids: UnpairedExample(
            ids, completion_ids, row["label"], tokenizer.decode(ids), row.get("answer"))

    return load_examples(path, "unpaired", encode_row, max_length, truncation, skip_invalid)


def _sequence(prompt_ids: list[int], reply_ids: list[int]) -> SFTExample:
    return SFTExample(prompt_ids + reply_ids, [False] * len(prompt_ids) + [True] * len(reply_ids))


def collate_replies(prompts: Sequence[list[int]], replies: Sequence[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """`collate_sft` of prompt i + reply i rows (right-padded, loss on the replies), with `response_lengths`
    (trained tokens per row): the layout every offline batch here is made of."""
    batch = collate_sft([_sequence(p, r) for p, r in zip(prompts, replies)], pad_id)
    batch["response_lengths"] = torch.tensor([len(r) for r in replies], dtype=torch.long)
    return batch


def collate_preferences(examples: Sequence[PreferenceExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch of B pairs, rows 0..B-1 prompt + chosen, rows B..2B-1 prompt + rejected.

    T = the longest of the 2B sequences - 1. Returns `input_ids`, `attention_mask`, `targets`
    [2B, T] exactly as `collate_sft` lays them out (targets: the next token where it is a reply
    token, else IGNORE_INDEX), `response_lengths` [2B] (tokens with a target, >= 1) and `margin` [B]
    float32.
    """
    if not examples:
        raise ValueError("collate_preferences needs at least one example")
    prompts = [e.prompt_ids for e in examples]
    batch = collate_replies(prompts * 2, [e.chosen_ids for e in examples] + [e.rejected_ids for e in examples], pad_id)
    batch["margin"] = torch.tensor([e.margin for e in examples], dtype=torch.float32)
    return batch


def collate_unpaired(examples: Sequence[UnpairedExample], pad_id: int, kl_shift: int = 1) -> dict[str, torch.Tensor]:
    """Right-padded KTO batch of B >= 2 examples and its B mismatched pairs (module doc), both [B, T].

    T = the longest of the 2B sequences - 1, so the halves can be concatenated into one forward.
    Returns `input_ids`, `attention_mask`, `targets` [B, T] and `response_lengths` [B] of the labelled
    (prompt i, completion i) rows, the same four with a `kl_` prefix for (prompt i, completion
    (i - kl_shift) mod B), and `labels` [B] bool (True = desirable).
    """
    b = len(examples)
    if b < 2:
        raise ValueError(f"collate_unpaired needs at least 2 examples to mismatch prompts and completions, got {b}")
    if kl_shift % b == 0:
        raise ValueError(f"kl_shift={kl_shift} is a multiple of the batch size {b}: every prompt would keep its "
                         "own completion")
    prompts = [e.prompt_ids for e in examples]
    completions = [e.completion_ids for e in examples]
    kl_completions = [completions[(i - kl_shift) % b] for i in range(b)]
    both = collate_replies(prompts * 2, completions + kl_completions, pad_id)
    batch = {k: v[:b] for k, v in both.items()}
    batch.update({f"kl_{k}": v[b:] for k, v in both.items()})
    batch["labels"] = torch.tensor([e.label for e in examples], dtype=torch.bool)
    return batch
