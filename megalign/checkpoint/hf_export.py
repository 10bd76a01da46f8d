"""Export of a trained model in Hugging Face format, from any data x tensor x pipeline-parallel layout.

`save_hf_checkpoint` already gathers tp shards onto tp rank 0 and writes atomically (temporary name,
rename) and refuses NaN weights. What it leaves to the caller under data parallelism is choosing one
replica: every dp replica holds the same weights, so only dp rank 0's tp group writes, and a barrier
makes the files visible to every rank when `export_hf` returns. Pipeline stages (pp > 1) write one
safetensors shard each plus an index (`save_hf_checkpoint` with the layout), which `transformers` loads
as any sharded checkpoint.

Given the run's tokenizer, the same writing rank (dp rank 0, tp rank 0) also writes its files
(`Tokenizer.save`) and a `generation_config.json` with its bos / eos / pad ids, before the barrier,
so `AutoTokenizer.from_pretrained(path)` and `AutoModelForCausalLM.from_pretrained(path).generate`
work from transformers alone and stop at EOS as megalign's rollout does. The tokenizer is saved into
a temporary folder inside `path` and its files renamed into place, like the weights, so a crash
leaves no half-written tokenizer file. generation_config.json is plain JSON (no transformers import
needed for it) with the fields `GenerationConfig` reads.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Optional, Union

import torch.distributed as dist

from megalign.models import save_hf_checkpoint
from megalign.parallel.layout import ParallelLayout

if TYPE_CHECKING:  # only the type: checkpoint code does not depend on the data package
    from megalign.data.tokenizer import Tokenizer


def generation_config(tokenizer: Tokenizer) -> dict:
    """generation_config.json contents: the tokenizer's special ids (no bos_token_id when it has none)."""
    config = {"eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    if tokenizer.bos_id is not None:
        config["bos_token_id"] = tokenizer.bos_id
    return config


def save_tokenizer_files(tokenizer: Tokenizer, path: str) -> None:
    """Write `tokenizer`'s HF files and generation_config.json into the existing folder `path`, each file atomically."""
    staging = tempfile.mkdtemp(prefix=".tokenizer.tmp", dir=path)
    try:
        tokenizer.save(staging)
        with open(os.path.join(staging, "generation_config.json"), "w") as f:
            json.dump(generation_config(tokenizer), f, indent=2)
        for name in os.listdir(staging):
            os.replace(os.path.join(staging, name), os.path.join(path, name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def export_hf(model, path: Union[str, os.PathLike], layout: Optional[ParallelLayout] = None,
              tokenizer: Optional[Tokenizer] = None, architecture: Optional[str] = None) -> str:
    """Write `model` (a `CausalLM` / `ValueModel` / `RewardModel`, tp-sharded or not, whole or this rank's
    pipeline stage with `layout.pp > 1`) to `path`.

    With `tokenizer`, also its files and generation_config.json (module doc). `architecture` as in
    `save_hf_checkpoint` (e.g. a critic's `LlamaForTokenClassification`). Collective when a
    process group exists: every rank calls it. Returns `path`.
    """
    if layout is None or layout.dp_rank == 0:
        save_hf_checkpoint(model, path, architecture, layout)
        first_stage = layout is None or layout.is_first_stage  # at pp > 1 the first stage renames the folder into place
        if tokenizer is not None and model.model.factory.tp_rank == 0 and first_stage:
            save_tokenizer_files(tokenizer, os.fspath(path))
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return os.fspath(path)
