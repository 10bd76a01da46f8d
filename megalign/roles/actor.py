"""Policy roles: the actor (trains, and generates with its own tensor-parallel weights) and the frozen reference.

Design choices:

- Hybrid engine: the actor's rollout runs `megalign.rollout.rollout` (shared-prompt prefill, continuous
  batching) on the very modules it trains (KV-cache decode on the tp shards), so there is no inference
  copy of the weights to refresh after each update and no weight-sync step.
- Log-probs of response tokens come from one forward over prompt + response (padded rows, or the
  rows' real tokens packed, `megalign.roles.packing`), then the fused LM head
  (`LMHead.token_logprob`: `fused_linear_token_logprob`, vocab-parallel, chunks of tokens) on only
  the real response tokens, so neither `[tokens, V]` logits nor their gradient ever exist: the head's
  only `[tokens, V / tp]` temporary is one chunk of `head_chunk_tokens` tokens (fp32 at V = 151936:
  594 MiB per 1024 tokens). The temperature divides the logits exactly as during sampling, so on-policy
  ratios start at 1.
- Precision: the actor keeps fp32 master weights and computes in bf16 under autocast when its dtype
  is bf16 (`megalign.parallel.MixedPrecision`); the frozen reference simply stores bf16 weights.
- Pipeline stages (`layout.pp > 1`, the model from `stage_from_pretrained`): the pipeline runs the
  trunk (`model.model`) and the head runs inside the last stage's per-micro-batch function
  (`head_logprobs` on its hidden states), so logits exist one micro-batch at a time. Scores
  (`pipeline_scores`: the actor's and reference's `pipeline_logprobs`, the critic's `pipeline_values`)
  are broadcast from the last stage over the pp group: every rank of a pp group holds the whole
  rollout batch, and every phase after scoring reads them there. Rollouts go through
  `pipeline_rollout` (micro-batches of rows in flight across the stages, `rollout.engine.pp_microbatches`;
  the engine's per-sample streams, so the same samples as at pp = 1).
- `TrainableRole` is what the PPO critic (`megalign.roles.critic`) reuses: a model, a ZeRO-1 AdamW whose state is the
  "optimizer" offload part, gradient sync over dp, global-norm clipping and a skipped update when
  anything is non-finite.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megalign.models import CausalLM
from megalign.parallel import MixedPrecision, ParallelLayout, Pipeline, all_finite, clip_grad_norm_, sync_gradients
from megalign.roles.base import ModelRole, optimizer_slots
from megalign.roles.packing import PipelinePacks, pipeline_packs, response_hidden, response_positions, scatter_response
from megalign.rollout import EngineConfig, GenerationOutput, RolloutStats, SamplingParams, pipeline_rollout, rollout
from megalign.rollout.routing import RoutingRecorder


def head_logprobs(model: CausalLM, layout: ParallelLayout, hidden: torch.Tensor, targets: torch.Tensor,
                  temperature: float, with_entropy: bool = False, chunk_tokens: int = 1024):
    """log p(target) [B, R] fp32 (and entropy [B, R]) from the final hidden states that predict `targets`.

    Args:
        hidden: [B, R, H] the trunk's output at the positions predicting each target (response
            position t - 1 for response token t); on a pipeline, the last stage's output. Any leading
            shape works ([N, H] with targets [N] for positions already selected).
        targets: [B, R] int64 token ids.
        chunk_tokens: tokens per chunk of the head; the only [tokens, V/tp] temporary is one
            [chunk_tokens, V/tp] logits chunk (in the compute dtype), forward and backward.
    The fused LM head of `model` (`LMHead.token_logprob`: vocab-sharded over `layout.tp_group`, in
    chunks of tokens, so the [B, R, V/tp] logits and their gradient never exist); the entropy comes
    from the same pass and is differentiable (PPO's entropy bonus).
    """
    return model.lm_head.token_logprob(hidden, targets, layout.tp_group if layout.tp > 1 else None, temperature,
                                       with_entropy, chunk_tokens)


def response_logprobs(model: CausalLM, layout: ParallelLayout, sequences: torch.Tensor, attention_mask: torch.Tensor,
                      response_len: int, temperature: float, with_entropy: bool = False, pack: bool = False,
                      pack_tokens: Optional[int] = None, pack_max_fill: float = 1.0, chunk_tokens: int = 1024):
    """log p(response token) [B, R] fp32 (and entropy [B, R]) under softmax(logits / temperature).

    Args:
        sequences: [B, P + R] left-padded prompts then responses (`GenerationOutput.sequences`).
        attention_mask: [B, P + R] 1 for real tokens.
        response_len: R, the response columns at the end of `sequences`.
        pack / pack_tokens / pack_max_fill: the trunk runs on the rows' real tokens packed (`megalign.roles.packing`).
        chunk_tokens: tokens per chunk of the fused head (`head_logprobs`).
    The head runs only on the real response tokens; other positions are 0, which the caller masks out.
    """
    hidden, rows, cols = response_hidden(model.model, sequences, attention_mask, response_len, pack, pack_tokens,
                                         pack_max_fill)
    out = head_logprobs(model, layout, hidden, sequences[:, -response_len:][rows, cols], temperature, with_entropy,
                        chunk_tokens)
    b = sequences.shape[0]
    if with_entropy:
        return tuple(scatter_response(x, rows, cols, b, response_len) for x in out)
    return scatter_response(out, rows, cols, b, response_len)


class PolicyRole(ModelRole):
    """A causal LM role that scores responses (the reference, and the base of the actor).

    `pack` / `pack_tokens` / `pack_max_fill`: its response forwards run on packed rows (`megalign.roles.packing`; at
    pp > 1 one pack a pipeline micro-batch, `pipeline_packs`). `head_chunk_tokens`: tokens per chunk of its fused
    LM head (`head_logprobs`).
    """

    def __init__(self, name: str, model: CausalLM, layout: ParallelLayout, precision: MixedPrecision,
                 offload_weights: bool, extra_switches: Optional[dict[str, bool]] = None, *, pack: bool = False,
                 pack_tokens: Optional[int] = None, pack_max_fill: float = 1.0, head_chunk_tokens: int = 1024):
        super().__init__(name, model, layout, offload_weights, extra_switches)
        if head_chunk_tokens < 1:
            raise ValueError(f"{name}: head_chunk_tokens must be >= 1, got {head_chunk_tokens}")
        self.precision = precision
        self.pack, self.pack_tokens, self.pack_max_fill = pack, pack_tokens, pack_max_fill
        self.head_chunk_tokens = head_chunk_tokens

    @torch.no_grad()
    def logprobs(self, sequences: torch.Tensor, attention_mask: torch.Tensor, response_len: int,
                 temperature: float) -> torch.Tensor:
        """[B, R] fp32 log-probs of the responses, without gradient (old or reference log-probs)."""
        with self.precision.autocast(self.layout.device):
            return response_logprobs(self.model, self.layout, sequences, attention_mask, response_len, temperature,
                                     pack=self.pack, pack_tokens=self.pack_tokens, pack_max_fill=self.pack_max_fill,
                                     chunk_tokens=self.head_chunk_tokens)

    @torch.no_grad()
    def pipeline_scores(self, sequences: torch.Tensor, attention_mask: torch.Tensor, response_len: int,
                        micro_batch_size: int, head: Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor],
                        batch: Optional[dict[str, torch.Tensor]] = None) -> torch.Tensor:
        """[B, R] fp32 no-grad scores of the responses on a pipeline stage (`layout.pp > 1`; module doc).

        The forward-only schedule over micro-batches of `micro_batch_size` rows (B must be a multiple of it, in at
        least pp micro-batches), or, when the role packs (`pipeline_packs`), of one pack each (laid back into its
        rows); on the last stage `head(hidden [b, R, H], that micro-batch's rows of batch)` -> [b, R] runs on the
        states predicting each response token; the result is broadcast from the last stage to every rank
        of the pp group. Positions without a real predicted token are 0, as at pp = 1 (`response_positions`).
        `pipeline_logprobs` and the critic's `pipeline_values` are this with their heads.
        """
        layout = self.layout
        b = sequences.shape[0]
        if b % micro_batch_size or b // micro_batch_size < layout.pp:
            raise ValueError(f"{self.name} at pp={layout.pp}: {b} rows must split into at least pp micro-batches of "
                             f"micro_batch_size={micro_batch_size}")

        batch = batch or {}
        packs = self.pipeline_packs(sequences, attention_mask)

        def score(hidden: torch.Tensor, rows: dict[str, torch.Tensor]) -> torch.Tensor:
            if packs is not None:  # one pack: back to its rows' padded layout, and those rows of `batch`
                pack = int(rows["pack"][0])
                hidden = packs.unpack(pack, hidden)
                rows = {name: value[packs.rows[pack]] for name, value in batch.items()}
            return head(hidden[:, -response_len - 1:-1], rows).float()

        with self.precision.autocast(layout.device):
            if packs is None:
                out = Pipeline(self.model.model, layout, b // micro_batch_size).score(
                    sequences, score, attention_mask=attention_mask, batch=batch)
            else:
                n = len(packs.rows)
                out = Pipeline(self.model.model, layout, n).score(
                    packs.input_ids, score, cu_seqlens=packs.cu_seqlens,
                    batch={"pack": torch.arange(n, device=sequences.device)})
        if out is None:
            out = torch.empty(b, response_len, dtype=torch.float32, device=layout.device)
        dist.broadcast(out, src=layout.stage_rank(layout.pp - 1), group=layout.pp_group)
        return out.masked_fill_(~response_positions(attention_mask, response_len), 0.0)

    def pipeline_packs(self, sequences: torch.Tensor, attention_mask: torch.Tensor) -> Optional[PipelinePacks]:
        """The rows as pipeline packs (`megalign.roles.packing.pipeline_packs`, at least pp of them) when this role
        packs and their real tokens fill at most `pack_max_fill` of the padded rows, else None (padded)."""
        if not self.pack or float(attention_mask.sum()) > self.pack_max_fill * attention_mask.numel():
            return None
        return pipeline_packs(sequences, attention_mask, self.pack_tokens, self.layout.pp)

    def pipeline_logprobs(self, sequences: torch.Tensor, attention_mask: torch.Tensor, response_len: int,
                          temperature: float, micro_batch_size: int) -> torch.Tensor:
        """`logprobs` of a pipeline stage (`layout.pp > 1`): `pipeline_scores` with the fused LM head."""
        return self.pipeline_scores(
            sequences, attention_mask, response_len, micro_batch_size,
            lambda hidden, rows: head_logprobs(self.model, self.layout, hidden, rows["targets"], temperature,
                                               chunk_tokens=self.head_chunk_tokens),
            {"targets": sequences[:, -response_len:]})


class Reference(PolicyRole):
    """The frozen reference policy of the KL term; never trained, so its weights may be stored in bf16."""

    def __init__(self, model: CausalLM, layout: ParallelLayout, offload_weights: bool, **packing):
        """`packing`: `pack`, `pack_tokens`, `pack_max_fill`, `head_chunk_tokens` of `PolicyRole`."""
        model.requires_grad_(False).eval()
        super().__init__("reference", model, layout, MixedPrecision(None), offload_weights, **packing)


class TrainableRole(PolicyRole):
    """A role that trains its model: the actor, and the PPO critic (`megalign.roles.critic`).

    The optimizer is given (the trainers build AdamW with ZeRO-1 over dp, `megalign.trainers.optim`,
    and set its learning rate); its local state (the shard of a ZeRO-1 optimizer) is the
    "optimizer" offload part. `optimizer_step` syncs gradients over dp (summed:
    losses are normalised by global counts, see `megalign.algos.aggregation.loss_normalizer`), clips the
    global norm, and steps only when the loss and the norm are finite on every rank; otherwise it
    drops the gradients (a skipped update).

    `batch_copies`: how many of this role's dp replicas train on the same batch (1 when its dp is the
    trainer's data dp). A role whose dp is larger than the data layout's (a pp = 1 critic beside a
    pp = 2 actor: two critic replicas inside one actor replica, each holding that replica's whole
    batch) computes the same gradient on each copy, so the summed gradient is divided by the copies.

    `updates` counts the optimizer steps taken (the same on every rank, the decision being collective),
    so a trainer can tell a step that moved the model from one whose updates were all skipped.
    """

    def __init__(self, name: str, model: CausalLM, layout: ParallelLayout, precision: MixedPrecision,
                 offload_weights: bool, offload_optimizer: bool, optimizer: torch.optim.Optimizer,
                 grad_clip: Optional[float], batch_copies: int = 1, **packing):
        """`packing`: `pack`, `pack_tokens`, `pack_max_fill`, `head_chunk_tokens` of `PolicyRole`."""
        precision.check_model(model)
        super().__init__(name, model, layout, precision, offload_weights, {"optimizer": offload_optimizer}, **packing)
        self.optimizer = optimizer
        self.grad_clip = grad_clip
        self.batch_copies = batch_copies
        self.updates = 0

    def parts(self):
        return {**super().parts(), "optimizer": optimizer_slots(getattr(self.optimizer, "optim", self.optimizer))}

    def optimizer_step(self, loss: torch.Tensor) -> tuple[bool, torch.Tensor]:
        """After backward of a mini-batch: (stepped, grad norm); `loss` is this rank's share, checked for NaN.

        A collective over the world: every rank calls it once per mini-batch.
        """
        sync_gradients(self.model, self.layout, average=False)  # the experts over expert-dp at ep > 1
        if self.batch_copies > 1:  # the same batch's gradient summed once per copy (class doc)
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.div_(self.batch_copies)
        norm = clip_grad_norm_(self.model, self.grad_clip or math.inf, self.layout)
        stepped = all_finite([loss.detach(), norm])
        if stepped:
            self.optimizer.step()
            self.updates += 1
        self.optimizer.zero_grad(set_to_none=True)
        return stepped, norm


class Actor(TrainableRole):
    """The policy being trained; it also produces the rollouts (hybrid engine)."""

    def __init__(self, *args, **kwargs):
        """The arguments of `TrainableRole` after its name."""
        super().__init__("actor", *args, **kwargs)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, group_size: int, params: SamplingParams,
                 generator: torch.Generator, engine: EngineConfig,
                 routing: Optional[RoutingRecorder] = None) -> tuple[GenerationOutput, RolloutStats]:
        """`group_size` samples of each left-padded prompt [U, P] with the training weights (eval mode, no dropout):
        [U * G] rows, a prompt's samples adjacent. The rollout's seed is drawn from `generator` (checkpointed by the
        trainer), so a resumed run samples the same. `routing`: records an MoE actor's experts (pp = 1 only). At
        ep > 1 every rank of the ep group calls it with its own prompts (the engine keeps them in lock step; the
        pipelined rollout does not and is refused)."""
        seed = int(torch.randint(0, 2 ** 62, (), generator=generator, device=generator.device))
        with self.precision.autocast(self.layout.device):
            if self.layout.pp > 1:
                self.layout.refuse_expert_parallel("the actor's pipelined rollout (actor.pp > 1)")
                return pipeline_rollout(self.model, input_ids, attention_mask, group_size, params, seed, self.layout, engine)
            return rollout(self.model, input_ids, attention_mask, group_size, params, seed, engine,
                           routing=routing)

    def logprobs_with_grad(self, sequences: torch.Tensor, attention_mask: torch.Tensor, response_len: int,
                           temperature: float, hidden: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs [B, R], entropy [B, R]) with gradient through the log-probs, for the policy loss.

        hidden: at pp > 1, the last stage's trunk output [B, P + R, H] for these rows (inside the 1F1B
        schedule, `OnlineTrainer.train_role`); the head then runs on it (already under the schedule's autocast).
        """
        if hidden is not None:
            return head_logprobs(self.model, self.layout, hidden[:, -response_len - 1:-1], sequences[:, -response_len:],
                                 temperature, with_entropy=True, chunk_tokens=self.head_chunk_tokens)
        with self.precision.autocast(self.layout.device):
            return response_logprobs(self.model, self.layout, sequences, attention_mask, response_len, temperature,
                                     with_entropy=True, pack=self.pack, pack_tokens=self.pack_tokens,
                                     pack_max_fill=self.pack_max_fill, chunk_tokens=self.head_chunk_tokens)
