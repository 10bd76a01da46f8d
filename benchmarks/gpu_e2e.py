#!/usr/bin/env python3
"""Step 4 of the prepared GPU check: GRPO and PPO end to end through the real entry points, and the rollout engine
with and without CUDA graphs, on a random-weights model of Qwen2.5-0.5B's shape.

    python3 benchmarks/gpu_e2e.py --out DIR                        # on the GPU (benchmarks/gpu_check.sh), < ~150 s
    python benchmarks/gpu_e2e.py --device cpu --tiny --out DIR     # the same phases on the CPU with a tiny model

Phases, in this order, each in its own process (so a CUDA error, a crash or a hang in one cannot poison the next)
under a timeout taken from the remaining `--budget`; a failed phase prints the tail of its log (the traceback) and
the next one runs:

  build    a random Qwen2 model from a `transformers` config (Qwen2.5-0.5B: hidden 896, 24 layers, 14 heads, 2 KV
           heads, intermediate 4864, vocab 151936, tied embeddings; `--tiny`: 2 layers, hidden 64, vocab 512),
           saved in bf16, and an offline tokenizer in a folder of its own (`data.tokenizer.path`): the built-in
           character tokenizer's ids (`megalign.data.CharTokenizer`: specials 0-2, printable ASCII) padded with
           filler tokens up to the model's vocabulary, so the trainers' start-up check (every tokenizer id a model
           row, no model row the tokenizer cannot decode) passes and a random model's samples decode to text.
           (Not in the model folder: there transformers 5's AutoTokenizer picks Qwen2Tokenizer for a qwen2
           config.json, which adds `<|endoftext|>`, one id more than the model has rows.)
  rollout  the engine alone (`megalign.rollout.rollout`) on the bf16 model: 64 prompts of 128 tokens, 256 new
           tokens, static shapes without and with CUDA graphs (`--rollout-modes`; also `static_autocast` /
           `graphs_autocast`: fp32 weights under bf16 autocast, as the actor rolls out, and `eager` / `eager_again`:
           the trainers' default engine, whose window grows every step, run only while the phase has time left: on
           the H200 it ran at 870 tokens/s against 2700 static and 14500 with graphs). Tokens/s (whole call, and the
           engine's decode tokens/s and ms per decode step) and whether each graph replay gives its static eager
           run's tokens (it must: the same kernels on the same shapes). It runs before the trainers: when its graph
           mode raised or hung, grpo and ppo run with `cuda_graphs=false` (reported), so one capture bug does not
           cost the whole end-to-end check.
  grpo     `python3 -m torch.distributed.run --standalone --nproc-per-node 1 launch/train_grpo.py --config
           examples/grpo_arith.yaml ...`: world size 1 on NCCL (device=cuda, gloo beside it for CPU tensors),
           actor.dtype=bf16 (bf16 compute over fp32 master weights), SDPA attention (MEGALIGN_ATTENTION=sdpa), the
           rollout engine with static shapes and CUDA graphs, the embedded arithmetic task, 16 prompts x 8 samples,
           64 response tokens, 2 steps, then the checkpoint, the HF export and the greedy evaluation (16 held-out
           prompts, before and after).
  ppo      the same with launch/train_ppo.py and examples/ppo_arith.yaml: actor, critic (a fresh value head on the
           policy) and a bf16 reference; the reward from the verifiers instead of the example's reward model.

The reward is the verifier (`math_accuracy`, which a random model never earns) plus `varied_reward` below (a hash
of the response text), so the advantages, and with them the policy gradient, are not all zero. Dynamic sampling
and the overlong mask of the example configs are off for the same reason (every response of a random model runs
to the length limit).

Output: one JSON line per phase, `{"phase", "status": "ok" | "failed" | "skipped", "wall_s", figures...}`, on
stdout and appended to OUT/summary.jsonl; each phase's log in OUT/<phase>.log and the trainers' metrics in
OUT/<phase>_metrics.jsonl (benchmarks/gpu_check.sh passes a temporary OUT and keeps only stdout: the JSON lines
say it all). Figures: per step wall seconds (`time/step`, the phase timers `time/*`), rollout tokens/s (the whole
generate phase, and the engine's decode tokens/s), peak GPU memory (`torch.cuda.max_memory_allocated`, GiB),
losses and gradient norms, the checkpoint's size, and whether megalign.ops has its CUDA kernels (`ops_with_cuda`;
the trainers use them whenever it is true, MEGALIGN_OPS being unset). Model, runs and checkpoints live in a
work folder (on /dev/shm when it has room, as checkpoints of the 0.5B model are ~6 GB per trained role), removed
at the end unless `--keep`. Exit status 0 when every phase is ok, else 1. The trainer phases also report
`startup_s` (imports, torchrun, the roles' models built: the log's time stamps), `train_to_table_s` (evaluation
before, the steps, checkpoint, HF export, evaluation after) and `checkpoint_mib`.

Measured on the H200 (2026-12-04, torch 2.11.0+cu130, transformers 5.17, megalign._C not built so the pure-torch
ops; `--budget 240`): build 14 s; grpo ok in 45 s (steps 4.55 s with graph capture, then 0.80 s; rollout 18.8k
tokens/s in step 2; peak 14.6 GiB; 6.2 GB checkpoint); ppo ok in 59 s (steps 2.34 / 1.31 s; peak 21.0 GiB; 11.8 GB
checkpoint, about 30 s of the phase); rollout phase at batch 64: eager 870, static 2707, graphs 14535 tokens/s.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.abspath(__file__)
PHASES = ("build", "rollout", "grpo", "ppo")
ROLLOUT_MODES = ("static", "graphs", "static_autocast", "graphs_autocast", "eager", "eager_again")

QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                  rms_norm_eps=1e-6, tie_word_embeddings=True)
TINY_MODEL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rope_theta=1e4, rms_norm_eps=1e-6,
                  tie_word_embeddings=True)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The work of each phase."""

    prompts: int          # prompts per training step
    group: int            # samples per prompt
    response: int         # response tokens at most
    eval_samples: int     # held-out prompts evaluated before and after training
    eval_new: int         # their new tokens at most
    rollout_batch: int    # rollout phase: prompts (one sample each)
    rollout_prompt: int   # their length
    rollout_new: int      # new tokens
    # phase timeouts (seconds) at most, and the least a later phase is left
    # measured on the H200 (torch 2.11, /dev/shm): build 14 s, rollout static + graphs ~20 s, grpo 45 s, ppo 59 s
    # (about half of each trainer phase is writing its checkpoint: 6 GB for GRPO, 12 GB for PPO)
    caps: tuple = (("build", 45), ("rollout", 40), ("grpo", 70), ("ppo", 85))
    floors: tuple = (("build", 10), ("rollout", 15), ("grpo", 45), ("ppo", 60))


