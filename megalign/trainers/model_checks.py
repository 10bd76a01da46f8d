"""Start-up checks of the models a run names, each error naming the config key and folder at fault.

`ModelError` (a model that does not fit the run) and `ModelPathError` (a folder that is not an HF
checkpoint) are printed by the launcher as one line, as config errors are. `check_model` compares a
built model with the run's tokenizer and longest sequence; `check_stages` (the layer split: even, or the role's
`first_stage_layers` / `last_stage_layers` / `stage_layers`) and `check_same_batch`
check pipeline stages and how two roles' layouts share the batch. `check_tokenizer` checks, before its weights
load, that a role reading the actor's token ids was saved with the actor's tokenizer: equal sizes are not enough
(Llama-2 and Mistral both have 32000 ids, and an RM of one scores the other's ids as noise), so the fingerprints
(`megalign.data.tokenizer.tokenizer_fingerprint`) must be equal; a folder without tokenizer files keeps only the
size check of `check_model`.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Optional

from megalign.data import Tokenizer, TokenizerConfig, build_tokenizer, check_vocab
from megalign.data.tokenizer import FINGERPRINT_PARTS, _detect, tokenizer_fingerprint
from megalign.parallel import ParallelLayout, StageSplit
from megalign.parallel.layout import example_split

logger = logging.getLogger(__name__)


class ModelError(ValueError):
    """A model that does not fit the run (vocabulary, positions, layers per stage), named by its config key and
    folder: the launcher prints it as one line, as a config error."""


class ModelPathError(FileNotFoundError):
    """A model folder a config key names that is missing or not an HF checkpoint (one line, as `ModelError`)."""


def check_model_path(path: str, key: str) -> None:
    """ModelPathError naming the config `key` when `path` is not an HF checkpoint folder (no config.json)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        what = "does not exist" if not os.path.exists(path) else "has no config.json"
        raise ModelPathError(
            f"{key}={path!r} {what}: it must be an HF checkpoint folder (e.g. the run_dir/hf export of an SFT run). "
            f"For the embedded example, `launch/run_embedded.sh` creates it (or: python launch/train_sft.py "
            f"--config examples/sft_arith.yaml, which writes runs/sft_arith/hf)")


def check_stages(num_layers: int, pp: int, key: str, what: str, stages: Optional[StageSplit] = None) -> None:
    """ModelError naming `key`'s options and `what` (where the layer count comes from) unless `stages` (the role's
    `ModelRoleConfig.stage_split`, or its layout's `stages`; default: an even split) splits the `num_layers` decoder
    layers over `pp` stages, e.g. "actor.pp=8 does not divide the 28 decoder layers of actor.path '...': set
    actor.first_stage_layers / actor.last_stage_layers or actor.stage_layers, e.g. [3, 3, 4, 4, 4, 4, 3, 3]"."""
    stages = dataclasses.replace(stages or StageSplit(), key=key)
    if not stages.uneven and num_layers % pp:
        raise ModelError(f"{key}.pp={pp} does not divide the {num_layers} decoder layers of {what}: set "
                         f"{key}.first_stage_layers / {key}.last_stage_layers (the stages between split the rest "
                         f"evenly) or {key}.stage_layers, e.g. {example_split(num_layers, pp)}")
    try:
        stages.sizes(num_layers, pp)
    except ValueError as exc:
        raise ModelError(f"{what}: {exc}") from exc


def check_same_batch(layout: ParallelLayout, key: str, data_layout: ParallelLayout, data_key: str) -> None:
    """How data moves between two roles' layouts on the same ranks, checked: a role computes on the batch its ranks
    hold, and the batches are split by `data_layout`'s dp coordinate (every rank of a `data_key` tp x pp replica holds
    that replica's whole batch, pipeline stages included). So each replica of the role (its ranks with one dp
    coordinate: its tp group x pp group) must lie inside one `data_key` replica; then no data moves: a role at pp = 1
    beside a pp > 1 model scores the batch on every stage's ranks (redundantly), and a role's tp group sees one batch.
    ValueError naming both layouts and the offending ranks otherwise (e.g. reference.tp=2 beside model.tp=1, dp=2)."""
    for replica in range(layout.dp):
        ranks = [r for r in range(layout.world_size) if layout.coords(r)["dp"] == replica]
        batches = sorted({data_layout.coords(r)["dp"] for r in ranks})
        if len(batches) > 1:
            raise ValueError(
                f"{key}.tp={layout.tp} x {key}.pp={layout.pp} does not fit {data_key}.tp={data_layout.tp} x "
                f"{data_key}.pp={data_layout.pp}: ranks {ranks} (one {key} replica) hold the batches of {data_key} "
                f"dp ranks {batches} of dp={data_layout.dp}; a {key} replica must lie inside one {data_key} replica")


