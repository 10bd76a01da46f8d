"""PPO step throughput and peak memory: megalign's PPO trainer vs TRL's `PPOTrainer`, side by side in one process.

    pip install --no-deps --target /tmp/trl_ppo trl==1.12.0   # once: TRL's last release with PPO
    python benchmarks/bench_ppo_trl.py --trl-path /tmp/trl_ppo [--quick]

TRL's PPO (`trl.experimental.ppo`) shipped up to TRL 1.12.0 and is gone from 1.13 on (the project's
TRL 1.16 has no `trl.experimental.ppo`), so the TRL side imports TRL 1.12.0 from `--trl-path` (put
first on `sys.path`; installed with `--no-deps`, it runs on the same torch, transformers and
accelerate as megalign). Without it the TRL rows are skipped with a message.

The same work on both sides, per step:

- Models: four roles from two random checkpoints of the same shape (4 layers, hidden 256, 4 heads, fp32,
  vocab 32000; `harness.build_model_dir`'s char-level tokenizer with placeholder tokens filling the
  vocabulary): the policy (actor, and the frozen reference: a second copy of the same weights on both
  sides) and a `LlamaForSequenceClassification` with one label, which is the reward model and the
  critic's initialisation (TRL: `value_model` and `reward_model` both loaded from it; megalign:
  `reward.model.path` and `critic.path`, the critic reading its head).
- Prompts: the first P prompts of the embedded arithmetic task's train split, as raw text after BOS.
  megalign reads them from a prompt file (P prompts x G responses per step); TRL's dataset holds each
  of them G times and its batch is the whole dataset (P * G rows, shuffled by its loader), so every
  step of both sides samples from the same P prompts.
- Exactly R generated tokens per response on both sides: no stop token (TRL `stop_token=None`, which
  also clears the policy's `generation_config.eos_token_id`; megalign's trainer gets sampling
  parameters without `eos_token_id`), temperature 1, no top-k / top-p. Generated tokens are counted
  from the generated columns on both sides.
- Old log-probs from the sampling pass (TRL takes them from `generate`'s scores; megalign
  `rollout.old_logprobs=rollout`); reference log-probs and critic values in one no-grad forward of all
  P * G rows (TRL `local_rollout_forward_batch_size=P*G`; megalign `algo.micro_batch_size=P*G`).
- TRL's objective, configured on megalign: k1 KL in the per-token reward with a fixed beta = 0.05
  (TRL `kl_coef`, `kl_estimator=k1`; megalign `algo.kl_in=reward`, `kl_estimator=k1`, no `kl_target`),
  the score at the last response token, GAE gamma = 1, lambda = 0.95, advantages whitened, values
  clipped at +-0.2 around the old values with the 0.5 max-of-squares loss, policy clip 0.2, no entropy
  bonus, no reward whitening / normalisation / clipping.
- Updates: 2 PPO epochs x 2 mini-batches of P*G/2 rows, one optimizer step per mini-batch, no gradient
  accumulation (TRL `num_ppo_epochs=2`, `num_mini_batches=2`, `per_device_train_batch_size=P*G`,
  `gradient_accumulation_steps=1`; megalign `algo.ppo_epochs=2`, `algo.mini_batches=2`); AdamW
  betas (0.9, 0.999), constant lr 1e-5 for actor and critic, no weight decay, torch's fused AdamW (TRL's
  default `optim=adamw_torch_fused`; megalign `optim.fused=true`, `critic.optim.fused=true`); fp32 weights
  (TRL `bf16=False`), no activation checkpointing (TRL's PPOConfig defaults
  `gradient_checkpointing=True`: set False, as megalign stores activations by default).

What differs and cannot be configured away (say so beside the numbers):

- TRL trains policy and value model as one module (`PolicyAndValueWrapper`) with one AdamW: loss =
  pg_loss + vf_coef * vf_loss (vf_coef = 0.1 by default, kept), one backward through both. megalign
  runs the critic's update and then the actor's, each with its own AdamW (the value loss unscaled).
  So TRL's update phase is both updates; the table gives megalign's two updates summed beside it.
- TRL's PPO loop never clips gradients (no `clip_grad_norm_` in it); megalign clips each role's
  global norm at 1.0 (its default, kept: one norm per optimizer step).
- TRL computes the entropy of every updated token over the vocabulary (a softmax of the [b, R, V]
  logits per micro-batch) and keeps `generate`'s [N, R, V] scores; megalign records only the sampled
  token's log-prob during sampling and computes the entropy only for the logged metric (fused).
- TRL treats a sampled pad token as the end of the response for the masks (random models sample it);
  megalign masks by what was generated. The compute per step is the same (fixed shapes).

Timing: both trainers live in this process and run alternately in rounds of `steps` steps (megalign
then TRL in even rounds, TRL then megalign in odd ones), so load from other processes hits both; the
first step of every round is warm-up and dropped, the numbers are medians of the rest. megalign's
phases are its `time/<phase>` metrics (generate, reward, reference, values, critic_update, update).
TRL's step runs from one `on_step_end` callback to the next (from `on_train_begin` for the first),
and its phases by wrapping `trl.experimental.ppo.ppo_trainer`'s module functions for the step:
generate = `batch_generation`, reference = `forward` calls without grad, values / reward =
`get_reward` on the value model / reward model, update = from the first `forward` with grad to the
step's end (forward + backward + AdamW of both models, over all epochs and mini-batches); the rest
(log-probs from the scores, GAE, whitening, logging, `gc.collect`) is "other" on both sides.
"tokens/s" = generated tokens / whole step time; the table's "s / 1k gen tokens" row is its inverse, so
its "time / megalign" ratio is megalign's speed-up in generated tokens per second. Beside the wall
time, each step's CPU time of this process (`time.process_time`) is reported: with one torch thread it
is the step's work, which other jobs on a loaded machine do not inflate as they do the wall time.

Peak memory: in this process, glibc told (`mallopt`) to serve every allocation above 64 KiB with mmap so
freed buffers leave RSS; the kernel's peak-RSS counter is reset before each timed step
(`harness.reset_peak_rss`) and read after it: "peak" is the median of the steps' high-water marks
above the RSS at their start (the weights, optimizer states and the other side's models are in that
base, so it is the step's own transient memory: activations, logits, gradients, rollout buffers).

Threads: one torch thread by default (`--threads`): see bench_grpo_trl.py's module doc for why on a
shared 2-core machine.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
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

from harness import (
    Row,
    build_model_dir,
    machine_line,
    peak_rss_since,
    print_report,
    quiet,
    reset_peak_rss,
)

from megalign.data import ArithTaskConfig, make_splits

PHASES = ("generate", "reward", "reference", "values", "update", "other")
MEGALIGN_UPDATES = ("critic_update", "actor_update")


@dataclasses.dataclass
class Setup:
    prompts: int
    group: int
    max_new: int
    rounds: int
    steps: int  # per round, the first dropped
    epochs: int = 2
    mini_batches: int = 2
    kl_coef: float = 0.05
    lr: float = 1e-5
    seed: int = 0

    @property
    def rows(self) -> int:
        return self.prompts * self.group


def build_models(root: str, vocab: int) -> tuple[str, str]:
    """(policy dir, reward-model dir): `build_model_dir`'s Llama and tokenizer, and a one-label
    `LlamaForSequenceClassification` of the same config (its own random weights) with the same tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    policy, rm = os.path.join(root, "policy"), os.path.join(root, "rm")
    build_model_dir(policy, vocab)
    config = LlamaConfig.from_pretrained(policy)
    config.num_labels = 1
    torch.manual_seed(1)
    LlamaForSequenceClassification(config).save_pretrained(rm)
    AutoTokenizer.from_pretrained(policy).save_pretrained(rm)
    return policy, rm


