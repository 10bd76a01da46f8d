"""DPO and reward-model step throughput and peak memory: megalign vs TRL's `DPOTrainer` / `RewardTrainer`.

    python benchmarks/bench_dpo_trl.py [--quick] [--cases dpo-online,dpo-cache,rm] [--threads N] [--json PATH]

TRL is a benchmark-only dependency (`pip install trl`, not in pyproject); without it the TRL rows
are skipped with a message and only megalign is measured.

The same work on both sides, per step (the structure of `bench_grpo_trl.py`):

- Model: the random Llama of `harness.build_model_dir` (4 layers, hidden 256, fp32) at vocab 32000
  (the char-level HF tokenizer's 99 tokens plus placeholders, as in a real tokenizer: the LM head
  and the log-softmax over the vocabulary are a large share of the step), saved once with
  `save_pretrained`; both frameworks load the policy, the DPO reference and the reward model
  (`*ForSequenceClassification`, a fresh `score` head) from that folder.
- Data: the embedded arithmetic preference pairs (`megalign.data.arith.preference_rows` of the train
  split: prompt, the correct `\\boxed{}` answer as chosen, a wrong one as rejected, a margin), the first
  batch x steps pairs (a round of `steps` steps is one epoch on both sides: TRL restarts its
  dataloader at every `train()` call, megalign's sampler wraps at the same point, so both time the
  same batches), written to one JSONL file that megalign loads (`data.path`) and TRL gets as a
  `datasets.Dataset` of the same rows, in file order on both sides (megalign shuffle=False, TRL
  train_sampling_strategy="sequential"). Plain strings: BOS + prompt + reply + EOS on both sides,
  so a pair's token ids are the same (checked: the tokens per step printed for each side agree).
- DPO: sigmoid loss, beta 0.1, a frozen reference copy, mean over pairs. Reference log-probs in two
  modes, compared like with like: `online` (megalign reference.mode=online, TRL
  precompute_ref_log_probs=False: the reference scores each batch inside the step) and `cache`
  (megalign reference.mode=cache, TRL precompute_ref_log_probs=True: one scoring pass before
  training, outside the timed step).
- RM: Bradley-Terry with the margin column on both sides (-log sigma(r_c - r_r - m)), no centring.
- One micro-batch of B pairs per step (2B sequences, chosen and rejected in one forward on both
  sides), AdamW (0.9, 0.999), eps 1e-8, no weight decay, constant lr 1e-4, grad clip 1.0, fp32, no
  gradient checkpointing (TRL's default is on; megalign stores activations by default), dropout off.
  Both sides run torch's fused AdamW kernel: HF Trainer's default (`adamw_torch_fused`) and megalign's
  `optim.fused=true` (its default is the per-tensor loop, about 5x slower per update on this CPU).

Throughput: both trainers live in this process and run alternately, rounds of `steps` steps each
(megalign first in even rounds, TRL first in odd ones), so load from other processes hits both;
the first step of every round is warm-up and dropped; reported numbers are medians. megalign's step
is `train_step()` timed around the call (data collation included); TRL's step is timed with a
`TrainerCallback` from on_step_begin to on_step_end (its collation happens in the dataloader, before
on_step_begin, so it is not counted: in TRL's favour). tokens/s = real (non-padding) tokens of the
2B sequences of the step / step time; each side counts the tokens of the batch it actually ran
(TRL: its batch's attention_mask; megalign: the RM batch's attention_mask, the DPO batch's plus one
per row, the last token that is only a target in its next-token layout).

Memory (CPU, the same method on both sides): each side runs in its own freshly spawned process
(`harness.in_fresh_process`, glibc serving allocations above 64 KiB with mmap so freed memory leaves
RSS), builds its trainer (weights, reference, data, TRL's precomputed reference log-probs), then runs
three steps in its own loop. Before step 1 and before step 3 the kernel's peak-RSS counter is reset
(/proc/self/clear_refs) and the RSS read; "peak beyond weights" is the high-water mark reached during
step 1 above the RSS before it (everything the training step adds to the loaded models: gradients,
AdamW state, activations, logits, temporaries), "steady step" the same for step 3 (the optimizer
state already exists: activations, gradients and temporaries only).

Threads: one torch thread per side by default (see bench_grpo_trl.py for why on a shared machine).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness import (Row, build_model_dir, in_fresh_process, machine_line, peak_rss_since, print_report,  # noqa: E402
                     quiet, reset_peak_rss, trl_available)

from megalign.data import ArithTaskConfig, make_splits  # noqa: E402
from megalign.data.arith import preference_rows  # noqa: E402

CASES = ("dpo-online", "dpo-cache", "rm")
MEMORY_STEPS = 3  # memory children: marks before step 1 and before step 3


@dataclasses.dataclass
class Setup:
    """Sizes; the data is `steps` batches, so a round is one epoch on both sides and they time the same batches."""

    batch: int  # pairs per step
    rounds: int
    steps: int  # per round, the first dropped; >= MEMORY_STEPS
    vocab: int = 32000
    lr: float = 1e-4
    beta: float = 0.1
    seed: int = 0


def write_pairs(path: str, n: int) -> list[dict]:
    """The first n arithmetic preference rows of the train split, as JSONL at `path`; returns the rows."""
    train, _ = make_splits(ArithTaskConfig())
    rows = preference_rows(train, 0)[:n]
    if len(rows) < n:
        raise ValueError(f"the arithmetic train split has {len(rows)} pairs, fewer than batch x steps = {n}")
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return rows


# ----- megalign side

class MegalignSide:
    name = "megalign"

    def __init__(self, model_dir: str, data_path: str, run_dir: str, s: Setup, case: str):
        from megalign.data import TokenizerConfig
        from megalign.trainers.cli import init_distributed
        from megalign.trainers.evaluation import EvalConfig
        from megalign.trainers.optim import OptimConfig
        from megalign.trainers.preference import (DPOConfig, PairwiseObjective, PreferenceAlgoConfig,
                                                  PreferenceDataConfig, RewardAlgoConfig, RewardModelObjective,
                                                  RMConfig)
        from megalign.trainers.supervised import PolicyModelConfig, ReferenceConfig, SupervisedTrainer

        init_distributed("cpu")
        common = dict(
            run_dir=run_dir, steps=10**6, seed=s.seed, device="cpu", batch_size=s.batch,
            model=PolicyModelConfig(path=model_dir),
            data=PreferenceDataConfig(path=data_path, tokenizer=TokenizerConfig(kind="hf", path=model_dir),
                                      shuffle=False, max_length=256),
            optim=OptimConfig(lr=s.lr, warmup_steps=0, schedule="constant", weight_decay=0.0, betas=(0.9, 0.999),
                              eps=1e-8, grad_clip=1.0, fused=True),
            eval=EvalConfig(max_samples=0), save_every=0, resume="none", export_hf=False, tensorboard=False)
        if case == "rm":
            cfg = RMConfig(algo=RewardAlgoConfig(margin=True, center_coef=0.0), **common)
            self.trainer = SupervisedTrainer(cfg, RewardModelObjective, "RM")
        else:
            cfg = DPOConfig(reference=ReferenceConfig(mode="online" if case == "dpo-online" else "cache"),
                            algo=PreferenceAlgoConfig(loss="sigmoid", beta=s.beta), **common)
            self.trainer = SupervisedTrainer(cfg, PairwiseObjective, "DPO")
            self.trainer.on_train_start()  # cache mode: the scoring pass, outside the timed steps
        objective = self.trainer.objective
        collate = objective.collate
        self._tokens = 0.0

        def counting_collate(examples, device):
            batch = collate(examples, device)
            # a DPO row is in the next-token layout (input = ids[:-1]): its last token is only a target
            self._tokens = float(batch.attention_mask.sum()) + (batch.input_ids.shape[0] if case != "rm" else 0)
            return batch

        objective.collate = counting_collate

    def step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        self.trainer.train_step()
        seconds = time.perf_counter() - t0
        self.trainer.progress["step"] += 1
        return {"step": seconds, "tokens": self._tokens}

    def round(self, steps: int) -> list[dict[str, float]]:
        return [self.step() for _ in range(steps)]

    def memory(self) -> dict[str, int]:
        out = {}
        for i in range(1, MEMORY_STEPS + 1):
            if i in (1, MEMORY_STEPS):
                base = reset_peak_rss()
            self.step()
            if i in (1, MEMORY_STEPS):
                out["first" if i == 1 else "steady"] = peak_rss_since(base)
        return out


# ----- TRL side

class TRLSide:
    name = "trl"

    def __init__(self, model_dir: str, data_path: str, out_dir: str, s: Setup, case: str):
        from datasets import Dataset
        from transformers import AutoTokenizer, TrainerCallback

        with open(data_path) as f:
            rows = [json.loads(line) for line in f]
        columns = ("prompt", "chosen", "rejected", "margin") if case == "rm" else ("prompt", "chosen", "rejected")
        dataset = Dataset.from_list([{k: r[k] for k in columns} for r in rows])
        common = dict(
            output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, report_to="none",
            per_device_train_batch_size=s.batch, gradient_accumulation_steps=1, learning_rate=s.lr,
            lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
            adam_epsilon=1e-8, optim="adamw_torch_fused", max_grad_norm=1.0, max_steps=s.steps, seed=s.seed, gradient_checkpointing=False,
            train_sampling_strategy="sequential", logging_steps=1, save_strategy="no", disable_tqdm=True,
            dataloader_num_workers=0, max_length=None, disable_dropout=True)
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        if case == "rm":
            from trl import RewardConfig, RewardTrainer
            args = RewardConfig(center_rewards_coefficient=None, **common)
            trainer = RewardTrainer(model=model_dir, args=args, train_dataset=dataset, processing_class=tokenizer)
        else:
            from trl import DPOConfig, DPOTrainer
            args = DPOConfig(beta=s.beta, loss_type=["sigmoid"], precompute_ref_log_probs=case == "dpo-cache",
                             **common)
            trainer = DPOTrainer(model=model_dir, args=args, train_dataset=dataset, processing_class=tokenizer)
        compute_loss = trainer.compute_loss
        acc: dict[str, float] = {}
        records: list[dict[str, float]] = []
        marks: dict[str, int] = {}
        memory_mode = {"on": False}

        def counting_compute_loss(model, inputs, *a, **k):
            acc["tokens"] = float(inputs["attention_mask"].sum())
            return compute_loss(model, inputs, *a, **k)

        trainer.compute_loss = counting_compute_loss

        class StepTimer(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                step = state.global_step + 1
                if memory_mode["on"] and step in (1, MEMORY_STEPS):
                    marks["base"] = reset_peak_rss()
                acc["t0"] = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                seconds = time.perf_counter() - acc["t0"]
                records.append({"step": seconds, "tokens": acc["tokens"]})
                if memory_mode["on"] and state.global_step in (1, MEMORY_STEPS):
                    marks["first" if state.global_step == 1 else "steady"] = peak_rss_since(marks["base"])

        trainer.add_callback(StepTimer())
        self.trainer, self.args, self.records, self.marks, self.memory_mode = trainer, args, records, marks, memory_mode

    def round(self, steps: int) -> list[dict[str, float]]:
        self.args.max_steps = steps
        self.records.clear()
        with contextlib.redirect_stdout(io.StringIO()):  # its per-step log dicts
            self.trainer.train()
        return list(self.records)

    def memory(self) -> dict[str, int]:
        self.memory_mode["on"] = True
        self.round(MEMORY_STEPS)
        return {k: self.marks[k] for k in ("first", "steady")}


SIDES = {"megalign": MegalignSide, "trl": TRLSide}


def _memory_child(impl: str, model_dir: str, data_path: str, run_dir: str, s: Setup, case: str,
                  threads: int) -> dict[str, int]:
    """Peak RSS of the first and a steady training step of one side, in this (fresh) process."""
    quiet()
    torch.set_num_threads(threads)
    return SIDES[impl](model_dir, data_path, run_dir, s, case).memory()


# ----- the comparison

def measure(model_dir: str, data_path: str, tmp: str, s: Setup, case: str, impls: list[str]):
    """{impl: per-step records after warm-up}, the implementations alternating round by round."""
    sides = [SIDES[impl](model_dir, data_path, os.path.join(tmp, f"{impl}_{case}"), s, case) for impl in impls]
    records: dict[str, list[dict[str, float]]] = {side.name: [] for side in sides}
    for r in range(s.rounds):
        for side in (sides if r % 2 == 0 else sides[::-1]):
            records[side.name] += side.round(s.steps)[1:]
    return records


def summarise(records, memory, case: str) -> tuple[list[Row], list[str]]:
    rows, lines = [], []
    tps = {}
    for impl, recs in records.items():
        step = statistics.median(r["step"] for r in recs)
        tps[impl] = statistics.median(r["tokens"] / r["step"] for r in recs)
        tokens = statistics.median(r["tokens"] for r in recs)
        mem = memory[impl]
        rows.append(Row("s / 1k tokens", case, impl, statistics.median(r["step"] / r["tokens"] * 1e3 for r in recs)))
        rows.append(Row("step, peak beyond weights", case, impl, step, mem["first"]))
        rows.append(Row("steady step, peak", case, impl, step, mem["steady"]))
        lines.append(f"{case} | {impl}: {len(recs)} steps, {tokens:.0f} tokens/step, step {step * 1e3:.0f} ms, "
                     f"{tps[impl]:.0f} tok/s; peak beyond weights {mem['first'] / 2**20:.0f} MiB (first step), "
                     f"{mem['steady'] / 2**20:.0f} MiB (steady step)")
    if "trl" in records:
        lines.append(f"{case} | megalign / trl tokens/s: {tps['megalign'] / tps['trl']:.2f}x (target >= 1.5x); "
                     f"megalign / trl peak beyond weights: "
                     f"{memory['megalign']['first'] / memory['trl']['first']:.0%} first step, "
                     f"{memory['megalign']['steady'] / memory['trl']['steady']:.0%} steady step (target <= 60%)")
    return rows, lines


def _run(quick: bool, threads: int, cases: tuple[str, ...]) -> tuple[list[Row], list[str]]:
    quiet()
    torch.set_num_threads(threads)
    s = Setup(batch=8, rounds=2, steps=3) if quick else Setup(batch=32, rounds=2, steps=3)
    version = trl_available()
    lines = []
    if version is None:
        lines.append("trl is not installed (`pip install trl`, a benchmark-only dependency): TRL rows skipped")
        print(lines[-1], file=sys.stderr)
    impls = ["megalign"] + (["trl"] if version is not None else [])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, f"model_v{s.vocab}")
        build_model_dir(model_dir, s.vocab)
        data_path = os.path.join(tmp, "pairs.jsonl")
        write_pairs(data_path, s.batch * s.steps)
        for case in cases:
            label = f"{case} V={s.vocab} B={s.batch} pairs"
            memory = {impl: in_fresh_process(_memory_child, impl, model_dir, data_path,
                                             os.path.join(tmp, f"mem_{impl}_{case}"), s, case, threads)
                      for impl in impls}
            case_rows, case_lines = summarise(measure(model_dir, data_path, tmp, s, case, impls), memory, label)
            rows += case_rows
            lines += case_lines
    return rows, lines


def run(quick: bool = False, threads: int = 1) -> list[Row]:
    rows, _ = _run(quick, threads, CASES)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="B=8 pairs instead of 32 (2 rounds of 3 steps either way)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both sides (default 1)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    parser.add_argument("--json", help="also write the rows and lines here")
    args = parser.parse_args()
    cases = tuple(args.cases.split(","))
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; choose from {list(CASES)}")
    import transformers

    t0 = time.perf_counter()
    rows, lines = _run(args.quick, args.threads, cases)
    print_report(f"{machine_line()}; transformers {transformers.__version__}, trl {trl_available() or '-'}",
                 rows, lines, time.perf_counter() - t0, args.json)


if __name__ == "__main__":
    main()
