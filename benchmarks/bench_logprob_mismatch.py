"""Rollout vs trainer log-probs: default vs batch-invariant mode, fp32 and bf16, with what the mode costs.

    nice -n 15 python benchmarks/bench_logprob_mismatch.py [--repeats K] [--threads N] [--models tiny,small]
        [--prompts U --group G --max-new R]

In one process, for each model, dtype and mode, the same work:

- Models: random Qwen2 decoders (q/k/v biases, GQA 4 query heads over 2 key/value heads, untied head), matrices
  drawn from N(0, 0.02^2) as HF initialises them: `tiny` 2 layers, hidden 64, vocab 512; `small` 4 layers,
  hidden 256, vocab 8192. bf16 = the trainer's mixed precision (fp32 weights, CPU autocast to bf16).
- Rollout: `megalign.rollout.rollout` (the trainer's engine: shared-prompt prefill, finished-row compaction, KV-cache
  decode) of U random prompts of lengths 3 .. 24 (left-padded to the longest), G samples each, up to R new tokens at
  temperature 1; it records log softmax(logits)[token] of every sampled token.
- Recompute: the trainer's old-log-prob forward, `megalign.roles.actor.response_logprobs` over the finished padded
  rows (the fused LM head at tp = 1), without gradient.
- Mismatch (`megalign.rollout.mismatch`, what every online step logs): max |d| and mean k3 = exp(d) - 1 - d over the
  response tokens, d = recomputed - rollout, and the fraction of tokens whose two fp32 values are equal bit for bit.
- Modes: `default` (the fast paths: SDPA, MKL gemm, the fused head) and `invariant`
  (`megalign.models.batch_invariant`, what `actor.batch_invariant: true` turns on).
- Cost: rollout tokens/s = generated tokens / rollout seconds (prefill included); recompute tokens/s = response
  tokens / recompute seconds; both the best of `--repeats` rounds after a warm-up round, the modes alternating in
  each round; the ratio invariant / default of each. The mismatch figures come from the first round (every round
  samples the same tokens: same seed).

One torch thread by default (the machine's 2 cores are shared; bench_rollout.py's convention).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import types

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness import machine_line  # noqa: E402

from megalign.models import CausalLM, ModelConfig, batch_invariant  # noqa: E402
from megalign.roles.actor import response_logprobs  # noqa: E402
from megalign.rollout import SamplingParams, rollout  # noqa: E402
from megalign.rollout.mismatch import mismatch_metrics, mismatch_sums  # noqa: E402

PAD, EOS = 0, 2
MODELS = {"tiny": dict(layers=2, hidden=64, vocab=512), "small": dict(layers=4, hidden=256, vocab=8192)}
LAYOUT = types.SimpleNamespace(tp=1, tp_group=None)
"""tp = 1 without a process group: what `response_logprobs` reads of a layout."""
DTYPES = {"fp32": None, "bf16": torch.bfloat16}
MODES = ("default", "invariant")


def build(layers: int, hidden: int, vocab: int) -> CausalLM:
    """A random Qwen2-shaped `CausalLM` (module doc), fp32, eval mode."""
    config = ModelConfig(model_type="qwen2", vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=hidden // 4, qkv_bias=True, max_position_embeddings=256, pad_token_id=PAD)
    torch.manual_seed(0)
    model = CausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    return model.eval()


def prompts(n: int, vocab: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts `[n, 24]` of lengths spread over 3 .. 24, and their mask."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(3, 24, n).round().long()[torch.randperm(n, generator=g)]
    width = int(lengths.max())
    ids = torch.randint(3, vocab, (n, width), generator=g)
    mask = (torch.arange(width)[None] >= width - lengths[:, None]).long()
    return ids.masked_fill(mask == 0, PAD), mask


def one_round(model, layout, ids, mask, group: int, params: SamplingParams, dtype) -> dict:
    """Rollout then recompute under `dtype`'s autocast: seconds, token counts and the mismatch sums."""
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None), torch.no_grad():
        t0 = time.perf_counter()
        out, _ = rollout(model, ids, mask, group, params, seed=7)
        t1 = time.perf_counter()
        r = params.max_new_tokens
        n = out.logprobs.shape[1]
        sequences = F.pad(out.sequences, (0, r - n), value=PAD)
        attention = F.pad(out.attention_mask, (0, r - n))
        t2 = time.perf_counter()
        recomputed = response_logprobs(model, layout, sequences, attention, r, params.temperature)
        t3 = time.perf_counter()
    response = attention[:, -r:]
    tokens = int(response.sum())
    sums = mismatch_sums(recomputed, F.pad(out.logprobs, (0, r - n)), response)
    return {"rollout_s": t1 - t0, "recompute_s": t3 - t2, "tokens": tokens, "sums": sums}


