"""The online trainers' actor update: peak memory of the fused LM head vs the eager head, and tokens/s of
packed vs padded rows on a long-tail length distribution.

Both parts run the trainers' update code path on a synthetic `RolloutBatch`-shaped batch: the actor's
`Actor.logprobs_with_grad` (one trunk forward, the head, log-probs and entropy), GRPO's clipped
`policy_loss`, `aggregate_loss` over the token count (token-mean, as `OnlineTrainer.train_role`), the
backward and `Actor.optimizer_step` (dp all-reduce, clipping, AdamW), on one gloo rank at pp = 1.

memory  V = 151936 (Qwen2's vocabulary), hidden 1024, 2 layers, tied embeddings, fp32; 4 responses x
        1024 tokens = 4096 response tokens after 16 prompt tokens, in one micro-batch of 4 rows, two of 2
        rows and four of 1 row. Peers (`MemoryPeer`):
          head       fused: megalign today, `head_logprobs` = `LMHead.token_logprob`
                     (fused_linear_token_logprob) on the response tokens only, in chunks of
                     `actor.head_chunk_tokens` tokens (the default 1024, and 256); eager: the head before
                     the fused path, `model.lm_head(hidden)` -> [B, R, V] logits ->
                     `vocab_parallel_token_logprob` (patched into `megalign.roles.actor.head_logprobs`);
          embedding  into .grad: today's `embedding_into_grad`; dense: the embedding's dense backward
                     before this change (`F.embedding` patched in), which builds a second [V, H]
                     gradient for autograd to add into the tied head's;
          AdamW      foreach (the trainers' default `optim.fused=false`) or fused (`optim.fused=true`).
          activation checkpointing  off, or on (`actor.activation_checkpointing=true`: each decoder
                     layer keeps only its input and is recomputed in the backward), for the fused and
                     the eager head at one micro-batch.
        Each runs in a fresh process (`harness.in_fresh_process`, peak RSS): weights and the AdamW state
        (created by a zero-gradient step first) are inputs; the peak beyond them is read after the
        forward + backward and again after the optimizer step (the whole update). All include the
        parameter gradients (the tied [V, H] head / embedding gradient, 594 MiB, is needed by every
        peer). Target: fused <= 25% of the eager-head trainer path (eager, one micro-batch).
packing hidden 256, 4 layers, V = 4096, fp32; 32 responses of at most 512 tokens with lengths drawn from
        512 * Beta(1, 3) (mean 128 = a quarter of the max), prompts of 8..32 tokens, micro-batches of 8
        rows; `rollout.pack` on (packs of one padded row, 544 tokens) vs off (padded [8, 544] rows).
        Median seconds of the whole update (interleaved), response tokens / s. Target: packed >= 2x.

Run from the repository root: `PYTHONPATH=. python benchmarks/bench_trainer_memory.py [--part memory|packing]
[--quick]` (the memory part at full size takes several minutes per peer on a loaded CPU).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from harness import in_fresh_process, machine_line, median_times_interleaved, peak_rss_since, reset_peak_rss  # noqa: E402

import megalign.parallel.layers as layers_module  # noqa: E402
import megalign.roles.actor as actor_module  # noqa: E402
from megalign.algos.aggregation import aggregate_loss, loss_normalizer  # noqa: E402
from megalign.models import CausalLM, ModelConfig  # noqa: E402
from megalign.ops.policy_loss import policy_loss  # noqa: E402
from megalign.parallel import MixedPrecision, ParallelLayout, vocab_parallel_token_logprob  # noqa: E402
from megalign.roles import Actor  # noqa: E402
from megalign.trainers.optim import OptimConfig, build_optimizer  # noqa: E402


def eager_head_logprobs(model, layout, hidden, targets, temperature, with_entropy=False, chunk_tokens=None):
    """The trainers' head before the fused path: the [.., V/tp] logits, then the vocab-parallel log-prob
    (`head_logprobs`' signature; it has no chunks)."""
    return vocab_parallel_token_logprob(model.lm_head(hidden), targets, layout.tp_group if layout.tp > 1 else None,
                                        model.lm_head.vocab_start, temperature=temperature,
                                        return_entropy=with_entropy, vocab_size=model.config.vocab_size)


def _init_single_rank() -> ParallelLayout:
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp(prefix='megalign-bench-')}",
                                rank=0, world_size=1)
    return ParallelLayout.build(tp=1, device_type="cpu")


