"""MoE actors in the online trainers: routing replay, router agreement, the load-balancing loss (`MoEOnline`).

An MoE router can pick other experts in the training forward than it did while sampling (other batch shapes,
kernels or precision, or an update between rollout and training), so the trained log-probs belong to another
network than the sampled ones; MoE RL runs collapse from it (Megatron-LM #4168). The fix, as verl / slime /
NeMo-RL do it, is routing replay:

- While sampling, the engine records every sequence's experts per MoE layer (`megalign.rollout.routing`) into
  `RolloutBatch.routing` `[N, P + R, L, k]` (int16, -1 where nothing was routed: padding, each response's last
  token; those positions route by the router, and no scored log-prob depends on them).
- `actor.routing_replay: true`: the actor's old-log-prob recomputation and its training forwards run with those
  experts (`MoEMLP.route`'s replay: the router's own probabilities at the recorded experts, so the router still
  learns); `reference.routing_replay: true` does the same for the reference's forwards (a reference with the
  actor's MoE layers).
- `actor.routing_replay: false`: `moe/router_agreement`, the fraction of the recorded (token, layer, expert)
  slots the actor's router chooses again (`routing_agreement`), is logged every step, measured on the
  recomputation of the old log-probs, or, without one, on the actor's forwards before its first update of the
  step; summed over dp.
- `actor.moe_aux_loss_coef` c > 0: c times the load-balancing loss (`load_balancing_loss`, transformers'
  `load_balancing_loss_func`, pooled over a micro-batch's forwards, padding excluded) is added to each trained
  unit's loss (every response token, or each online-DPO pair), so the loss aggregation weighs it as the
  units: with token-mean, c times the token-weighted mean of the micro-batches' aux losses. Logged as
  `actor/moe_aux_loss` (that mean, summed over dp). Default (null): the checkpoint's `router_aux_loss_coef` when
  its config.json sets `output_router_logits: true` (transformers adds the loss to its training loss exactly
  then), else 0.

The trainers' forwards lay rows out their own way (padded `[b, W]` rows, or each row's real tokens packed,
`megalign.roles.packing`, one forward per pack); `stream_routing` maps the batch's record onto them: a
forward pre-hook on the decoder reads each forward's inputs and takes the next rows of the stream (b padded
rows, or the whole rows whose real tokens fill the pack), in the order the trainer's loops run them.
Limits (refused at start-up with the key; `online_config.check_moe_keys` for the last two): a dense actor,
actor.pp > 1 (pipelined rollout and updates) and multi-turn episodes (`rollout.env`) take neither replay nor
the aux loss, and record nothing (no agreement logged).
"""
from __future__ import annotations

import contextlib
import inspect
import json
import os
from typing import Iterator, Optional

import torch

from megalign.models.decoder import Decoder
from megalign.models.moe import Routing, load_balancing_loss, routing_agreement
from megalign.parallel.collectives import all_reduce
from megalign.rollout import RolloutBatch
from megalign.rollout.routing import NONE, RoutingRecorder
from megalign.trainers.online_config import moe_keys_asked