def first_prompts(n: int) -> list[dict[str, str]]:
    train, _ = make_splits(ArithTaskConfig())
    if len(train) < n:
        raise ValueError(f"the arithmetic train split has {len(train)} prompts, fewer than prompts={n}")
    return [{"prompt": e.prompt, "answer": e.answer} for e in train[:n]]


class PeakSteps:
    """Marks and reads the peak RSS of each step (module doc)."""

    def __init__(self):
        self.base = reset_peak_rss()

    def start(self):
        self.base = reset_peak_rss()

    def read(self) -> int:
        return peak_rss_since(self.base)


# ----- megalign side

class MegalignSide:
    name = "megalign"

    def __init__(self, policy: str, rm: str, prompt_file: str, run_dir: str, s: Setup):
        from megalign.config import load_config
        from megalign.trainers.cli import init_distributed
        from megalign.trainers.ppo import PPOConfig, PPOTrainer

        init_distributed("cpu")
        cfg = load_config(PPOConfig, None, [
            f"run_dir={run_dir}", f"actor.path={policy}", f"reference.path={policy}", f"critic.path={rm}",
            f"reward.model.path={rm}", "reward.terms=[]", "steps=1000000", f"seed={s.seed}", "device=cpu",
            f"data.path={prompt_file}", "data.tokenizer.kind=hf", f"data.tokenizer.path={policy}", "data.shuffle=false",
            f"rollout.prompts_per_step={s.prompts}", f"rollout.group_size={s.group}",
            f"rollout.max_response_length={s.max_new}", "rollout.temperature=1.0", "rollout.top_p=1.0",
            "rollout.old_logprobs=rollout",
            f"algo.kl_coef={s.kl_coef}", "algo.kl_in=reward", "algo.kl_estimator=k1", "algo.gamma=1.0", "algo.lam=0.95",
            "algo.whiten_advantages=true", "algo.cliprange_value=0.2", "algo.eps_low=0.2", "algo.entropy_coef=0",
            "algo.loss_agg=token-mean", f"algo.ppo_epochs={s.epochs}", f"algo.mini_batches={s.mini_batches}",
            f"algo.micro_batch_size={s.rows}",
            *(f"{o}.{k}" for o in ("optim", "critic.optim") for k in (
                f"lr={s.lr}", "warmup_steps=0", "schedule=constant", "weight_decay=0.0", "betas=[0.9,0.999]",
                "grad_clip=1.0", "fused=true")),
            "eval.max_samples=0", "save_every=0", "resume=none", "export_hf=false", "tensorboard=false"])
        self.trainer = PPOTrainer(cfg)
        # exactly max_new tokens per response, as TRL without a stop token (module doc)
        self.trainer.params = dataclasses.replace(self.trainer.params, eos_token_id=None)
        self.s = s

    def round(self, steps: int, peak: PeakSteps) -> list[dict[str, float]]:
        out = []
        for _ in range(steps):
            peak.start()
            cpu = time.process_time()
            m = self.trainer.train_step()
            cpu = time.process_time() - cpu
            mem = peak.read()
            self.trainer.progress["step"] += 1
            phases = {p: m.get(f"time/{p}", 0.0) for p in ("generate", "reward", "reference", "values")}
            phases["critic_update"] = m.get("time/critic_update", 0.0)
            phases["actor_update"] = m.get("time/update", 0.0)
            phases["update"] = phases["critic_update"] + phases["actor_update"]
            phases["other"] = m["time/step"] - sum(phases[p] for p in PHASES[:-1])
            out.append({"step": m["time/step"], "cpu": cpu, "tokens": m["response_length/mean"] * self.s.rows,
                        "peak": mem, **phases})
        return out


