"""Export of a trained model in Hugging Face format, from any data x tensor-parallel layout.

`save_hf_checkpoint` already gathers tp shards onto tp rank 0 and writes atomically (temporary name,
rename) and refuses NaN weights. What it leaves to the caller under data parallelism is choosing one
replica: every dp replica holds the same weights, so only dp rank 0's tp group writes, and a barrier
makes the files visible to every rank when `export_hf` returns.
"""
from __future__ import annotations

import os
from typing import Optional, Union

import torch.distributed as dist

from megalign.models import save_hf_checkpoint
from megalign.parallel.layout import ParallelLayout


def export_hf(model, path: Union[str, os.PathLike], layout: Optional[ParallelLayout] = None) -> str:
    """Write `model` (a whole-model `CausalLM` / `ValueModel` / `RewardModel`, tp-sharded or not) to `path`.

    Collective when a process group exists: every rank calls it. Returns `path`.
    """
    if layout is not None and layout.pp > 1:
        raise ValueError("export_hf: pipeline-parallel models are exported stage by stage, which is not supported; "
                         f"got pp={layout.pp}")
    if layout is None or layout.dp_rank == 0:
        save_hf_checkpoint(model, path)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return os.fspath(path)
