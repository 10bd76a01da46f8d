"""Export of a trained model in Hugging Face format, from any data x tensor x pipeline-parallel layout.

`save_hf_checkpoint` already gathers tp shards onto tp rank 0 and writes atomically (temporary name,
rename) and refuses NaN weights. What it leaves to the caller under data parallelism is choosing one
replica: every dp replica holds the same weights, so only dp rank 0's tp group writes (under expert
parallelism the first ep group's ranks, dp ranks [0, ep), gather the experts onto dp rank 0), and a barrier
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

A model with LoRA adapters (`megalign.models.lora`) exports either merged (`export_hf` folds
`scale * B A` into the weights for the write and unfolds them after: a plain HF checkpoint) or as a
PEFT adapter folder (`export_peft_adapter`: adapter_config.json + adapter_model.safetensors under PEFT's
key names, `base_model.model.<HF module>.lora_A.weight` `[r, in]` / `lora_B.weight` `[out, r]`), which
`peft.PeftModel.from_pretrained(<the base model in transformers>, path)` loads.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Optional, Union

import torch.distributed as dist
from safetensors.torch import save_file

from megalign.models import save_hf_checkpoint
from megalign.models.hf_adapter import hf_rule
from megalign.models.lora import lora_modules, merged_base_view
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
    if layout is None or layout.dp_rank < layout.ep:  # one replica; at ep > 1 its ep group, which gathers the experts
        with merged_base_view(model):  # a LoRA model writes merged weights; no-op without adapters
            save_hf_checkpoint(model, path, architecture, layout)
        first_stage = layout is None or layout.is_first_stage  # at pp > 1 the first stage renames the folder into place
        writer = layout is None or layout.dp_rank == 0
        if tokenizer is not None and model.model.factory.tp_rank == 0 and first_stage and writer:
            save_tokenizer_files(tokenizer, os.fspath(path))
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return os.fspath(path)


def export_peft_adapter(model, path: Union[str, os.PathLike], base_model_name_or_path: str,
                        layout: Optional[ParallelLayout] = None) -> str:
    """Write `model`'s LoRA adapters (whole model, tp-sharded or not; pp = 1) as a PEFT adapter folder at `path`.

    Each adapter's tp shards are gathered onto tp rank 0 (dp rank 0's), which writes adapter_model.safetensors
    (temporary name, rename) and adapter_config.json (`base_model_name_or_path` recorded there). Collective
    when a process group exists: every rank calls it. Returns `path`.
    """
    modules = lora_modules(model)
    if not modules:
        raise ValueError("export_peft_adapter: the model has no LoRA adapters")
    if model.model.layer_range != (0, model.config.num_hidden_layers):
        raise ValueError("export_peft_adapter: pipeline stages (pp > 1) are not supported; export merged")
    path = os.fspath(path)
    factory = model.model.factory
    if layout is None or layout.dp_rank == 0:
        tensors = {}
        for name, module in modules.items():
            hf_module = hf_rule(f"{name}.weight")[0][: -len(".weight")]
            for part in ("lora_A", "lora_B"):
                tensor = getattr(module, part).detach()
                dim = getattr(module, "tp_shard_dims", {}).get(part)  # nn.Linear (tp = 1): none
                if dim is not None:
                    tensor = factory.gather_to_first(tensor, dim)
                if tensor is not None:
                    tensors[f"base_model.model.{hf_module}.{part}.weight"] = tensor.contiguous().cpu()
        if factory.tp_rank == 0:
            cfg = model.lora_config
            config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
                      "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout,
                      "target_modules": sorted({n.rsplit(".", 1)[-1] for n in modules}), "bias": "none",
                      "fan_in_fan_out": False, "inference_mode": True, "use_rslora": cfg.use_rslora, "use_dora": False,
                      "init_lora_weights": True, "modules_to_save": None}
            os.makedirs(path, exist_ok=True)
            tmp = f".tmp{os.getpid()}"
            weights, cfg_file = os.path.join(path, "adapter_model.safetensors"), os.path.join(path, "adapter_config.json")
            save_file(tensors, weights + tmp, metadata={"format": "pt"})
            with open(cfg_file + tmp, "w") as f:
                json.dump(config, f, indent=2)
            os.replace(weights + tmp, weights)
            os.replace(cfg_file + tmp, cfg_file)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return path
