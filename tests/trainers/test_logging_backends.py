"""Weights & Biases and MLflow beside metrics.jsonl: the calls each backend gets (recording fakes put in
sys.modules), the run ids kept for resume, the config check, one SFT run end to end, and the real packages
in their offline modes (W&B's offline run file read back record by record, MLflow's file:// store read
back with its client), each skipped when its package is missing."""
import json
import math
import struct
import sys
import time
import types

import pytest
from parallel.dist_utils import run_distributed
from trainers.test_sft import read_metrics, tiny_config

from megalign.config import ConfigError, from_dict, to_dict
from megalign.trainers import log_backends
from megalign.trainers.log_backends import RUN_IDS_FILE, LoggingConfig, flatten_config
from megalign.trainers.logging import MetricsLogger
from megalign.trainers.sft import SFTConfig, train_sft

CONFIG = {"steps": 3, "optim": {"lr": 0.01, "betas": [0.9, 0.95]}, "model": {"path": None}, "empty": {}}
FLAT = {"steps": 3, "optim.lr": 0.01, "optim.betas": [0.9, 0.95], "model.path": None, "empty": {}}


class FakeWandb(types.ModuleType):
    """`wandb` recording `init`, and runs recording `define_metric`, `log`, `finish`."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.runs = [], []

    def init(self, **kwargs):
        self.inits.append(kwargs)
        run = types.SimpleNamespace(id=kwargs["id"] or f"wb{len(self.runs)}", defined=[], logged=[], finished=[])
        run.define_metric = lambda name, **kw: run.defined.append((name, kw))
        run.log = lambda row: run.logged.append(row)
        run.finish = lambda exit_code=None: run.finished.append(exit_code)
        self.runs.append(run)
        return run


class FakeMlflowClient:
    """`mlflow.MlflowClient` over dicts: experiments, runs (status, params, metrics as (key, value, step))."""

    store = {"experiments": {}, "runs": {}}

    def __init__(self, tracking_uri=None):
        self.tracking_uri = tracking_uri

    def get_experiment_by_name(self, name):
        eid = self.store["experiments"].get(name)
        return None if eid is None else types.SimpleNamespace(experiment_id=eid)

    def create_experiment(self, name):
        self.store["experiments"][name] = eid = str(len(self.store["experiments"]))
        return eid

    def create_run(self, experiment_id, run_name=None, tags=None):
        run_id = f"ml{len(self.store['runs'])}"
        self.store["runs"][run_id] = {"experiment": experiment_id, "name": run_name, "tags": tags, "status": "RUNNING",
                                      "params": {}, "metrics": []}
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id=run_id))

    def get_run(self, run_id):
        return types.SimpleNamespace(data=types.SimpleNamespace(params=dict(self.store["runs"][run_id]["params"])))

    def update_run(self, run_id, status):
        self.store["runs"][run_id]["status"] = status

    def set_terminated(self, run_id, status):
        self.store["runs"][run_id]["status"] = status

    def log_batch(self, run_id, metrics=(), params=()):
        assert len(metrics) <= 100 and len(params) <= 100
        run = self.store["runs"][run_id]
        for p in params:
            assert p.key not in run["params"], "MLflow params cannot be logged twice"
            run["params"][p.key] = p.value
        run["metrics"] += [(m.key, m.value, m.step) for m in metrics]


@pytest.fixture
def fakes(monkeypatch):
    """Recording `wandb` and `mlflow` modules (and a fresh MLflow store), found by import and by find_spec."""
    wandb = FakeWandb()
    mlflow = types.ModuleType("mlflow")
    FakeMlflowClient.store = {"experiments": {}, "runs": {}}
    mlflow.MlflowClient = FakeMlflowClient
    entities = types.ModuleType("mlflow.entities")
    entities.Metric = lambda key, value, timestamp, step: types.SimpleNamespace(key=key, value=value, step=step)
    entities.Param = lambda key, value: types.SimpleNamespace(key=key, value=value)
    for name, module in (("wandb", wandb), ("mlflow", mlflow), ("mlflow.entities", entities)):
        monkeypatch.setitem(sys.modules, name, module)
    real_find_spec = log_backends.importlib.util.find_spec
    monkeypatch.setattr(log_backends.importlib.util, "find_spec",
                        lambda name: object() if name in ("wandb", "mlflow") else real_find_spec(name))
    return wandb, FakeMlflowClient.store


def test_flatten_config_dotted_keys():
    assert flatten_config(CONFIG) == FLAT


def test_fake_backends_get_the_same_rows_step_and_config(tmp_path, fakes):
    wandb, store = fakes
    cfg = LoggingConfig(backends=["jsonl", "wandb", "mlflow"], project="proj", tags=["a"], wandb_mode="offline")
    with MetricsLogger(tmp_path, log_config=cfg, config=CONFIG) as log:
        log.log(1, {"loss": 2.5, "reward/mean": 0.25})
        log.log(2, {"loss": float("nan")})
    assert not (tmp_path / "tensorboard").exists()      # left out of backends
    init = wandb.inits[0]
    assert (init["project"], init["name"], init["mode"], init["tags"], init["id"], init["resume"]) == (
        "proj", tmp_path.name, "offline", ["a"], None, None)
    assert init["config"] == FLAT and init["dir"] == str(tmp_path)
    run = wandb.runs[0]
    assert run.defined == [("step", {}), ("*", {"step_metric": "step"})]
    assert run.logged[0] == {"loss": 2.5, "reward/mean": 0.25, "step": 1}
    assert run.logged[1]["step"] == 2 and math.isnan(run.logged[1]["loss"])
    assert run.finished == [0]
    (ml_id, ml_run), = store["runs"].items()
    assert store["experiments"] == {"proj": ml_run["experiment"]} and ml_run["name"] == tmp_path.name
    assert ml_run["tags"] == {"a": "true"} and ml_run["status"] == "FINISHED"
    assert ml_run["params"] == {"steps": "3", "optim.lr": "0.01", "optim.betas": "[0.9, 0.95]", "model.path": "null",
                                "empty": "{}"}
    assert ml_run["metrics"][:2] == [("loss", 2.5, 1), ("reward/mean", 0.25, 1)]
    assert ml_run["metrics"][2][0::2] == ("loss", 2) and math.isnan(ml_run["metrics"][2][1])
    assert json.loads((tmp_path / RUN_IDS_FILE).read_text()) == {"wandb": run.id, "mlflow": ml_id}
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_resume_continues_the_same_runs_and_a_fresh_run_starts_new_ones(tmp_path, fakes):
    wandb, store = fakes
    cfg = LoggingConfig(backends=["wandb", "mlflow"])
    with MetricsLogger(tmp_path, log_config=cfg, config={"steps": 3, "lr": 0.1}) as log:
        log.log(1, {"loss": 1.0})
    ids = json.loads((tmp_path / RUN_IDS_FILE).read_text())
    with MetricsLogger(tmp_path, log_config=cfg, config={"steps": 6, "lr": 0.1, "new": 1}, initial_step=1,
                       resumed=True) as log:
        log.log(2, {"loss": 0.5})
    assert (wandb.inits[1]["id"], wandb.inits[1]["resume"]) == (ids["wandb"], "allow")
    assert len(store["runs"]) == 1
    run = store["runs"][ids["mlflow"]]
    assert run["params"] == {"steps": "3", "lr": "0.1", "new": "1"}   # first values kept, the new key added
    assert run["metrics"] == [("loss", 1.0, 1), ("loss", 0.5, 2)] and run["status"] == "FINISHED"
    with MetricsLogger(tmp_path, log_config=cfg, config={}) as log:       # not resumed: new runs, new ids
        log.log(1, {"loss": 3.0})
    new_ids = json.loads((tmp_path / RUN_IDS_FILE).read_text())
    assert new_ids["mlflow"] != ids["mlflow"] and wandb.inits[2]["id"] is None and len(store["runs"]) == 2


def test_only_rank_0_opens_runs(tmp_path, fakes):
    wandb, store = fakes
    with MetricsLogger(tmp_path, rank=1, log_config=LoggingConfig(backends=["wandb", "mlflow"])) as log:
        log.log(1, {"loss": 1.0})
    assert wandb.inits == [] and store["runs"] == {} and not (tmp_path / RUN_IDS_FILE).exists()


def test_runs_are_marked_failed_or_killed_by_the_exception_on_its_way_out(tmp_path, fakes):
    wandb, store = fakes
    cfg = LoggingConfig(backends=["wandb", "mlflow"])
    for exc, code, status in ((RuntimeError("boom"), 1, "FAILED"), (SystemExit(75), 75, "KILLED")):
        with pytest.raises(type(exc)):
            with MetricsLogger(tmp_path, log_config=cfg) as log:
                log.log(1, {"loss": 1.0})
                raise exc
        assert wandb.runs[-1].finished == [code]
        assert store["runs"][json.loads((tmp_path / RUN_IDS_FILE).read_text())["mlflow"]]["status"] == status


def test_a_backend_that_cannot_start_stops_the_run_and_closes_the_others(tmp_path, fakes, monkeypatch):
    wandb, _ = fakes
    monkeypatch.setattr(FakeMlflowClient, "create_run", lambda *a, **k: (_ for _ in ()).throw(ConnectionError("down")))
    with pytest.raises(ConnectionError):
        MetricsLogger(tmp_path, log_config=LoggingConfig(backends=["wandb", "mlflow"]))
    assert wandb.runs[0].finished == [1]


def test_a_failing_backend_does_not_stop_training(tmp_path, fakes, caplog):
    wandb, _ = fakes
    with MetricsLogger(tmp_path, log_config=LoggingConfig(backends=["wandb"])) as log:
        wandb.runs[0].log = lambda row: (_ for _ in ()).throw(ConnectionError("network down"))
        for step in (1, 2, 3):
            log.log(step, {"loss": 1.0})
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    assert [r for r in caplog.records if "wandb failed to log step 1" in r.message]
    assert [r for r in caplog.records if "wandb failed on 3 log calls" in r.message]


def test_config_checks(monkeypatch):
    real_find_spec = log_backends.importlib.util.find_spec
    monkeypatch.setattr(log_backends.importlib.util, "find_spec",
                        lambda name: None if name in ("wandb", "mlflow") else real_find_spec(name))
    with pytest.raises(ValueError, match="'wandb' but the 'wandb' package is not installed: pip install wandb"):
        LoggingConfig(backends=["jsonl", "wandb"])
    with pytest.raises(ValueError, match="'mlflow' package is not installed"):
        LoggingConfig(backends=["mlflow"])
    with pytest.raises(ValueError, match="twice"):
        LoggingConfig(backends=["jsonl", "jsonl"])
    with pytest.raises(ConfigError, match="logging.backends"):
        from_dict(SFTConfig, {"logging": {"backends": ["neptune"]}})
    assert from_dict(SFTConfig, {"logging": {"backends": ["jsonl"]}}).logging.backends == ["jsonl"]


def _sft_logs_to_the_backends(tmp):
    """In the forked rank: the fakes of the parent's sys.modules record the trainer's calls."""
    wandb, store = sys.modules["wandb"], FakeMlflowClient.store
    run_dir = f"{tmp}/run"
    cfg = tiny_config(run_dir, "steps=2", "save_every=0", "logging.project=sft-test", "logging.run_name=tiny")
    cfg.logging.backends = ["jsonl", "wandb", "mlflow"]
    train_sft(cfg)
    rows = read_metrics(run_dir)
    logged = wandb.runs[0].logged
    assert [r["step"] for r in logged] == [r["step"] for r in rows] == [1, 2]
    assert set(logged[0]) == set(rows[0]) and logged[0]["loss"] == pytest.approx(rows[0]["loss"])
    assert wandb.inits[0]["config"] == flatten_config(to_dict(cfg)) and wandb.inits[0]["name"] == "tiny"
    assert wandb.runs[0].finished == [0]
    (run,) = store["runs"].values()
    assert run["params"]["optim.lr"] == "0.01" and run["status"] == "FINISHED"
    assert {(k, s) for k, _, s in run["metrics"]} == {(k, r["step"]) for r in rows for k in r if k != "step"}


def test_sft_run_logs_to_the_backends_with_its_config(tmp_path, fakes):
    run_distributed(_sft_logs_to_the_backends, str(tmp_path), world_size=1)


def _wandb_records(path):
    """Protobuf records of a W&B run file: a 7-byte `:W&B` header, then LevelDB log blocks of 32 KiB whose records
    (crc32, length uint16, type: 1 full, 2 first, 3 middle, 4 last) may span blocks."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, parts, out = 7, [], []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:
            pos += left
            continue
        if pos + 7 + length > len(data):
            break   # a record still being written
        parts.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            out.append(record)
            parts = []
    return out