class StreamRouting(Routing):
    """`Routing` for consecutive forwards over the rows of `plan` (module doc), each taking the rows it holds.

    `plan` `[b, W, L, k]` recorded experts of the rows (-1: none), `real` `[b, W]` bool their real tokens,
    `layers` the global MoE layers of dim 2; `replay` forces the plan, `record` keeps what each forward chose
    to compare it with the plan (`agreement`), `aux` pools the load-balancing statistics (`aux_loss`)."""

    def __init__(self, plan: torch.Tensor, real: torch.Tensor, layers: list[int], replay: bool, record: bool,
                 aux: bool):
        super().__init__(record=record, aux=aux)
        self.plan, self.real, self.layers, self.replaying = plan, real, layers, replay
        self.lengths = real.sum(1).tolist()
        self.cursor = 0
        self.current: dict[int, torch.Tensor] = {}
        self.pooled: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.counts = torch.zeros(2, dtype=torch.float64, device=plan.device)  # (shared slots, recorded slots)

    def next_forward(self, input_ids: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> None:
        """Before a decoder forward on `input_ids` `[b, W]` (padded rows) or `[1, total]` with `cu_seqlens` (a pack of
        whole rows' real tokens): this forward's slice of the plan."""
        self._settle()
        b, t = input_ids.shape[:2]
        start = self.cursor
        if cu_seqlens is None:
            if self.plan.shape[1] != t or start + b > len(self.lengths):
                raise ValueError(f"routing replay: a forward of {b} rows x {t} columns does not match the next rows of "
                                 f"the plan ({len(self.lengths) - start} rows x {self.plan.shape[1]} columns left)")
            ids, self.cursor = self.plan[start:start + b].reshape(b * t, *self.plan.shape[2:]), start + b
        else:
            total = 0
            while total < t and self.cursor < len(self.lengths):
                total, self.cursor = total + self.lengths[self.cursor], self.cursor + 1
            if total != t:
                raise ValueError(f"routing replay: a packed forward of {t} tokens is not the real tokens of whole rows "
                                 f"from row {start} of the plan")
            ids = self.plan[start:self.cursor][self.real[start:self.cursor]]
        ids = ids.long()
        self.current = {layer: ids[:, i] for i, layer in enumerate(self.layers)}
        self.replay = self.current if self.replaying else None

    def start_forward(self, token_mask: Optional[torch.Tensor]):
        forward = super().start_forward(token_mask)
        if self.aux:
            self._stats = forward.stats
        return forward

    def _settle(self) -> None:
        """Fold the finished forward's record and statistics into the sums, then drop them."""
        if self.record and self.current and self.chosen:
            recorded = {layer: self.current[layer] for layer in self.chosen}
            mask = recorded[self.layers[0]][:, 0] != NONE
            slots = mask.sum() * recorded[self.layers[0]].shape[1] * len(recorded)
            share = routing_agreement(recorded, self.chosen, mask).nan_to_num(0.0)
            self.counts += torch.stack([share * slots, slots.to(share.dtype)]).double()
            self.steps.clear()
            self.chosen = {}
        if self.aux and getattr(self, "_stats", None):
            forward = len(self.pooled)
            self.pooled.update({(forward, layer): s for layer, s in self._stats.items()})
            self._stats = None
        self.current = {}

    def aux_loss(self, num_experts: int) -> torch.Tensor:
        """The load-balancing loss of every forward so far, their statistics pooled (fp32 scalar)."""
        self._settle()
        return load_balancing_loss(Routing(stats=self.pooled), num_experts)


@contextlib.contextmanager
def stream_routing(model: torch.nn.Module, plan: torch.Tensor, real: torch.Tensor, layers: list[int], replay: bool,
                   record: bool, aux: bool) -> Iterator[StreamRouting]:
    """Attach a `StreamRouting` to `model`'s decoder (and a pre-hook that feeds it each forward's inputs) for the
    forwards inside the block; yields it (its sums are final after the block)."""
    decoders = [m for m in model.modules() if isinstance(m, Decoder)]
    if len(decoders) != 1:
        raise ValueError(f"stream_routing: expected one Decoder in {type(model).__name__}, found {len(decoders)}")
    decoder = decoders[0]
    routing = StreamRouting(plan, real, layers, replay, record, aux)
    signature = inspect.signature(decoder.forward)

    def pre_hook(module, args, kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        routing.next_forward(bound["input_ids"], bound.get("cu_seqlens"))

    handle = decoder.register_forward_pre_hook(pre_hook, with_kwargs=True)
    previous, decoder.routing = decoder.routing, routing
    try:
        yield routing
        routing._settle()
    finally:
        handle.remove()
        decoder.routing = previous


def aux_loss_default(path: str) -> float:
    """The checkpoint's `router_aux_loss_coef` when its config.json sets `output_router_logits` (module doc), else 0."""
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    return float(hf.get("router_aux_loss_coef", 0.001)) if hf.get("output_router_logits") else 0.0


class MoEOnline:
    """The MoE side of an `OnlineTrainer` (module doc): start-up checks, the rollout's recorder, the forwards'
    routing contexts, the aux loss and the metrics. A dense actor makes every part a no-op."""

    def __init__(self, trainer):
        cfg = trainer.cfg
        config = trainer.actor.model.config
        self.trainer, self.num_experts = trainer, config.num_experts
        self.replay, self.ref_replay = cfg.actor.routing_replay, cfg.reference.routing_replay
        coef, asked = cfg.actor.moe_aux_loss_coef, moe_keys_asked(cfg)
        if config.num_experts == 0 and asked:
            raise ValueError(f"{', '.join(asked)}: the actor ({cfg.actor.path}) is a dense model (num_experts=0); "
                             f"routing replay and the load-balancing loss need an MoE actor")
        self.coef = (aux_loss_default(cfg.actor.path) if coef is None else coef) if config.num_experts else 0.0
        # actor.pp > 1 and rollout.env with replay / the aux loss are refused by the config (`online_config`)
        self.record = config.num_experts > 0 and trainer.layout.pp == 1 and cfg.rollout.env is None
        if self.ref_replay:
            self._check_reference(trainer, config)
        self.sums = torch.zeros(4, dtype=torch.float64, device=trainer.layout.device)
        self.updates_at_start, self.measured = 0, False

    @staticmethod
    def _check_reference(trainer, config) -> None:
        ref = trainer.reference
        if ref is None:
            raise ValueError("reference.routing_replay=true: this run has no reference (the algorithm uses none)")
        rc = ref.model.config
        moe = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
        if (rc.num_experts, rc.num_experts_per_tok, rc.num_hidden_layers) != (
                config.num_experts, config.num_experts_per_tok, config.num_hidden_layers) or \
                moe != [i for i in range(rc.num_hidden_layers) if rc.is_moe_layer(i)]:
            raise ValueError("reference.routing_replay=true: the reference's MoE layers (experts, top-k, layers) "
                             "differ from the actor's, so the actor's recorded experts do not apply to it")
        if ref.layout.pp > 1:
            raise ValueError(f"reference.routing_replay=true needs reference.pp=1, got {ref.layout.pp}")

    # ----- the rollout

    def recorder(self) -> Optional[RoutingRecorder]:
        """A recorder for the actor's rollout when the run records (an MoE actor at pp = 1, one turn), else None."""
        return RoutingRecorder() if self.record else None

    @staticmethod
    def batch_routing(recorder: Optional[RoutingRecorder], pad: int) -> Optional[torch.Tensor]:
        """`RolloutBatch.routing` from the rollout's record, its response columns padded by `pad` (with -1)."""
        if recorder is None or recorder.sequences is None:
            return None
        return torch.nn.functional.pad(recorder.sequences, (0, 0, 0, 0, 0, pad), value=NONE)

    # ----- the forwards

    def start_step(self) -> None:
        """Before scoring: the step's agreement is measured until the actor's first update (module doc)."""
        self.sums.zero_()
        self.updates_at_start, self.measured = self.trainer.actor.updates, False

    def _context(self, model, batch: RolloutBatch, rows, columns: Optional[slice], replay: bool, record: bool,
                 aux: bool):
        if batch.routing is None or not (replay or record or aux):
            return contextlib.nullcontext()
        plan, mask = batch.routing[rows], batch.attention_mask[rows]
        if columns is not None:
            plan, mask = plan[:, columns], mask[:, columns]
        layers = [i for i in range(model.config.num_hidden_layers) if model.config.is_moe_layer(i)]
        return stream_routing(model, plan, mask.bool(), layers, replay, record, aux)

    @contextlib.contextmanager
    def actor_forwards(self, batch: RolloutBatch, rows, columns: Optional[slice] = None, training: bool = True):
        """Around the actor's forwards over batch rows `rows` in order (a slice, or indices [b]; `columns` of each):
        replay, the agreement record before the first update, and (`training`) the aux statistics. Yields the
        `StreamRouting`, or None when nothing applies (a dense actor, no record)."""
        measure = not self.replay and not self.measured and self.trainer.actor.updates == self.updates_at_start
        with self._context(self.trainer.actor.model, batch, rows, columns, self.replay, measure,
                           training and self.coef > 0) as routing:
            yield routing
        if routing is not None and measure:
            self.sums[:2] += routing.counts
            self.measured = not training  # a recomputation covers the step; training forwards until the first update

    def reference_forwards(self, batch: RolloutBatch, rows, columns: Optional[slice] = None):
        """Around the reference's forwards over batch rows `rows` (as `actor_forwards`): replay when asked for."""
        if not self.ref_replay:
            return contextlib.nullcontext()
        return self._context(self.trainer.reference.model, batch, rows, columns, True, False, False)

    def with_aux(self, loss: torch.Tensor, units: torch.Tensor, routing: Optional[StreamRouting]) -> torch.Tensor:
        """`loss` [b, T] per unit plus coef x the aux loss of the forwards `routing` ran on every unit of `units`
        [b, T] (module doc); `loss` unchanged without an aux loss."""
        if routing is None or not self.coef:
            return loss
        aux = routing.aux_loss(self.num_experts)
        weight = units.detach().double().sum()
        self.sums[2:] += torch.stack([aux.detach().double() * weight, weight])
        return loss + self.coef * aux * units

    def metrics(self) -> dict[str, torch.Tensor]:
        """`moe/router_agreement` (replay off, when measured) and `actor/moe_aux_loss` (coef > 0), summed over dp."""
        if not self.record:
            return {}
        total = all_reduce(self.sums, self.trainer.layout.dp_group)
        out = {}
        if not self.replay:
            out["moe/router_agreement"] = total[0] / total[1].clamp(min=1.0)
        if self.coef:
            out["actor/moe_aux_loss"] = total[2] / total[3].clamp(min=1.0)
        return out

