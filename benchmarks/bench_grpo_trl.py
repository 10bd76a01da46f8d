"""GRPO step throughput: megalign's GRPO trainer vs TRL's `GRPOTrainer`, side by side in one process.

    python benchmarks/bench_grpo_trl.py [--quick]

TRL is a test / benchmark extra (`pip install -e ".[trl]"`, also in `[test]`); without it the TRL rows
are skipped with a message and only megalign is measured.

The same work on both sides, per step:

- Model: a random Llama (4 layers, hidden 256, 4 heads, fp32) and a character-level HF tokenizer
  (`tokenizers` WordLevel over printable ASCII + `<pad>`, `<bos>`, `<eos>`: 99 tokens, wrapped as
  `PreTrainedTokenizerFast` with a chat template, BOS added by its post-processor), both saved with
  `save_pretrained` into one temp dir that both frameworks load. Cases V=99 (the task's own
  alphabet: the LM head is negligible) and V=32000 (placeholder tokens fill the vocabulary, as in a
  real tokenizer: the LM head and the log-softmax over the vocabulary become a large share).
- Prompts: the embedded arithmetic task's train split (`megalign.data.arith`), as raw text after BOS
  on both sides (megalign `prompt` rows; TRL non-conversational `prompt` column), in dataset order
  (no shuffling on either side), so both generate from the same prompts.
- P prompts x G completions per step, temperature 1, top-p 1, no top-k, at most R new tokens;
  reward = megalign's `math_accuracy` (TRL gets a wrapper of the same function); group-normalised
  advantages; token-mean loss (megalign `token-mean`, TRL `dapo`), clip 0.2 both sides; old
  log-probs not recomputed (megalign: from the rollout; TRL: num_iterations=1 and
  steps_per_generation=1 skip them); one optimizer step per GRPO step over all P*G responses in one
  micro-batch (megalign mini_batches=1, micro_batch_size=P*G; TRL per_device_train_batch_size=P*G,
  gradient_accumulation_steps=1); AdamW betas (0.9, 0.95), constant lr, grad clip 1.0; beta=0
  (no reference model on either side) and beta=0.04 (a frozen reference copy on both sides).
- megalign: no dynamic sampling, no overlong masking; TRL: mask_truncated_completions=False and
  gradient_checkpointing=False (TRL defaults it to True, which recomputes the forward in the
  backward; megalign's activation checkpointing is off by default too).

Timing: both trainers live in this process and run alternately, rounds of `steps` steps each
(megalign then TRL in even rounds, TRL then megalign in odd ones), so load from other processes on the machine hits both; the
first step of every round is warm-up and dropped, the reported numbers are medians of the rest.
megalign's per-step phases are its own `time/*` metrics. TRL's step is timed with a
`TrainerCallback` (on_step_begin -> on_step_end: generation, scoring, the update and the optimizer
step) and its phases by wrapping its methods on the instance: generation = `_generate_single_turn`
(`model.generate` + EOS masking), scoring = `_calculate_rewards`, reference =
`_get_per_token_logps_and_entropies` calls made while preparing the batch (no grad),
update = step - `_prepare_inputs` (forward/backward + optimizer). Generated tokens are counted per
completion up to and including EOS on both sides. "tokens/s" = generated tokens / whole step time;
the table's "s / 1k gen tokens" row is its inverse, so that row's "time / megalign" ratio is
megalign's speed-up in generated tokens per second.

Threads: one torch thread per side by default (`--threads`). The model is tiny, so an op is
microseconds of math, and on a shared 2-core machine two OpenMP threads that get descheduled turn
every op into a barrier wait: a 16 x 16-token `generate` of this model measured 0.1-0.3 s with
one thread and 2.9-4.2 s with two while other jobs ran. One thread keeps both sides out of that.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness import Row, build_model_dir, print_report, quiet, trl_available  # noqa: E402

from megalign.data import ArithTaskConfig, TokenizerConfig, make_splits  # noqa: E402
from megalign.rewards.math import math_accuracy  # noqa: E402

PHASES = ("generate", "score", "reference", "update", "other")
@dataclasses.dataclass
class Setup:
    prompts: int
    group: int
    max_new: int
    rounds: int
    steps: int  # per round, the first dropped
    cases: tuple[tuple[int, float], ...]  # (vocab size, beta)
    lr: float = 1e-4
    seed: int = 0


# ----- megalign side

class MegalignSide:
    name = "megalign"

    def __init__(self, model_dir: str, run_dir: str, s: Setup, beta: float):
        from megalign.roles import RewardConfig
        from megalign.trainers.cli import init_distributed
        from megalign.trainers.evaluation import EvalConfig
        from megalign.trainers.grpo import AlgoConfig, GRPOConfig, GRPOTrainer
        from megalign.trainers.online_config import ActorConfig, PromptDataConfig, RolloutConfig
        from megalign.trainers.optim import OptimConfig

        init_distributed("cpu")
        n = s.prompts * s.group
        cfg = GRPOConfig(
            run_dir=run_dir, steps=10**6, seed=s.seed, device="cpu", actor=ActorConfig(path=model_dir),
            reward=RewardConfig(),  # math_accuracy, weight 1
            data=PromptDataConfig(tokenizer=TokenizerConfig(kind="hf", path=model_dir), shuffle=False),
            rollout=RolloutConfig(group_size=s.group, prompts_per_step=s.prompts, temperature=1.0, top_p=1.0,
                                  max_response_length=s.max_new, old_logprobs="rollout"),
            algo=AlgoConfig(eps_low=0.2, eps_high=None, kl_coef=beta, loss_agg="token-mean", advantage="grpo",
                            dynamic_sampling=False, overlong="none", mini_batches=1, ppo_epochs=1, micro_batch_size=n),
            optim=OptimConfig(lr=s.lr, warmup_steps=0, schedule="constant", weight_decay=0.0, betas=(0.9, 0.95),
                              grad_clip=1.0),
            eval=EvalConfig(max_samples=0), save_every=0, resume="none", export_hf=False, tensorboard=False)
        self.trainer = GRPOTrainer(cfg)
        self.n = n

    def round(self, steps: int) -> list[dict[str, float]]:
        out = []
        for _ in range(steps):
            m = self.trainer.train_step()
            self.trainer.progress["step"] += 1
            phases = {"generate": m.get("time/generate", 0.0), "score": m.get("time/reward", 0.0),
                      "reference": m.get("time/reference", 0.0) + m.get("time/old_logprobs", 0.0),
                      "update": m.get("time/update", 0.0)}
            phases["other"] = m["time/step"] - sum(phases.values())
            out.append({"step": m["time/step"], "tokens": m["response_length/mean"] * self.n, **phases})
        return out


# ----- TRL side

def _math_accuracy_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """megalign's `math_accuracy` as a TRL reward function (the `answer` column comes as a kwarg)."""
    return [math_accuracy(c, a) for c, a in zip(completions, answer)]


