#!/usr/bin/env python3
"""Step 5 of the prepared GPU check (issues 29 and 30): one GRPO step of a Qwen3-1.7B-sized and a LoRA one of a
Qwen3-8B-sized random model in bf16 on one GPU, and a tiny Qwen3-MoE with routing replay on and off, through the real
trainer (`torchrun launch/train_grpo.py`, as benchmarks/gpu_e2e.py runs it, whose runner this script reuses).

    python3 benchmarks/gpu_models.py --out DIR                        # on the GPU (benchmarks/gpu_check.sh), <= 270 s
    python benchmarks/gpu_models.py --device cpu --tiny --out DIR     # the same phases on the CPU, tiny models

Phases, each in its own process under a timeout from the remaining `--budget` (caps below, per phase, H100 guesses:
no GPU run of this script yet); a failed phase prints its log's tail and the next one runs:

  build  random models from `transformers` configs, saved in bf16 in a work folder (/dev/shm when it has room):
         Qwen3-1.7B's shape (hidden 2048, 28 layers, 16 heads, 8 KV heads, head_dim 128, intermediate 6144, vocab
         151936, tied; 2.03 B parameters) and a small Qwen3-MoE (hidden 256, 4 layers, 8 experts, top 2, vocab 512),
         each with an offline tokenizer of its vocabulary (`gpu_e2e.save_tokenizer`).        cap 45 s
  dense  GRPO on the 1.7B model: actor.dtype=bf16 (bf16 compute over fp32 master weights), SDPA, the rollout engine
         with static shapes and CUDA graphs, 8 prompts x 8 samples x 128 response tokens, micro-batches of 16 rows,
         2 steps (step 1 captures the graphs; step 2 is the figure). Planned at 41.1 GiB on 80 GiB.  cap 80 s
  moe    the MoE model, GRPO with actor.routing_replay=false then true (2 steps each, engine defaults): the
         moe/router_agreement probe (replay off) and the rollout/logprob_* probes of both.       cap 50 s
  lora   builds Qwen3-8B's shape (hidden 4096, 36 layers, 32 heads, 8 KV heads, head_dim 128, intermediate 12288,
         vocab 151936, untied; 8.19 B parameters), asks the planner first (`megalign.plan`, preset qwen3-8b, this
         run's overrides, the GPU's memory; the estimate goes in the figures, and a plan that does not fit is not
         run), then GRPO with actor.lora (rank 16, alpha 32, all-linear; the base frozen in fp32), 4 prompts x 4
         samples x 64 tokens, micro-batches of 2 rows, 2 steps. Planned at 47.4 GiB on 80 GiB.  cap 130 s

A trainer phase ends once the metrics of its last step are in metrics.jsonl: the process group is then killed, as
the final checkpoint (24 GB of fp32 weights and Adam state for the 1.7B actor) and teardown are not what is measured.
The reward is gpu_e2e's (the verifier plus `varied_reward`), evaluation is off (eval.max_samples=0).

Output: as gpu_e2e, one JSON line per phase on stdout and in OUT/summary.jsonl, logs in OUT/<phase>.log. Figures per
trained step: wall seconds, the phase timers (`time/*`), generation tokens/s (`tokens_per_s`: response tokens over the
generate phase; `tokens_per_s/decode`), update tokens/s (`update_tokens_per_s`: response tokens over `time/update`),
peak GPU memory (`memory/cuda_peak_allocated_gib`, torch.cuda.max_memory_allocated), losses, gradient norms, the
`rollout/logprob_*` probes (rollout vs recomputed log-probs, bf16 here) and `moe/router_agreement`.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_e2e as e2e  # noqa: E402  (benchmarks/ is not a package)

SCRIPT = os.path.abspath(__file__)
PHASES = ("build", "dense", "moe", "lora")
CAPS = (("build", 45), ("dense", 80), ("moe", 50), ("lora", 130))          # seconds, 305 in all, budget 270
FLOORS = (("build", 10), ("dense", 40), ("moe", 25), ("lora", 90))
TINY_CAPS = (("build", 60), ("dense", 120), ("moe", 180), ("lora", 120))
TINY_FLOORS = (("build", 10), ("dense", 20), ("moe", 30), ("lora", 20))

ROPE = dict(max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6)
SHAPES = {  # name -> (transformers config class, fields)
    "dense": ("Qwen3Config", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                                  **ROPE)),
    "lora": ("Qwen3Config", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                                 **ROPE)),
    "moe": ("Qwen3MoeConfig", dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                                   tie_word_embeddings=False, **ROPE)),
}
TINY_DENSE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, **ROPE)
TINY_SHAPES = {
    "dense": ("Qwen3Config", dict(TINY_DENSE, tie_word_embeddings=True)),
    "lora": ("Qwen3Config", dict(TINY_DENSE, tie_word_embeddings=False)),
    "moe": ("Qwen3MoeConfig", dict(TINY_DENSE, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                   norm_topk_prob=True, decoder_sparse_step=1, tie_word_embeddings=False)),
}
PLAN_PRESET = {"dense": "qwen3-1.7b", "lora": "qwen3-8b"}
LORA = '{"rank": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}'
# run overrides per trained phase (GPU, tiny): the work's size, and what the phase is about
RUNS = {
    "dense": (["rollout.prompts_per_step=8", "rollout.group_size=8", "rollout.max_response_length=128",
               "algo.micro_batch_size=16"],
              ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_response_length=8"]),
    "moe": (["rollout.prompts_per_step=8", "rollout.group_size=4", "rollout.max_response_length=32",
             "rollout.engine.static=auto", "rollout.engine.cuda_graphs=auto"],
            ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_response_length=8"]),
    "lora": (["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_response_length=64",
              "algo.micro_batch_size=2", f"actor.lora={LORA}"],
             ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_response_length=8",
              f"actor.lora={LORA}"]),
}
COMMON = ["algo.mini_batches=1", "export_hf=false", "algo.dynamic_sampling=false", "algo.overlong=none",
          "eval.max_samples=0"]
PROBES = ("rollout/logprob_max_abs_diff", "rollout/logprob_k3", "rollout/logprob_bitwise_equal", "moe/router_agreement")
STEPS = 2


class ModelsRunner(e2e.Runner):
    """gpu_e2e's runner (budget, children, reports) with this script's phases."""

    def __init__(self, args: argparse.Namespace):
        super().__init__(args)
        caps, floors = (TINY_CAPS, TINY_FLOORS) if args.tiny else (CAPS, FLOORS)
        self.sizes = e2e.Sizes(prompts=0, group=0, response=0, eval_samples=0, eval_new=1, rollout_batch=0,
                               rollout_prompt=0, rollout_new=0, caps=caps, floors=floors)
        self.model = os.path.join(self.work, "dense")  # the build phase's model (gpu_e2e's check before a phase)

    def run(self) -> int:
        e2e.PHASES = PHASES  # Runner.run orders the phases by its module's list
        return super().run()

    def paths(self, name: str) -> tuple[str, str]:
        """(model folder, tokenizer folder) of model `name`."""
        vocab = (TINY_SHAPES if self.args.tiny else SHAPES)[name][1]["vocab_size"]
        return os.path.join(self.work, name), os.path.join(self.work, f"tokenizer_{vocab}")

    def build(self, phase: str, timeout: float, names: list[str]) -> tuple[str, dict]:
        result = os.path.join(self.work, f"{phase}_result.json")
        cmd = [sys.executable, SCRIPT, "--worker", ",".join(names), "--result", result, "--workdir", self.work,
               "--device", self.args.device] + (["--tiny"] if self.args.tiny else [])
        rc, _, log_path = self.child(phase, cmd, timeout)
        figures = {}
        if os.path.isfile(result):
            with open(result, encoding="utf-8") as fh:
                figures = json.load(fh)
        errors = figures.pop("errors", [])
        if rc != 0 or errors:
            return self.failure(phase, rc, log_path, {**figures, **({"errors": errors} if errors else {})})
        return "ok", figures

    def phase_build(self, timeout: float) -> tuple[str, dict]:
        status, figures = self.build("build", timeout, ["dense", "moe"])
        self.build_info = {k: figures[k] for k in ("ops_have_extension", "ops_with_cuda", "ops_mode") if k in figures}
        return status, figures

    def plan(self, name: str, overrides: list[str]) -> dict:
        """The planner's estimate of this run at the preset's full size on one GPU of this device's memory."""
        from megalign.plan.planner import plan_memory
        from megalign.plan.runconfig import plan_from_run_config

        gib = 80.0
        if self.args.device == "cuda":
            import torch

            gib = torch.cuda.get_device_properties(0).total_memory / 2**30
        sized = [o for o in overrides if o.startswith(("rollout.", "algo.", "actor.lora"))]
        plan, model = plan_from_run_config(os.path.join(e2e.ROOT, "examples", "grpo_arith.yaml"), 1, PLAN_PRESET[name],
                                           overrides=sized + ["actor.dtype=bf16"], gpu_memory_gib=gib,
                                           attention="sdpa")
        estimate = plan_memory(plan, model)
        peak = estimate.peak()
        return {"plan_peak_gib": round(peak.total / 2**30, 2), "plan_peak_phase": peak.step.phase,
                "plan_gpu_gib": round(gib, 1), "plan_fits": bool(estimate.fits)}

    def phase_dense(self, timeout: float) -> tuple[str, dict]:
        return self.train("dense", timeout, self.overrides("dense"))

    def phase_moe(self, timeout: float) -> tuple[str, dict]:
        results = {}
        for replay in ("false", "true"):
            left = timeout - sum(r.get("wall_s", 0.0) for r in results.values())
            t0 = time.perf_counter()
            status, figures = self.train(f"moe_replay_{replay}", left / (2 if replay == "false" else 1),
                                         self.overrides("moe") + [f"actor.routing_replay={replay}"])
            results[f"replay_{replay}"] = {"status": status, "wall_s": round(time.perf_counter() - t0, 1), **figures}
        ok = all(r["status"] == "ok" for r in results.values())
        return ("ok" if ok else "failed"), results

    def phase_lora(self, timeout: float) -> tuple[str, dict]:
        overrides = self.overrides("lora")
        figures = self.plan("lora", overrides) if not self.args.tiny else {}
        print(f"# plan of the lora phase: {figures}", flush=True)
        if figures and not figures["plan_fits"]:
            return "failed", {**figures, "error": "the planner says the LoRA run does not fit: not run"}
        t0 = time.perf_counter()
        status, built = self.build("lora_build", timeout - 30, ["lora"])
        figures.update(built)
        if status != "ok":
            return status, figures
        status, trained = self.train("lora", timeout - (time.perf_counter() - t0), overrides)
        return status, {**figures, **trained}

    def overrides(self, name: str) -> list[str]:
        model, tokenizer = self.paths(name)
        return COMMON + [f"actor.path={model}", f"data.tokenizer.path={tokenizer}"] + RUNS[name][self.args.tiny]

    def train(self, phase: str, timeout: float, overrides: list[str]) -> tuple[str, dict]:
        """GRPO for STEPS steps; the process group is killed once the last step's metrics are logged."""
        run_dir = os.path.join(self.work, phase)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               os.path.join(e2e.ROOT, "launch", "train_grpo.py"), "--config",
               os.path.join(e2e.ROOT, "examples", "grpo_arith.yaml"),
               *merged(self.trainer_overrides(phase) + [f"steps={STEPS}"] + overrides)]
        rc, seconds, log_path = self.watched(phase, cmd, timeout, lambda: logged_steps(run_dir) >= STEPS)
        rows = [r for r in e2e.read_metrics(run_dir) if "time/step" in r]
        settings = dict(o.split("=", 1) for o in overrides if o.startswith("rollout."))
        responses = int(settings["rollout.prompts_per_step"]) * int(settings["rollout.group_size"])
        figures = {"responses": responses, "steps": [step_figures(r, responses) for r in rows],
                   "stopped_after_s": round(seconds, 1)}
        problems = [f"step {r['step']}: actor/{k} missing or not finite" for r in rows for k in ("loss", "grad_norm")
                    if r.get(f"actor/{k}") is None]
        if rc != 0 or len(rows) < STEPS or problems:
            return self.failure(phase, rc, log_path, {**figures, "problems": problems})
        return "ok", figures

    def watched(self, phase: str, cmd: list[str], timeout: float, done) -> tuple[int, float, str]:
        """Like gpu_e2e's `child` (own process group, stamped log OUT/<phase>.log, killed at `timeout`: 124), but the
        group is also ended as soon as `done()` holds (checked every second), and that counts as status 0."""
        log_path = os.path.join(self.out, f"{phase}.log")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "MEGALIGN_ATTENTION": "sdpa",
               "PYTHONPATH": os.pathsep.join(filter(None, [e2e.ROOT, os.environ.get("PYTHONPATH")]))}
        t0 = time.perf_counter()
        with open(log_path, "w", encoding="utf-8") as log:
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            proc = subprocess.Popen(cmd, cwd=e2e.ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            reader = threading.Thread(target=e2e.copy_stamped, args=(proc.stdout, log, t0), daemon=True)
            reader.start()
            rc, note = None, f"killed after the phase's timeout of {timeout:.0f} s"
            while rc is None and time.perf_counter() - t0 < timeout:
                try:
                    rc = proc.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    if done():
                        rc, note = 0, f"stopped once step {STEPS}'s metrics were logged"
            if note.startswith("stopped"):  # SIGKILL: on SIGTERM the trainer would write its checkpoint first
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
            elif rc is None:
                e2e.kill_group(proc)
                rc = 124
            reader.join(timeout=10)
            if rc == 124 or note.startswith("stopped"):
                log.write(f"\n[gpu_models] {note} ({time.perf_counter() - t0:.1f} s)\n")
        return rc, time.perf_counter() - t0, log_path


def merged(overrides: list[str]) -> list[str]:
    """`key=value` overrides, the last of each key kept, in first-seen order (a readable command line)."""
    last = dict(o.split("=", 1) for o in overrides)
    return [f"{k}={v}" for k, v in last.items()]


def logged_steps(run_dir: str) -> int:
    """How many step rows metrics.jsonl holds."""
    return sum(1 for r in e2e.read_metrics(run_dir) if "time/step" in r)


def step_figures(row: dict, responses: int) -> dict:
    """gpu_e2e's figures of a step row, the probes, and the update's response tokens per second (`responses`: the
    step's samples; dynamic sampling is off, so all of them are trained on)."""
    out = e2e.step_figures(row, ("actor",))
    out.update({k: round(row[k], 6) for k in PROBES if isinstance(row.get(k), float)})
    tokens = (row.get("response_length/mean") or 0.0) * responses
    if tokens and row.get("time/update"):
        out["update_tokens_per_s"] = round(tokens / row["time/update"], 1)
    return out


# ----------------------------------------------------------------------------------------------- the build worker

def worker_build(args) -> dict:
    """Random models `args.worker` (names of SHAPES), saved in bf16, and their tokenizers."""
    import torch
    import transformers

    from megalign.data.tokenizer import CharTokenizer

    char = CharTokenizer()
    out = {**e2e.device_info(args.device), **e2e.ops_info(), "transformers": transformers.__version__}
    for name in args.worker.split(","):
        class_name, shape = (TINY_SHAPES if args.tiny else SHAPES)[name]
        shape = dict(shape)
        theta = shape.pop("rope_theta")
        config = getattr(transformers, class_name)(
            **shape, rope_parameters={"rope_type": "default", "rope_theta": theta}, hidden_act="silu",
            pad_token_id=char.pad_id, bos_token_id=char.bos_id, eos_token_id=char.eos_id)
        torch.manual_seed(0)
        t0 = time.perf_counter()
        with torch.device(args.device):  # initialise on the device: an 8 B init is minutes on one CPU thread
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        params = sum(p.numel() for p in model.parameters())
        init_s = time.perf_counter() - t0
        model.save_pretrained(os.path.join(args.workdir, name))
        del model
        tok = os.path.join(args.workdir, f"tokenizer_{shape['vocab_size']}")
        if not os.path.isdir(tok):
            e2e.save_tokenizer(tok, shape["vocab_size"])
        out[name] = {"params_m": round(params / 1e6, 1), "layers": shape["num_hidden_layers"],
                     "vocab": shape["vocab_size"], "init_s": round(init_s, 2),
                     "total_s": round(time.perf_counter() - t0, 2)}
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where the phases run (default cuda)")
    p.add_argument("--tiny", action="store_true", help="tiny models and batches (the CPU check of this script)")
    p.add_argument("--out", default=None, help="results folder (default $OUT, else ./gpu_results)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for all phases together (default 270 on CUDA, 600 with --tiny on the CPU)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    p.add_argument("--workdir", default=None, help="work folder to use and keep (default: a fresh one, removed)")
    p.add_argument("--keep", action="store_true", help="keep the work folder (models, runs)")
    p.add_argument("--cap", action="append", default=[], metavar="PHASE=SECONDS",
                   help="a phase's timeout at most (default " + ", ".join(f"{k}={v}" for k, v in CAPS) + ")")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # build: comma-separated model names
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    if set(args.phases) - set(PHASES):
        p.error(f"--phases: unknown {sorted(set(args.phases) - set(PHASES))}; choose from {', '.join(PHASES)}")
    if args.worker and set(args.worker.split(",")) - set(SHAPES):
        p.error(f"--worker: unknown models in {args.worker!r}")
    if args.out is None:
        args.out = os.environ.get("OUT") or os.path.join(os.getcwd(), "gpu_results")
    try:
        args.cap = {k: float(v) for k, v in (item.split("=", 1) for item in args.cap)}
    except ValueError:
        p.error(f"--cap: expected PHASE=SECONDS, got {args.cap}")
    if set(args.cap) - set(PHASES):
        p.error(f"--cap: unknown phases {sorted(set(args.cap) - set(PHASES))}")
    if args.budget is None:
        args.budget = 270.0 if args.device == "cuda" else 600.0
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        try:
            figures, rc = worker_build(args), 0
        except BaseException as exc:
            traceback.print_exc()
            figures, rc = {"errors": [f"{type(exc).__name__}: {exc}"[:400]]}, 1
        e2e.write_result(args.result, figures)
        return rc
    return ModelsRunner(args).run()


if __name__ == "__main__":
    sys.exit(main())