def test_wandb_offline_run_files_hold_the_rows_and_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):   # nothing in $HOME
        monkeypatch.setenv(name, str(tmp_path / "wandb_home" / name.lower()))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = LoggingConfig(backends=["jsonl", "wandb"], project="offline-test", wandb_mode="offline")
    with MetricsLogger(tmp_path, log_config=cfg, config=CONFIG) as log:
        log.log(1, {"loss": 2.5, "reward/mean": 0.25})
        log.log(2, {"loss": 1.5})
    run_id = json.loads((tmp_path / RUN_IDS_FILE).read_text())["wandb"]
    with MetricsLogger(tmp_path, log_config=cfg, config=CONFIG, initial_step=1, resumed=True) as log:
        log.log(2, {"loss": 1.25})
    files = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert [f.name for f in files] == [f"run-{run_id}.wandb"] * 2       # the resumed run kept its id
    for file, expected in zip(files, ([(1, 2.5), (2, 1.5)], [(2, 1.25)])):
        records = _wandb_records(file)
        deadline = time.monotonic() + 20
        while "exit" not in [r.WhichOneof("record_type") for r in records] and time.monotonic() < deadline:
            time.sleep(0.2)   # W&B's service process may still be writing the file after finish() returns
            records = _wandb_records(file)
        run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
        assert (run.run_id, run.project, run.display_name) == (run_id, "offline-test", tmp_path.name)
        config = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in run.config.update}
        config.pop("_wandb", None)
        assert config == FLAT
        history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                   for r in records if r.WhichOneof("record_type") == "history"]
        assert [(h["step"], h["loss"]) for h in history] == expected
        exit_record = next(r.exit for r in records if r.WhichOneof("record_type") == "exit")
        assert exit_record.exit_code == 0
    assert history[0].keys() >= {"step", "loss"}


def test_mlflow_file_store_reads_back(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")    # MLflow 3 keeps its file store behind this switch
    uri = (tmp_path / "mlruns").as_uri()
    cfg = LoggingConfig(backends=["mlflow"], project="file-test", run_name="r1", mlflow_tracking_uri=uri)
    with MetricsLogger(tmp_path, log_config=cfg, config=CONFIG) as log:
        log.log(1, {"loss": 2.5, "reward/mean": 0.25})
        log.log(2, {"loss": 1.5})
    run_id = json.loads((tmp_path / RUN_IDS_FILE).read_text())["mlflow"]
    with MetricsLogger(tmp_path, log_config=cfg, config={**CONFIG, "steps": 4}, initial_step=2, resumed=True) as log:
        log.log(3, {"loss": 0.5})
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "r1"
    assert run.data.params == {"steps": "3", "optim.lr": "0.01", "optim.betas": "[0.9, 0.95]", "model.path": "null",
                               "empty": "{}"}
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [(1, 2.5), (2, 1.5), (3, 0.5)]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "reward/mean")] == [(1, 0.25)]
    assert client.get_experiment_by_name("file-test").experiment_id == run.info.experiment_id
