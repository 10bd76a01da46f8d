"""Mixture-of-experts MLP (Qwen3-MoE, Mixtral, Qwen2-MoE): top-k softmax router, grouped expert matmuls, routing replay.

Semantics are transformers' (5.x) `Qwen3MoeSparseMoeBlock` / `MixtralSparseMoeBlock`: router logits
`x @ W_r^T` in the activation dtype, softmax in fp32, top-k of the probabilities, the k weights
renormalised to sum to 1 when `norm_topk_prob` (Mixtral always), and the token's output
`sum_j w_j * down_j(silu(gate_j(x)) * up_j(x))` over its k experts; Qwen2-MoE adds a shared expert
scaled by a sigmoid gate (`MoEMLP`). LoRA (`lora.py`) adapts the named linears only, so neither the
router nor the stacked experts get adapters. Design choices:

- Experts are stacked: `gate_proj`, `up_proj` `[E, F, H]` and `down_proj` `[E, H, F]` (one parameter per
  kind, HF's per-expert `nn.Linear` weights stacked along dim 0 by the adapter). The N * k (token, expert)
  pairs are sorted by expert once; each projection is then one grouped matmul over the expert
  segments (`torch._grouped_mm`, which runs fp32 / bf16 / fp16 on CPU in torch 2.13 when the rows are
  16-byte aligned). Where it cannot run (other dtypes, unaligned widths, a torch without it) the same
  segments go through a loop over experts, which is the reference the grouped path is tested against.
  Outputs are unsorted and the k expert outputs of a token summed with their weights in fp32 (the
  weights stay fp32 where transformers' Qwen3-MoE rounds them to the activation dtype first). The
  per-expert counts come from a scatter-add, not `bincount`, so the single-device path has no host sync.
- Tensor parallelism slices every expert like the dense SwiGLU: each rank holds `F / tp` of every
  expert's gate/up rows and down columns (`tp_shard_dims`), the router is replicated (its input is).
  The expert input enters through `copy_to_group` (its gradient summed over ranks), the combined output
  leaves through `reduce_from_group` (one all-reduce of `[N, H]` per layer), and the routing weights pass
  `copy_to_group` too: each rank's output is a partial sum over its slice, so a weight's gradient is too.
- Expert parallelism (`factory.ep_size` > 1, Megatron's: experts split over `factory.ep_group`, ranks of the
  data-parallel group that hold other tokens): rank r holds experts `[r * E / ep, (r + 1) * E / ep)`. The
  (token, expert) rows sorted by expert are sent to their experts' ranks by one all-to-all (split sizes
  exchanged first by a small all-to-all of the per-expert counts: one host sync per MoE layer, as in
  Megatron's dropless dispatcher), regrouped by local expert, run through the grouped matmuls, and sent
  back by the reverse all-to-all, whose backward is the forward one. The expert weights are then not
  replicated over the ep group: their gradient covers every rank's tokens, so the data-parallel
  all-reduce must leave them out over the ep group (`ep_shard_dims` marks them, dim 0).
- Routing state lives in a `Routing` object the caller attaches for one forward (`moe_routing`): it
  records the chosen experts `[N, k]` per layer (`record`), forces given ones (`replay`: the
  probabilities are the current router's, gathered at the given experts and renormalised alike, so the
  router still gets a gradient: routing replay as verl / Megatron do it; a token whose ids are -1 has no
  record, e.g. a response's last token, never fed during sampling, and routes by the router), and collects what the
  load-balancing loss needs. Layers are keyed by their global index. Each decoder forward gets its own
  `ForwardRouting` (fresh record and statistics dicts), which the layers hold on to: activation
  checkpointing's recomputation, run during a later backward, rewrites its own forward's entries (with the
  same values), never a later micro-batch's.
- `load_balancing_loss` is transformers' `load_balancing_loss_func` (Switch Transformer eq. 4-6 pooled over
  the MoE layers): `E * sum_e f_e * P_e` with f_e the fraction of (token, layer) rows that chose e among
  their k (so sum_e f_e = k) and P_e the mean router probability of e, padding excluded. It counts the
  experts actually used, which are the router's top-k except under replay.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalign.parallel.collectives import Group, copy_to_group, reduce_from_group


@dataclass
class Routing:
    """MoE routing state of one forward, shared by every MoE layer of a model (attach with `moe_routing`).

    `N` below is the number of tokens of the forward, `B * T` flattened row-major (padding included).
    """

    record: bool = False
    """Fill `chosen` with each MoE layer's expert ids."""
    replay: Optional[dict[int, torch.Tensor]] = None
    """Global layer index -> `[N, k]` integer expert ids to use instead of the router's top-k (-1: the router's)."""
    aux: bool = False
    """Collect the load-balancing statistics (`load_balancing_loss`)."""
    chosen: dict[int, torch.Tensor] = field(default_factory=dict)
    """Global layer index -> `[N, k]` int64 chosen experts of the latest forward (filled when `record`)."""
    steps: list[dict[int, torch.Tensor]] = field(default_factory=list)
    """`chosen` of every forward in the block, oldest first (`steps[-1] is chosen`): a KV-cache generation's
    prefill `[B * P, k]` then one `[B, k]` per decoded token, for the caller to assemble per sequence."""
    stats: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """Global layer index -> (`[E]` fp32 counts of chosen experts, `[E]` fp32 summed probabilities, token count),
    padding excluded (filled when `aux`)."""
    token_mask: Optional[torch.Tensor] = None
    """`[N]` bool: real tokens (set by the decoder from its attention mask; None = all)."""

    def start_forward(self, token_mask: Optional[torch.Tensor]) -> "ForwardRouting":
        """Called by the decoder at the start of each forward: fresh `chosen` (kept in `steps`) and `stats`."""
        self.token_mask = token_mask
        self.stats = {}
        if self.record:
            self.chosen = {}
            self.steps.append(self.chosen)
        return ForwardRouting(self.replay, token_mask, self.chosen if self.record else None,
                              self.stats if self.aux else None)


