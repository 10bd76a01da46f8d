"""Incremental decoding with a KV cache on the training weights: the simple loop, and the sampling rules.

The trainers roll out with `megalign.rollout.engine.rollout` (shared-prompt prefill, continuous batching);
`generate` here is the textbook loop it is checked against, and `pipeline_generate` its pp > 1 form.

Design choices:
- The policy's own modules run the decode (no weight copy, no second engine): one prefill forward over
  the left-padded prompts fills a preallocated `KVCache`, then one forward per new token. The LM head
  runs on the last position only.
- Prompts are left-padded so every row's next token lands in the same column; positions count only real
  tokens (cumsum of the attention mask), so a padded prompt decodes exactly as it would alone.
- A row stops at its first EOS or stop token (kept in the output, as in transformers); after that it is
  filled with `pad_token_id`, attention-mask 0 and log-prob 0. The loop ends when every row has stopped
  or after `max_new_tokens`.
- Sampling follows transformers' processor order: temperature, then top-k, then top-p (nucleus:
  keep the smallest set of tokens whose probability sums to at least top_p; Holtzman et al. 2019).
  `temperature == 0` means greedy (argmax). Randomness comes only from the `torch.Generator` passed
  in, so a seeded generator reproduces a rollout.
- Returned log-probs: log softmax(logits / T)[token], the temperature-scaled distribution *before*
  top-k / top-p truncation (T = 1 for greedy). That is the quantity a trainer recomputes with one
  forward over the finished sequences (logits / T, as verl does), so on-policy importance ratios start
  at exactly 1; the truncated distribution would put the renormalisation mass into the ratio. Without
  top-k / top-p it is exactly the distribution sampled from.
- Tensor parallelism: each rank runs the decode on its own heads (its KV cache holds only its kv
  heads) and the LM head's vocab-sharded logits of the last position are all-gathered
  (`LMHead.gather_logits`, `[B, V]` per step; exact, so every tp rank holds bit-identical logits and
  greedy argmax agrees without communication). A sampled token is broadcast from tp rank 0, so the
  ranks never diverge even if sampling kernels were not bitwise reproducible across processes; only tp
  rank 0's generator matters (give every tp rank the same seed anyway, and different dp ranks
  different seeds for different rollouts). Log-probs are computed on every rank for the agreed token.
- Pipeline parallelism (`pipeline_generate`, pp > 1): every stage keeps a KV cache for its own layers.
  Per forward (the prefill, then one per token), the first stage embeds and runs its layers and
  `dist.send`s the hidden states `[B, T, H]` to the next stage over the pp group; each later stage
  `recv`s, runs its layers and sends on; the last stage applies the head and samples (only its
  generator matters). The token and its log-prob are broadcast from the last stage to every pp rank,
  so all stages feed the same token, stop together and return the same output. Stages run one after
  another (no overlap between micro-batches): a simple, exact baseline, not a fast one.
- Expert parallelism (an MoE model at ep > 1): every MoE forward is an all-to-all over the ep group, so the ranks
  of the group, which hold different prompts, must run the same number of forwards although each decodes until
  its own rows stop. `ExpertLockstep` keeps them in step, as expert-parallel inference engines do: before its
  forwards a rank agrees with the group on the most forwards any rank plans (one all-reduce of a scalar), and a
  rank with fewer (or none: its rows all stopped, or it was given no prompts) runs forwards of zero tokens whose
  outputs are dropped. The forwards of the other ranks' tokens do not depend on those empty ones, so a rank's
  outputs are those it gets at ep = 1 (to the rounding of the experts' grouped matmuls over other row counts).
  `generate` agrees once per forward and drains at its end; the rollout engine once per `sync_every` decode
  steps (`megalign.rollout.engine`). `pipeline_generate` is not lock-stepped (refused at ep > 1 by its callers).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megalign.models import CausalLM
from megalign.models.moe import moe_routing
from megalign.parallel.collectives import all_reduce
from megalign.parallel.layout import ParallelLayout


LogitsProcessor = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(logits `[B, V]` fp32, output rows `[B]` int64, tokens generated so far `[B]` int64) -> logits `[B, V]`: edits a
step's logits before temperature and sampling (so the recorded log-probs are of the edited distribution), like
a transformers `LogitsProcessor`; device ops only (the rollout engine's decode step must not sync)."""