FULL = Sizes(prompts=16, group=8, response=64, eval_samples=16, eval_new=16, rollout_batch=64, rollout_prompt=128,
             rollout_new=256)
TINY = Sizes(prompts=4, group=4, response=8, eval_samples=4, eval_new=8, rollout_batch=8, rollout_prompt=16,
             rollout_new=16, caps=(("build", 120), ("rollout", 120), ("grpo", 240), ("ppo", 240)),
             floors=(("build", 10), ("rollout", 10), ("grpo", 20), ("ppo", 20)))


def varied_reward(prompt: str, response: str, answer, metadata) -> float:
    """A reward term in {0, 1/3, 2/3, 1} from a hash of the response text: it differs between the samples of a random
    model, so groups have unequal rewards and the policy gradient is not zero (the trainers load it by file path)."""
    return (zlib.crc32(response.encode("utf-8")) % 4) / 3.0


# ----------------------------------------------------------------------------------------------- the parent

class Runner:
    """Runs the phases in order within the budget and reports one JSON line each."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.sizes = TINY if args.tiny else FULL
        self.start = time.perf_counter()
        self.out = os.path.abspath(args.out)
        os.makedirs(self.out, exist_ok=True)
        self.summary = os.path.join(self.out, "summary.jsonl")
        self.work = args.workdir or make_workdir(args.tiny)
        os.makedirs(self.work, exist_ok=True)
        self.model = os.path.join(self.work, "model")
        self.tokenizer = os.path.join(self.work, "tokenizer")
        self.build_info: dict = {}
        self.graphs_ok: bool | None = None  # whether the rollout phase replayed CUDA graphs under autocast
        self.results: list[dict] = []

    # ----- bookkeeping

    def remaining(self) -> float:
        return self.args.budget - (time.perf_counter() - self.start)

    def timeout_for(self, phase: str, later: list[str]) -> float:
        caps, floors = {**dict(self.sizes.caps), **self.args.cap}, dict(self.sizes.floors)
        reserve = sum(floors[p] for p in later)
        return min(caps[phase], self.remaining() - reserve)

    def report(self, phase: str, status: str, wall: float, figures: dict) -> dict:
        record = {"phase": phase, "status": status, "wall_s": round(wall, 2), "device": self.args.device,
                  "tiny": self.args.tiny, **figures}
        line = json.dumps(record, default=str)
        print(line, flush=True)
        with open(self.summary, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
        self.results.append(record)
        return record

    def run(self) -> int:
        phases = [p for p in PHASES if p in self.args.phases]
        print(f"# gpu_e2e: device={self.args.device} tiny={self.args.tiny} budget={self.args.budget:.0f}s "
              f"work={self.work} out={self.out}", flush=True)
        try:
            for i, phase in enumerate(phases):
                timeout = self.timeout_for(phase, phases[i + 1:])
                if phase != "build" and not os.path.isfile(os.path.join(self.model, "config.json")):
                    self.report(phase, "skipped", 0.0, {"error": "no model: the build phase failed"})
                    continue
                if timeout < 5:
                    self.report(phase, "skipped", 0.0, {"error": f"budget spent ({self.remaining():.0f} s left)"})
                    continue
                t0 = time.perf_counter()
                try:
                    status, figures = getattr(self, f"phase_{phase}")(timeout)
                except Exception as exc:  # the parent's own bug: report it and go on
                    traceback.print_exc()
                    status, figures = "failed", {"error": f"{type(exc).__name__}: {exc}"}
                self.report(phase, status, time.perf_counter() - t0, figures)
        finally:
            if not self.args.keep and not self.args.workdir:
                shutil.rmtree(self.work, ignore_errors=True)
        failed = [r["phase"] for r in self.results if r["status"] != "ok"]
        total = time.perf_counter() - self.start
        print(f"# gpu_e2e: {len(self.results) - len(failed)}/{len(self.results)} phases ok in {total:.1f} s"
              + (f"; not ok: {', '.join(failed)}" if failed else ""), flush=True)
        return 1 if failed or not self.results else 0

    # ----- children

    def child(self, phase: str, cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int, float, str]:
        """Run `cmd` in its own process group with its output in OUT/<phase>.log, each line (and each progress-bar
        update) stamped with the seconds since the start (`+  12.3s| `); (status, seconds, log path).
        On a timeout the whole group is killed (status 124)."""
        log_path = os.path.join(self.out, f"{phase}.log")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "MEGALIGN_ATTENTION": "sdpa", **(env or {})}
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
        t0 = time.perf_counter()
        with open(log_path, "w", encoding="utf-8") as log:
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            reader = threading.Thread(target=copy_stamped, args=(proc.stdout, log, t0), daemon=True)
            reader.start()
            try:
                rc = proc.wait(timeout=max(timeout, 1))
            except subprocess.TimeoutExpired:
                kill_group(proc)
                rc = 124
            reader.join(timeout=10)
            if rc == 124:
                log.write(f"\n[gpu_e2e] killed after the phase's timeout of {timeout:.0f} s\n")
        return rc, time.perf_counter() - t0, log_path

    def failure(self, phase: str, rc: int, log_path: str, figures: dict) -> tuple[str, dict]:
        lines = unstamped(read_tail(log_path, 2000))
        ranked = [line for line in lines if line.startswith("[rank")]  # torchrun's copy of the trainer's traceback
        tail = (ranked[-50:] + ["..."] + lines[-3:]) if ranked else lines[-60:]
        print(f"# ---- {phase} failed (status {rc}); from {log_path}:", flush=True)
        print("\n".join("#   " + line for line in tail), flush=True)
        return "failed", {**figures, "rc": rc, "error": error_line(lines)}

    def worker(self, phase: str, timeout: float, extra: list[str] = ()) -> tuple[str, dict]:
        result = os.path.join(self.work, f"{phase}_result.json")
        cmd = [sys.executable, SCRIPT, "--worker", phase, "--result", result, "--workdir", self.work,
               "--device", self.args.device, "--deadline", f"{time.time() + timeout - 3:.1f}"]
        cmd += ["--rollout-modes", ",".join(self.args.rollout_modes)] + (["--tiny"] if self.args.tiny else [])
        cmd += list(extra)
        rc, seconds, log_path = self.child(phase, cmd, timeout)
        figures = {}
        if os.path.isfile(result):
            with open(result, encoding="utf-8") as fh:
                figures = json.load(fh)
        errors = figures.pop("errors", [])
        if rc != 0 or errors:
            return self.failure(phase, rc, log_path, {**figures, **({"errors": errors} if errors else {})})
        return "ok", figures

    # ----- phases

    def phase_build(self, timeout: float) -> tuple[str, dict]:
        status, figures = self.worker("build", timeout)
        self.build_info = {k: figures[k] for k in ("ops_have_extension", "ops_with_cuda", "ops_mode") if k in figures}
        return status, figures

    def trainer_overrides(self, phase: str) -> list[str]:
        s = self.sizes
        graphs = self.args.device == "cuda" and self.graphs_ok is not False
        terms = [{"name": "math_accuracy", "weight": 1.0}, {"name": f"{SCRIPT}:varied_reward", "weight": 1.0}]
        return [
            f"run_dir={os.path.join(self.work, phase)}", "steps=2", "seed=0", f"device={self.args.device}",
            "resume=none", "save_every=0", "tensorboard=false", "log_every=1",
            f"actor.path={self.model}", "actor.dtype=bf16",
            "data.tokenizer.kind=hf", f"data.tokenizer.path={self.tokenizer}",
            f"reward.terms={json.dumps(terms)}",
            f"rollout.group_size={s.group}", f"rollout.prompts_per_step={s.prompts}",
            f"rollout.max_response_length={s.response}", "rollout.engine.static=true",
            f"rollout.engine.cuda_graphs={'true' if graphs else 'false'}",
            f"eval.max_samples={s.eval_samples}", f"eval.max_new_tokens={s.eval_new}", "eval.every=0",
        ]

    def trainer_phase(self, phase: str, timeout: float, script: str, config: str, overrides: list[str],
                      roles: tuple[str, ...]) -> tuple[str, dict]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               os.path.join(ROOT, "launch", script), "--config", os.path.join(ROOT, "examples", config), *overrides]
        rc, seconds, log_path = self.child(phase, cmd, timeout)
        run_dir = os.path.join(self.work, phase)
        rows = read_metrics(run_dir)
        if rows:
            shutil.copyfile(os.path.join(run_dir, "metrics.jsonl"), os.path.join(self.out, f"{phase}_metrics.jsonl"))
        steps = [r for r in rows if "time/step" in r]
        figures = {**self.build_info, "cuda_graphs": any(o == "rollout.engine.cuda_graphs=true" for o in overrides),
                   "steps": [step_figures(r, roles) for r in steps],
                   "eval_accuracy": [r["eval/accuracy"] for r in rows if "eval/accuracy" in r and "time/step" not in r]}
        lines = read_tail(log_path, 5000)
        ready, table = stamp_of(lines, "roles ["), stamp_of(lines, "held-out accuracy")
        if ready is not None:  # imports, torchrun, the roles' models built and loaded
            figures["startup_s"] = ready
        if ready is not None and table is not None:  # eval before, the steps, checkpoint, HF export, eval after
            figures["train_to_table_s"] = round(table - ready, 1)
            figures["after_table_s"] = round(seconds - table, 1)  # process group teardown, exit
        if steps:
            figures["peak_gpu_gib"] = max((r.get("memory/cuda_peak_allocated_gib") or 0.0) for r in steps)
            figures["step_s"] = [round(r["time/step"], 3) for r in steps]
            figures["rollout_tokens_per_s"] = [round(r.get("tokens_per_s") or 0.0, 1) for r in steps]
        problems = check_run(rows, run_dir, roles, self.args.device, export=phase == "grpo") if rc == 0 else []
        figures["checkpoint_mib"] = round(folder_bytes(os.path.join(run_dir, "checkpoints")) / 2**20, 1)
        for name in ("checkpoints", "hf"):  # room for the next phase's (the work folder may be in memory)
            shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)
        if rc != 0:
            return self.failure(phase, rc, log_path, figures)
        if problems:
            return self.failure(phase, 0, log_path, {**figures, "problems": problems})
        return "ok", figures

    def phase_grpo(self, timeout: float) -> tuple[str, dict]:
        overrides = self.trainer_overrides("grpo") + ["export_hf=true", "algo.dynamic_sampling=false",
                                                      "algo.overlong=none"]
        return self.trainer_phase("grpo", timeout, "train_grpo.py", "grpo_arith.yaml", overrides, ("actor",))

    def phase_ppo(self, timeout: float) -> tuple[str, dict]:
        overrides = self.trainer_overrides("ppo") + [
            "export_hf=false", "reward.model=null", "reward.check_with=null", "critic.path=null", "critic.dtype=bf16",
            "reference.dtype=bf16", "algo.critic_warmup=0", "algo.reward_normalize=false"]
        return self.trainer_phase("ppo", timeout, "train_ppo.py", "ppo_arith.yaml", overrides, ("actor", "critic"))

    def phase_rollout(self, timeout: float) -> tuple[str, dict]:
        status, figures = self.worker("rollout", timeout)
        if self.args.device == "cuda":
            # the trainers roll out as graphs_autocast does (graphs on bf16 weights when that mode did not run):
            # CUDA graphs off for them when it raised or hung here (the worker writes its figures after every mode,
            # so a killed run still tells)
            for static, graphs in (("static_autocast", "graphs_autocast"), ("static", "graphs")):
                if static in figures and graphs in self.args.rollout_modes:
                    self.graphs_ok = graphs in figures
                    break
        return status, {**self.build_info, **figures}


def make_workdir(tiny: bool) -> str:
    """A fresh folder for the model and the runs: on /dev/shm when it has room for them (checkpoints of the full
    model are ~6 GB per trained role: fast to write there), else the temporary folder."""
    need = 2 * 2**30 if tiny else 24 * 2**30  # the model, and one phase's checkpoints at a time
    base = None
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        try:
            if shutil.disk_usage("/dev/shm").free > need:
                base = "/dev/shm"
        except OSError:
            pass
    return tempfile.mkdtemp(prefix="megalign-e2e-", dir=base)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to the process group this script started for `proc` (and only that one)."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


STAMP = re.compile(r"^\+\s*(\d+\.\d)s\| ")


def copy_stamped(stream, log, t0: float) -> None:
    """Copy a child's output to `log` line by line (a carriage return, as progress bars write, ends a line too),
    each prefixed with the seconds since `t0`."""
    pending = b""
    while True:
        chunk = stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536)
        if not chunk:
            break
        pending += chunk
        *lines, pending = re.split(rb"[\r\n]", pending)
        stamp = f"+{time.perf_counter() - t0:6.1f}s| "
        for line in lines:
            if line.strip():
                log.write(stamp + line.decode("utf-8", "replace") + "\n")
        log.flush()
    if pending.strip():
        log.write(f"+{time.perf_counter() - t0:6.1f}s| " + pending.decode("utf-8", "replace") + "\n")
    log.flush()


def unstamped(lines: list[str]) -> list[str]:
    return [STAMP.sub("", line) for line in lines]


def stamp_of(lines: list[str], needle: str) -> float | None:
    """The time stamp of the first log line containing `needle`, or None."""
    for line in lines:
        match = STAMP.match(line)
        if match and needle in line:
            return float(match.group(1))
    return None


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def read_tail(path: str, lines: int) -> list[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return [line.rstrip("\n") for line in fh.readlines()[-lines:]]
    except OSError as exc:
        return [f"(cannot read {path}: {exc})"]


def error_line(lines: list[str]) -> str:
    """The line of a log that says what went wrong: the last exception line of the trainer's own traceback
    (torchrun's `[rank0]:` lines, not its ChildFailedError wrapper), else the last exception line, else the last."""
    pattern = re.compile(r"^(\[rank\d+\]: )?([\w.]+(Error|Exception|Interrupt)|AssertionError|SystemExit)\b")
    found = [line for line in lines if pattern.match(line) and "ChildFailedError" not in line]
    ranked = [line for line in found if line.startswith("[rank")]
    pick = ranked or found or [line for line in lines if line.strip()] or [""]
    return pick[-1][:400]


def read_metrics(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    rows = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                rows.append(json.loads(line))
            except ValueError:  # a line cut by a killed run
                pass
    return rows


STEP_KEYS = ("time/step", "tokens_per_s", "tokens_per_s/decode", "tokens_per_s/prefill", "rollout/decode_steps",
             "memory/cuda_peak_allocated_gib", "memory/cpu_peak_rss_gib", "reward/mean", "reward/std",
             "response_length/mean", "nan_skips", "empty_updates")
ROLE_KEYS = ("loss", "grad_norm", "entropy", "clip_frac", "approx_kl", "value_mean")


def step_figures(row: dict, roles: tuple[str, ...]) -> dict:
    """The figures of one metrics.jsonl step row: wall seconds, throughput, memory, losses, phase timers."""
    out = {"step": row["step"]}
    out.update({k: row[k] for k in STEP_KEYS if k in row})
    out.update({f"{role}/{k}": row[f"{role}/{k}"] for role in roles for k in ROLE_KEYS if f"{role}/{k}" in row})
    out.update({k: row[k] for k in row if k.startswith("time/") and k != "time/step"})
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}


def check_run(rows: list[dict], run_dir: str, roles: tuple[str, ...], device: str, export: bool) -> list[str]:
    """What is wrong with a finished 2-step run (an empty list when nothing): both steps logged, finite losses and
    gradient norms, no skipped update, the last checkpoint written, the HF export (when asked), CUDA memory used."""
    problems = []
    steps = [r for r in rows if "time/step" in r]
    if [r["step"] for r in steps] != [1, 2]:
        problems.append(f"expected metrics of steps 1 and 2, got steps {[r['step'] for r in steps]}")
    for r in steps:
        for role in roles:
            for key in (f"{role}/loss", f"{role}/grad_norm"):
                if r.get(key) is None:
                    problems.append(f"step {r['step']}: {key} is missing or not finite")
        if r.get("nan_skips") or r.get("empty_updates"):
            problems.append(f"step {r['step']}: skipped updates (nan_skips={r.get('nan_skips')}, "
                            f"empty_updates={r.get('empty_updates')})")
        if device == "cuda" and not r.get("memory/cuda_peak_allocated_gib"):
            problems.append(f"step {r['step']}: no CUDA memory reported")
    if not any(r.get("actor/grad_norm") for r in steps):
        problems.append("the actor's gradient norm is 0 at every step (no policy gradient)")
    checkpoints = os.path.join(run_dir, "checkpoints")
    if not (os.path.isdir(checkpoints) and any(name.endswith("2") for name in os.listdir(checkpoints))):
        problems.append(f"no checkpoint of step 2 in {checkpoints}")
    if export and not os.path.isfile(os.path.join(run_dir, "hf", "config.json")):
        problems.append("no HF export (run_dir/hf/config.json)")
    return problems


# ----------------------------------------------------------------------------------------------- the workers

def ops_info() -> dict:
    import megalign.ops as ops
    from megalign.ops import _backend

    return {"ops_have_extension": bool(ops.HAVE_EXTENSION), "ops_with_cuda": bool(ops.WITH_CUDA),
            "ops_mode": _backend.mode()}


def device_info(device: str) -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available()}
    if device == "cuda" and torch.cuda.is_available():
        info.update(cuda=torch.version.cuda, gpu=torch.cuda.get_device_name(),
                    capability=torch.cuda.get_device_capability())
    return info


