"""Hugging Face checkpoint interop: config.json + safetensors <-> megalign modules (torchtitan's state-dict adapter).

The adapter is two things per tensor: a name mapping (megalign name <-> HF name, a small regex table
shared by Llama, Qwen2, Qwen3 and Mistral, which name their tensors alike) and a transform applied while
reading one tensor through `safetensors.safe_open(...).get_slice`.
MoE layers (Qwen3-MoE, Mixtral) add a per-family table (`_MOE_RULES`): a stacked expert parameter
`[E, ...]` is E file tensors, one per expert, in the hub layout transformers reads and writes
(`mlp.experts.{e}.gate_proj` / `block_sparse_moe.experts.{e}.w1`, ...); expert e is read into slice e
and written from it (`hf_entries`). Under expert parallelism (`factory.ep_size` > 1) a rank reads its own
experts only, and saving gathers them over the ep group (every ep rank calls it; ep rank 0 writes). The
transforms:
- tensor-parallel slicing: each parameter is split along `shard_dim` (0 for column-parallel weights,
  biases and the vocabulary, 1 for row-parallel weights, None = replicated); a rank reads only rows /
  columns `[rank * local, (rank + 1) * local)` of the file, never the whole tensor; on save the shards are
  gathered along the same dim onto tp rank 0, one tensor at a time, and tp rank 0 writes;
- vocabulary padding: embedding / LM-head rows past the real vocab are not in the file and are zero-filled
  (they get -inf logits anyway, see `heads.LMHead`); on save they are dropped.

Loading is strict: tensors the model needs but the checkpoint lacks, and checkpoint tensors the model
has no place for, fail together with both lists of names. Exceptions: a tied model ignores an
`lm_head.weight` in the file (some tied checkpoints store the duplicate), and a pipeline stage
(`layer_range`, see `Decoder`) skips the tensors of other stages: layers outside its range, the
embedding unless it is the first stage, the final norm and heads unless it is the last (a stray tensor
is still reported, by the last stage). A stage's local layer i is the file's layer start + i.

Tied word embeddings split into pipeline stages (see `heads`): the last stage's LM-head copy is read
from `model.embed_tokens.weight` (its vocabulary rows, padded like the embedding) and is not written
on save, so the tied matrix is saved once, by the first stage, as at pp=1.
"""
from __future__ import annotations

import json
import os
import re
from typing import Iterable, Iterator, Optional, Sequence, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megalign.parallel.collectives import gather_to_first
from megalign.parallel.data_parallel import pp_tied_parameters
from megalign.parallel.layout import ParallelLayout
from megalign.parallel.pipeline import stage_layer_range

from .config import ModelConfig, hf_architecture
from .heads import CausalLM, RewardModel, ValueModel
from .parallelize import TensorParallelFactory, tensor_parallel_config

_Model = Union[CausalLM, ValueModel, RewardModel]

# (megalign-name regex, HF-name template, shard_dim). `{0}` in a template is the layer index.
_RULES = [
    (r"model\.embed\.weight", "model.embed_tokens.weight", 0),
    (r"model\.norm\.weight", "model.norm.weight", None),
    (r"model\.layers\.(\d+)\.attn_norm\.weight", "model.layers.{0}.input_layernorm.weight", None),
    (r"model\.layers\.(\d+)\.mlp_norm\.weight", "model.layers.{0}.post_attention_layernorm.weight", None),
    (r"model\.layers\.(\d+)\.attn\.([qkv])_proj\.(weight|bias)", "model.layers.{0}.self_attn.{1}_proj.{2}", 0),
    (r"model\.layers\.(\d+)\.attn\.o_proj\.weight", "model.layers.{0}.self_attn.o_proj.weight", 1),
    (r"model\.layers\.(\d+)\.attn\.o_proj\.bias", "model.layers.{0}.self_attn.o_proj.bias", None),
    (r"model\.layers\.(\d+)\.attn\.([qk])_norm\.weight", "model.layers.{0}.self_attn.{1}_norm.weight", None),
    (r"model\.layers\.(\d+)\.mlp\.(gate|up)_proj\.(weight|bias)", "model.layers.{0}.mlp.{1}_proj.{2}", 0),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", "model.layers.{0}.mlp.down_proj.weight", 1),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.bias", "model.layers.{0}.mlp.down_proj.bias", None),
    # Qwen2-MoE's shared expert and its gate
    (r"model\.layers\.(\d+)\.mlp\.shared_expert\.(gate|up)_proj\.weight",
     "model.layers.{0}.mlp.shared_expert.{1}_proj.weight", 0),
    (r"model\.layers\.(\d+)\.mlp\.shared_expert\.down_proj\.weight",
     "model.layers.{0}.mlp.shared_expert.down_proj.weight", 1),
    (r"model\.layers\.(\d+)\.mlp\.shared_expert_gate\.weight", "model.layers.{0}.mlp.shared_expert_gate.weight",
     None),
    (r"lm_head\.proj\.weight", "lm_head.weight", 0),
    (r"head\.score\.weight", "score.weight", None),
]
_VOCAB_PARAMS = ("model.embed.weight", "lm_head.proj.weight")

