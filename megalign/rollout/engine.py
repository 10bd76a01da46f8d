"""Fast rollouts of G samples per prompt on the training weights: shared-prompt prefill, continuous batching,
a static decode step for CUDA graphs, and per-row random streams.

`rollout(model, input_ids, attention_mask, group_size, params, seed, config)` returns what
`generate(model, input_ids.repeat_interleave(G, 0), ...)` returns (rows prompt-major, the G samples of
a prompt adjacent; same greedy tokens, same log-prob definition, see `generate`'s module doc), computed
with far less work:

- Shared-prompt prefill: each prompt is prefilled once (its K/V and the logits of its last token); its
  G samples draw their first tokens from those logits and start decoding from copies of its K/V
  (`SlotKVCache.fill`). At G = 8 this removes 7/8 of the prefill. Prompts are prefilled in chunks as
  their samples are admitted, right-padded to the chunk's longest prompt, so only U prompts' K/V
  (not U * G) exist before decoding.
- Continuous batching over a slot cache (`megalign.models.SlotKVCache`): at most `config.max_batch`
  rows decode together, each at its own column (its prompt starts at slot 0, no padding inside a
  row). Every `config.sync_every` decode steps the host reads which rows finished (EOS / stop token /
  `max_new_tokens`): their tokens are harvested, their slots are refilled with pending samples, and
  once nothing is pending the live rows are compacted to the front so the batch shrinks with them.
  That read is the only host sync of the decode: in between, a finished row rides along (its
  outputs go to a trash column) for at most `sync_every - 1` steps.
- Static decode step (`config.static`): the step attends the whole cache (`window = max_len`) and
  batch sizes are rounded up to powers of two, so each step of a given batch size has the same
  shapes and reads no host value: `config.cuda_graphs` captures one CUDA graph per batch size and
  replays it (on CUDA; the same step is what `torch.compile(fullgraph=True)` traces). Eager mode
  instead attends only up to the longest live column and compacts to the exact live count. Both
  default to `auto`: static with CUDA graphs on CUDA, eager on the CPU (`EngineConfig.resolved`).
- Randomness: one counter-based stream per sample, independent of batching. The uniform behind
  sample g of prompt key p at response step s is
  `u = (h >> 40 + 1) / 2**24` in (0, 1] with `h = mix(mix(mix(mix(seed) + (p + 1) c) + (g + 1) c) + (s + 1) c)`,
  `mix` the SplitMix64 finaliser (Steele, Lea & Flood 2014, "Fast splittable pseudorandom number
  generators") and c = 0x9E3779B97F4A7C15 (64-bit wrap-around arithmetic). A token is drawn by
  inverse CDF: the first token whose cumulative (fp32) probability reaches u times the total. So a
  sample depends only on (seed, prompt key, g) and the model, never on `max_batch`, `sync_every`,
  the static mode or the order of the prompts (pass `prompt_keys` to keep keys when reordering).
  Greedy decoding (temperature 0) draws nothing.
- Tensor parallelism: every tp rank runs the same schedule (its decisions come from tokens that are
  identical on all ranks: the logits are all-gathered exactly and the sampled token is broadcast from
  tp rank 0, as in `generate`; the seed is broadcast once), so the ranks stay in lock step.
- Pipeline parallelism: `megalign.rollout.pipeline.pipeline_rollout` runs the same prefill, streams and
  finished-row rule over micro-batches in flight across the stages (its module doc).
- Expert parallelism (an MoE model at ep > 1): the ranks of an ep group roll out their own prompts, and every MoE
  forward is an all-to-all over the group. At each host check (and before the first admission) a rank counts the
  forwards it will run until the next check (its prefill chunks, plus `sync_every` decode steps while it has live
  rows), the group agrees on the largest count (one all-reduce of a scalar), and a rank with fewer runs forwards
  of zero tokens for the difference (`generate.ExpertLockstep`); a rank whose rows all finished drains, idling
  until the group is done. Its samples and log-probs are those of the same call at ep = 1 (the streams above do
  not depend on the schedule). CUDA graphs stay off at ep > 1: the all-to-all's split sizes are read on the host.

Costs (for U prompts, G samples, lengths n_i): prefill sum_p |prompt p| tokens instead of G times
that; decode sum_i n_i row-steps plus at most (sync_every - 1) per sample, instead of U * G * max_i n_i.
"""
from __future__ import annotations