def measure(model, ids, mask, group: int, params: SamplingParams, dtype, repeats: int) -> dict[str, dict]:
    """{mode: {rollout_tps, recompute_tps, tokens, max_abs, k3, bitwise}}: a warm-up round, then `repeats` rounds
    with the modes alternating; best seconds; mismatch from the first timed round."""
    rounds: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for i in range(repeats + 1):
        for mode in MODES:
            with batch_invariant.batch_invariant(mode == "invariant"):
                result = one_round(model, LAYOUT, ids, mask, group, params, dtype)
            if i:
                rounds[mode].append(result)
    table = {}
    for mode, results in rounds.items():
        first = results[0]
        if any(not torch.equal(r["sums"], first["sums"]) for r in results):
            raise RuntimeError(f"{mode}: the rounds' mismatch differs (the rollout is seeded; it should not)")
        metrics = mismatch_metrics(first["sums"])
        table[mode] = {"rollout_tps": first["tokens"] / min(r["rollout_s"] for r in results),
                       "recompute_tps": first["tokens"] / min(r["recompute_s"] for r in results),
                       "tokens": first["tokens"], "max_abs": metrics["rollout/logprob_max_abs_diff"],
                       "k3": metrics["rollout/logprob_k3"], "bitwise": metrics["rollout/logprob_bitwise_equal"]}
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,small", help=f"comma-separated, of {list(MODELS)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=8, help="U: prompts")
    parser.add_argument("--group", type=int, default=4, help="G: samples a prompt")
    parser.add_argument("--max-new", type=int, default=32, help="R: new tokens at most")
    args = parser.parse_args()
    names = args.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown or args.repeats < 1 or args.threads < 1 or min(args.prompts, args.group, args.max_new) < 1:
        parser.error(f"--models must name {list(MODELS)} (unknown: {unknown}); --repeats, --threads, --prompts, "
                     f"--group, --max-new must be >= 1")
    torch.set_num_threads(args.threads)
    print(f"{datetime.date.today()}  {machine_line()}")
    print(f"U={args.prompts} prompts (3-24 tokens, left-padded) x G={args.group}, up to R={args.max_new} new tokens, "
          f"temperature 1; best of {args.repeats} rounds after a warm-up\n")
    print("| model | dtype | mode | max abs diff | mean k3 | bitwise equal | rollout tok/s | recompute tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    start = time.perf_counter()
    for name in names:
        spec = MODELS[name]
        model = build(spec["layers"], spec["hidden"], spec["vocab"])
        ids, mask = prompts(args.prompts, spec["vocab"])
        params = SamplingParams(max_new_tokens=args.max_new, temperature=1.0, eos_token_id=EOS, pad_token_id=PAD)
        for dtype_name, dtype in DTYPES.items():
            table = measure(model, ids, mask, args.group, params, dtype, args.repeats)
            label = f"{name} ({spec['layers']} layers, hidden {spec['hidden']}, vocab {spec['vocab']})"
            for mode, row in table.items():
                print(f"| {label} | {dtype_name} | {mode} | {row['max_abs']:.3g} | {row['k3']:.3g} | "
                      f"{row['bitwise']:.1%} | {row['rollout_tps']:.0f} | {row['recompute_tps']:.0f} |")
            d, b = table["default"], table["invariant"]
            print(f"| {label} | {dtype_name} | invariant / default | | | | {b['rollout_tps'] / d['rollout_tps']:.2f}x "
                  f"| {b['recompute_tps'] / d['recompute_tps']:.2f}x |", flush=True)
    print(f"\n{table['default']['tokens']} response tokens a round; total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