def save_tokenizer(path: str, vocab_size: int) -> int:
    """An HF fast tokenizer in `path` with `CharTokenizer`'s ids and chat template, its vocabulary filled to
    `vocab_size` (`CharTokenizer.save`), so the model's rows and the tokenizer's ids agree one to one. Returns the
    tokenizer's size."""
    from megalign.data.tokenizer import CharTokenizer

    CharTokenizer().save(path, vocab_size)
    return vocab_size


def worker_build(args, sizes: Sizes) -> dict:
    import torch
    import transformers
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megalign.data import build_tokenizer
    from megalign.data.tokenizer import CharTokenizer, TokenizerConfig

    shape = dict(TINY_MODEL if args.tiny else QWEN25_05B)
    theta = shape.pop("rope_theta")
    rope = ({"rope_parameters": {"rope_type": "default", "rope_theta": theta}}
            if int(transformers.__version__.split(".")[0]) >= 5 else {"rope_theta": theta})
    char = CharTokenizer()
    config = Qwen2Config(**shape, **rope, hidden_act="silu", use_sliding_window=False, pad_token_id=char.pad_id,
                         bos_token_id=char.bos_id, eos_token_id=char.eos_id)
    path = os.path.join(args.workdir, "model")
    torch.manual_seed(0)
    t0 = time.perf_counter()
    # initialise on the device (a 0.5B init is seconds on one CPU thread), store bf16 as Qwen2.5's checkpoints are
    with torch.device(args.device if args.device == "cuda" else "cpu"):
        model = Qwen2ForCausalLM(config)
    model = model.to("cpu", torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    init_s = time.perf_counter() - t0
    model.save_pretrained(path)
    del model
    tok_path = os.path.join(args.workdir, "tokenizer")
    n_tok = save_tokenizer(tok_path, shape["vocab_size"])
    tok = build_tokenizer(TokenizerConfig(kind="hf", path=tok_path))  # what the trainers read
    sample = "12+7="
    if tok.decode(tok.encode(sample)) != sample or tok.vocab_size != shape["vocab_size"]:
        raise RuntimeError(f"tokenizer round trip failed: {tok.decode(tok.encode(sample))!r}, size {tok.vocab_size}")
    return {**device_info(args.device), **ops_info(), "transformers": transformers.__version__,
            "params_m": round(params / 1e6, 1), "layers": shape["num_hidden_layers"], "vocab": shape["vocab_size"],
            "tokenizer_ids": n_tok, "init_s": round(init_s, 2), "total_s": round(time.perf_counter() - t0, 2)}


def worker_rollout(args, sizes: Sizes) -> dict:
    """The engine alone (module doc): bf16 weights eager, static and static + CUDA graphs; then fp32 weights under
    bf16 autocast (the actor's way) static and static + CUDA graphs, the check the trainer phases rely on."""
    import contextlib

    import torch

    from megalign.models import from_pretrained
    from megalign.rollout import EngineConfig, SamplingParams, rollout

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    path = os.path.join(args.workdir, "model")
    t0 = time.perf_counter()
    models = {"bf16": from_pretrained(path, dtype=torch.bfloat16).eval().to(device)}
    out = {"load_s": round(time.perf_counter() - t0, 2), "batch": sizes.rollout_batch, "prompt": sizes.rollout_prompt,
           "new_tokens": sizes.rollout_new}
    vocab = models["bf16"].config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (sizes.rollout_batch, sizes.rollout_prompt), generator=g).to(device)
    mask = torch.ones_like(ids)
    params = SamplingParams(max_new_tokens=sizes.rollout_new, temperature=1.0, eos_token_id=2, pad_token_id=0)
    warm = SamplingParams(max_new_tokens=8, temperature=1.0, eos_token_id=2, pad_token_id=0)
    eager = EngineConfig(static=False, cuda_graphs=False)
    static, graphs = EngineConfig(static=True, cuda_graphs=False), EngineConfig(static=True, cuda_graphs=True)
    # name -> (weights, engine, under bf16 autocast)
    known = {"static": ("bf16", static, False), "graphs": ("bf16", graphs, False),
             "static_autocast": ("fp32", static, True), "graphs_autocast": ("fp32", graphs, True),
             "eager": ("bf16", eager, False), "eager_again": ("bf16", eager, False)}
    modes = {name: known[name] for name in args.rollout_modes if cuda or not name.startswith("graphs")}

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    tokens, errors, skipped = {}, [], []
    for name, (weights, config, autocast) in modes.items():
        # the eager engine (the trainers' default: its window grows with the longest live row, so every step is a
        # new attention shape) ran at 1/3 of the static step's speed on the H200: it runs only when time is left
        static_s = out.get("static", {}).get("wall_s", 5.0)
        need = (4 * static_s if name.startswith("eager") else 0.0) + (8.0 if weights not in models else 0.0)
        if args.deadline and time.time() + need > args.deadline:
            skipped.append(name)
            continue
        try:
            if weights not in models:
                models.clear()  # one model on the device at a time
                dtype = torch.bfloat16 if weights == "bf16" else None
                models[weights] = from_pretrained(path, dtype=dtype).eval().to(device)
            model = models[weights]
            amp = torch.autocast(device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
            with amp:
                rollout(model, ids, mask, 1, warm, seed=1, config=config)  # warm-up: kernels, allocator, cuBLAS
                sync()
                t = time.perf_counter()
                result, stats = rollout(model, ids, mask, 1, params, seed=0, config=config)
                sync()
                wall = time.perf_counter() - t
            generated = int(result.attention_mask[:, sizes.rollout_prompt:].sum())
            tokens[name] = result.sequences[:, sizes.rollout_prompt:].cpu()
            out[name] = {"tokens": generated, "wall_s": round(wall, 4), "tokens_per_s": round(generated / wall, 1),
                         "decode_tokens_per_s": round(stats.decode_tokens / max(stats.decode_s, 1e-9), 1),
                         "prefill_s": round(stats.prefill_s, 4), "decode_steps": stats.decode_steps,
                         "ms_per_decode_step": round(1000 * stats.decode_s / max(stats.decode_steps, 1), 2)}
        except Exception as exc:
            traceback.print_exc()
            errors.append(f"{name}: {type(exc).__name__}: {exc}"[:400])
        write_result(args.result, {**out, "errors": errors + [f"killed or crashed after mode {name}"]})
    for a, b in (("static", "graphs"), ("static_autocast", "graphs_autocast"), ("eager", "static")):
        if a in tokens and b in tokens and tokens[a].shape == tokens[b].shape:
            out[f"same_tokens_{b}_vs_{a}"] = round(float((tokens[a] == tokens[b]).float().mean()), 4)
    for a, b in (("graphs", "static"), ("graphs", "eager"), ("graphs", "eager_again"),
                 ("graphs_autocast", "static_autocast")):
        if a in out and b in out:
            out[f"speedup_{a}_vs_{b}"] = round(out[a]["tokens_per_s"] / out[b]["tokens_per_s"], 2)
    for a, b in (("static", "graphs"), ("static_autocast", "graphs_autocast")):
        same = out.get(f"same_tokens_{b}_vs_{a}")
        if same is not None and same < 1.0:  # the same kernels on the same shapes: bit for bit
            errors.append(f"{b}: the CUDA-graph replay's tokens differ from {a}'s ({same:.2%} equal)")
    if skipped:
        out["skipped_for_time"] = skipped
    if cuda:
        out["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    return {**device_info(args.device), **out, "errors": errors}


WORKERS = {"build": worker_build, "rollout": worker_rollout}


def run_worker(args) -> int:
    """A child: run one worker and write its figures (and its errors) to `--result`, whatever happens."""
    sizes = TINY if args.tiny else FULL
    try:
        figures = WORKERS[args.worker](args, sizes)
        rc = 0
    except BaseException as exc:
        traceback.print_exc()
        figures, rc = {"errors": [f"{type(exc).__name__}: {exc}"[:400]]}, 1
    write_result(args.result, figures)
    return rc


def write_result(path: str, figures: dict) -> None:
    """The worker's figures, written whole (a reader never sees half a file)."""
    with open(path + ".tmp", "w", encoding="utf-8") as fh:
        json.dump(figures, fh, default=str)
    os.replace(path + ".tmp", path)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where the phases run (default cuda)")
    p.add_argument("--tiny", action="store_true", help="a tiny model and tiny batches (the CPU check of this script)")
    p.add_argument("--out", default=None, help="results folder (default $OUT, else ./gpu_results)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for all phases together (default 150 on CUDA, 600 with --tiny on the CPU)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    p.add_argument("--workdir", default=None, help="work folder to use and keep (default: a fresh one, removed)")
    p.add_argument("--keep", action="store_true", help="keep the work folder (model, runs, checkpoints)")
    p.add_argument("--rollout-modes", default=None,
                   help=f"rollout phase modes, of {','.join(ROLLOUT_MODES)} (default static,graphs,eager,eager_again "
                        "on CUDA, the eager ones only while time is left; every non-graph mode on the CPU)")
    p.add_argument("--cap", action="append", default=[], metavar="PHASE=SECONDS",
                   help="a phase's timeout at most (default " + ", ".join(f"{k}={v}" for k, v in FULL.caps) + ")")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)  # a worker's end (epoch seconds)
    args = p.parse_args(argv)
    args.phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    unknown = [x for x in args.phases if x not in PHASES]
    if unknown:
        p.error(f"--phases: unknown {unknown}; choose from {', '.join(PHASES)}")
    if args.out is None:
        args.out = os.environ.get("OUT") or os.path.join(os.getcwd(), "gpu_results")
    if args.rollout_modes is None:
        args.rollout_modes = ("static,graphs,eager,eager_again" if args.device == "cuda" else
                              "static,static_autocast,eager,eager_again")
    args.rollout_modes = [m.strip() for m in args.rollout_modes.split(",") if m.strip()]
    if set(args.rollout_modes) - set(ROLLOUT_MODES):
        p.error(f"--rollout-modes: unknown {sorted(set(args.rollout_modes) - set(ROLLOUT_MODES))}")
    try:
        args.cap = {k: float(v) for k, v in (item.split("=", 1) for item in args.cap)}
    except ValueError:
        p.error(f"--cap: expected PHASE=SECONDS, got {args.cap}")
    if set(args.cap) - set(PHASES):
        p.error(f"--cap: unknown phases {sorted(set(args.cap) - set(PHASES))}")
    if args.budget is None:
        args.budget = 150.0 if args.device == "cuda" else 600.0
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    return Runner(args).run()


if __name__ == "__main__":
    sys.exit(main())
