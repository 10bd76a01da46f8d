"""Prompt datasets for online RL (JSONL, Parquet or a `datasets` folder) and a deterministic, resumable, sharded sampler.

Rows: `{"prompt": str, "answer": ...}` or `{"messages": [{"role", "content"}, ...], "answer": ...}`,
with `answer` a string or number; every other field is kept in `metadata` and reaches the reward
functions. Design choices:

- One reader for every dataset file (`read_rows`, also used by the SFT loader): `.jsonl`,
  `.parquet` (pyarrow), or a folder written by `datasets`' `Dataset.save_to_disk` (read with
  `datasets.load_from_disk`, imported only then: it is an optional dependency). A `DatasetDict`
  folder is refused with its split names rather than one split being picked silently.
- Validation happens once, at load: a malformed row (bad JSON, not an object, both or neither of
  prompt/messages, wrong types, characters the tokenizer cannot encode) raises `DataError` naming
  `file:line` (JSONL, 1-based) or `file row i` (Parquet and datasets folders, 0-based); with
  `skip_invalid=True` it is skipped and counted instead. Blank JSONL lines are not rows.
- `prompt` rows are encoded as raw text after BOS (base models, the built-in arithmetic task);
  with `template_prompts=True` they are wrapped as one user message and go through the chat
  template, like `messages` rows always do.
- A prompt longer than `max_prompt_length` tokens is dropped, never truncated (a cut prompt would
  ask another question), and counted. Counts are in `dataset.stats` and logged once at load.
- `PromptSampler` sees the data as one endless stream, epoch after epoch, each epoch a permutation
  seeded by (seed, epoch). The global batch at step t is stream positions
  [t*B*W, (t+1)*B*W) for B prompts per rank and W ranks, and rank r takes positions r, r+W, ...
  So nothing is dropped or repeated within an epoch whatever the remainder N mod (B*W): the
  remainder's global batch simply continues into the next epoch. Its state is one integer (the
  stream position), so a resumed run continues exactly, even with another world size.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from typing import Any, Iterator, Optional

import numpy as np

from megalign.data.tokenizer import Tokenizer, check_messages

logger = logging.getLogger(__name__)


class DataError(ValueError):
    """A dataset that cannot be used; the message names the file and line or row."""


@dataclasses.dataclass(frozen=True)
class PromptExample:
    """One usable prompt: `prompt_ids` [P] (P <= max_prompt_length) is what the policy continues."""

    prompt_ids: list[int]
    prompt_text: str
    answer: Any
    metadata: dict[str, Any]
    source: str
    """Where the row came from (`file:line` or `file row i`), for error messages downstream."""


@dataclasses.dataclass
class DatasetStats:
    """Row counts of one load: rows = kept + invalid + too_long."""

    rows: int = 0
    kept: int = 0
    invalid: int = 0
    too_long: int = 0

    def as_dict(self, prefix: str = "data/") -> dict[str, int]:
        return {f"{prefix}{k}": v for k, v in dataclasses.asdict(self).items()}


def _read_jsonl(path: str) -> Iterator[tuple[str, Any]]:
    """(`file:line`, parsed row, or a ValueError saying why the line is not JSON) per non-blank line."""
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                yield f"{path}:{lineno}", ValueError(f"not UTF-8: {exc}")
            except json.JSONDecodeError as exc:
                yield f"{path}:{lineno}", ValueError(f"invalid JSON: {exc}")


def _read_parquet(path: str) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several types (ArrowInvalid, OSError) for bad files
        raise DataError(f"{path}: cannot read as Parquet: {exc}") from exc
    for i, row in enumerate(rows):
        yield f"{path} row {i}", row


def _read_hf_dataset(path: str) -> Iterator[tuple[str, Any]]:
    """(`file row i`, row) of a folder written by `Dataset.save_to_disk`."""
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        with open(os.path.join(path, "dataset_dict.json")) as f:
            splits = json.load(f).get("splits", [])
        raise DataError(f"{path}: a DatasetDict with splits {splits}; give the folder of one split, "
                        f"e.g. {os.path.join(path, splits[0] if splits else 'train')}")
    if not os.path.isfile(os.path.join(path, "state.json")):
        raise DataError(f"{path}: a folder, but not one written by datasets' save_to_disk (it has no state.json)")
    try:
        import datasets
    except ImportError as exc:
        raise ImportError(f"{path}: reading a datasets folder needs the datasets package: "
                          "pip install 'megalign[datasets]'") from exc
    try:
        dataset = datasets.load_from_disk(path)
    except Exception as exc:  # datasets raises several types (FileNotFoundError, ArrowInvalid, ...) for bad folders
        raise DataError(f"{path}: cannot read as a datasets folder: {exc}") from exc
    for i, row in enumerate(dataset):
        yield f"{path} row {i}", row


def read_rows(path: str, what: str) -> Iterator[tuple[str, Any]]:
    """(source, parsed row) of a `.jsonl`, a `.parquet` or a `save_to_disk` folder (module doc); `what` names it in errors.

    A JSONL line that is not JSON comes as a ValueError in place of the row, for the caller to
    raise or count; file-level problems raise `DataError` here.
    """
    if os.path.isdir(path):
        return _read_hf_dataset(path)
    if not os.path.isfile(path):
        raise DataError(f"{path}: {what} file does not exist")
    if path.endswith(".jsonl"):
        return _read_jsonl(path)
    if path.endswith(".parquet"):
        return _read_parquet(path)
    raise DataError(f"{path}: unknown {what} file type; expected .jsonl, .parquet or a folder written by "
                    "datasets' save_to_disk")


def _encode_row(row: Any, tokenizer: Tokenizer, template_prompts: bool) -> tuple[list[int], Any, dict[str, Any]]:
    """(prompt ids, answer, metadata) of one parsed row; ValueError says what is wrong with it."""
    if isinstance(row, ValueError):
        raise row
    if not isinstance(row, dict):
        raise ValueError(f"a row must be an object with prompt or messages and answer, got {type(row).__name__}")
    has_prompt, has_messages = row.get("prompt") is not None, row.get("messages") is not None
    if has_prompt == has_messages:
        raise ValueError(f"a row needs exactly one of 'prompt' or 'messages' (fields: {', '.join(sorted(row))})")
    answer = row.get("answer")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError(f"'answer' must be a string or number, got {answer!r}")
    if isinstance(answer, float) and not math.isfinite(answer):
        raise ValueError(f"'answer' must be finite, got {answer!r}")
    if has_prompt:
        prompt = row["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"'prompt' must be a non-empty string, got {prompt!r}")
        if template_prompts:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        else:
            ids = tokenizer.encode(prompt, add_bos=True)
    else:
        check_messages(row["messages"])
        ids = tokenizer.apply_chat_template(row["messages"])
    metadata = {k: v for k, v in row.items() if k not in ("prompt", "messages", "answer")}
    return ids, answer, metadata


class PromptDataset:
    """The usable prompts of one file, in file order; `stats` counts what was left out and why."""

    def __init__(self, examples: list[PromptExample], stats: DatasetStats, path: str):
        self.examples = examples
        self.stats = stats
        self.path = path

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> PromptExample:
        return self.examples[index]


def load_prompts(
    path: str | os.PathLike,
    tokenizer: Tokenizer,
    max_prompt_length: int,
    skip_invalid: bool = False,
    template_prompts: bool = False,
) -> PromptDataset:
    """Load, validate and tokenise a `.jsonl`, `.parquet` or `datasets` folder of prompts (rules in the module doc)."""
    path = os.fspath(path)
    if max_prompt_length < 1:
        raise ValueError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
    stats, examples = DatasetStats(), []
    for source, row in read_rows(path, "prompt"):
        stats.rows += 1
        try:
            ids, answer, metadata = _encode_row(row, tokenizer, template_prompts)
        except ValueError as exc:
            if not skip_invalid:
                raise DataError(f"{source}: {exc} (set skip_invalid to skip and count such rows)") from None
            stats.invalid += 1
            continue
        if len(ids) > max_prompt_length:
            stats.too_long += 1
            continue
        examples.append(PromptExample(ids, tokenizer.decode(ids), answer, metadata, source))
    stats.kept = len(examples)
    if stats.invalid or stats.too_long:
        logger.warning(
            "%s: kept %d of %d rows; skipped %d invalid and dropped %d longer than %d tokens",
            path, stats.kept, stats.rows, stats.invalid, stats.too_long, max_prompt_length,
        )
    if not examples:
        raise DataError(f"{path}: no usable prompts ({stats})")
    return PromptDataset(examples, stats, path)


class PromptSampler:
    """Indices into a dataset of `num_prompts`, for one data-parallel rank (stream rules in the module doc)."""

    def __init__(self, num_prompts: int, seed: int = 0, shuffle: bool = True, rank: int = 0, world_size: int = 1):
        if num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.num_prompts, self.seed, self.shuffle = num_prompts, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.position = 0
        """Stream positions consumed by all ranks together."""
        self._order: Optional[tuple[int, np.ndarray]] = None

    @property
    def epoch(self) -> int:
        """The epoch the next prompt comes from."""
        return self.position // self.num_prompts

    def _index(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_prompts)
        if not self.shuffle:
            return offset
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts))
        return int(self._order[1][offset])

    def next_indices(self, batch_size: int) -> list[int]:
        """This rank's `batch_size` prompt indices of the next global batch of `batch_size * world_size`."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        start = self.position + self.rank
        indices = [self._index(start + j * self.world_size) for j in range(batch_size)]
        self.position += batch_size * self.world_size
        return indices

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "num_prompts": self.num_prompts, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; the dataset size, seed and shuffle must match the saved run."""
        for key in ("num_prompts", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]!r} but this sampler has {key}={getattr(self, key)!r}")
        self.position = int(state["position"])
