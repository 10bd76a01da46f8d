"""benchmarks/gpu_e2e.py, the end-to-end step of the prepared GPU check, run here: its CPU mode (`--device cpu
--tiny`) must report every phase ok, so the script the GPU slot runs once has no typo left; and a failing phase
must be reported (status, error line, traceback) without stopping the script."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_e2e.py")


def run_e2e(tmp_path, *args, timeout=900):
    proc = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path / "out"), "--workdir", str(tmp_path / "work"),
                           *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc, records


def test_cpu_mode_reports_every_phase_ok(tmp_path):  # six fresh interpreters (two under torchrun): 20-40 s here
    proc, records = run_e2e(tmp_path, "--device", "cpu", "--tiny")
    context = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert [r["phase"] for r in records] == ["build", "rollout", "grpo", "ppo"], context
    assert {r["phase"]: r.get("error") for r in records if r["status"] != "ok"} == {}, context
    assert proc.returncode == 0, context
    with open(tmp_path / "out" / "summary.jsonl", encoding="utf-8") as fh:
        assert [json.loads(line) for line in fh] == records
    build, rollout, grpo, ppo = records
    assert build["vocab"] == build["tokenizer_ids"] == 512
    for mode in ("eager", "static", "static_autocast"):
        # every row generates at least one token and at most new_tokens; the rate is tokens over the call's wall time,
        # which is rounded to 0.1 ms: the rate lies between tokens over the rounding interval's ends (a 20 ms call here)
        figures = rollout[mode]
        assert rollout["batch"] <= figures["tokens"] <= rollout["batch"] * rollout["new_tokens"], figures
        low, high = figures["tokens"] / (figures["wall_s"] + 5e-5), figures["tokens"] / max(figures["wall_s"] - 5e-5, 1e-9)
        assert low - 0.05 <= figures["tokens_per_s"] <= high + 0.05, figures
    for phase, run, roles in (("grpo", grpo, ("actor",)), ("ppo", ppo, ("actor", "critic"))):
        # the summary's figures are the trainer's own metrics rows, rounded
        with open(tmp_path / "out" / f"{phase}_metrics.jsonl", encoding="utf-8") as fh:
            rows = [row for row in map(json.loads, fh) if "time/step" in row]
        assert [s["step"] for s in run["steps"]] == [row["step"] for row in rows] == [1, 2]
        assert run["step_s"] == [round(row["time/step"], 3) for row in rows]
        assert run["rollout_tokens_per_s"] == [round(row["tokens_per_s"], 1) for row in rows]
        for step, row in zip(run["steps"], rows):
            for key in [f"{role}/{name}" for role in roles for name in ("loss", "grad_norm")]:
                assert step[key] == round(row[key], 4), (key, step, row)
            assert step["actor/grad_norm"] > 0, step  # varied_reward gives unequal groups: a policy gradient
        assert run["checkpoint_mib"] > 0 and run["cuda_graphs"] is False


def test_a_failing_phase_is_reported_and_the_rest_skipped(tmp_path):
    """The build asked for CUDA on a machine without it: one JSON line per phase, the error named, exit status 1."""
    if __import__("torch").cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    proc, records = run_e2e(tmp_path, "--device", "cuda", "--tiny", "--phases", "build,grpo", timeout=300)
    assert [(r["phase"], r["status"]) for r in records] == [("build", "failed"), ("grpo", "skipped")], proc.stdout
    assert records[0]["error"] and "no model" in records[1]["error"]
    assert "Traceback" in proc.stdout and proc.returncode == 1