import contextlib
import time
import dataclasses
from collections import deque
from dataclasses import dataclass
from typing import Callable, Literal, Optional, Sequence, Union

import torch

from megalign.config import option
from megalign.models import CausalLM, batch_invariant
from megalign.models.decoder import KVCache, SlotKVCache
from megalign.models.moe import moe_routing

from .generate import ExpertLockstep, GenerationOutput, LogitsProcessor, SamplingParams, _check_prompts, filter_logits
from .routing import RoutingRecorder

_U64 = 2 ** 64
_GOLDEN = 0x9E3779B97F4A7C15 - _U64  # as int64
_MIX1 = 0xBF58476D1CE4E5B9 - _U64
_MIX2 = 0x94D049BB133111EB - _U64


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 as unsigned 64-bit."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64_mix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function on int64 tensors (wrap-around arithmetic, bits read as unsigned)."""
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def _absorb(h: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    return splitmix64_mix(h + (value + 1) * _GOLDEN)


def stream_keys(seed: int, prompt_keys: torch.Tensor, samples: torch.Tensor) -> torch.Tensor:
    """int64 `[B]` key of each row's random stream from (seed, prompt key, sample index); module doc."""
    h = splitmix64_mix(torch.full_like(prompt_keys, seed))
    return _absorb(_absorb(h, prompt_keys), samples)


def stream_uniforms(keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """fp32 `[B]` uniforms in (0, 1] for response step `steps` `[B]` of the streams `keys` `[B]`."""
    h = _absorb(keys, steps)
    return (_shr(h, 40) + 1).float() * 2.0 ** -24


def pick_tokens(logits: torch.Tensor, params: SamplingParams, uniforms: Optional[torch.Tensor],
                agree: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits `[B, V]` -> (tokens `[B]`, log-probs `[B]` fp32), `sample_next` with inverse-CDF draws of `uniforms` `[B]`.

    A token with probability 0 (outside top-k / top-p, or vocabulary padding) is never drawn: the first
    index whose cumulative probability reaches u * total (u > 0) has a positive probability.
    """
    logits = logits.float()
    if params.temperature == 0:
        tokens = logits.argmax(-1)
    else:
        scaled = logits / params.temperature
        cdf = filter_logits(scaled, params.top_k, params.top_p).softmax(-1).cumsum(-1)
        tokens = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None]).clamp(max=cdf.shape[-1] - 1)[:, 0]
        if agree is not None:
            tokens = agree(tokens)
    if batch_invariant.enabled():  # the trainer's recomputation runs the same function (batch_invariant's doc)
        return tokens, batch_invariant.token_logprobs(logits, tokens, params.temperature)
    return tokens, (logits / (params.temperature or 1.0)).log_softmax(-1).gather(-1, tokens[:, None])[:, 0]


@dataclass
class EngineConfig:
    """How the rollout engine batches (module doc); none of it changes which tokens are generated."""

    max_batch: int = option(0, doc="rows decoded together at most (the slot cache's size); 0 = every sample of the call")
    sync_every: int = option(4, doc="decode steps between the host's checks for finished rows (the only host sync)")
    prefill_batch: int = option(16, doc="prompts prefilled together at most")
    static: Union[bool, Literal["auto"]] = option(
        "auto", doc="static-shape decode step: attend the whole cache, batch sizes in powers of two; auto = on CUDA "
                    "(at pp = 1)")
    cuda_graphs: Union[bool, Literal["auto"]] = option(
        "auto", doc="capture the static decode step as CUDA graphs, one per batch size (CUDA only); auto = on CUDA "
                    "with the static step")
    pp_microbatches: int = option(0, doc="micro-batches of rows in flight in `pipeline_rollout` at pp > 1 (at least pp "
                                         "keeps every stage busy); 0 = 2 * pp")

    def __post_init__(self):
        if self.max_batch < 0:
            raise ValueError(f"max_batch must be >= 0 (0 = all samples at once), got {self.max_batch}")
        if self.pp_microbatches < 0:
            raise ValueError(f"pp_microbatches must be >= 0 (0 = 2 * pp), got {self.pp_microbatches}")
        if self.sync_every < 1 or self.prefill_batch < 1:
            raise ValueError(f"sync_every and prefill_batch must be >= 1, got {self.sync_every} and {self.prefill_batch}")
        for name in ("static", "cuda_graphs"):
            if getattr(self, name) not in (True, False, "auto"):
                raise ValueError(f"{name} must be true, false or auto, got {getattr(self, name)!r}")

    def resolved(self, device: torch.device, pipelined: bool = False, tp: int = 1, ep: int = 1) -> "EngineConfig":
        """This config with `auto` decided for `device`: the static step and its CUDA graphs on CUDA, where
        they measured 2707 and 14535 tokens/s against the eager step's 870 (H200, a 0.5B model, batch 64,
        BENCHMARKS.md), off on the CPU (where the eager step's shorter window is the faster one) and in
        `pipeline_rollout` (`pipelined`), whose step is eager. Graphs stay off at tp > 1 unless asked
        for: capturing the tp collectives has not yet run on GPUs; and at ep > 1 (`rollout` refuses them there)."""
        static = (device.type == "cuda" and not pipelined) if self.static == "auto" else self.static
        graphs = (device.type == "cuda" and static and tp == 1 and ep == 1) if self.cuda_graphs == "auto" \
            else self.cuda_graphs
        return dataclasses.replace(self, static=static, cuda_graphs=graphs)


@dataclass
class RolloutStats:
    """What one `rollout` did: prefill and decode tokens and seconds (decode = everything after the prefills)."""

    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    decode_steps: int = 0
    recv_wait_s: float = 0.0
    """Seconds this rank waited on pipeline receives (`pipeline_rollout` at pp > 1; 0 otherwise): over
    prefill_s + decode_s it is the stage's bubble fraction."""

    def __add__(self, other: "RolloutStats") -> "RolloutStats":
        """Totals over several rollouts (e.g. a step's sampling rounds)."""
        return RolloutStats(*(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)))

    def metrics(self) -> dict[str, float]:
        """Throughputs (`tokens_per_s/prefill`: prompt tokens per prefill second, `tokens_per_s/decode`: generated
        tokens per decode second) and counts for a trainer's metrics."""
        return {"tokens_per_s/prefill": self.prefill_tokens / max(self.prefill_s, 1e-9),
                "tokens_per_s/decode": self.decode_tokens / max(self.decode_s, 1e-9),
                "rollout/prefill_tokens": self.prefill_tokens, "rollout/decode_steps": self.decode_steps}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Slots:
    """Per-row decode state for `slots` rows (device tensors, written in place) and the harvested outputs."""

    def __init__(self, slots: int, n_samples: int, max_new: int, device: torch.device):
        long = dict(dtype=torch.long, device=device)
        self.tokens = torch.zeros(slots, **long)  # last token, the next step's input
        self.positions = torch.zeros(slots, **long)  # its position id
        self.counts = torch.zeros(slots, **long)  # tokens generated so far
        self.done = torch.ones(slots, dtype=torch.bool, device=device)
        self.sample = torch.zeros(slots, **long)  # output row
        self.keys = torch.zeros(slots, **long)  # random stream
        self.hist_tokens = torch.zeros(slots, max_new + 1, **long)  # column max_new: trash of finished rows
        self.hist_logp = torch.zeros(slots, max_new + 1, dtype=torch.float32, device=device)
        # output row n_samples is a trash row: a harvested (or bucket-padding) slot points there, so a slot
        # harvested again at a later check never overwrites a real output
        self.out_tokens = torch.zeros(n_samples + 1, max_new, **long)
        self.out_logp = torch.zeros(n_samples + 1, max_new, dtype=torch.float32, device=device)
        self.out_lengths = torch.zeros(n_samples + 1, **long)
        self.max_new, self.trash = max_new, n_samples

    def record(self, rows: torch.Tensor, tokens: torch.Tensor, logp: torch.Tensor, stop_ids: torch.Tensor) -> None:
        """Append `tokens` / `logp` `[m]` to rows `rows` `[m]` that are live; finished rows write to the trash column."""
        done = self.done[rows]
        counts = self.counts[rows]
        cols = counts.masked_fill(done, self.max_new)
        self.hist_tokens[rows, cols] = tokens
        self.hist_logp[rows, cols] = logp
        counts = counts + (~done).long()
        self.counts[rows] = counts
        self.done[rows] = done | torch.isin(tokens, stop_ids) | (counts >= self.max_new)
        self.tokens[rows] = tokens
        self.positions[rows] = self.positions[rows] + 1

    def harvest(self, rows: torch.Tensor) -> None:
        """Copy the finished rows `rows` to their output rows; the rows then point at the trash row."""
        samples = self.sample[rows]
        self.out_tokens[samples] = self.hist_tokens[rows, :self.max_new]
        self.out_logp[samples] = self.hist_logp[rows, :self.max_new]
        self.out_lengths[samples] = self.counts[rows]
        self.sample[rows] = self.trash

    def compact(self, keep: torch.Tensor) -> None:
        n = keep.numel()
        for tensor in (self.tokens, self.positions, self.counts, self.done, self.sample, self.keys,
                       self.hist_tokens, self.hist_logp):
            tensor[:n] = tensor[keep]


def right_aligned(input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Left-padded prompts `[U, P]` with `lengths` `[U]` real tokens -> row p's tokens at columns [0, lengths[p])."""
    width = input_ids.shape[1]
    index = (torch.arange(width, device=input_ids.device)[None] + (width - lengths)[:, None]).clamp(max=width - 1)
    return input_ids.gather(1, index)


def assemble_output(input_ids: torch.Tensor, mask: torch.Tensor, group: int, tokens: torch.Tensor,
                    logp: torch.Tensor, lengths: torch.Tensor, pad_token_id: int) -> GenerationOutput:
    """The `generate` layout from harvested responses (`tokens` / `logp` `[U G, max_new]`, `lengths` `[U G]`):
    left-padded prompts `[U, P]` (each repeated G times), then N = longest response columns."""
    n = int(lengths.max())
    response = torch.arange(n, device=tokens.device)[None] < lengths[:, None]
    tokens = tokens[:, :n].masked_fill(~response, pad_token_id)
    logp = logp[:, :n].masked_fill(~response, 0.0)
    ids, mask = (x.repeat_interleave(group, 0) for x in (input_ids, mask))
    return GenerationOutput(torch.cat([ids, tokens], 1), torch.cat([mask, response.long()], 1), logp)


def _take(pending: deque, n: int) -> list[int]:
    """The next (at most) `n` pending samples, removed from `pending`."""
    return [pending.popleft() for _ in range(min(n, len(pending)))]


def _bucket(n: int, cap: int, static: bool) -> int:
    """Decode batch for n live rows: n, or the next power of two (at most cap) in static mode."""
    return min(cap, 1 << (n - 1).bit_length()) if static else n


class _Rollout:
    """One `rollout` call: the prompts, the slot cache, the schedule (module doc)."""

    def __init__(self, model: CausalLM, input_ids: torch.Tensor, mask: torch.Tensor, group_size: int,
                 params: SamplingParams, seed: int, config: EngineConfig, prompt_keys: torch.Tensor,
                 logits_processor: Optional[LogitsProcessor], recorder: Optional[RoutingRecorder] = None):
        factory = model.model.factory
        config = config.resolved(input_ids.device, tp=factory.tp_size, ep=factory.ep_size)  # no-op for `rollout`'s
        self.model, self.params, self.config, self.processor = model, params, config, logits_processor
        self.device = input_ids.device
        self.group = group_size
        self.input_ids, self.mask = input_ids, mask
        self.lengths = mask.sum(-1)
        lengths = self.lengths.tolist()
        self.prompts = right_aligned(input_ids, self.lengths)
        self.prompt_lengths = lengths
        self.n_samples = len(lengths) * group_size
        self.slots = min(config.max_batch or self.n_samples, self.n_samples)
        self.max_len = max(lengths) + params.max_new_tokens
        self.cache: SlotKVCache = model.model.new_kv_cache(self.slots, self.max_len, slotted=True)
        self.state = _Slots(self.slots, self.n_samples, params.max_new_tokens, self.device)
        self.stop_ids = torch.tensor(params.stop_ids, dtype=torch.long, device=self.device)
        self.seed = seed
        self.prompt_keys = prompt_keys
        self.agree = model.model.factory.broadcast_from_first
        self.stats = RolloutStats()
        self.prefilled: dict[int, tuple[KVCache, int, torch.Tensor]] = {}  # prompt -> (cache, row, last logits)
        self.graphs: dict[int, "torch.cuda.CUDAGraph"] = {}
        self.recorder = recorder  # MoE routing per sample (`megalign.rollout.routing`), when asked for
        self.lockstep = ExpertLockstep(model, self.device)  # the ep group's forwards in step (module doc)

    # ----- sampling

    def _pick(self, logits: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and log-probs for the slot rows `rows` `[m]` from their logits `[m, V]`."""
        state = self.state
        if self.processor is not None:  # rows riding along finished point at the trash row: clamp for the processor
            logits = self.processor(logits.float(), state.sample[rows].clamp(max=self.n_samples - 1), state.counts[rows])
        uniforms = None if self.params.temperature == 0 else stream_uniforms(state.keys[rows], state.counts[rows])
        return pick_tokens(logits, self.params, uniforms, self.agree)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head.gather_logits(self.model.lm_head(hidden))

    # ----- prefill and admission

    def _prefill(self, prompts: list[int]) -> None:
        """Prefill `prompts` (indices) in chunks; keep each one's K/V and last-token logits until its G samples joined."""
        for start in range(0, len(prompts), self.config.prefill_batch):
            chunk = prompts[start:start + self.config.prefill_batch]
            _sync(self.device)
            t0 = time.perf_counter()
            index = torch.tensor(chunk, device=self.device)
            lengths = self.lengths[index]
            width = max(self.prompt_lengths[p] for p in chunk)
            mask = (torch.arange(width, device=self.device)[None] < lengths[:, None]).long()
            cache = self.model.model.new_kv_cache(len(chunk), width)
            hidden = self.model.model(self.prompts[index, :width], mask, kv_cache=cache)
            if self.recorder is not None:
                self.recorder.prefill(index, width)
            last = self._logits(hidden.gather(1, (lengths - 1)[:, None, None].expand(-1, 1, hidden.shape[-1]))[:, 0])
            for row, p in enumerate(chunk):
                self.prefilled[p] = (cache, row, last[row])
            _sync(self.device)
            self.stats.prefill_s += time.perf_counter() - t0
            self.stats.prefill_tokens += sum(self.prompt_lengths[p] for p in chunk)

    def _unprefilled(self, take: list[int]) -> list[int]:
        """The prompts of samples `take` whose K/V is not held yet (sorted): what admitting them prefills."""
        return sorted({s // self.group for s in take} - set(self.prefilled))

    def _prefill_forwards(self, take: list[int]) -> int:
        """Forwards (prefill chunks) that admitting samples `take` runs."""
        return -(-len(self._unprefilled(take)) // self.config.prefill_batch)

    def _admit(self, free: list[int], take: list[int]) -> None:
        """Start samples `take` (taken from the pending ones) in the free slot rows `free`: copy their prompt's K/V,
        draw their first token."""
        rows_list = free[:len(take)]
        prompts = [s // self.group for s in take]
        self._prefill(self._unprefilled(take))
        rows = torch.tensor(rows_list, device=self.device)
        samples = torch.tensor(take, device=self.device)
        state = self.state
        state.sample[rows] = samples
        state.keys[rows] = stream_keys(self.seed, self.prompt_keys[samples // self.group], samples % self.group)
        state.counts[rows] = 0
        state.done[rows] = False
        state.positions[rows] = self.lengths[samples // self.group] - 1
        for cache in {id(self.prefilled[p][0]): self.prefilled[p][0] for p in prompts}.values():
            mine = [i for i, p in enumerate(prompts) if self.prefilled[p][0] is cache]
            src = torch.tensor([self.prefilled[prompts[i]][1] for i in mine], device=self.device)
            width = cache.length
            lengths = self.lengths[samples[mine] // self.group]
            valid = torch.arange(width, device=self.device)[None] < lengths[:, None]
            self.cache.fill(rows[mine], cache, src, valid)
        logits = torch.stack([self.prefilled[p][2] for p in prompts])
        tokens, logp = self._pick(logits, rows)
        state.record(rows, tokens, logp, self.stop_ids)
        for p in set(prompts):  # a prompt's K/V is dropped once its last sample joined
            if p * self.group + self.group - 1 in take:
                del self.prefilled[p]

    # ----- decode

    def _step(self, batch: int) -> None:
        """One decode step of rows `[0, batch)`: no host value read, fixed shapes for a fixed batch and window."""
        state = self.state
        rows = torch.arange(batch, device=self.device)
        hidden = self.model.model(state.tokens[:batch, None], position_ids=state.positions[:batch, None],
                                  kv_cache=self.cache)
        if self.recorder is not None:
            self.recorder.decode(state.sample[:batch], state.counts[:batch], state.done[:batch])
        tokens, logp = self._pick(self._logits(hidden[:, -1]), rows)
        state.record(rows, tokens, logp, self.stop_ids)

    def _graph_step(self, batch: int) -> None:
        """`_step` replayed from a CUDA graph. The first step of a batch size runs eagerly on a side stream (the
        warm-up capture needs), then the graph is captured; capture records kernels without running them."""
        if batch in self.graphs:
            self.graphs[batch].replay()
            return
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._step(batch)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step(batch)
        self.graphs[batch] = graph

    def run(self) -> GenerationOutput:
        cfg, state = self.config, self.state
        pending = deque(range(self.n_samples))
        batch = self.slots
        t0 = time.perf_counter()
        take = _take(pending, self.slots)
        forwards = self._prefill_forwards(take)
        idle = self.lockstep.agree(forwards) - forwards
        self._admit(list(range(self.slots)), take)
        self.lockstep.idle(idle)
        host_cols = self.cache.columns.tolist()  # host copy of each row's column: the eager window, no sync
        while True:
            done = state.done[:batch].tolist()  # the host sync, once per sync_every steps
            finished = [r for r, d in enumerate(done) if d]
            if finished:
                state.harvest(torch.tensor(finished, device=self.device))
            prefills = 0
            if pending and finished:
                take = _take(pending, len(finished))
                prefills = self._prefill_forwards(take)
                idle = self.lockstep.agree(prefills + cfg.sync_every) - prefills - cfg.sync_every
                self._admit(finished, take)
                cols = self.cache.columns[torch.tensor(finished, device=self.device)].tolist()
                for r, c in zip(finished, cols):
                    host_cols[r] = c
            else:
                live = [r for r, d in enumerate(done) if not d]
                if not live:
                    self.lockstep.drain()
                    break
                idle = self.lockstep.agree(cfg.sync_every) - cfg.sync_every
                new_batch = _bucket(len(live), self.slots, cfg.static)
                if new_batch < batch:
                    keep = torch.tensor(live, device=self.device)
                    self.cache.compact(keep)
                    state.compact(keep)
                    host_cols[:len(live)] = [host_cols[r] for r in live]
                    state.done[len(live):new_batch] = True  # bucket padding rows ride along finished
                    state.sample[len(live):new_batch] = state.trash
                    batch = new_batch
            for _ in range(cfg.sync_every):
                self.cache.window = self.max_len if cfg.static else min(self.max_len, max(host_cols[:batch]) + 1)
                (self._graph_step if cfg.cuda_graphs else self._step)(batch)
                host_cols[:batch] = [c + 1 for c in host_cols[:batch]]
                self.stats.decode_steps += 1
            self.lockstep.idle(idle)
        _sync(self.device)
        self.stats.decode_s = time.perf_counter() - t0 - self.stats.prefill_s
        self.stats.decode_tokens = int(state.out_lengths[:self.n_samples].sum())
        return self._output()

    def _output(self) -> GenerationOutput:
        state, n = self.state, self.n_samples
        return assemble_output(self.input_ids, self.mask, self.group, state.out_tokens[:n], state.out_logp[:n],
                               state.out_lengths[:n], self.params.pad_token_id)


@torch.no_grad()
def rollout(model: CausalLM, input_ids: torch.Tensor, attention_mask: torch.Tensor, group_size: int,
            params: SamplingParams, seed: int = 0, config: Optional[EngineConfig] = None,
            prompt_keys: Optional[Sequence[int]] = None,
            logits_processor: Optional[LogitsProcessor] = None,
            routing: Optional[RoutingRecorder] = None) -> tuple[GenerationOutput, RolloutStats]:
    """G = `group_size` continuations of each left-padded prompt of `input_ids` `[U, P]` (`attention_mask` `[U, P]`).

    Returns (output with U * G rows, prompt p's samples at rows [p G, (p + 1) G): `[U G, P + N]` sequences
    and mask, `[U G, N]` log-probs, as `generate` gives for the repeated prompts; and the prefill / decode
    statistics). `seed` (an int; every tp rank must pass the same, tp rank 0's is used) and the prompt
    keys (default 0..U-1) fix every sample (module doc). `logits_processor` edits each step's logits. `routing`: an
    MoE model's experts are recorded per sample and position into it (`routing.sequences` `[U G, P + N, L, k]`).
    At ep > 1 every rank of the ep group calls it, each with its own prompts and parameters (module doc).
    """
    factory = model.model.factory
    config = (config or EngineConfig()).resolved(input_ids.device, tp=factory.tp_size, ep=factory.ep_size)
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if config.cuda_graphs and (input_ids.device.type != "cuda" or not config.static):
        raise ValueError("config.cuda_graphs needs CUDA tensors and config.static=True")
    if config.cuda_graphs and factory.ep_size > 1:
        raise ValueError(f"config.cuda_graphs at ep={factory.ep_size}: the experts' all-to-all reads its split sizes "
                         f"on the host, which a CUDA graph cannot capture; set cuda_graphs to false or auto")
    mask = _check_prompts(input_ids, attention_mask)
    keys = torch.arange(input_ids.shape[0]) if prompt_keys is None else torch.as_tensor(list(prompt_keys))
    if keys.shape != (input_ids.shape[0],):
        raise ValueError(f"prompt_keys must hold one key per prompt ({input_ids.shape[0]}), got {tuple(keys.shape)}")
    seed_t = model.model.factory.broadcast_from_first(torch.tensor([seed], dtype=torch.long, device=input_ids.device))
    state = _Rollout(model, input_ids, mask, group_size, params, int(seed_t.item()), config,
                     keys.to(device=input_ids.device, dtype=torch.long), logits_processor, routing)
    with moe_routing(model, record=True) if routing is not None else contextlib.nullcontext() as record:
        if routing is not None:
            routing.begin(record, input_ids.shape[0], input_ids.shape[1], state.n_samples, params.max_new_tokens,
                          input_ids.device)
        out = state.run()
    if routing is not None:
        routing.assemble(mask, group_size, out.logprobs.shape[1])
    return out, state.stats