# ----- TRL side

class TRLSide:
    name = "trl"

    def __init__(self, policy: str, rm: str, prompts: list[dict[str, str]], out_dir: str, s: Setup):
        from datasets import Dataset
        from transformers import (
            AutoModelForCausalLM,
            AutoModelForSequenceClassification,
            AutoTokenizer,
        )
        from trl.experimental.ppo import PPOConfig, PPOTrainer
        from trl.experimental.ppo import ppo_trainer as module

        tok = AutoTokenizer.from_pretrained(policy, local_files_only=True)
        tok.padding_side = "left"  # queries are left-padded for generate, as TRL's PPO examples set
        rows = [tok(p["prompt"])["input_ids"] for p in prompts for _ in range(s.group)]
        dataset = Dataset.from_dict({"input_ids": rows})
        self.args = PPOConfig(
            output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, report_to="none", seed=s.seed,
            per_device_train_batch_size=s.rows, gradient_accumulation_steps=1, num_mini_batches=s.mini_batches,
            num_ppo_epochs=s.epochs, local_rollout_forward_batch_size=s.rows, total_episodes=s.rows * s.steps,
            response_length=s.max_new, stop_token=None, temperature=1.0, missing_eos_penalty=None,
            kl_coef=s.kl_coef, kl_estimator="k1", whiten_rewards=False, cliprange=0.2, cliprange_value=0.2,
            gamma=1.0, lam=0.95, learning_rate=s.lr, lr_scheduler_type="constant", warmup_steps=0,
            weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, gradient_checkpointing=False,
            num_sample_generations=0, logging_steps=1, save_strategy="no", disable_tqdm=True,
            dataloader_num_workers=0)
        load = {"local_files_only": True, "dtype": torch.float32}
        self.trainer = PPOTrainer(
            args=self.args, processing_class=tok, model=AutoModelForCausalLM.from_pretrained(policy, **load),
            ref_model=AutoModelForCausalLM.from_pretrained(policy, **load),
            reward_model=AutoModelForSequenceClassification.from_pretrained(rm, num_labels=1, **load),
            value_model=AutoModelForSequenceClassification.from_pretrained(rm, num_labels=1, **load),
            train_dataset=dataset)
        self.s, self.module = s, module
        self.records: list[dict[str, float]] = []
        self._instrument()

    def _instrument(self):
        """Wrap the PPO module's functions and add the step callback (module doc)."""
        from transformers import TrainerCallback

        module, trainer, acc, records = self.module, self.trainer, {}, self.records
        self.acc, self.peak = acc, None
        generate, forward, get_reward = module.batch_generation, module.forward, module.get_reward

        def add(name, t0):
            acc[name] = acc.get(name, 0.0) + time.perf_counter() - t0

        def timed_generation(model, queries, *args, **kwargs):
            t0 = time.perf_counter()
            out = generate(model, queries, *args, **kwargs)
            add("generate", t0)
            acc["tokens"] = acc.get("tokens", 0.0) + out[0].shape[0] * (out[0].shape[1] - queries.shape[1])
            return out

        def timed_forward(model, *args, **kwargs):
            if torch.is_grad_enabled():
                acc.setdefault("update_start", time.perf_counter())
                return forward(model, *args, **kwargs)
            t0 = time.perf_counter()
            out = forward(model, *args, **kwargs)
            add("reference", t0)
            return out

        def timed_reward(model, *args, **kwargs):
            t0 = time.perf_counter()
            out = get_reward(model, *args, **kwargs)
            add("reward" if model is trainer.reward_model else "values", t0)
            return out

        module.batch_generation, module.forward, module.get_reward = timed_generation, timed_forward, timed_reward
        side = self

        class StepTimer(TrainerCallback):
            def on_train_begin(self, args, state, control, **kw):
                acc.clear()
                side.peak.start()
                acc["t0"], acc["cpu0"] = time.perf_counter(), time.process_time()

            def on_step_end(self, args, state, control, **kw):
                end, cpu = time.perf_counter(), time.process_time() - acc["cpu0"]
                mem = side.peak.read()
                step = end - acc["t0"]
                phases = {k: acc.get(k, 0.0) for k in ("generate", "reward", "reference", "values")}
                phases["update"] = end - acc.get("update_start", end)
                phases["other"] = step - sum(phases.values())
                records.append({"step": step, "cpu": cpu, "tokens": acc.get("tokens", 0.0), "peak": mem, **phases})
                acc.clear()
                side.peak.start()
                acc["t0"], acc["cpu0"] = time.perf_counter(), time.process_time()

        trainer.add_callback(StepTimer())

    def round(self, steps: int, peak: PeakSteps) -> list[dict[str, float]]:
        self.peak = peak
        self.args.num_total_batches = steps
        self.args.total_episodes = steps * self.s.rows
        self.records.clear()
        with contextlib.redirect_stdout(io.StringIO()):  # its per-step log dicts and banners
            self.trainer.train()
        return list(self.records)


