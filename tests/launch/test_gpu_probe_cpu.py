"""benchmarks/gpu_probe.py and benchmarks/gpu_sanitize.py, steps 3 and 5 of the prepared GPU check,
run here in their CPU mode: every check must report ok (the same comparisons against fp32 torch
and the references that the GPU run makes, at small sizes), so the one GPU slot is not spent on a
typo; and a check that misses its bound must count as failed."""
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def probe():
    return _load("gpu_probe")


def test_probe_cpu_mode_every_check_ok(probe, tmp_path, kernels):
    assert probe.main(["--device", "cpu", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "probe.jsonl", encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh]
    assert [r["check"] for r in records] == ["setup", *probe.CHECKS]
    for r in records[1:]:
        assert r["ok"] is True and "error" not in r, r
    token = records[1]
    assert token["logp_err"] <= 1e-3 and token["grad_excess_over_bound"] <= 0 and token["ignored_rows_zero"]
    assert records[3]["gae_nonfinite_at"] == [3000, 3001]


def test_probe_counts_a_missed_bound_as_failed(probe, tmp_path, monkeypatch):
    def broken(device, sizes):
        raise AssertionError("planted")
    monkeypatch.setitem(probe.CHECKS, "nan_and_gae", broken)
    assert probe.main(["--device", "cpu", "--out", str(tmp_path), "--only", "nan_and_gae", "small_ops"]) == 1
    with open(tmp_path / "probe.jsonl", encoding="utf-8") as fh:
        records = {r["check"]: r for r in map(json.loads, fh)}
    assert records["nan_and_gae"]["ok"] is False and "planted" in records["nan_and_gae"]["error"]
    assert records["small_ops"]["ok"] is True


def test_sanitize_cases_cpu_mode(kernels):
    assert _load("gpu_sanitize").main(["--device", "cpu"]) == 0