def _actor(config: ModelConfig, layout: ParallelLayout, pack: bool, head_chunk_tokens: int = 1024,
           fused_adamw: bool = False, checkpointing: bool = False) -> Actor:
    torch.manual_seed(0)
    model = CausalLM(config, activation_checkpointing=checkpointing)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-6, fused=fused_adamw), layout)
    actor = Actor(model, layout, MixedPrecision(None), False, False, optimizer, 1.0, pack=pack,
                  head_chunk_tokens=head_chunk_tokens)
    for p in model.parameters():  # a zero-gradient step creates the AdamW state (an input, not the update's cost)
        p.grad = torch.zeros_like(p)
    actor.optimizer.step()
    actor.optimizer.zero_grad(set_to_none=True)
    return actor


def _batch(vocab: int, lengths: list[int], prompts: list[int], width: int, response_len: int):
    """(sequences, attention mask, response mask, old log-probs, advantages) of left-padded prompts and
    right-padded responses of the given lengths, as `OnlineTrainer.rollout` lays them out."""
    g = torch.Generator().manual_seed(1)
    b = len(lengths)
    seq = torch.randint(3, vocab, (b, width + response_len), generator=g)
    mask = torch.zeros_like(seq)
    for row, (p, r) in enumerate(zip(prompts, lengths)):
        mask[row, width - p:width + r] = 1
    seq[mask == 0] = 0
    response_mask = mask[:, width:].float()
    old = -torch.rand(b, response_len, generator=g) * 5
    adv = torch.randn(b, 1, generator=g).expand(b, response_len).contiguous()
    return seq, mask, response_mask, old, adv


def _backward(actor: Actor, batch, response_len: int, micro_batch: int) -> torch.Tensor:
    """Forward and backward of every micro-batch of one update (`OnlineTrainer.train_role`'s body); the loss."""
    seq, mask, response_mask, old, adv = batch
    normalizer = loss_normalizer(response_mask, "token-mean", actor.layout.dp_group)
    total = torch.zeros(())
    for s in range(0, seq.shape[0], micro_batch):
        rows = slice(s, s + micro_batch)
        logp, _ = actor.logprobs_with_grad(seq[rows], mask[rows], response_len, 1.0)
        per_token, _ = policy_loss(logp, old[rows], adv[rows], response_mask[rows], 0.2, 0.2)
        share = aggregate_loss(per_token, response_mask[rows], "token-mean", normalizer, response_len)
        share.backward()
        total = total + share.detach()
    return total


def _update(actor: Actor, batch, response_len: int, micro_batch: int) -> None:
    """One optimizer update over the batch: `_backward`, then `Actor.optimizer_step`."""
    actor.optimizer_step(_backward(actor, batch, response_len, micro_batch))


class MemoryPeer(NamedTuple):
    """One peer of the memory part (module docstring)."""

    head: str
    """"fused" or "eager"."""
    chunk: int
    """`actor.head_chunk_tokens` (the fused head's; the eager head has no chunks)."""
    dense_embedding: bool
    """the embedding's dense backward (before this change) instead of `embedding_into_grad`."""
    fused_adamw: bool
    """`optim.fused`."""
    micro_batches: int
    """micro-batches of the 4 rows."""
    checkpointing: bool = False
    """`actor.activation_checkpointing` (each decoder layer recomputed in the backward)."""