# megalign MoE parameter (after `model.layers.{i}.mlp.`) -> ({family: HF name after `model.layers.{i}.`,
# `{e}` the expert}, shard_dim of one HF tensor). Mixtral: w1 gate, w3 up, w2 down.
_MOE_RULES = {
    "router.weight": ({"qwen3_moe": "mlp.gate.weight", "mixtral": "block_sparse_moe.gate.weight"}, None),
    "experts.gate_proj": ({"qwen3_moe": "mlp.experts.{e}.gate_proj.weight",
                           "mixtral": "block_sparse_moe.experts.{e}.w1.weight"}, 0),
    "experts.up_proj": ({"qwen3_moe": "mlp.experts.{e}.up_proj.weight",
                         "mixtral": "block_sparse_moe.experts.{e}.w3.weight"}, 0),
    "experts.down_proj": ({"qwen3_moe": "mlp.experts.{e}.down_proj.weight",
                           "mixtral": "block_sparse_moe.experts.{e}.w2.weight"}, 1),
}
for _templates, _ in _MOE_RULES.values():
    _templates["qwen2_moe"] = _templates["qwen3_moe"]  # Qwen2-MoE names its experts and router as Qwen3-MoE does


def hf_rule(name: str, layer_offset: int = 0) -> tuple[str, Optional[int]]:
    """(HF name, shard_dim) of a megalign parameter name; `layer_offset` is a pipeline stage's first layer."""
    for pattern, template, shard_dim in _RULES:
        m = re.fullmatch(pattern, name)
        if m:
            groups = m.groups()
            if template.startswith("model.layers."):
                groups = (str(int(groups[0]) + layer_offset),) + groups[1:]
            return template.format(*groups), shard_dim
    raise KeyError(f"no HF name for megalign parameter {name!r}")