# ----- the comparison

def _median(records: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in records)


def summarise(records: dict[str, list[dict[str, float]]], case: str) -> tuple[list[Row], list[str]]:
    rows, lines = [], []
    for impl, recs in records.items():
        step, tokens, peak = _median(recs, "step"), _median(recs, "tokens"), int(_median(recs, "peak"))
        rows.append(Row("s / 1k gen tokens", case, impl, statistics.median(r["step"] / r["tokens"] * 1e3 for r in recs)))
        rows.append(Row("step (peak: the step's RSS high-water mark)", case, impl, step, peak))
        rows.append(Row("step, CPU time of the process", case, impl, _median(recs, "cpu")))
        for phase in PHASES:
            rows.append(Row(phase if phase != "update" else "update (critic + actor)", case, impl, _median(recs, phase)))
        tps = statistics.median(r["tokens"] / r["step"] for r in recs)
        split = ", ".join(f"{p} {_median(recs, p) * 1e3:.0f} ms ({_median(recs, p) / step:.0%})" for p in PHASES)
        if impl == "megalign":
            split += "; update = " + " + ".join(f"{p} {_median(recs, p) * 1e3:.0f} ms" for p in MEGALIGN_UPDATES)
        lines.append(f"{case} | {impl}: {len(recs)} steps, {tokens:.0f} gen tokens/step, step {step * 1e3:.0f} ms "
                     f"(CPU {_median(recs, 'cpu') * 1e3:.0f} ms), "
                     f"{tps:.0f} tok/s, peak {peak / 2**20:.0f} MiB; {split}")
    if "trl" in records:
        ours = statistics.median(r["tokens"] / r["step"] for r in records["megalign"])
        theirs = statistics.median(r["tokens"] / r["step"] for r in records["trl"])
        mem = _median(records["trl"], "peak") / max(_median(records["megalign"], "peak"), 1)
        cpu = _median(records["trl"], "cpu") / _median(records["megalign"], "cpu")
        lines.append(f"{case} | megalign / trl generated tokens/s: {ours / theirs:.2f}x (target >= 2x: "
                     f"{'met' if ours / theirs >= 2 else 'missed'}); trl / megalign step CPU time: {cpu:.2f}x; "
                     f"trl / megalign step peak memory: {mem:.2f}x")
    return rows, lines