def _memory_case(peer: MemoryPeer, vocab: int, hidden: int, rows: int, response_len: int) -> dict[str, float]:
    """MiB beyond the inputs at the peak of the forward + backward, and of the whole update (with the
    optimizer step), for one peer; run in a fresh process (module-level: spawn-safe)."""
    layout = _init_single_rank()
    if peer.head == "eager":
        actor_module.head_logprobs = eager_head_logprobs
    if peer.dense_embedding:
        layers_module.embedding_into_grad = lambda ids, weight: F.embedding(ids, weight)
    config = ModelConfig(model_type="qwen2", vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=2, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                         head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True)
    actor = _actor(config, layout, pack=False, head_chunk_tokens=peer.chunk, fused_adamw=peer.fused_adamw,
                   checkpointing=peer.checkpointing)
    batch = _batch(vocab, [response_len] * rows, [16] * rows, 16, response_len)
    base = reset_peak_rss()
    loss = _backward(actor, batch, response_len, rows // peer.micro_batches)
    backward = peak_rss_since(base)
    actor.optimizer_step(loss)
    return {"forward + backward": backward / 2**20, "whole update": peak_rss_since(base) / 2**20}


def run_memory(quick: bool) -> None:
    vocab, hidden, rows, response_len = (8192, 256, 4, 128) if quick else (151936, 1024, 4, 1024)
    small = 64 if quick else 256
    peers = [MemoryPeer("fused", 1024, False, False, 1), MemoryPeer("fused", 1024, True, False, 1),
             MemoryPeer("fused", small, False, False, 1), MemoryPeer("fused", small, False, True, 1),
             MemoryPeer("eager", 1024, False, False, 1),
             MemoryPeer("fused", 1024, False, False, 2), MemoryPeer("fused", 1024, True, False, 2),
             MemoryPeer("eager", 1024, False, False, 2),
             MemoryPeer("fused", small, False, False, 4), MemoryPeer("fused", small, True, False, 4),
             MemoryPeer("eager", 1024, False, False, 4),
             MemoryPeer("fused", 1024, False, False, 1, True), MemoryPeer("fused", small, False, True, 1, True),
             MemoryPeer("eager", 1024, False, False, 1, True)]
    peaks = {peer: in_fresh_process(_memory_case, peer, vocab, hidden, rows, response_len) for peer in peers}
    print(f"actor update, V={vocab} H={hidden}, {rows * response_len} response tokens in {rows} rows, fp32; peak "
          f"extra MiB; the ratios are of the whole update's peak")
    print("| micro-batches | head | head_chunk_tokens | embedding backward | AdamW | activation checkpointing "
          "| forward + backward | whole update | / eager, same micro-batches | / eager, one micro-batch |\n"
          "|---:|---|---:|---|---|---|---:|---:|---:|---:|")
    one = peaks[peers[4]]["whole update"]
    for peer, phases in peaks.items():
        eager = peaks[MemoryPeer("eager", 1024, False, False, peer.micro_batches)]["whole update"]
        whole = phases["whole update"]
        print(f"| {peer.micro_batches} | {peer.head} | {peer.chunk if peer.head == 'fused' else '-'} "
              f"| {'dense' if peer.dense_embedding else 'into .grad'} | {'fused' if peer.fused_adamw else 'foreach'} "
              f"| {'on' if peer.checkpointing else 'off'} | {phases['forward + backward']:.1f} | {whole:.1f} | {whole / eager:.1%} | {whole / one:.1%} |")


def run_packing(quick: bool) -> None:
    layout = _init_single_rank()
    vocab, rows, max_len, micro = (512, 8, 64, 4) if quick else (4096, 32, 512, 8)
    config = ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=256, intermediate_size=704,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, head_dim=64,
                         max_position_embeddings=1024)
    g = torch.Generator().manual_seed(2)
    lengths = (torch.distributions.Beta(1.0, 3.0).sample((rows,)) * max_len).long().clamp(1, max_len).tolist()
    prompts = torch.randint(8, 33, (rows,), generator=g).tolist()
    batch = _batch(vocab, lengths, prompts, 32, max_len)
    actors = {"packed": _actor(config, layout, pack=True), "padded": _actor(config, layout, pack=False)}
    times = median_times_interleaved({name: (lambda a=a: _update(a, batch, max_len, micro))
                                      for name, a in actors.items()}, repeats=3)
    tokens = sum(lengths)
    print(f"GRPO actor update, {rows} responses, max {max_len}, mean length {tokens / rows:.1f}, "
          f"{tokens} response tokens, micro-batches of {micro}")
    print("| rows | median s | response tokens/s | speed-up |\n|---|---:|---:|---:|")
    for name, t in times.items():
        print(f"| {name} | {t:.2f} | {tokens / t:.0f} | {times['padded'] / t:.2f}x |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("memory", "packing", "both"), default="both")
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    args = parser.parse_args()
    print(machine_line())
    if args.part in ("packing", "both"):
        run_packing(args.quick)
    if args.part in ("memory", "both"):
        run_memory(args.quick)


if __name__ == "__main__":
    main()
