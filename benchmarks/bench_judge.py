"""Judge rewards per second: megalign's logprob verdicts vs its generate-and-parse verdicts vs transformers `generate` + parse.

    python benchmarks/bench_judge.py [--quick] [--threads N] [--repeats K] [--prompts U --group G --max-new R1,R2,..]

The same judge prompts on every side, in one process:

- Judge: `harness.build_model_dir`'s random Llama (4 layers, hidden 256, vocab 32000) with its char-level
  HF tokenizer and chat template, saved once and loaded by both frameworks (fp32, SDPA).
- Prompts: U arithmetic problems x G candidate answers (distinct rows, as a GRPO step's samples are),
  each filled into one template ("Problem ... Answer ... Is the answer correct? Reply Y or N.") and
  rendered with the judge's chat template: U x G judge prompts (full: 16 x 4 = 64; `--quick` 8 x 4).
- Sides: `megalign logprob` = `Judge.verdicts` in logprob mode (one forward of the prompts in
  micro-batches of 32, p(Y) / (p(Y) + p(N)) at the first generated position); `megalign generate` =
  `Judge.verdicts` in generate mode (greedy on the rollout engine, R new tokens, then the regex);
  `transformers` = `model.generate(do_sample=False, max_new_tokens=R)` over the same left-padded
  prompts in batches of 32, decoded, the same regex. The random judge rarely stops early, so both
  generating sides decode R tokens a row. The judge's per-step cache is cleared before every call.
- Budgets: the generating sides run at each R of `--max-new` (full: 16, 64, 256; `--quick` 16, 64):
  a judge that writes a rationale before its score needs hundreds of tokens, one that answers a score
  directly a few (the judge's config is given 1024 positions, its RoPE having no position weights; the
  prompts take about 170). The logprob side reads one position whatever R is, so its lead grows with R:
  every side pays the same prefill of the prompts, which bounds the ratio at short budgets.

Timing: one warm-up call per side, then `--repeats` rounds, the sides alternating in each round, median
seconds; "rewards/s" = judge prompts / seconds. One torch thread by default (a shared 2-core machine).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness import build_model_dir, machine_line, median_times_interleaved, quiet  # noqa: E402

from megalign.parallel import ParallelLayout  # noqa: E402
from megalign.roles.judge import JudgeConfig, load_judge  # noqa: E402

TEMPLATE = "Problem: {prompt}\nAnswer: {response}\nIs the answer correct? Reply Y or N."
PATTERN = r"([YN])"
BATCH = 32
POSITIONS = 1024


def judge_rows(prompts: int, group: int, seed: int = 0) -> list[dict[str, str]]:
    """U x G (problem, candidate answer) rows, all distinct."""
    rng = random.Random(seed)
    rows = []
    for _ in range(prompts):
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        for g in range(group):
            rows.append({"prompt": f"What is {a} + {b}? Think, then give the final answer.",
                         "response": f"{a} + {b} makes {a + b + g - group // 2}, so the answer is {a + b + g - group // 2}."})
    return rows


def transformers_side(model, tokenizer, texts: list[str], max_new: int):
    """Greedy `generate` + parse over `texts` (already chat-rendered) in batches of BATCH, left-padded."""
    tokenizer.padding_side = "left"
    scores = []
    for start in range(0, len(texts), BATCH):
        enc = tokenizer(texts[start:start + BATCH], return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**enc, do_sample=False, max_new_tokens=max_new, pad_token_id=0, eos_token_id=2)
        for row in tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True):
            m = re.search(PATTERN, row)
            scores.append(1.0 if m and m.group(1) == "Y" else 0.0)
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--group", type=int, default=None)
    parser.add_argument("--max-new", default=None, help="comma-separated new-token budgets of the generating sides")
    args = parser.parse_args()
    quiet()
    torch.set_num_threads(args.threads)
    prompts = args.prompts or (8 if args.quick else 16)
    group = args.group or 4
    max_news = [int(v) for v in (args.max_new or ("16,64" if args.quick else "16,64,256")).split(",")]
    from transformers import AutoTokenizer, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "judge")
        build_model_dir(path, 32000)
        with open(os.path.join(path, "config.json")) as fh:  # room for a rationale (RoPE: positions are not weights)
            config = json.load(fh)
        config["max_position_embeddings"] = POSITIONS
        with open(os.path.join(path, "config.json"), "w") as fh:
            json.dump(config, fh)
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'rendezvous')}", rank=0, world_size=1)
        layout = ParallelLayout.build(tp=1)
        common = dict(path=path, template=TEMPLATE, answers=["Y", "N"], micro_batch_size=BATCH, pattern=PATTERN)
        logprob = load_judge("logprob", JudgeConfig(**common, mode="logprob"), layout)
        hf_model = LlamaForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
        hf_tok = AutoTokenizer.from_pretrained(path)
        rows = judge_rows(prompts, group)
        texts = [logprob.tokenizer.decode(logprob.encode(logprob.template.render(r)), skip_special=False) for r in rows]
        texts = [t.removeprefix("<bos>") for t in texts]
        assert [hf_tok(t, add_special_tokens=True)["input_ids"] for t in texts[:2]] == \
               [logprob.encode(logprob.template.render(r)) for r in rows[:2]], "the two frameworks see other ids"

        def ours(judge):
            def call():
                judge.new_step()
                return judge.verdicts(judge.template, rows)
            return call

        t0 = time.perf_counter()
        results = {}
        with torch.no_grad():
            for max_new in max_news:
                generate = load_judge("generate", JudgeConfig(**common, mode="generate", max_new_tokens=max_new), layout)
                results[max_new] = median_times_interleaved(
                    {"megalign logprob": ours(logprob), "megalign generate": ours(generate),
                     "transformers generate": lambda: transformers_side(hf_model, hf_tok, texts, max_new)},
                    repeats=args.repeats)
        dist.destroy_process_group()
    n = len(rows)
    mean_len = sum(len(logprob.encode(logprob.template.render(r))) for r in rows) / n
    print(machine_line())
    print(f"judge: 4 layers, hidden 256, vocab 32000; {n} judge prompts ({prompts} x {group}, {mean_len:.0f} tokens on "
          f"average), batches of {BATCH}\n")
    print("| new tokens (generating sides) | side | seconds | rewards/s | vs transformers |\n|---:|---|---:|---:|---:|")
    for max_new, seconds in results.items():
        base = seconds["transformers generate"]
        for name, s in seconds.items():
            print(f"| {max_new} | {name} | {s:.3f} | {n / s:.1f} | {base / s:.2f}x |")
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