def hf_entries(name: str, config: ModelConfig, layer_offset: int = 0, ep_size: int = 1,
               ep_rank: int = 0) -> list[tuple[str, Optional[int], Optional[int]]]:
    """[(HF name, local expert index or None, shard_dim of the HF tensor)] of megalign parameter `name`.

    One entry for every parameter but a stacked expert weight, which has one per expert it holds (its
    slice `[i]` is the HF tensor of global expert `ep_rank * E / ep_size + i`); `layer_offset` is a
    pipeline stage's first layer."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.(router\.weight|experts\.\w+)", name)
    if m is None:
        hf_name, shard_dim = hf_rule(name, layer_offset)
        return [(hf_name, None, shard_dim)]
    templates, shard_dim = _MOE_RULES[m.group(2)]
    prefix = f"model.layers.{int(m.group(1)) + layer_offset}."
    template = templates[config.model_type]
    if "{e}" not in template:
        return [(prefix + template, None, shard_dim)]
    n = config.num_experts // ep_size
    return [(prefix + template.format(e=ep_rank * n + i), i, shard_dim) for i in range(n)]


def _tied_copies(model: "_Model") -> set[int]:
    """ids of the parameters that are a pipeline stage's copy of a tied embedding (`pp_tied_parameters`).

    Unsplit, the tied head is the embedding's Parameter and is not marked; only the last stage's
    LM-head copy of a split tied model is, and it is read from (and saved as) the embedding.
    """
    return {id(p) for p, is_copy in pp_tied_parameters(model).items() if is_copy}


def _other_stage(hf_name: str, layer_range: tuple[int, int], num_layers: int) -> bool:
    """Whether checkpoint tensor `hf_name` belongs to another pipeline stage than layers `layer_range`."""
    start, end = layer_range
    m = re.match(r"model\.layers\.(\d+)\.", hf_name)
    if m:
        return int(m.group(1)) < num_layers and not start <= int(m.group(1)) < end
    if hf_name == "model.embed_tokens.weight":
        return start > 0
    return end < num_layers  # final norm and heads live on the last stage


def _checkpoint_index(path: str) -> dict[str, str]:
    """HF tensor name -> safetensors file, for `model.safetensors` or a sharded `model.safetensors.index.json`."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise FileNotFoundError(f"{path} holds neither model.safetensors nor model.safetensors.index.json")
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def _read_local(tensor_slice, global_shape: list[int], local: torch.Tensor, shard_dim: Optional[int],
                tp_rank: int) -> torch.Tensor:
    """Read this rank's part of one file tensor into a tensor shaped like `local`.

    Along `shard_dim` the rank owns `[rank * n, (rank + 1) * n)` with n = local.shape[shard_dim]; indices past
    the file's extent (vocabulary padding) are zero-filled.
    """
    if shard_dim is None:
        return tensor_slice[:]
    n = local.shape[shard_dim]
    start = tp_rank * n
    stop = min(start + n, global_shape[shard_dim])
    index = [slice(None)] * len(global_shape)
    index[shard_dim] = slice(start, stop)
    part = tensor_slice[tuple(index)] if stop > start else torch.empty(0)
    if stop - start == n:
        return part
    out = torch.zeros_like(local, device="cpu")
    out.narrow(shard_dim, 0, max(stop - start, 0)).copy_(part)
    return out


def checkpoint_has_tensor(path: Union[str, os.PathLike], name: str) -> bool:
    """Whether the safetensors of checkpoint folder `path` hold tensor `name` (HF naming, e.g. "score.weight")."""
    return name in _checkpoint_index(os.fspath(path))


def _wanted(model: _Model, new_head: bool) -> tuple[dict[str, tuple[str, Optional[int], Optional[int]]], set[str]]:
    """(HF name -> (megalign name, expert index or None, shard_dim) of every tensor `model` reads, the HF names it
    may skip when present: a tied LM head, another ep rank's experts); `new_head` as in `load_hf_weights`."""
    config: ModelConfig = model.config
    factory = model.model.factory
    params = dict(model.named_parameters())  # each tensor once: a tied LM head is the embedding
    copies = _tied_copies(model)
    wanted = {}
    for name, param in params.items():
        if new_head and name.startswith("head."):
            continue
        for hf_name, expert, shard_dim in hf_entries("model.embed.weight" if id(param) in copies else name, config,
                                                     model.model.layer_range[0], factory.ep_size, factory.ep_rank):
            wanted[hf_name] = (name, expert, shard_dim)
    ignorable = {"lm_head.weight"} if config.tie_word_embeddings or new_head else set()
    if factory.ep_size > 1:  # the other ep ranks' experts
        ignorable |= {n for name in params for n, _, _ in hf_entries(name, config, model.model.layer_range[0])}
        ignorable -= set(wanted)
    return wanted, ignorable


