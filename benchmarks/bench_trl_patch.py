"""TRL's GRPOTrainer and DPOTrainer update, stock vs patched with megalign's kernels, side by side.

    PYTHONPATH=. python benchmarks/bench_trl_patch.py [--quick] [--threads N]

TRL is a test / benchmark extra (`pip install -e ".[test]"`); without it the script says so and stops.

Both sides are TRL 1.16's own trainers on the same random Llama (2 layers, hidden 128, 4 heads,
untied LM head, fp32, bf16=False) saved once per vocabulary size (32000, Llama 2's; 151936,
Qwen2's) with a word-level tokenizer of that size. "TRL + megalign" is a trainer built after
`megalign.integrations.apply_megalign_kernels_to_trl()`: its LM head is
`fused_linear_token_logprob` over the labelled positions and GRPO's dapo loss is
`megalign.ops.policy_loss`; "TRL" is a trainer built without the patch (TRL's
`ChunkedLogProbFunction` head, which on a CPU folds [tokens, 32768] tiles with torch ops and scores
every position, and TRL's loss code).

The update is `trainer.compute_loss(model, batch)` and the backward to every parameter, i.e. a
`training_step` without the rollout (GRPO) or the data collation (DPO) and without the optimizer:
- GRPO: 8 completions of 64 tokens after 16-token prompts (left-padded prompts, right-padded
  completions, 412 completion tokens), loss_type dapo, beta 0 (no reference model), old log-probs
  given (num_iterations > 1 style), advantages of both signs;
- DPO: 4 pairs, prompts of 16 tokens, chosen / rejected completions of 24-48 tokens, sigmoid loss,
  beta 0.1, the reference model's forward inside the step (precompute_ref_log_probs=False).

Time: median of 5 steps after one warm-up, the two sides alternating step by step in one process
(the patch is switched on for the patched side's steps and off for the stock side's, since GRPO's
loss is patched on the class). Memory (CPU): peak RSS of one step beyond the RSS before it, in a
fresh spawned process per side (benchmarks/harness.py `peak_memory`: /proc clear_refs + VmHWM,
glibc's mmap threshold at 64 KiB so freed buffers leave RSS); it includes the parameter gradients
(the same on both sides) and whatever the LM head and loss allocate. --quick: vocabulary 4096 and
halved batches, to check the script runs.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import tempfile
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness import Row, format_table, machine_line, median_times_interleaved, peak_memory  # noqa: E402

OURS, STOCK = "TRL + megalign", "TRL"


def trl_missing() -> str | None:
    try:
        import trl  # noqa: F401
    except ImportError as exc:
        return str(exc)
    return None


def _quiet() -> None:
    import datasets
    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    logging.getLogger("trl").setLevel(logging.ERROR)


def build_model_dir(path: str, vocab_size: int) -> None:
    """A random Llama and a word-level tokenizer `t0 .. t{V-1}` (pad t0, eos t1, bos t2) in `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", bos_token="t2").save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, pad_token_id=0, eos_token_id=1,
                         bos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(path)


def _zero_reward(completions, **kwargs) -> list[float]:
    return [0.0] * len(completions)


def _words(g: torch.Generator, vocab: int, n: int) -> str:
    return " ".join(f"t{i}" for i in torch.randint(3, vocab, (n,), generator=g).tolist())


def _grpo(model_dir: str, out_dir: str, vocab: int, scale: int):
    import datasets
    import trl
    from transformers import AutoTokenizer

    b, tp, tc = 8 // scale, 16, 64 // scale
    args = trl.GRPOConfig(output_dir=out_dir, per_device_train_batch_size=b, num_generations=b,
                          max_completion_length=tc, report_to=[], use_cpu=True, save_strategy="no", bf16=False,
                          gradient_checkpointing=False, loss_type="dapo", beta=0.0, disable_tqdm=True)
    trainer = trl.GRPOTrainer(model=model_dir, reward_funcs=_zero_reward, args=args,
                              train_dataset=datasets.Dataset.from_dict({"prompt": ["t3"] * b}),
                              processing_class=AutoTokenizer.from_pretrained(model_dir))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    g = torch.Generator().manual_seed(0)
    prompt_mask = torch.ones(b, tp, dtype=torch.long)
    completion_mask = torch.ones(b, tc, dtype=torch.long)
    for row in range(b):
        prompt_mask[row, : row % 4] = 0
        completion_mask[row, tc - (row * 7) % (tc // 2):] = 0
    prompt_ids = torch.randint(3, vocab, (b, tp), generator=g).masked_fill(prompt_mask == 0, 0)
    completion_ids = torch.randint(3, vocab, (b, tc), generator=g).masked_fill(completion_mask == 0, 0)
    batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
             "completion_mask": completion_mask, "advantages": torch.randn(b, generator=g),
             "num_items_in_batch": completion_mask.sum().float()}
    batch["old_per_token_logps"] = -torch.log(torch.tensor(float(vocab))) + 0.1 * torch.randn(b, tc, generator=g)
    return trainer, batch


def _dpo(model_dir: str, out_dir: str, vocab: int, scale: int):
    import datasets
    import trl
    from transformers import AutoTokenizer

    pairs = 4 // scale
    g = torch.Generator().manual_seed(0)
    data = datasets.Dataset.from_dict({
        "prompt": [_words(g, vocab, 16) for _ in range(pairs)],
        "chosen": [" " + _words(g, vocab, (24 + 8 * i) // scale) for i in range(pairs)],
        "rejected": [" " + _words(g, vocab, (48 - 8 * i) // scale) for i in range(pairs)]})
    args = trl.DPOConfig(output_dir=out_dir, per_device_train_batch_size=pairs, report_to=[], use_cpu=True,
                         save_strategy="no", bf16=False, gradient_checkpointing=False, beta=0.1, disable_tqdm=True)
    trainer = trl.DPOTrainer(model=model_dir, args=args, train_dataset=data,
                             processing_class=AutoTokenizer.from_pretrained(model_dir))
    trainer.model.train()
    return trainer, next(iter(trainer.get_train_dataloader()))


BUILDERS = {"GRPO update": _grpo, "DPO update": _dpo}


def make_step(kind: str, impl: str, model_dir: str, vocab: int, scale: int, threads: int):
    """Build the trainer of `kind` (patched when impl is OURS) and return one update step (spawn-safe)."""
    from megalign.integrations import apply_megalign_kernels_to_trl, megalign_kernels_in_trl, unpatch_trl

    torch.set_num_threads(threads)
    _quiet()
    if impl == OURS:
        apply_megalign_kernels_to_trl()
    else:
        unpatch_trl()
    trainer, batch = BUILDERS[kind](model_dir, tempfile.mkdtemp(), vocab, scale)
    unpatch_trl()
    params = [p for p in trainer.model.parameters() if p.requires_grad]

    def step():
        with megalign_kernels_in_trl() if impl == OURS else contextlib.nullcontext():
            loss = trainer.compute_loss(trainer.model, batch)
            grads = torch.autograd.grad(loss, params)
        return loss.detach(), grads

    return step


def run(quick: bool = False, threads: int = 1) -> list[Row]:
    torch.set_num_threads(threads)
    _quiet()
    vocabs, scale = ((4096,), 2) if quick else ((32000, 151936), 1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for vocab in vocabs:
            model_dir = os.path.join(tmp, f"llama_v{vocab}")
            build_model_dir(model_dir, vocab)
            for kind in BUILDERS:
                steps = {impl: make_step(kind, impl, model_dir, vocab, scale, threads) for impl in (OURS, STOCK)}
                seconds = median_times_interleaved(steps, repeats=3 if quick else 5)
                for impl in (OURS, STOCK):
                    peak = peak_memory(make_step, kind, impl, model_dir, vocab, scale, threads)
                    rows.append(Row(kind, f"V={vocab}", impl, seconds[impl], peak))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="vocabulary 4096, halved batches")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: a shared machine)")
    args = parser.parse_args()
    missing = trl_missing()
    if missing:
        print(f"TRL is not installed ({missing}); pip install -e '.[test]' to run this benchmark")
        return
    rows = run(args.quick, args.threads)
    print(machine_line())
    print(format_table(rows, ours=OURS))


if __name__ == "__main__":
    main()