class TRLSide:
    name = "trl"

    def __init__(self, model_dir: str, out_dir: str, s: Setup, beta: float):
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer

        train, _ = make_splits(ArithTaskConfig())
        self.dataset = Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in train])
        n = s.prompts * s.group
        self.args = GRPOConfig(
            output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, report_to="none", use_vllm=False,
            per_device_train_batch_size=n, gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
            num_generations=s.group, max_completion_length=s.max_new, temperature=1.0, top_p=1.0, top_k=0,
            beta=beta, epsilon=0.2, loss_type="dapo", scale_rewards="group", mask_truncated_completions=False,
            learning_rate=s.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
            adam_beta2=0.95, max_grad_norm=1.0, max_steps=s.steps, shuffle_dataset=False, seed=s.seed,
            gradient_checkpointing=False,  # TRL's default is True; megalign stores activations (its default)
            logging_steps=1, save_strategy="no", disable_tqdm=True, log_completions=False,
            dataloader_num_workers=0)
        self.model_dir, self.trainer_cls = model_dir, GRPOTrainer
        self.trainer = None

    def _build(self):
        from transformers import AutoTokenizer, TrainerCallback

        tokenizer = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
        trainer = self.trainer_cls(model=self.model_dir, reward_funcs=_math_accuracy_reward, args=self.args,
                                   train_dataset=self.dataset, processing_class=tokenizer)
        records: list[dict[str, float]] = []
        acc: dict[str, float] = {}
        state = {"preparing": False}

        def timed(name, fn, count_tokens=False, only_when_preparing=False):
            def wrapper(*args, **kwargs):
                t0 = time.perf_counter()
                result = fn(*args, **kwargs)
                dt = time.perf_counter() - t0
                if not only_when_preparing or state["preparing"]:
                    acc[name] = acc.get(name, 0.0) + dt
                if count_tokens:
                    acc["tokens"] = acc.get("tokens", 0.0) + sum(len(c) for c in result[0])
                return result
            return wrapper

        prepare = trainer._prepare_inputs

        def prepare_inputs(*args, **kwargs):
            state["preparing"] = True
            try:
                return timed("prepare", prepare)(*args, **kwargs)
            finally:
                state["preparing"] = False

        trainer._generate_single_turn = timed("generate", trainer._generate_single_turn, count_tokens=True)
        trainer._calculate_rewards = timed("score", trainer._calculate_rewards)
        trainer._get_per_token_logps_and_entropies = timed("reference", trainer._get_per_token_logps_and_entropies,
                                                           only_when_preparing=True)
        trainer._prepare_inputs = prepare_inputs

        class StepTimer(TrainerCallback):
            def on_step_begin(self, args, st, control, **kw):
                acc.clear()
                acc["t0"] = time.perf_counter()

            def on_step_end(self, args, st, control, **kw):
                step = time.perf_counter() - acc["t0"]
                phases = {k: acc.get(k, 0.0) for k in ("generate", "score", "reference")}
                phases["update"] = step - acc.get("prepare", 0.0)
                phases["other"] = acc.get("prepare", 0.0) - sum(phases[k] for k in ("generate", "score", "reference"))
                records.append({"step": step, "tokens": acc.get("tokens", 0.0), **phases})

        trainer.add_callback(StepTimer())
        self.trainer, self.records = trainer, records

    def round(self, steps: int) -> list[dict[str, float]]:
        if self.trainer is None:
            self._build()
        self.args.max_steps = steps
        self.records.clear()
        with contextlib.redirect_stdout(io.StringIO()):  # its per-step log dicts
            self.trainer.train()
        return list(self.records)