def _fill(model: _Model, params: dict[str, torch.Tensor], target: tuple[str, Optional[int], Optional[int]],
          hf_name: str, tensor_slice, global_shape: list[int], where: str) -> None:
    """Copy this rank's part of HF tensor `hf_name` (`tensor_slice`: a safetensors slice or a tensor, of
    `global_shape`) into the parameter of `params` (the model's, by name) that `target` names; `where` names the
    source in the shape error."""
    config: ModelConfig = model.config
    factory = model.model.factory
    name, expert, shard_dim = target
    param = params[name] if expert is None else params[name][expert]
    expected = list(param.shape)
    if shard_dim is not None:
        expected[shard_dim] *= factory.tp_size
    if name in _VOCAB_PARAMS:
        expected[0] = config.vocab_size
    if global_shape != expected:
        raise ValueError(f"{where}: tensor {hf_name} has shape {global_shape}, expected {expected} for {name}")
    with torch.no_grad():
        param.copy_(_read_local(tensor_slice, global_shape, param, shard_dim, factory.tp_rank))


def load_hf_weights(model: _Model, path: Union[str, os.PathLike], new_head: bool = False) -> None:
    """Fill `model` (on any tp rank of its factory) from the safetensors files in checkpoint folder `path`.

    `new_head`: the scalar head of a value / reward model is not read (the model keeps its own init)
    and the checkpoint's LM head is ignored: a reward model or critic started from a policy checkpoint.
    """
    path = os.fspath(path)
    config: ModelConfig = model.config
    wanted, ignorable = _wanted(model, new_head)
    files = _checkpoint_index(path)
    ignorable |= {n for n in files if _other_stage(n, model.model.layer_range, config.num_hidden_layers)}
    missing = sorted(set(wanted) - set(files))
    unexpected = sorted(set(files) - set(wanted) - ignorable)
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match {type(model).__name__}: "
                         f"missing tensors {missing}; unexpected tensors {unexpected}")
    by_file: dict[str, list[str]] = {}
    for hf_name in wanted:
        by_file.setdefault(files[hf_name], []).append(hf_name)
    params = dict(model.named_parameters())
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as f:
            for hf_name in names:
                tensor_slice = f.get_slice(hf_name)
                _fill(model, params, wanted[hf_name], hf_name, tensor_slice, list(tensor_slice.get_shape()), file)


def load_hf_tensors(model: _Model, tensors: Iterable[tuple[str, torch.Tensor]], where: str) -> None:
    """Fill `model` (on any tp / ep rank) from whole HF-named tensors as they arrive (`hf_tensor_stream` on the
    sending side; another stage's layers are skipped), each rank keeping its own shard: how rollout ranks take
    the trainer's weights at another tp size (`megalign.parallel.placement`). Raises ValueError naming `where`
    for a tensor the model does not know or one it did not get."""
    config: ModelConfig = model.config
    wanted, ignorable = _wanted(model, new_head=False)
    params, seen = dict(model.named_parameters()), set()
    for hf_name, tensor in tensors:
        if hf_name in wanted:
            _fill(model, params, wanted[hf_name], hf_name, tensor, list(tensor.shape), where)
            seen.add(hf_name)
        elif hf_name not in ignorable and not _other_stage(hf_name, model.model.layer_range, config.num_hidden_layers):
            raise ValueError(f"{where}: unexpected tensor {hf_name} for {type(model).__name__}")
    missing = sorted(set(wanted) - seen)
    if missing:
        raise ValueError(f"{where}: missing tensors {missing}")


def _hf_config(model: _Model, architecture: Optional[str]) -> dict:
    """config.json contents for `model`; `architecture` as in `save_hf_checkpoint`."""
    config: ModelConfig = model.config
    if architecture is None and not isinstance(model, CausalLM):
        architecture = hf_architecture(config.model_type, "SequenceClassification")
    hf_config = config.to_hf(architecture)
    if not isinstance(model, CausalLM):
        for key in ("id2label", "label2id"):
            hf_config.pop(key, None)
        hf_config["num_labels"] = 1
    if hf_config["architectures"][0].endswith("ForTokenClassification"):
        # transformers' token-classification head has a bias unless told otherwise; ours has none
        hf_config["token_classification_bias"] = False
    return hf_config