@dataclass
class ForwardRouting:
    """What the MoE layers of one forward read and write (`Routing.start_forward`); None: not asked for."""

    replay: Optional[dict[int, torch.Tensor]]
    token_mask: Optional[torch.Tensor]
    chosen: Optional[dict[int, torch.Tensor]]
    stats: Optional[dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]


@contextmanager
def moe_routing(model: nn.Module, record: bool = False, replay: Optional[dict[int, torch.Tensor]] = None,
                aux: bool = False) -> Iterator[Routing]:
    """Attach a fresh `Routing` to every `Decoder` in `model` for the forwards inside the block; yields it.

    A forward outside any block routes by the router alone and records nothing."""
    from .decoder import Decoder

    decoders = [m for m in model.modules() if isinstance(m, Decoder)]
    if not decoders:
        raise ValueError(f"moe_routing: {type(model).__name__} holds no Decoder")
    routing = Routing(record=record, replay=replay, aux=aux)
    previous = [d.routing for d in decoders]
    for d in decoders:
        d.routing = routing
    try:
        yield routing
    finally:
        for d, before in zip(decoders, previous):
            d.routing = before


def load_balancing_loss(routing: Routing, num_experts: int) -> torch.Tensor:
    """transformers' `load_balancing_loss_func` from the statistics of every MoE layer in `routing` (module doc).

    Scalar fp32; multiply by `ModelConfig.router_aux_loss_coef` to add it to the loss (as
    `Qwen3MoeForCausalLM` / `MixtralForCausalLM` do). Raises when the forward collected no statistics."""
    if not routing.stats:
        raise ValueError("load_balancing_loss: no MoE statistics; run the forward inside moe_routing(model, aux=True)")
    counts = sum(s[0] for s in routing.stats.values())
    probs = sum(s[1] for s in routing.stats.values())
    rows = sum(s[2] for s in routing.stats.values())
    return num_experts * torch.sum((counts / rows) * (probs / rows))