@dataclass
class SamplingParams:
    """How to pick each new token and when to stop."""

    max_new_tokens: int
    """Upper bound on generated tokens per row."""
    temperature: float = 1.0
    """Logits are divided by it before sampling; 0 = greedy decoding."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 = off)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest top set with probability >= top_p (1.0 = off)."""
    eos_token_id: Optional[int] = None
    """End-of-sequence token; a row stops after emitting it."""
    stop_token_ids: Sequence[int] = ()
    """More tokens that stop a row like EOS (e.g. chat end-of-turn markers)."""
    pad_token_id: int = 0
    """Fills a row after it stopped (masked out in the returned attention mask)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def stop_ids(self) -> list[int]:
        return ([self.eos_token_id] if self.eos_token_id is not None else []) + list(self.stop_token_ids)


@dataclass
class GenerationOutput:
    """Prompts followed by their continuations, for B rows, P prompt columns and N generated columns."""

    sequences: torch.Tensor
    """`[B, P + N]` token ids: the left-padded prompts, then generated tokens (pad after a row stopped)."""
    attention_mask: torch.Tensor
    """`[B, P + N]` 1 for real tokens (prompt and generated, stop token included), 0 for padding."""
    logprobs: torch.Tensor
    """`[B, N]` fp32 log-probs of the generated tokens under the temperature-scaled distribution (0 on padding)."""


class ExpertLockstep:
    """Keeps the ranks of `model`'s expert-parallel group in step during generation (module doc); free at ep = 1.

    Every rank of the group makes the same sequence of calls: `agree(n)` with the forwards it plans before its next
    agreement (0: it has nothing left), then runs them, then `idle(agreed - n)`; a rank done with its rows calls
    `drain()`, which idles until every rank of the group is done."""

    def __init__(self, model: CausalLM, device: torch.device):
        factory = model.model.factory
        self.model, self.device = model, device
        self.group = factory.ep_group if factory.ep_size > 1 else None

    def agree(self, n: int) -> int:
        """The most forwards any rank of the group plans (`n` itself at ep = 1, no collective)."""
        if self.group is None:
            return n
        return int(all_reduce(torch.tensor([n], dtype=torch.long, device=self.device), self.group, dist.ReduceOp.MAX))

    def idle(self, n: int) -> None:
        """`n` forwards of zero tokens (`[0, 1]` ids, no cache): only the MoE layers' all-to-alls do anything. They run
        in a routing block of their own, so a caller's `moe_routing` record sees the real forwards only."""
        if n <= 0:
            return
        empty = torch.zeros(0, 1, dtype=torch.long, device=self.device)
        with moe_routing(self.model):
            for _ in range(n):
                self.model.model(empty)

    def drain(self) -> None:
        """Idle until no rank of the group plans a forward; at ep = 1 a no-op."""
        while n := self.agree(0):
            self.idle(n)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set to -inf every logit outside the top-k and outside the top-p nucleus (transformers' warpers). `[B, V]`."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - top_p
        drop[..., -1] = False  # always keep the most likely token
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: Optional[torch.Generator],
                agree: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits `[B, V]` -> (tokens `[B]`, log-probs `[B]` fp32; see the module docstring for which distribution).

    `agree` maps sampled tokens to the ones every tensor-parallel rank uses (tp rank 0's, broadcast);
    greedy tokens need no agreement (argmax of identical logits).
    """
    logits = logits.float()
    scaled = logits / params.temperature if params.temperature else logits
    if params.temperature == 0:
        tokens = logits.argmax(-1)
    else:
        probs = filter_logits(scaled, params.top_k, params.top_p).softmax(-1)
        tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]
        if agree is not None:
            tokens = agree(tokens)
    return tokens, scaled.log_softmax(-1).gather(-1, tokens[:, None])[:, 0]


def _check_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Validate left-padded prompts; return the mask as long."""
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(f"input_ids and attention_mask must both be [batch, prompt_len], got "
                         f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}")
    mask = attention_mask.long()
    if not bool(mask[:, -1].all()) or not bool((mask[:, 1:] >= mask[:, :-1]).all()):
        raise ValueError("prompts must be left-padded with a real last token in every row (attention_mask rows "
                         "of the form 0...01...1)")
    return mask


@torch.no_grad()
def generate(model: CausalLM, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams,
             generator: Optional[torch.Generator] = None,
             logits_processor: Optional[LogitsProcessor] = None) -> GenerationOutput:
    """Continue each left-padded prompt of `input_ids` `[B, P]` (mask `attention_mask` `[B, P]`) with `model`.

    Every row must hold at least one real token and be padded on the left only. With a tensor-parallel
    `model`, every tp rank calls it with the same prompts and gets the same output. The simple loop
    (every row decodes until the last one stops, one host sync per token): the reference that the fast
    engine (`megalign.rollout.rollout`) is tested against. At ep > 1 every rank of the ep group calls it (each with
    its own prompts) and the ranks stay in lock step (`ExpertLockstep`); a rank without prompts calls
    `ExpertLockstep(model, device).drain()` instead.
    """
    mask = _check_prompts(input_ids, attention_mask)
    batch, prompt_len = input_ids.shape
    stop_ids = torch.tensor(params.stop_ids, dtype=torch.long, device=input_ids.device)
    cache = model.model.new_kv_cache(batch, prompt_len + params.max_new_tokens)
    lockstep = ExpertLockstep(model, input_ids.device)

    lockstep.agree(1)
    hidden = model.model(input_ids, mask, kv_cache=cache)
    tokens, logprobs = [], []
    finished = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
    rows = torch.arange(batch, device=input_ids.device)
    for step in range(params.max_new_tokens):
        logits = model.lm_head.gather_logits(model.lm_head(hidden[:, -1]))  # [B, V], same on every tp rank
        if logits_processor is not None:
            logits = logits_processor(logits.float(), rows, torch.full_like(rows, step))
        token, logprob = sample_next(logits, params, generator, agree=model.model.factory.broadcast_from_first)
        token = token.masked_fill(finished, params.pad_token_id)
        tokens.append(token)
        logprobs.append(logprob.masked_fill(finished, 0.0))
        mask = torch.cat([mask, (~finished).long()[:, None]], dim=1)
        finished = finished | torch.isin(token, stop_ids)
        if step + 1 == params.max_new_tokens or bool(finished.all()):
            break
        lockstep.agree(1)
        hidden = model.model(token[:, None], mask, kv_cache=cache)
    lockstep.drain()
    return GenerationOutput(torch.cat([input_ids, torch.stack(tokens, 1)], 1), mask, torch.stack(logprobs, 1))


@torch.no_grad()
def pipeline_generate(model: CausalLM, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      params: SamplingParams, layout: ParallelLayout,
                      generator: Optional[torch.Generator] = None) -> GenerationOutput:
    """`generate` with `model` this rank's pipeline stage (`megalign.models.stage_from_pretrained`) over `layout.pp_group`.

    Every rank of the pp group (and of each stage's tp group) calls it with the same prompts and gets the
    same output; only the last stage's `generator` is used. At pp == 1 it is `generate`.
    """
    if layout.pp == 1:
        return generate(model, input_ids, attention_mask, params, generator)
    mask = _check_prompts(input_ids, attention_mask)
    device = layout.device
    input_ids, mask = input_ids.to(device), mask.to(device)
    batch, prompt_len = input_ids.shape
    group, last = layout.pp_group, layout.stage_rank(layout.pp - 1)
    stop_ids = torch.tensor(params.stop_ids, dtype=torch.long, device=device)
    cache = model.model.new_kv_cache(batch, prompt_len + params.max_new_tokens)
    hidden_dtype = next(model.parameters()).dtype

    def stage_forward(ids: torch.Tensor) -> Optional[torch.Tensor]:
        """Run this stage on the step's input (token ids on the first stage, else the received hidden states)."""
        x = ids
        if not layout.is_first_stage:
            x = torch.empty(batch, ids.shape[1], model.config.hidden_size, dtype=hidden_dtype, device=device)
            dist.recv(x, src=layout.prev_stage_rank, group=group)
        hidden = model.model(x, mask, kv_cache=cache)
        if layout.is_last_stage:
            return hidden
        dist.send(hidden.contiguous(), dst=layout.next_stage_rank, group=group)
        return None

    step_ids = input_ids
    tokens, logprobs = [], []
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    for step in range(params.max_new_tokens):
        hidden = stage_forward(step_ids)
        if layout.is_last_stage:
            logits = model.lm_head.gather_logits(model.lm_head(hidden[:, -1]))
            token, logprob = sample_next(logits, params, generator, agree=model.model.factory.broadcast_from_first)
        else:
            token = torch.empty(batch, dtype=torch.long, device=device)
            logprob = torch.empty(batch, dtype=torch.float32, device=device)
        dist.broadcast(token, src=last, group=group)
        dist.broadcast(logprob, src=last, group=group)
        token = token.masked_fill(finished, params.pad_token_id)
        tokens.append(token)
        logprobs.append(logprob.masked_fill(finished, 0.0))
        mask = torch.cat([mask, (~finished).long()[:, None]], dim=1)
        finished = finished | torch.isin(token, stop_ids)
        if step + 1 == params.max_new_tokens or bool(finished.all()):  # the same on every stage
            break
        step_ids = token[:, None]
    return GenerationOutput(torch.cat([input_ids, torch.stack(tokens, 1)], 1), mask, torch.stack(logprobs, 1))