def hf_tensor_stream(model: _Model, to_cpu: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name with the global layer index, whole tensor) of this stage's parameters, gathered one at a time over
    the tp group (and the ep group for experts): a collective every tp / ep rank runs to the end, which yields
    only on tp rank 0 (ep rank 0). At most one whole tensor beyond the model is in flight. `to_cpu`: copy to the
    CPU (an export) or keep on the device (a weight broadcast)."""
    factory = model.model.factory
    config: ModelConfig = model.config
    offset = model.model.layer_range[0]
    copies = _tied_copies(model)
    owner = factory.tp_rank == 0 and factory.ep_rank == 0
    for name, param in model.named_parameters():  # a tied LM head is the embedding: written once
        if id(param) in copies:  # the first stage writes the matrix
            continue
        entries = hf_entries(name, config, offset)  # every expert: the ep ranks' stacked together
        stacked = entries[0][1] is not None  # experts [E, ...]: the HF tensor's dim d is the parameter's d + 1
        shard_dim = entries[0][2]
        tensor = param.detach()
        if shard_dim is not None:
            tensor = factory.gather_to_first(tensor, shard_dim + stacked)
        if tensor is not None and stacked and factory.ep_size > 1:
            tensor = gather_to_first(tensor, 0, factory.ep_group)  # among the tp-rank-0 ranks
        if tensor is None or not owner:  # not tp rank 0 (or ep rank 0): this rank only sends
            continue
        if name in _VOCAB_PARAMS:
            tensor = tensor[: config.vocab_size]
        for hf_name, expert, _ in entries:
            part = (tensor if expert is None else tensor[expert]).contiguous()
            yield hf_name, part.cpu() if to_cpu else part


def _gathered_tensors(model: _Model) -> Optional[dict[str, torch.Tensor]]:
    """HF name (global layer index) -> whole CPU tensor of this stage; None except on tp rank 0 (ep rank 0)."""
    factory = model.model.factory
    tensors = dict(hf_tensor_stream(model))
    return tensors if factory.tp_rank == 0 and factory.ep_rank == 0 else None


def _non_finite(tensors: dict[str, torch.Tensor]) -> list[str]:
    return [hf_name for hf_name, tensor in tensors.items() if not bool(torch.isfinite(tensor).all())]


def save_hf_checkpoint(model: _Model, path: Union[str, os.PathLike], architecture: Optional[str] = None,
                       layout: Optional[ParallelLayout] = None) -> None:
    """Write `model.safetensors` + `config.json` that `transformers` loads (padded vocab rows dropped).

    A tensor-parallel model is gathered tensor by tensor onto tp rank 0 (so at most one whole tensor
    beyond the model is in flight), which writes: a collective over the tp group, so every tp rank
    calls it; ranks other than tp rank 0 return once their shards are sent, before the files exist
    (barrier before reading them there). With dp > 1, call it on one dp replica only, or each replica's
    tp rank 0 writes the same files; under expert parallelism every rank of the ep group calls it (the
    experts are gathered over it) and ep rank 0 writes. Files are written under a temporary name unique to the process
    and renamed when complete, so a crash never leaves a half-written checkpoint; a model holding NaN or
    inf is refused (ValueError naming the tensors) before anything is written.
    `architecture` defaults to the family's ...ForCausalLM, or ...ForSequenceClassification for scalar heads.

    Pipeline stages (`layer_range`, pp > 1): pass `layout`; every rank of every stage calls it. The
    result is a sharded HF checkpoint: stage s writes its tensors (global layer indices) to
    `model-{s+1:05d}-of-{pp:05d}.safetensors` in a temporary directory next to `path` (the stages must
    share a filesystem); after all stages wrote, the first stage adds `model.safetensors.index.json` and
    `config.json` and renames the directory to `path` (an existing `path` is replaced whole), so a
    half-written checkpoint never appears under `path`. The tp-rank-0 ranks of all stages return after
    the rename; a NaN / inf on any stage is refused on every stage before anything is written.
    """
    path = os.fspath(path)
    config: ModelConfig = model.config
    if model.model.layer_range != (0, config.num_hidden_layers):
        if layout is None or layout.pp == 1:
            raise ValueError(f"save_hf_checkpoint needs the whole model or the layout of its pipeline; got the "
                             f"pipeline stage of layers {model.model.layer_range} out of "
                             f"{config.num_hidden_layers} without a layout with pp > 1")
        return _save_pipeline_stage(model, path, architecture, layout)
    tensors = _gathered_tensors(model)
    if tensors is None:
        return
    broken = _non_finite(tensors)
    if broken:
        raise ValueError(f"save_hf_checkpoint: not writing {path}: tensors {broken} hold NaN or inf values")
    hf_config = _hf_config(model, architecture)
    os.makedirs(path, exist_ok=True)
    weights, cfg = os.path.join(path, "model.safetensors"), os.path.join(path, "config.json")
    tmp = f".tmp{os.getpid()}"
    save_file(tensors, weights + tmp, metadata={"format": "pt"})
    with open(cfg + tmp, "w") as f:
        json.dump(hf_config, f, indent=2)
    os.replace(weights + tmp, weights)
    os.replace(cfg + tmp, cfg)


def _save_pipeline_stage(model: _Model, path: str, architecture: Optional[str], layout: ParallelLayout) -> None:
    """The pp > 1 branch of `save_hf_checkpoint` (see there); collectives over tp, then over pp on tp rank 0."""
    import shutil
    import uuid

    import torch.distributed as dist

    tensors = _gathered_tensors(model)
    if tensors is None:  # tp rank > 0: shards sent; the tp-rank-0 ranks' pp group does the rest
        return
    group, first = layout.pp_group, layout.stage_rank(0)
    # every stage learns every stage's non-finite tensors, so all refuse together instead of hanging
    broken = [None] * layout.pp
    dist.all_gather_object(broken, _non_finite(tensors), group=group)
    broken = sum(broken, [])
    if broken:
        raise ValueError(f"save_hf_checkpoint: not writing {path}: tensors {broken} hold NaN or inf values")
    target = os.path.abspath(path)
    tmp = [None]
    if layout.is_first_stage:
        tmp[0] = f"{target}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.makedirs(tmp[0])
    dist.broadcast_object_list(tmp, src=first, group=group)
    tmp = tmp[0]
    shard = f"model-{layout.pp_rank + 1:05d}-of-{layout.pp:05d}.safetensors"
    error = None
    try:
        save_file(tensors, os.path.join(tmp, shard), metadata={"format": "pt"})
    except Exception as e:  # reported to every stage below, so none waits for a file that never comes
        error = f"stage {layout.pp_rank}: {e!r}"
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    stages = [None] * layout.pp
    dist.all_gather_object(stages, (shard, sorted(tensors), size, error), group=group)  # also the barrier
    errors = [s[3] for s in stages if s[3] is not None]
    status = [None]
    if layout.is_first_stage:
        try:
            if errors:
                raise RuntimeError("; ".join(errors))
            weight_map = {name: file for file, names, _, _ in stages for name in names}
            index = {"metadata": {"total_size": sum(s[2] for s in stages)}, "weight_map": dict(sorted(weight_map.items()))}
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(_hf_config(model, architecture), f, indent=2)
            old = None
            if os.path.lexists(target):
                old = f"{target}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                os.replace(target, old)
            os.replace(tmp, target)
            if old is not None:
                shutil.rmtree(old) if os.path.isdir(old) and not os.path.islink(old) else os.remove(old)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            status[0] = f"save_hf_checkpoint: not writing {path}: {e!r}"
    dist.broadcast_object_list(status, src=first, group=group)
    if status[0] is not None:
        raise RuntimeError(status[0])


_KINDS = {"causal_lm": CausalLM, "value": ValueModel, "reward": RewardModel}


def from_pretrained(path: Union[str, os.PathLike], kind: str = "causal_lm", factory=None,
                    vocab_pad_multiple: int = 1, dtype: Optional[torch.dtype] = None,
                    activation_checkpointing: bool = False, layer_range: Optional[tuple[int, int]] = None,
                    layout: Optional[ParallelLayout] = None, new_head: bool = False) -> _Model:
    """Build a megalign model from an HF checkpoint folder.

    kind: 'causal_lm' (policy / reference), 'value' (critic; reads `score.weight`, e.g. from a reward
    model), or 'reward' (`...ForSequenceClassification`). dtype: parameter dtype (default: fp32).
    layer_range: build and read only decoder layers `[start, end)` (a pipeline stage, see `Decoder`).
    layout: build this rank's tensor-parallel shards over `layout.tp_group` (`TensorParallelFactory`,
    vocabulary padded to a multiple of lcm(vocab_pad_multiple, tp)) on `layout.device`, reading only
    this rank's slices of the checkpoint; a collective-free load, but every tp rank must call it.
    Give either `layout` or a custom `factory`, not both. `new_head` (value / reward kinds): start the
    scalar head fresh instead of reading it, e.g. a reward model from an SFT checkpoint; the caller
    initialises it (`load_hf_weights`).
    """
    if kind not in _KINDS:
        raise ValueError(f"kind {kind!r} is not one of {sorted(_KINDS)}")
    config = ModelConfig.from_hf(path, vocab_pad_multiple=vocab_pad_multiple)
    if layout is not None:
        if factory is not None:
            raise ValueError("from_pretrained: give either layout or factory, not both")
        config = tensor_parallel_config(config, layout.tp)
        factory = TensorParallelFactory(layout)
    model = _KINDS[kind](config, factory, activation_checkpointing, layer_range)
    if layout is not None:
        model.to(layout.device)
    if dtype is not None:
        model.to(dtype)
    if new_head and kind == "causal_lm":
        raise ValueError("from_pretrained: new_head applies to the 'value' and 'reward' kinds, not 'causal_lm'")
    load_hf_weights(model, path, new_head)
    return model


def scalar_head_from_pretrained(path: Union[str, os.PathLike], kind: str, layout: ParallelLayout, seed: int,
                                dtype: Optional[torch.dtype] = None, activation_checkpointing: bool = False
                                ) -> tuple[Union[ValueModel, RewardModel], bool]:
    """(model, fresh): a value / reward model from `path`, with its scalar head read when the checkpoint has one.

    From a policy checkpoint (no `score.weight`, e.g. an SFT export) the head starts fresh (`fresh`
    True): a small normal init with std 1/(H+1) (OpenRLHF's), drawn from `seed` on the host, so it
    is the same on every rank and every tp size. From a reward model (or critic) export it is read.
    At `layout.pp > 1` the model is this rank's pipeline stage (`stage_from_pretrained`, layers split
    evenly): the head exists on the last stage only, read or drawn there the same way, and `fresh`
    is the same on every stage (it depends on the checkpoint only). dtype and activation_checkpointing
    as in `from_pretrained`.
    """
    if kind not in ("value", "reward"):
        raise ValueError(f"scalar_head_from_pretrained: kind must be 'value' or 'reward', got {kind!r}")
    fresh = not checkpoint_has_tensor(path, "score.weight")
    if layout.pp > 1:
        model = stage_from_pretrained(path, layout, kind, dtype=dtype, new_head=fresh,
                                      activation_checkpointing=activation_checkpointing)
    else:
        model = from_pretrained(path, kind=kind, layout=layout, dtype=dtype, new_head=fresh,
                                activation_checkpointing=activation_checkpointing)
    if fresh and model.head is not None:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            weight = model.head.score.weight
            weight.copy_(torch.randn(weight.shape, generator=generator) / (model.config.hidden_size + 1))
    return model, fresh


def stage_from_pretrained(path: Union[str, os.PathLike], layout: ParallelLayout, kind: str = "causal_lm",
                          split: Optional[Sequence[int]] = None, **kwargs) -> _Model:
    """This rank's pipeline stage of an HF checkpoint: only its layers are built and read from the files.

    The stage is built with `layout` (`from_pretrained(layout=...)`): tensor-parallel
    over `layout.tp_group` when tp > 1, on `layout.device`, so `layout` must come from
    `ParallelLayout.build`. kind and kwargs (vocab_pad_multiple, dtype, activation_checkpointing) as in
    `from_pretrained`; split as in `megalign.parallel.stage_layer_range`.
    """
    num_layers = ModelConfig.from_hf(path).num_hidden_layers
    return from_pretrained(path, kind, layer_range=stage_layer_range(num_layers, layout, split), layout=layout,
                           **kwargs)