def routing_agreement(recorded: dict[int, torch.Tensor], recomputed: dict[int, torch.Tensor],
                      token_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Fraction (fp32 scalar) of the chosen (token, layer, expert) slots that two routings share.

    `recorded` / `recomputed`: global layer -> `[N, k]` expert ids (`Routing.chosen`, e.g. of the rollout and of
    the training forward with replay off), the same layers in both; `token_mask` `[N]` bool: the tokens that count
    (all when None). Per token and layer, |set(a) & set(b)| / k: the order of a token's k experts does not matter.
    1.0 when replay holds or nothing flipped; the router agreement the online trainers log."""
    if sorted(recorded) != sorted(recomputed):
        raise ValueError(f"routing_agreement: layers {sorted(recorded)} and {sorted(recomputed)} differ")
    shared = total = 0.0
    for layer, a in recorded.items():
        b = recomputed[layer]
        if a.shape != b.shape:
            raise ValueError(f"routing_agreement: layer {layer} has shapes {tuple(a.shape)} and {tuple(b.shape)}")
        same = (a[:, :, None] == b[:, None, :].to(a.device)).any(-1).float().sum(-1)  # [N] experts in both
        m = torch.ones_like(same) if token_mask is None else token_mask.to(same.device, torch.float32)
        shared = shared + (same * m).sum()
        total = total + m.sum() * a.shape[1]
    return shared / total


def _autocast_dtype(device: torch.device) -> Optional[torch.dtype]:
    """The dtype autocast runs matmuls in on `device`'s type; None when autocast is off there."""
    kind = device.type
    if torch._C._is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return None


def _as_matmul_operand(t: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """`t` cast as autocast casts a matmul operand (`dtype` from `_autocast_dtype`): float64 and non-floating
    tensors are left alone, as autocast leaves them. `torch._grouped_mm` is not on autocast's cast list, so the
    experts cast by hand; the cast is differentiable, its gradient returns in the parameter's dtype."""
    if dtype is None or not t.is_floating_point() or t.dtype in (dtype, torch.float64):
        return t
    return t.to(dtype)


def _grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` takes these operands: its dtypes, and rows of both a multiple of 16 bytes."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != w.dtype:
        return False
    dtypes = (torch.bfloat16,) if x.device.type == "cuda" else (torch.float32, torch.bfloat16, torch.float16)
    return x.dtype in dtypes and all(n * x.element_size() % 16 == 0 for n in w.shape[1:])


def _contiguous_grad(y: torch.Tensor) -> torch.Tensor:
    if y.requires_grad:  # _grouped_mm's backward refuses stride-0 gradients (e.g. of a `.sum()`)
        y.register_hook(lambda g: g.contiguous())
    return y


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows of `x` `[M, in]` sorted by expert times their expert's `weight` `[E, out, in]`^T -> `[M, out]`.

    `counts` `[E]` rows per expert, `ends` `[E]` int32 their cumulative sum (segment ends)."""
    if _grouped_mm_ok(x, weight):
        return _contiguous_grad(torch._grouped_mm(x, weight.transpose(-2, -1), offs=ends))
    parts = x.split(counts.tolist())
    return torch.cat([p @ w.T for p, w in zip(parts, weight)]) if parts else x.new_zeros(0, weight.shape[1])


def _inverse(order: torch.Tensor) -> torch.Tensor:
    """The permutation undoing `order` (`x[order][_inverse(order)] == x`)."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


class _AllToAll(torch.autograd.Function):
    """Rows `[sum(send), ...]` -> `[sum(recv), ...]`: rank r's `send[j]` rows go to rank j; backward: the reverse."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights; this rank holds `F / tp` of each expert's width (`tp_shard_dims`) and,
    under expert parallelism, experts `[ep_rank * E / ep, (ep_rank + 1) * E / ep)` only (`ep_shard_dims`).

    forward: tokens `[N, H]`, chosen (global) experts `[N, k]`, their weights `[N, k]` fp32 -> `[N, H]` (partial
    over tp ranks: the caller all-reduces)."""

    def __init__(self, num_experts: int, hidden: int, width: int, tp_size: int, ep_size: int = 1, ep_group=None):
        super().__init__()
        local = width // tp_size
        self.num_experts = num_experts
        self.ep_size, self.ep_group = ep_size, ep_group
        n = num_experts // ep_size
        self.gate_proj = nn.Parameter(torch.empty(n, local, hidden))
        self.up_proj = nn.Parameter(torch.empty(n, local, hidden))
        self.down_proj = nn.Parameter(torch.empty(n, hidden, local))
        for p in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(p, std=0.02)
        self.tp_shard_dims = {"gate_proj": 1, "up_proj": 1, "down_proj": 2}
        self.ep_shard_dims = {"gate_proj": 0, "up_proj": 0, "down_proj": 0} if ep_size > 1 else {}

    def _swiglu(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows `[M, H]` sorted by local expert, `counts` `[E_local]` -> `[M, H]` (in the autocast dtype under
        autocast: the stacked weights are cast once here, each expert a slice of the cast copy)."""
        dtype = _autocast_dtype(xs.device)
        xs = _as_matmul_operand(xs, dtype)
        gate, up, down = (_as_matmul_operand(w, dtype) for w in (self.gate_proj, self.up_proj, self.down_proj))
        ends = counts.cumsum(0).to(torch.int32)
        h = F.silu(grouped_linear(xs, gate, counts, ends)) * grouped_linear(xs, up, counts, ends)
        return grouped_linear(h, down, counts, ends)

    def _dispatch(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Expert parallelism: rows sorted by global expert, `counts` `[E]` -> their outputs, in the same order."""
        ep, n_local = self.ep_size, self.num_experts // self.ep_size
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.ep_group)  # [source rank, local expert]
        send, recv = counts.view(ep, n_local).sum(1).tolist(), received.view(ep, n_local).sum(1).tolist()
        xr = _AllToAll.apply(xs, send, recv, self.ep_group)  # ordered by (source rank, local expert)
        local_ids = torch.arange(n_local, device=xs.device).repeat(ep).repeat_interleave(received)
        order = torch.argsort(local_ids, stable=True)
        yr = self._swiglu(xr[order], received.view(ep, n_local).sum(0))[_inverse(order)]
        return _AllToAll.apply(yr, recv, send, self.ep_group)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        n, k = experts.shape
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, token order kept
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        xs = _as_matmul_operand(x, _autocast_dtype(x.device))[order // k]  # cast before the k-fold gather
        ys = self._swiglu(xs, counts) if self.ep_size == 1 else self._dispatch(xs, counts)
        y = ys[_inverse(order)].view(n, k, ys.shape[-1])  # explicit width: n = 0 on an idle ep rank (zero tokens)
        return (y.float() * weights[..., None]).sum(1).to(x.dtype)


class MoEMLP(nn.Module):
    """Router + `GroupedExperts` in place of a dense SwiGLU (module doc). `[B, T, H]` -> `[B, T, H]`.

    `layer` is the global layer index (the key of this layer's `Routing` entries); `group` the
    tensor-parallel group (None at tp = 1). `shared_expert` (Qwen2-MoE): a SwiGLU every token goes through,
    its output scaled by sigmoid(`shared_expert_gate`(x)) and added, as in transformers' Qwen2MoeSparseMoeBlock."""

    def __init__(self, config, factory, layer: int, shared_expert: Optional[nn.Module] = None):
        super().__init__()
        self.shared_expert = shared_expert
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False) if shared_expert is not None else None
        self.layer = layer
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.group: Group = factory.group if factory.tp_size > 1 else None
        if config.num_experts % factory.ep_size:
            raise ValueError(f"num_experts ({config.num_experts}) must be divisible by the expert-parallel size "
                             f"{factory.ep_size}")
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = GroupedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                      factory.tp_size, factory.ep_size, factory.ep_group)

    def route(self, x: torch.Tensor, routing: Optional[ForwardRouting]) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[N, H]` -> (expert ids `[N, k]` int64, weights `[N, k]` fp32); `routing`: record, replay, statistics."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        replay = routing.replay.get(self.layer) if routing is not None and routing.replay is not None else None
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if replay is not None:
            if replay.shape != (x.shape[0], self.top_k):
                raise ValueError(f"routing replay for layer {self.layer} has shape {tuple(replay.shape)}, "
                                 f"expected {(x.shape[0], self.top_k)} (tokens, experts per token)")
            given = replay.to(device=x.device, dtype=torch.long)
            experts = torch.where(given >= 0, given, experts)  # -1: no record for this token, the router's choice
            weights = probs.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        if routing is not None and routing.chosen is not None:
            routing.chosen[self.layer] = experts.detach()
        if routing is not None and routing.stats is not None:
            routing.stats[self.layer] = self._stats(probs, experts, routing.token_mask)
        return experts, weights

    def _stats(self, probs: torch.Tensor, experts: torch.Tensor, mask: Optional[torch.Tensor]):
        """(`[E]` counts of chosen experts, `[E]` summed probabilities, token count) over real tokens."""
        m = torch.ones(probs.shape[0], device=probs.device) if mask is None else mask.to(probs.device, torch.float32)
        counts = torch.zeros(probs.shape[1], device=probs.device).index_add_(
            0, experts.reshape(-1), m.repeat_interleave(experts.shape[1]))
        return counts, (probs * m[:, None]).sum(0), m.sum()

    def forward(self, x: torch.Tensor, routing: Optional[ForwardRouting] = None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        experts, weights = self.route(x, routing)
        if self.group is None:
            out = self.experts(x, experts, weights)
        else:
            out = self.experts(copy_to_group(x, self.group), experts, copy_to_group(weights, self.group))
            out = reduce_from_group(out, self.group)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view(shape)
