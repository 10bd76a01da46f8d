"""The online family's update step, one for every algorithm and every layout: `RoleLoss` (what a role is trained on)
and `accumulate` (one mini-batch's forward + backward in micro-batches: padded or packed rows at pp = 1, the
1F1B schedule over padded rows or packs at pp > 1), which `OnlineTrainer.train_role` runs per mini-batch.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from megalign.parallel import MicroBatchSums, Pipeline
from megalign.roles import TrainableRole
from megalign.rollout import RolloutBatch


@dataclasses.dataclass
class RoleLoss:
    """What `OnlineTrainer.train_role` trains a role on.

    `fn(rows, hidden)` -> (the loss per unit [b, T], {name: 0-d sum} with exactly the names `stats`) for rows [b]
    of the units; `hidden` is None at pp = 1 (the loss runs its own forward) and the last pipeline stage's output
    for those rows at pp > 1. `units` [n, T]: what the loss is aggregated over when it is not each response's
    tokens (`batch.response_mask`, the default): online DPO's [pairs, 1] ones (one loss per pair: token-mean is
    the mean over the global pairs). `unit_inputs(rows)` -> (sequences, attention mask) [k b, T]: the pipeline's
    padded inputs for b units of k rows each at pp > 1 (default: the batch's rows), as online DPO's interleaved
    chosen / rejected pair.
    """

    fn: Callable[[torch.Tensor, Optional[torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]]
    stats: tuple[str, ...]
    units: Optional[torch.Tensor] = None
    unit_inputs: Optional[Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = None


def accumulate(role: TrainableRole, micro_batch_size: int, batch: RolloutBatch, rows: torch.Tensor,
               normalizer: torch.Tensor, share_of: Callable, n_stats: int, unit_inputs: Optional[Callable] = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward + backward of `role` on mini-batch `rows` in micro-batches of `micro_batch_size` units, gradients
    accumulated: (the mini-batch loss, detached, on every pp rank; its summed statistics [n_stats], on the last
    stage at pp > 1).

    pp = 1: `share_of(micro rows, normalizer)` per micro-batch, the loss running its own forward (packed or
    padded: `megalign.roles.packing`), then its backward. pp > 1: one 1F1B schedule, `share_of(micro rows,
    normalizer, hidden)` on the last stage's hidden states of each micro-batch, which is either padded rows
    (`unit_inputs(rows)` -> (sequences, attention mask) [k b, T] when a unit is k rows, as online DPO's
    interleaved pair) or one pack of the rows' real tokens (`PolicyRole.pipeline_packs`, turned back into the
    rows' padded layout by `PipelinePacks.unpack`; a filler pack, added to reach pp micro-batches, holds no row
    and adds 0 times its output so its backward runs). Every way gives the unpipelined loop's gradient.
    """
    size, layout = micro_batch_size, role.layout
    if layout.pp == 1:
        mini_loss = torch.zeros((), device=layout.device)
        local = torch.zeros(n_stats, dtype=torch.float64, device=layout.device)
        for micro in torch.split(rows, size):
            if micro.numel():
                share, stats = share_of(micro, normalizer)
                share.backward()
                mini_loss, local = mini_loss + share.detach(), local + stats
        return mini_loss, local
    if len(rows) % size or len(rows) // size < layout.pp:
        raise ValueError(f"{role.name} at pp={layout.pp}: a mini-batch of {len(rows)} responses must split into at "
                         f"least pp micro-batches of algo.micro_batch_size={size} (rollout.prompts_per_step x "
                         f"group_size / dp / algo.mini_batches)")
    sequences, attention_mask = ((batch.sequences[rows], batch.attention_mask[rows]) if unit_inputs is None
                                 else unit_inputs(rows))
    packs = role.pipeline_packs(sequences, attention_mask) if unit_inputs is None else None
    span = len(sequences) // len(rows)  # input rows a unit
    n = len(rows) // size if packs is None else len(packs.rows)
    sums = MicroBatchSums(n, len(sequences) if packs is None else n, layout.device)

    def loss_fn(hidden: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        if packs is None:
            share, stats = share_of(mb["rows"][::span], normalizer, hidden)
        else:
            pack = int(mb["pack"][0])
            if not len(packs.rows[pack]):
                return hidden.sum() * 0.0
            share, stats = share_of(rows[packs.rows[pack]], normalizer, packs.unpack(pack, hidden))
        sums.put("stats", mb["slot"], stats)
        return share

    inputs = (dict(input_ids=sequences, attention_mask=attention_mask, batch={"rows": rows.repeat_interleave(span)})
              if packs is None else
              dict(input_ids=packs.input_ids, cu_seqlens=packs.cu_seqlens, batch={"pack": torch.arange(n, device=layout.device)}))
    inputs["batch"]["slot"] = sums.slots
    with role.precision.autocast(layout.device):
        loss = Pipeline(role.model.model, layout, n).train_step(loss_fn=loss_fn, normalizer=1.0, **inputs)
    return loss, sums.sums().get("stats", torch.zeros(n_stats, dtype=torch.float64, device=layout.device))