def _trl_ppo_version(trl_path: str | None) -> str | None:
    if trl_path:
        sys.path.insert(0, trl_path)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    try:
        import trl
        import trl.experimental.ppo
    except ImportError:
        return None
    return trl.__version__


def _run(quick: bool, threads: int, trl_path: str | None) -> tuple[list[Row], list[str], str | None]:
    quiet()
    torch.set_num_threads(threads)
    ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD: module doc, "Peak memory"
    s = Setup(prompts=4, group=4, max_new=8, rounds=2, steps=2) if quick else \
        Setup(prompts=16, group=4, max_new=24, rounds=2, steps=3)
    version = _trl_ppo_version(trl_path)
    lines = []
    if version is None:
        lines.append("trl.experimental.ppo is not importable (TRL 1.13+ removed it: pip install --no-deps --target DIR "
                     "trl==1.12.0 and pass --trl-path DIR): TRL rows skipped")
        print(lines[-1], file=sys.stderr)
    vocab = 32000
    with tempfile.TemporaryDirectory() as tmp:
        policy, rm = build_models(tmp, vocab)
        prompts = first_prompts(s.prompts)
        prompt_file = os.path.join(tmp, "prompts.jsonl")
        with open(prompt_file, "w") as f:
            f.writelines(json.dumps(p) + "\n" for p in prompts)
        peak = PeakSteps()
        sides = [MegalignSide(policy, rm, prompt_file, os.path.join(tmp, "mg"), s)]
        if version is not None:
            sides.append(TRLSide(policy, rm, prompts, os.path.join(tmp, "trl"), s))
        records: dict[str, list[dict[str, float]]] = {side.name: [] for side in sides}
        for r in range(s.rounds):
            for side in (sides if r % 2 == 0 else sides[::-1]):
                records[side.name] += side.round(s.steps, peak)[1:]
        case = f"V={vocab} P={s.prompts} G={s.group} R={s.max_new} epochs={s.epochs} mb={s.mini_batches}"
        rows, case_lines = summarise(records, case)
    return rows, lines + case_lines, version


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, under a few minutes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both sides (default 1)")
    parser.add_argument("--trl-path", help="folder holding TRL 1.12.0 (the last TRL with trl.experimental.ppo)")
    parser.add_argument("--json", help="also write the rows and lines here")
    args = parser.parse_args()
    import transformers

    t0 = time.perf_counter()
    rows, lines, version = _run(args.quick, args.threads, args.trl_path)
    print_report(f"{machine_line()}; transformers {transformers.__version__}, trl {version or '-'}", rows, lines,
                 time.perf_counter() - t0, args.json)


if __name__ == "__main__":
    main()
