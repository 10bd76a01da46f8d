"""`rollout` at pp > 1: micro-batches of rows in flight across the pipeline stages, so the stages decode concurrently.

`pipeline_rollout(model, input_ids, attention_mask, group_size, params, seed, layout, config)` takes
`rollout`'s arguments plus the layout (after the seed), with `model` this rank's stage (`megalign.models.stage_from_pretrained`),
and returns what `rollout` returns on the unsplit model (same tokens and log-probs for the same seed,
up to fp32 rounding of the split forward), on every rank of the pp group.

Schedule. The U * G samples (prompt-major) are split into m = `config.pp_microbatches` (default 2 pp,
at most U G) contiguous micro-batches of near-equal size. m = pp is the least that keeps every stage
busy if the tokens' trip back took no time; 2 pp leaves the first stage a micro-batch of slack for it
and measured faster (BENCHMARKS.md, "Pipeline rollout"), though each extra micro-batch adds forwards
(a decode step over few rows costs nearly as much as over many: the weights are read once per forward). Every stage keeps one slot KV cache
(`SlotKVCache`) per micro-batch for its own layers and visits the live micro-batches round-robin:
round 0 prefills micro-batch 0, 1, ..., m-1, every later round decodes one token of each. A visit on
stage s runs its layers on what stage s-1 sent for that micro-batch (token ids on the first stage) and
`dist.isend`s the hidden states `[rows, T, H]` to stage s+1 over `layout.pp_group` without waiting; the
last stage applies the head, samples, and `isend`s the micro-batch's tokens `[rows]` point-to-point to
every other stage (the first stage feeds them in at its next visit of that micro-batch, the others need
them to drop finished rows). So while stage s works on micro-batch j, stage s+1 works on j-1: stage s
next needs micro-batch j's tokens m visits later, and the last stage produced them pp - 1 - s visits
after stage s sent j on, so with m >= pp no stage waits after the fill (the pipeline's fill and
drain, and the tail where fewer than pp micro-batches are still live, remain). Messages between two
ranks go in one direction per kind and are matched in order (hidden states tag 0, tokens tag 1).
A stage posts the receive of a micro-batch's next tokens right after sending it on and waits for it
at its next visit. Tested on gloo (CPU) only: NCCL runs all point-to-point ops of one communicator
on one stream, so there the next hidden-state send queues behind that pending token receive and the
overlap would be lost; giving the tokens their own process group would avoid it (not built).

Kept from `rollout` (its module doc): the per-sample counter-based streams (`stream_keys`,
`stream_uniforms`, inverse-CDF `pick_tokens`), so a sample depends only on (seed, prompt key, g) and
not on m or pp; the shared-prompt prefill within a micro-batch (its prompts are prefilled once, right
padded, in chunks of `config.prefill_batch`, and copied into the G rows; a prompt whose samples straddle
two micro-batches is prefilled once in each, at most m - 1 extra prefills); finished-row compaction
(after each token every stage drops the rows that hit EOS / a stop token / `max_new_tokens` from the
micro-batch's cache, and a micro-batch whose rows all finished leaves the rotation); tensor
parallelism inside a stage (each tp rank talks to the same tp rank of the next stage, the sampled
token is agreed from tp rank 0, so tp ranks stay in lock step). Not kept: continuous batching
(every sample starts in its micro-batch; `config.max_batch` must be 0), the `sync_every` check and
the static / CUDA-graph step: the pipeline's host must know each message's shape, so the finished
rows are read every token (one host read per micro-batch step, where the transfer already syncs).

Log-probs exist only on the last stage during decoding; one broadcast over the pp group at the end
gives every stage the full output. `RolloutStats`: prefill_s = this stage's round 0, decode_s = the
rest, recv_wait_s = time blocked in receives (its bubble fraction is recv_wait_s / (prefill_s + decode_s)).
"""
from __future__ import annotations

import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megalign.models import CausalLM
from megalign.models.decoder import KVCache
from megalign.parallel.layout import ParallelLayout