def check_model(model, tokenizer: Tokenizer, accepted_vocab: set[int], key: str, path: Optional[str], max_length: int,
                length_what: str) -> None:
    """Start-up checks of a model (from config key `key`, folder `path` or None) against the run's `tokenizer`.

    Vocabulary: every tokenizer id must be a row of the model (`check_vocab`), and a model with
    more rows than the tokenizer has ids is accepted only with its own tokenizer (HF checkpoints
    pad the embedding, e.g. Qwen2.5's 151936 rows for 151665 ids) or with the vocabulary of a model
    already accepted (`accepted_vocab`, which this adds to: the reference of a padded actor): anything
    else would sample ids the tokenizer cannot decode, mid-rollout. Length: the longest sequence the
    run feeds the model (`max_length` tokens, named by `length_what`) must fit its positions.
    """
    config, tok = model.config, tokenizer
    where = f"{key} {path!r}" if path else key
    try:
        check_vocab(tok, config.vocab_size, where)
    except ValueError as exc:
        raise ModelError(str(exc)) from exc
    tok_path = getattr(tok, "path", None)
    own = (tok_path is not None and path is not None and
           os.path.realpath(tok_path if os.path.isdir(tok_path) else os.path.dirname(tok_path))
           == os.path.realpath(path))
    if config.vocab_size > tok.vocab_size and not own and config.vocab_size not in accepted_vocab:
        raise ModelError(f"tokenizer ({tok.name}, {tok.vocab_size} ids) does not match {where} (vocab_size "
                         f"{config.vocab_size}) and is not that model's own tokenizer: the model would sample ids "
                         f"the tokenizer cannot decode. Use the model's tokenizer (data.tokenizer.path) or a model "
                         f"built for this one")
    accepted_vocab.add(config.vocab_size)
    if max_length > config.max_position_embeddings:
        raise ModelError(f"{length_what} is {max_length} tokens but {key} has max_position_embeddings="
                         f"{config.max_position_embeddings}; lower the length limits")


def folder_tokenizer(path: str, key: str) -> Optional[Tokenizer]:
    """The tokenizer saved in checkpoint folder `path` (config key `key`), or None when it holds no tokenizer files."""
    if _detect(path) is None:
        return None
    try:
        return build_tokenizer(TokenizerConfig(path=path))
    except (OSError, ValueError) as exc:
        raise ModelError(f"{key}={path!r}: cannot read its tokenizer files: {exc}") from exc


def check_tokenizer(tokenizer: Tokenizer, key: str, path: str, remedy: str = "") -> None:
    """ModelError unless the tokenizer saved with the checkpoint at `path` (config key `key`) is the run's `tokenizer`.

    For every role that reads the actor's token ids (reference, critic, reward models; module doc), before its
    weights load. The message names both tokenizers (each with its folder), the differing parts (vocabulary, special
    tokens, normaliser) and `remedy` (another way out than a checkpoint trained with the actor's tokenizer). A folder
    without tokenizer files is logged and left to `check_model`'s vocabulary-size check."""
    own_path = getattr(tokenizer, "path", None)
    if own_path is not None and os.path.realpath(own_path) == os.path.realpath(path):
        return
    saved = folder_tokenizer(path, key)
    if saved is None:
        logger.info("%s=%r has no tokenizer files: only its vocabulary size is checked against the run's tokenizer "
                    "(%s)", key, path, tokenizer.name)
        return
    ours, theirs = tokenizer_fingerprint(tokenizer), tokenizer_fingerprint(saved)
    differ = [part for part in FINGERPRINT_PARTS if ours[part] != theirs[part]]
    if differ:
        raise ModelError(
            f"{key}={path!r} was saved with another tokenizer ({saved.name}) than the run's ({tokenizer.name}: the "
            f"actor's, or data.tokenizer.path): they differ in {', '.join(differ)}. This role reads the actor's token "
            f"ids, which would be other text to it; use a checkpoint trained with the actor's tokenizer{remedy}")
