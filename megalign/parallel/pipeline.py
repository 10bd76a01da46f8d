"""Pipeline parallelism: decoder layers split over the pp stages, a micro-batched 1F1B training step and a
forward-only scoring pass, scheduled by `torch.distributed.pipelining`.

Design choices:

- Splitting. Stage s holds decoder layers `[start_s, end_s)` (`stage_layer_range`): `L / pp` each by
  default (L not divisible by pp is an error naming the options that fix it), or stages of uneven size
  (`megalign.parallel.layout.StageSplit`, carried by the layout: Megatron's `first_stage_layers` /
  `last_stage_layers`, the middle stages splitting the rest evenly, or a `stage_layers` list such as
  `[3, 3, 4, 4, 4, 4, 3, 3]` for 28 layers at pp = 8), e.g. to give the first stage (embedding) and the
  last (LM head and loss) fewer layers; an explicit `split` argument overrides the layout's. Layer names
  stay global wherever they leave a stage (HF export, `hf_rule(name, start)`), and the schedule does not
  care: every stage sends activations of one shape whatever its layer count. The
  models build only those layers (`layer_range`): the embedding only on the first stage, the final norm
  and head only on the last; `megalign.models.stage_from_pretrained` reads only the stage's tensors from the checkpoint,
  and only this rank's tensor-parallel slices of them (tp x pp: the stage is built over `layout.tp_group`).
  Tied embeddings (small Qwen2) follow Megatron: the last stage holds a copy of the embedding matrix as
  its LM head, and the gradients of the two copies are summed over `layout.embedding_group` when the
  step's gradients are finalised (`clip_grad_norm_`, see `data_parallel`), not in `train_step`, which
  may run several times (gradient accumulation) before one optimizer step.
- Schedules. `torch.distributed.pipelining` runs on gloo and NCCL with our stage modules as they are:
  `PipelineStage` + `Schedule1F1B` for training, `ScheduleGPipe` without a loss function (forward
  only) for scoring. A fresh stage and schedule are built per call and infer the activation shapes
  from the first micro-batch (torch's dynamic metadata mode), so batches of any sequence length work
  without declaring shapes. The price: every call runs micro-batch 0 once more through each stage's
  forward (and, in training, the last stage's backward) plus one small metadata send per stage, i.e.
  ~1/n_microbatches extra compute, and micro-batch 0's `loss_fn` runs twice: statistics taken inside it
  go through `MicroBatchSums`, where the repeat overwrites instead of adding. Declaring static shapes (`input_args` / `output_args`) would remove
  it, but the last stage's output shape depends on the head and the score function, so it is not done.
- Per-micro-batch loss inputs. torch's schedule calls `loss_fn(output, target)` with `target` split on
  dim 0 like the inputs, and nothing else split per micro-batch (`loss_kwargs` are the same for all).
  We pass the row indices `arange(B)` as the target, and the loss closure selects the micro-batch's rows
  of every tensor in `batch` (labels, masks, advantages, old log-probs, ...): one index tensor carries
  whatever the loss needs.
- Loss aggregation. `loss_fn` returns the micro-batch's *sum* (over its valid tokens, or its sequences);
  each is divided by the caller's global `normalizer` (e.g. the valid-token count of the whole batch)
  and the schedule runs with `scale_grads=False`. The micro-batch losses then add up to exactly the
  unpipelined `sum / normalizer`, and so do the gradients, however unevenly the valid tokens fall into
  micro-batches (a mean of per-micro-batch means would over-weight the tokens of sparse micro-batches).
- Results. `train_step` returns the loss on every pp rank (one broadcast of a scalar, for logging).
  `score` returns its per-row outputs on the last stage only (None elsewhere): losses run on the last
  stage, so that is where scored log-probs / values are consumed; broadcasting `[B, T]` would be waste.
  `score_broadcast` is for results every stage needs (rewards, held-out metrics), of batches of any size.
  A `score_fn` runs inside the last stage per micro-batch, so full `[B, T, V]` logits never coexist.
- Inputs. Every rank of the pp group passes the same whole batch: the first stage reads `input_ids`,
  every stage `attention_mask` (each stage builds its attention mask and position ids from it), the
  last stage `batch`. B must divide evenly into micro-batches because a stage's receive buffers have
  one shape; no KV cache. Packed rows go through as one pack a micro-batch (`cu_seqlens` in place of
  `attention_mask`, every pack padded to one length L: `megalign.roles.packing.pipeline_packs`).
- Data parallelism composes from outside: after `train_step`, `allreduce_gradients(stage.parameters(),
  layout.dp_group)` then `clip_grad_norm_(stage, max_norm, layout)` as for an unpipelined model.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from .layout import ParallelLayout, StageSplit

Batch = dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, Batch], torch.Tensor]
"""(last-stage output of one micro-batch, that micro-batch's rows of `batch`) -> summed loss (scalar)."""
ScoreFn = Callable[[torch.Tensor, Batch], torch.Tensor]
"""(last-stage output of one micro-batch, its rows of `batch`) -> per-row result `[b, ...]`."""


def stage_layer_range(num_layers: int, layout: ParallelLayout,
                      split: Optional[Sequence[int]] = None) -> tuple[int, int]:
    """Decoder layers `[start, end)` (global indices) of this rank's pipeline stage.

    split: layers per stage (length pp, each >= 1, summing to num_layers); default: the layout's
    `stages` (`ParallelLayout.with_stages`: Megatron's first / last stage layer counts or a list), else
    `num_layers / pp` each, which must divide evenly (the error names the options that fix it).
    """
    stages = layout.stages if split is None else StageSplit(stage_layers=tuple(split), key=layout.stages.key)
    sizes = stages.sizes(num_layers, layout.pp)
    start = sum(sizes[: layout.pp_rank])
    return start, start + sizes[layout.pp_rank]


def _select_rows(batch: Batch, rows: torch.Tensor) -> Batch:
    """Rows `rows` (`[b]` indices) of every `[B, ...]` tensor of `batch`: one micro-batch's loss inputs."""
    return {k: v.index_select(0, rows) for k, v in batch.items()}


class _ScoredStage(nn.Module):
    """The last stage's model followed by `score_fn` on each micro-batch (its rows arrive as a kwarg)."""

    def __init__(self, model: nn.Module, score_fn: ScoreFn, batch: Batch):
        super().__init__()
        self.model = model
        self.score_fn = score_fn
        self.batch = batch

    def forward(self, x: torch.Tensor, rows: torch.Tensor, **kwargs):
        return self.score_fn(self.model(x, **kwargs), _select_rows(self.batch, rows))


class _PackedStage(nn.Module):
    """A stage model run on one pack a micro-batch: `cu_seqlens` arrives as that micro-batch's `[1, D + 1]` row of
    the `[n_microbatches, D + 1]` boundaries (torch's schedule splits kwargs on dim 0) and is passed on as `[D + 1]`."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor):
        return self.model(x, cu_seqlens=cu_seqlens[0])


class MicroBatchSums:
    """Sums of statistics taken inside a pipelined loss function, each micro-batch counted once.

    torch's schedule calls micro-batch 0's loss function twice (module notes), so adding up would count it twice.
    Instead each micro-batch writes its values to its own row: pass `slots` (`[B]`, the micro-batch index of
    every row) in `train_step`'s `batch`, and call `put(name, batch_mb["slot"], values)` in the loss function; a
    repeat overwrites. `sums()` adds the rows. Everything stays on the device (no host sync).
    """

    def __init__(self, n_microbatches: int, batch_size: int, device: torch.device):
        self.n_microbatches = n_microbatches
        self.slots = torch.arange(n_microbatches, device=device).repeat_interleave(batch_size // n_microbatches)
        self.table: dict[str, torch.Tensor] = {}

    def put(self, name: str, slot: torch.Tensor, values: torch.Tensor) -> None:
        """Record `values` (any shape, k elements) of statistic `name` for the micro-batch whose `slot` rows these are."""
        values = values.detach().reshape(1, -1)
        row = self.table.setdefault(name, values.new_zeros(self.n_microbatches, values.shape[1]))
        row.index_copy_(0, slot[:1], values)

    def sums(self) -> dict[str, torch.Tensor]:
        """{name: [k] sum over the micro-batches} of what was `put` (on the last stage; empty elsewhere)."""
        return {name: table.sum(0) for name, table in self.table.items()}


class Pipeline:
    """Runs this rank's stage model (from `stage_from_pretrained` or built with `layer_range`) in
    micro-batched pipeline schedules over `layout.pp_group`.

    Every rank of the pp group calls the same method with the same whole batch (see the module notes).
    n_microbatches: micro-batches per call; 1F1B needs at least pp of them, and the batch size must be a
    multiple of it.
    """

    def __init__(self, model: nn.Module, layout: ParallelLayout, n_microbatches: int):
        if n_microbatches < layout.pp:
            raise ValueError(f"pipeline: n_microbatches={n_microbatches} must be >= pp={layout.pp} (1F1B fills "
                             f"every stage before the first backward)")
        self.model = model
        self.layout = layout
        self.n_microbatches = n_microbatches

    def _stage(self, module: nn.Module) -> PipelineStage:
        layout = self.layout
        return PipelineStage(module, layout.pp_rank, layout.pp, layout.device, group=layout.pp_group)

    def _inputs(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                batch: Batch, cu_seqlens: Optional[torch.Tensor] = None) -> tuple[tuple, dict, torch.Tensor]:
        """Check shapes; return this stage's whole-batch (args, kwargs) for `schedule.step` (input_ids
        only on the first stage) and the row indices `arange(B)`."""
        if cu_seqlens is not None:
            if attention_mask is not None or input_ids.shape[0] != self.n_microbatches \
                    or cu_seqlens.shape[0] != self.n_microbatches:
                raise ValueError(f"pipeline: packed micro-batches take one pack each ([{self.n_microbatches}, L] "
                                 f"input_ids and [{self.n_microbatches}, D + 1] cu_seqlens) and no attention_mask; got "
                                 f"{tuple(input_ids.shape)} and {tuple(cu_seqlens.shape)}")
            args, _, rows = self._inputs(input_ids, None, batch)
            return args, {"cu_seqlens": cu_seqlens}, rows
        if input_ids.dim() != 2:
            raise ValueError(f"pipeline: input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        b = input_ids.shape[0]
        if b % self.n_microbatches:
            raise ValueError(f"pipeline: batch size {b} is not divisible by n_microbatches={self.n_microbatches}")
        for key, value in batch.items():
            if value.shape[0] != b:
                raise ValueError(f"pipeline: batch[{key!r}] has {value.shape[0]} rows, input_ids has {b}")
        args = (input_ids,) if self.layout.is_first_stage else ()
        kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
        return args, kwargs, torch.arange(b, device=input_ids.device)

    def train_step(self, input_ids: torch.Tensor, loss_fn: LossFn, normalizer: Union[float, torch.Tensor], *,
                   attention_mask: Optional[torch.Tensor] = None, batch: Optional[Batch] = None,
                   cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One 1F1B forward + backward over the micro-batches; gradients accumulate into `.grad`.

        Args:
            input_ids: `[B, T]` token ids.
            loss_fn: `(output_mb, batch_mb) -> scalar` summed over the micro-batch; output_mb is the last
                stage model's output for `B / n_microbatches` rows (logits `[b, T, V_local]` for a CausalLM).
            normalizer: the global denominator, e.g. the number of valid tokens in the whole batch.
            attention_mask: `[B, T]`, 1 for real tokens.
            batch: per-row tensors the loss needs, each with B rows (split into micro-batches for loss_fn).
            cu_seqlens: packed micro-batches (`megalign.roles.packing.pipeline_packs`): input_ids `[n, L]` holds one
                pack of documents a micro-batch (n = n_microbatches), `cu_seqlens` `[n, D + 1]` their boundaries
                (a pack with fewer documents repeats L at the end); no attention_mask.

        Returns:
            The loss `sum over micro-batches of loss_fn / normalizer` (a detached fp32 scalar) on every pp rank.
        """
        batch = batch or {}
        args, kwargs, rows = self._inputs(input_ids, attention_mask, batch, cu_seqlens)
        schedule = Schedule1F1B(
            self._stage(self.model if cu_seqlens is None else _PackedStage(self.model)), self.n_microbatches,
            loss_fn=lambda output, mb_rows: loss_fn(output, _select_rows(batch, mb_rows)) / normalizer,
            scale_grads=False,
        )
        losses: list[torch.Tensor] = []
        target = rows if self.layout.is_last_stage else None
        schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        if self.layout.is_last_stage:
            loss = torch.stack(losses).sum().detach().float()
        else:
            loss = torch.zeros((), device=self.layout.device)
        if self.layout.pp > 1:
            dist.broadcast(loss, src=self.layout.stage_rank(self.layout.pp - 1), group=self.layout.pp_group)
        return loss

    @torch.no_grad()
    def score(self, input_ids: torch.Tensor, score_fn: Optional[ScoreFn] = None, *,
              attention_mask: Optional[torch.Tensor] = None, batch: Optional[Batch] = None,
              cu_seqlens: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Forward only, micro-batch by micro-batch, without autograd.

        Args:
            input_ids, attention_mask, batch, cu_seqlens: as in `train_step`.
            score_fn: `(output_mb, batch_mb) -> [b, ...]` applied on the last stage to each micro-batch
                (e.g. per-token log-probs of the labels); None keeps the model output (logits, values).

        Returns:
            On the last stage, the per-micro-batch results concatenated in row order `[B, ...]`; None elsewhere.
        """
        batch = batch or {}
        args, kwargs, rows = self._inputs(input_ids, attention_mask, batch, cu_seqlens)
        module = self.model if cu_seqlens is None else _PackedStage(self.model)
        if self.layout.is_last_stage and score_fn is not None:
            module = _ScoredStage(module, score_fn, batch)
            kwargs["rows"] = rows
        out = ScheduleGPipe(self._stage(module), self.n_microbatches).step(*args, **kwargs)
        return out if self.layout.is_last_stage else None

    def score_broadcast(self, input_ids: torch.Tensor, score_fn: ScoreFn, shape: Sequence[int] = (), *,
                        attention_mask: Optional[torch.Tensor] = None, batch: Optional[Batch] = None) -> torch.Tensor:
        """`score` of a batch of any size, its `[B, *shape]` fp32 result on every rank of the pp group.

        For scores every stage consumes (a reward model's rewards, held-out metrics, a whole-batch statistic a
        1F1B loss needs first): B is padded to a multiple of `n_microbatches` with copies of its last row
        (dropped after), `score_fn` returns `[b, *shape]` per micro-batch, and the last stage's result is
        broadcast over pp (one message of the result's size).
        """
        batch = batch or {}
        b = input_ids.shape[0]
        pad = -b % self.n_microbatches
        if pad:
            take = torch.cat([torch.arange(b), torch.full((pad,), b - 1)]).to(input_ids.device)
            input_ids = input_ids[take]
            attention_mask = None if attention_mask is None else attention_mask[take]
            batch = {name: value[take] for name, value in batch.items()}
        out = self.score(input_ids, lambda output, mb: score_fn(output, mb).float(), attention_mask=attention_mask,
                         batch=batch)
        if out is None:
            out = torch.empty((b + pad, *shape), dtype=torch.float32, device=self.layout.device)
        if self.layout.pp > 1:
            dist.broadcast(out, src=self.layout.stage_rank(self.layout.pp - 1), group=self.layout.pp_group)
        return out[:b]