# ----- the comparison

def _median(records: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in records)


def measure(model_dir: str, tmp: str, s: Setup, beta: float, with_trl: bool) -> dict[str, list[dict[str, float]]]:
    """{impl: per-step records after warm-up}, the implementations alternating round by round."""
    tag = f"{os.path.basename(model_dir)}_beta{beta}"
    sides = [MegalignSide(model_dir, os.path.join(tmp, f"mg_{tag}"), s, beta)]
    if with_trl:
        sides.append(TRLSide(model_dir, os.path.join(tmp, f"trl_{tag}"), s, beta))
    records: dict[str, list[dict[str, float]]] = {side.name: [] for side in sides}
    for r in range(s.rounds):
        for side in (sides if r % 2 == 0 else sides[::-1]):
            records[side.name] += side.round(s.steps)[1:]
    return records


def summarise(records: dict[str, list[dict[str, float]]], case: str) -> tuple[list[Row], list[str]]:
    rows, lines = [], []
    # a phase megalign does not run here (reference at beta=0) has no ratio: left out of the table
    phases = [p for p in PHASES if _median(records["megalign"], p) > 0]
    for impl, recs in records.items():
        step, tokens = _median(recs, "step"), _median(recs, "tokens")
        rows.append(Row("s / 1k gen tokens", case, impl, statistics.median(r["step"] / r["tokens"] * 1e3 for r in recs)))
        rows.append(Row("step", case, impl, step))
        for phase in phases:
            rows.append(Row(phase, case, impl, _median(recs, phase)))
        tps = statistics.median(r["tokens"] / r["step"] for r in recs)
        gen_tps = statistics.median(r["tokens"] / max(r["generate"], 1e-9) for r in recs)
        split = ", ".join(f"{p} {_median(recs, p) * 1e3:.0f} ms ({_median(recs, p) / step:.0%})" for p in PHASES)
        lines.append(f"{case} | {impl}: {len(recs)} steps, {tokens:.0f} gen tokens/step, step {step * 1e3:.0f} ms, "
                     f"{tps:.0f} tok/s (generation phase alone {gen_tps:.0f} tok/s); {split}")
    if "trl" in records:
        ours = statistics.median(r["tokens"] / r["step"] for r in records["megalign"])
        theirs = statistics.median(r["tokens"] / r["step"] for r in records["trl"])
        lines.append(f"{case} | megalign / trl generated tokens/s: {ours / theirs:.2f}x")
    return rows, lines


def run(quick: bool = False, threads: int = 1) -> list[Row]:
    rows, _ = _run(quick, threads)
    return rows


def _run(quick: bool, threads: int = 1) -> tuple[list[Row], list[str]]:
    quiet()
    torch.set_num_threads(threads)
    s = Setup(prompts=4, group=4, max_new=16, rounds=2, steps=2, cases=((99, 0.0),)) if quick else \
        Setup(prompts=16, group=8, max_new=24, rounds=3, steps=3, cases=((99, 0.0), (99, 0.04), (32000, 0.0)))
    version = trl_available()
    lines = []
    if version is None:
        lines.append("trl is not installed (`pip install trl`, a benchmark-only dependency): TRL rows skipped")
        print(lines[-1], file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for vocab, beta in s.cases:
            model_dir = os.path.join(tmp, f"model_v{vocab}")
            if not os.path.isdir(model_dir):
                build_model_dir(model_dir, vocab)
            case = f"V={vocab} beta={beta:g} P={s.prompts} G={s.group} R={s.max_new}"
            case_rows, case_lines = summarise(measure(model_dir, tmp, s, beta, version is not None), case)
            rows += case_rows
            lines += case_lines
    return rows, lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one beta, under a minute")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for both sides (default 1: see the module doc)")
    parser.add_argument("--json", help="also write the rows and lines here")
    args = parser.parse_args()
    import transformers

    t0 = time.perf_counter()
    rows, lines = _run(args.quick, args.threads)
    print_report(f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl_available() or '-'}, "
                 f"{torch.get_num_threads()} threads", rows, lines, time.perf_counter() - t0, args.json)


if __name__ == "__main__":
    main()