from .engine import (EngineConfig, RolloutStats, _Slots, _sync, assemble_output, pick_tokens, right_aligned,
                     rollout, stream_keys, stream_uniforms)
from .generate import GenerationOutput, LogitsProcessor, SamplingParams, _check_prompts

_HIDDEN, _TOKENS = 0, 1  # message tags


class _MicroBatch:
    """Samples `[start, end)` on this stage: their slot cache, decode state (rows `[0, live)` decode) and pending receive."""

    def __init__(self, model: CausalLM, start: int, end: int, max_len: int, max_new: int, device: torch.device):
        self.start, self.end, self.live = start, end, end - start
        self.cache = model.model.new_kv_cache(self.live, max_len, slotted=True)
        self.state = _Slots(self.live, self.live, max_new, device)
        self.tokens_in: Optional[tuple[dist.Work, torch.Tensor]] = None  # the last stage's next tokens (other stages)


class _PipelineRollout:
    """One `pipeline_rollout` call on one rank: the micro-batches, the messages and the statistics."""

    def __init__(self, model: CausalLM, input_ids: torch.Tensor, mask: torch.Tensor, group_size: int,
                 params: SamplingParams, layout: ParallelLayout, seed: int, config: EngineConfig,
                 prompt_keys: torch.Tensor, logits_processor: Optional[LogitsProcessor]):
        self.model, self.params, self.layout, self.config = model, params, layout, config
        self.processor, self.seed, self.prompt_keys, self.group = logits_processor, seed, prompt_keys, group_size
        self.device = input_ids.device
        self.input_ids, self.mask = input_ids, mask
        self.lengths = mask.sum(-1)
        self.prompt_lengths = self.lengths.tolist()
        self.prompts = right_aligned(input_ids, self.lengths)
        self.n_samples = input_ids.shape[0] * group_size
        self.max_len = max(self.prompt_lengths) + params.max_new_tokens
        self.stop_ids = torch.tensor(params.stop_ids, dtype=torch.long, device=self.device)
        self.hidden_size = model.config.hidden_size
        self.hidden_dtype = next(model.parameters()).dtype
        self.agree = model.model.factory.broadcast_from_first
        m = min(config.pp_microbatches or 2 * layout.pp, self.n_samples)
        bounds = [i * self.n_samples // m for i in range(m + 1)]
        self.micro = [_MicroBatch(model, a, b, self.max_len, params.max_new_tokens, self.device)
                      for a, b in zip(bounds[:-1], bounds[1:])]
        self.others = [layout.stage_rank(s) for s in range(layout.pp - 1)]  # the last stage's token receivers
        self.sends: list[dist.Work] = []
        self.stats = RolloutStats()

    # ----- messages

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int) -> tuple[dist.Work, torch.Tensor]:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        return dist.irecv(buf, src=src, group=self.layout.pp_group, tag=tag), buf

    def _wait(self, pending: tuple[dist.Work, torch.Tensor]) -> torch.Tensor:
        t0 = time.perf_counter()
        pending[0].wait()
        self.stats.recv_wait_s += time.perf_counter() - t0
        return pending[1]

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self.sends = [w for w in self.sends if not w.is_completed()]
        self.sends.append(dist.isend(tensor.contiguous(), dst=dst, group=self.layout.pp_group, tag=tag))

    def _stage(self, first_input: torch.Tensor, **forward) -> torch.Tensor:
        """This stage's layers on `first_input` (token ids `[B, T]`) on the first stage, else on the previous stage's
        hidden states `[B, T, H]`; sent on unless this is the last stage. Returns this stage's hidden states."""
        layout = self.layout
        x = first_input
        if not layout.is_first_stage:
            shape = (*first_input.shape, self.hidden_size)
            x = self._wait(self._recv(shape, self.hidden_dtype, layout.prev_stage_rank, _HIDDEN))
        hidden = self.model.model(x, **forward)
        if not layout.is_last_stage:
            self._send(hidden, layout.next_stage_rank, _HIDDEN)
        return hidden

    # ----- sampling and the finished rows

    def _pick(self, mb: _MicroBatch, logits: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Last stage: tokens and log-probs of rows `rows` `[r]` of `mb` from their logits `[r, V]` (as `rollout`)."""
        state = mb.state
        if self.processor is not None:
            logits = self.processor(logits.float(), mb.start + state.sample[rows], state.counts[rows])
        uniforms = None if self.params.temperature == 0 else stream_uniforms(state.keys[rows], state.counts[rows])
        return pick_tokens(logits, self.params, uniforms, self.agree)

    def _tokens(self, mb: _MicroBatch, logits: Optional[torch.Tensor]) -> None:
        """Record `mb`'s next tokens, then harvest and drop its finished rows on every stage alike. The last stage
        samples them from `logits` `[live, V]` and sends them to every other stage; the others wait for them."""
        rows = torch.arange(mb.live, device=self.device)
        if self.layout.is_last_stage:
            tokens, logp = self._pick(mb, logits, rows)
            for dst in self.others:
                self._send(tokens, dst, _TOKENS)
        else:
            tokens, logp = self._wait(mb.tokens_in), torch.zeros(mb.live, device=self.device)
            mb.tokens_in = None
        mb.state.record(rows, tokens, logp, self.stop_ids)
        done = mb.state.done[:mb.live].tolist()
        finished = [r for r, d in enumerate(done) if d]
        if finished:
            mb.state.harvest(torch.tensor(finished, device=self.device))
            keep = torch.tensor([r for r, d in enumerate(done) if not d], dtype=torch.long, device=self.device)
            mb.cache.compact(keep)
            mb.state.compact(keep)
            mb.live = keep.numel()

    # ----- the two kinds of visit

    def _prefill(self, mb: _MicroBatch) -> Optional[torch.Tensor]:
        """Round 0 of `mb`: prefill its prompts once each (chunks of `prefill_batch`, right padded) and copy each
        prompt's K/V into its samples' rows; the last stage's logits `[rows, V]` of each row's prompt's last token."""
        samples = torch.arange(mb.start, mb.end, device=self.device)
        prompts = samples // self.group
        first, last_prompt = mb.start // self.group, (mb.end - 1) // self.group
        last_logits = []
        for lo in range(first, last_prompt + 1, self.config.prefill_batch):
            chunk = torch.arange(lo, min(lo + self.config.prefill_batch, last_prompt + 1), device=self.device)
            lengths = self.lengths[chunk]
            width = max(self.prompt_lengths[lo:lo + chunk.numel()])
            mask = (torch.arange(width, device=self.device)[None] < lengths[:, None]).long()
            cache: KVCache = self.model.model.new_kv_cache(chunk.numel(), width)
            hidden = self._stage(self.prompts[chunk, :width], attention_mask=mask, kv_cache=cache)
            mine = ((prompts >= lo) & (prompts < lo + chunk.numel())).nonzero()[:, 0]
            valid = torch.arange(width, device=self.device)[None] < self.lengths[prompts[mine]][:, None]
            mb.cache.fill(mine, cache, prompts[mine] - lo, valid)
            if self.layout.is_last_stage:
                at_last = hidden.gather(1, (lengths - 1)[:, None, None].expand(-1, 1, hidden.shape[-1]))[:, 0]
                last_logits.append(self.model.lm_head.gather_logits(self.model.lm_head(at_last)))
            self.stats.prefill_tokens += sum(self.prompt_lengths[lo:lo + chunk.numel()])
        state = mb.state
        state.sample[:] = torch.arange(mb.live, device=self.device)
        state.keys[:] = stream_keys(self.seed, self.prompt_keys[prompts], samples % self.group)
        state.done.zero_()
        state.positions[:] = self.lengths[prompts] - 1
        return torch.cat(last_logits)[prompts - first] if self.layout.is_last_stage else None

    def _decode(self, mb: _MicroBatch) -> Optional[torch.Tensor]:
        """One token of `mb`'s live rows; the last stage's logits `[live, V]`."""
        state = mb.state
        mb.cache.window = min(self.max_len, int(mb.cache.columns[:mb.live].max()) + 1)
        hidden = self._stage(state.tokens[:mb.live, None], position_ids=state.positions[:mb.live, None],
                             kv_cache=mb.cache)
        return self.model.lm_head.gather_logits(self.model.lm_head(hidden[:, -1])) if self.layout.is_last_stage else None

    def _visit(self, mb: _MicroBatch, prefill: bool) -> None:
        """Stage's turn on `mb`: take in its previous tokens (other stages), run the prefill or one decode step if
        rows are live, then sample and send the tokens (last stage) or post their receive (other stages)."""
        last = self.layout.is_last_stage
        if not last and not prefill:
            self._tokens(mb, None)
        if not mb.live:
            return
        logits = self._prefill(mb) if prefill else self._decode(mb)
        self.stats.decode_steps += not prefill
        if last:
            self._tokens(mb, logits)
        else:
            mb.tokens_in = self._recv((mb.live,), torch.long, self.layout.stage_rank(self.layout.pp - 1), _TOKENS)

    def run(self) -> GenerationOutput:
        t0 = time.perf_counter()
        for mb in self.micro:
            self._visit(mb, prefill=True)
        _sync(self.device)
        self.stats.prefill_s = time.perf_counter() - t0
        while any(mb.live for mb in self.micro):
            for mb in self.micro:
                if mb.live:
                    self._visit(mb, prefill=False)
        for work in self.sends:
            work.wait()
        _sync(self.device)
        self.stats.decode_s = time.perf_counter() - t0 - self.stats.prefill_s
        tokens, logp, lengths = (torch.cat([getattr(mb.state, name)[:mb.end - mb.start] for mb in self.micro])
                                 for name in ("out_tokens", "out_logp", "out_lengths"))
        dist.broadcast(logp, src=self.layout.stage_rank(self.layout.pp - 1), group=self.layout.pp_group)
        self.stats.decode_tokens = int(lengths.sum())
        return assemble_output(self.input_ids, self.mask, self.group, tokens, logp, lengths, self.params.pad_token_id)


@torch.no_grad()
def pipeline_rollout(model: CausalLM, input_ids: torch.Tensor, attention_mask: torch.Tensor, group_size: int,
                     params: SamplingParams, seed: int, layout: ParallelLayout,
                     config: Optional[EngineConfig] = None, prompt_keys: Optional[Sequence[int]] = None,
                     logits_processor: Optional[LogitsProcessor] = None) -> tuple[GenerationOutput, RolloutStats]:
    """`rollout` with `model` this rank's pipeline stage over `layout.pp_group` (module doc); at pp == 1 it is `rollout`.

    Every rank of the pp group (and of each stage's tp group) calls it with the same prompts `[U, P]`, seed
    and prompt keys, and gets the same `[U G, P + N]` output; only the last stage's seed is used.
    """
    config = config or EngineConfig()
    if layout.pp == 1:
        return rollout(model, input_ids, attention_mask, group_size, params, seed, config, prompt_keys,
                       logits_processor)
    config = config.resolved(layout.device, pipelined=True)
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if config.max_batch or config.static or config.cuda_graphs:
        raise ValueError("pipeline_rollout starts every sample at once in its micro-batch with an eager step: "
                         f"config.max_batch must be 0 and config.static / cuda_graphs False, got max_batch="
                         f"{config.max_batch}, static={config.static}, cuda_graphs={config.cuda_graphs}")
    mask = _check_prompts(input_ids, attention_mask)
    device = layout.device
    keys = torch.arange(input_ids.shape[0]) if prompt_keys is None else torch.as_tensor(list(prompt_keys))
    if keys.shape != (input_ids.shape[0],):
        raise ValueError(f"prompt_keys must hold one key per prompt ({input_ids.shape[0]}), got {tuple(keys.shape)}")
    seed_t = model.model.factory.broadcast_from_first(torch.tensor([seed], dtype=torch.long, device=device))
    run = _PipelineRollout(model, input_ids.to(device), mask.to(device), group_size, params, layout,
                           int(seed_t.item()), config, keys.to(device=device, dtype=torch.long), logits_processor)
    out = run.run()
    return out, run.stats
