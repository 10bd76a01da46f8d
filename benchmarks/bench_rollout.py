"""A GRPO-shaped rollout: megalign's engine vs transformers `generate` vs megalign's simple loop, side by side.

    python benchmarks/bench_rollout.py [--quick] [--threads N] [--repeats K] [--layers L --hidden H] [--prompts U --max-new R]

The same work on every side, in one process:

- Model: a random Llama, vocab 32000, saved with `save_pretrained` and loaded by both frameworks (fp32,
  SDPA). Default 2 layers, hidden 128, 4 heads, intermediate 352: a small trunk because the 2 CPU cores
  of the machine are shared (`--layers 4 --hidden 256` is bench_grpo_trl's model); the 32000-row LM
  head is the same as a real model's.
- Prompts: U random prompts of 64-256 tokens (uniform lengths, left-padded), G samples each; full
  mode U=32, G=8, up to R=256 new tokens; `--quick` U=8, G=4, 16-64 prompt tokens, R=64.
- Lengths: a long-tailed schedule fixes each response's length, n = ceil(R * u^3) for u uniform (mean
  about R/4, a few near R), and one response per run of exactly R (a GRPO step usually has a truncated
  response, which is what keeps the simple loops decoding). A logits processor that every side shares
  (`ForcedLengths`: EOS is masked out before token n and is the only choice at token n) enforces it,
  so every side generates exactly the same number of tokens (checked).
- Sampling: temperature 1, no top-k / top-p, on every side (the tokens differ, their count does not).
- Sides: `transformers` = `model.generate(do_sample=True, top_k=0)` with its KV cache over the U*G
  repeated prompts; `megalign-loop` = `megalign.rollout.generate` (the simple loop: every row until the
  last stops) over the same rows; `megalign` = `megalign.rollout.rollout` (shared-prompt prefill,
  finished-row compaction, eager decode, `sync_every` 4) with all U*G rows in flight, and
  `megalign max_batch=64` the same engine with 64 slots (continuous batching).

Timing: one small warm-up call per side, then `--repeats` rounds, the sides alternating in each round,
median seconds reported. "tok/s" = generated tokens / seconds of the whole rollout (prefill included);
megalign's engine also reports its own prefill and decode throughputs. One torch thread by default
(see bench_grpo_trl.py's module doc for why on a shared 2-core machine).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness import Row, format_table, machine_line  # noqa: E402

from megalign.models import from_pretrained  # noqa: E402
from megalign.rollout import EngineConfig, SamplingParams, generate, rollout  # noqa: E402

VOCAB, EOS, PAD = 32000, 2, 0


class ForcedLengths:
    """Logits processor making output row r end with EOS as its token number lengths[r] (EOS impossible before).

    megalign form: (logits `[B, V]`, rows `[B]`, steps `[B]` tokens generated so far) -> logits;
    `hf()` wraps it as a transformers `LogitsProcessor` (rows = batch rows, step from the sequence length).
    """

    def __init__(self, lengths: torch.Tensor):
        self.lengths = lengths

    def __call__(self, logits: torch.Tensor, rows: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        force = (steps + 1 >= self.lengths[rows])[:, None]
        is_eos = torch.arange(logits.shape[-1], device=logits.device) == EOS
        return logits.masked_fill((force & ~is_eos) | (~force & is_eos), float("-inf"))

    def hf(self, prompt_width: int):
        from transformers import LogitsProcessor

        outer = self

        class _HF(LogitsProcessor):
            def __call__(self, input_ids, scores):
                rows = torch.arange(scores.shape[0], device=scores.device)
                return outer(scores, rows, torch.full_like(rows, input_ids.shape[1] - prompt_width))
        return _HF()


def length_schedule(n: int, max_new: int, seed: int) -> torch.Tensor:
    """`[n]` long-tailed response lengths ceil(max_new * u^3), one of them max_new (module doc)."""
    u = torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    lengths = (max_new * u ** 3).ceil().long().clamp(1, max_new)
    lengths[int(u.argmax())] = max_new
    return lengths


def prompts(n: int, shortest: int, longest: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts `[n, longest]` with lengths uniform in [shortest, longest], and their mask."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, longest + 1, (n,), generator=g)
    ids = torch.randint(3, VOCAB, (n, longest), generator=g)
    mask = (torch.arange(longest)[None] >= longest - lengths[:, None]).long()
    return ids.masked_fill(mask == 0, PAD), mask


def build(path: str, layers: int, hidden: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 32 * 32,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=1024, pad_token_id=PAD, bos_token_id=1, eos_token_id=EOS,
                         tie_word_embeddings=False)
    hf = LlamaForCausalLM(config).eval()
    hf.save_pretrained(path)
    return hf, from_pretrained(path).eval()


def sides(hf, ours, ids, mask, group: int, max_new: int, processor: ForcedLengths):
    """{name: () -> (generated tokens, engine stats or None)} over the same prompts and schedule."""
    from transformers import GenerationConfig, LogitsProcessorList

    rep_ids, rep_mask = ids.repeat_interleave(group, 0), mask.repeat_interleave(group, 0)
    width = ids.shape[1]
    params = SamplingParams(max_new_tokens=max_new, temperature=1.0, eos_token_id=EOS, pad_token_id=PAD)
    hf_config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new,
                                 eos_token_id=EOS, pad_token_id=PAD)
    hf_processors = LogitsProcessorList([processor.hf(width)])

    def transformers_side():
        with torch.no_grad():
            out = hf.generate(rep_ids, attention_mask=rep_mask, generation_config=hf_config,
                              logits_processor=hf_processors)
        response = out[:, width:]
        # tokens up to and including the first EOS of each row
        ended = (response == EOS).long().cumsum(-1)
        return int(((ended == 0) | ((ended == 1) & (response == EOS))).sum()), None

    def loop_side():
        out = generate(ours, rep_ids, rep_mask, params, torch.Generator().manual_seed(0), logits_processor=processor)
        return int(out.attention_mask[:, width:].sum()), None

    def engine_side(max_batch: int):
        def run():
            out, stats = rollout(ours, ids, mask, group, params, seed=0, config=EngineConfig(max_batch=max_batch),
                                 logits_processor=processor)
            return int(out.attention_mask[:, width:].sum()), stats
        return run

    return {"megalign": engine_side(0), "megalign max_batch=64": engine_side(64), "megalign-loop": loop_side,
            "transformers": transformers_side}


def measure(fns, repeats: int):
    times = {name: [] for name in fns}
    tokens, stats = {}, {}
    for r in range(repeats):
        order = list(fns) if r % 2 == 0 else list(fns)[::-1]
        for name in order:
            t0 = time.perf_counter()
            tokens[name], s = fns[name]()
            times[name].append(time.perf_counter() - t0)
            if s is not None:
                stats.setdefault(name, []).append(s)
    return {name: statistics.median(ts) for name, ts in times.items()}, tokens, stats


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="U=8 prompts of 16-64 tokens, G=4, R=64")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--prompts", type=int, help="U (full mode 32)")
    parser.add_argument("--max-new", type=int, help="R (full mode 256)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    u, group, shortest, longest, max_new = (8, 4, 16, 64, 64) if args.quick else (32, 8, 64, 256, 256)
    u, max_new = args.prompts or u, args.max_new or max_new
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        hf, ours = build(tmp, args.layers, args.hidden)
        ids, mask = prompts(u, shortest, longest, seed=1)
        lengths = length_schedule(u * group, max_new, seed=2)
        warm = sides(hf, ours, ids[:2, -16:], mask[:2, -16:].clone().fill_(1), 2, 4,
                     ForcedLengths(torch.tensor([4, 2, 3, 1])))
        for fn in warm.values():
            fn()
        fns = sides(hf, ours, ids, mask, group, max_new, ForcedLengths(lengths))
        seconds, tokens, stats = measure(fns, args.repeats)
    expected = int(lengths.sum())
    if any(t != expected for t in tokens.values()):
        raise RuntimeError(f"sides generated different token counts {tokens} (schedule: {expected})")
    case = (f"U={u} x G={group}, prompts {shortest}-{longest}, R={max_new}, {expected} gen tokens, "
            f"{args.layers}L h{args.hidden} V{VOCAB}")
    rows = [Row("rollout", case, name, s) for name, s in seconds.items()]
    print(machine_line())
    print(format_table(rows))
    print()
    for name, s in seconds.items():
        line = f"{name}: {s:.2f} s, {expected / s:.0f} generated tok/s"
        if name in stats:
            st = stats[name][-1]
            line += (f" (prefill {st.prefill_tokens} prompt tokens at {st.prefill_tokens / st.prefill_s:.0f} tok/s, "
                     f"decode {st.decode_tokens / st.decode_s:.0f} tok/s over {st.decode_steps} steps)")
        print(line)
    for peer in ("transformers", "megalign-loop"):
        print(f"megalign / {peer} generated tokens/s: {seconds[peer] / seconds['megalign']:.2f}x "
              f"(max_batch=64: {seconds[peer] / seconds['megalign max_batch=64']:.2f}x)")
    print(f"mean response {expected / (u * group):.1f} tokens, longest {int(lengths.max())}; "
          f"{time.perf_counter() - t_start:.0f} s in all")


if __name__ == "__main__":
    main()
