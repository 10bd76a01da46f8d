"""Metric backends beside metrics.jsonl and TensorBoard: Weights & Biases and MLflow, chosen in the run config.

```yaml
logging:
  backends: [jsonl, tensorboard, wandb, mlflow]   # verl's trainer.logger, TRL's report_to
  project: arith-grpo          # the W&B project and the MLflow experiment
  run_name: grpo-lr1e-6        # null: the run_dir's folder name
```

Design choices:

- Each backend is imported only when the config lists it; a listed backend whose package is missing fails
  when the config is loaded (`LoggingConfig.__post_init__`), naming the package and how to install it,
  before any model is built. `jsonl` is always written (the record of truth that resume trims and plots
  read): listing it is allowed, leaving it out changes nothing.
- Same names, same step: every `MetricsLogger.log` row goes to every backend with the metric names of
  metrics.jsonl and the trainer's step. W&B gets the step as a metric `step` declared the x-axis of every
  other (`define_metric`), not as its own `_step`, which only grows: a resumed run logs again the steps
  after its checkpoint, and W&B would drop them. MLflow takes the step as is (`log_batch`).
- The config is logged with the run, flattened to dotted keys (`optim.lr`): W&B's `config`, MLflow's params
  (strings: JSON for lists and null, cut to MLflow's 6000 characters with a count in the log). A resumed
  MLflow run, whose params cannot change, gets only the keys it lacks; the changed ones are named in the log.
- Resume continues the same run where the backend allows: the run ids are kept in `run_dir/logging_runs.json`
  and a resumed trainer reopens them (W&B `id=..., resume="allow"`; MLflow the same run id, set RUNNING
  again); a fresh run writes new ids.
- MLflow goes through an explicit `MlflowClient` (no process-wide active run). A backend that fails while
  logging (a network error) never stops training: the first failure is logged with its traceback, the
  rest counted and reported when the run closes. Closing marks the run finished, or failed (W&B exit code 1,
  MLflow FAILED) when an exception is on its way out, or killed (MLflow KILLED, W&B the exit status) for a
  preemption exit.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import logging
import os
import sys
import time
from typing import Any, Literal, Mapping, Optional

from megalign.config import atomic_write_text, option

logger = logging.getLogger(__name__)

BACKENDS = ("jsonl", "tensorboard", "wandb", "mlflow")
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""Backend -> the package it needs (pip names; `mlflow-skinny` is enough for MLflow)."""

RUN_IDS_FILE = "logging_runs.json"
MLFLOW_PARAM_MAX = 6000
"""MLflow's longest param value (MAX_PARAM_VAL_LENGTH)."""


@dataclasses.dataclass
class LoggingConfig:
    """Where the metrics go besides metrics.jsonl (always written) and how the run is named there."""

    backends: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = option(
        ["jsonl", "tensorboard"], doc="metric backends: jsonl (always written), tensorboard (also needs tensorboard: "
                                      "true, the default), wandb, mlflow; each imported only when listed")
    project: str = option("megalign", doc="the W&B project and the MLflow experiment name")
    run_name: Optional[str] = option(None, doc="the run's display name in W&B / MLflow; null: the run_dir's folder name")
    entity: Optional[str] = option(None, doc="W&B entity (team or user); null: W&B's default (WANDB_ENTITY)")
    tags: list[str] = option([], doc="tags of the run (W&B tags; MLflow tags with the value 'true')")
    wandb_mode: Optional[Literal["online", "offline"]] = option(
        None, doc="W&B mode; null: WANDB_MODE, else online. offline writes run_dir/wandb for `wandb sync` later")
    mlflow_tracking_uri: Optional[str] = option(
        None, doc="MLflow tracking URI (http://..., sqlite:///..., file:///...); null: MLFLOW_TRACKING_URI, else MLflow's default")

    def __post_init__(self):
        if len(set(self.backends)) != len(self.backends):
            raise ValueError(f"logging.backends lists a backend twice: {self.backends}")
        if not self.project:
            raise ValueError("logging.project must not be empty")
        for backend in self.backends:
            package = PACKAGES.get(backend)
            if backend in ("wandb", "mlflow") and importlib.util.find_spec(package) is None:
                raise ValueError(f"logging.backends lists {backend!r} but the {package!r} package is not installed: "
                                 f"pip install {package} (or megalign[{backend}])")


def flatten_config(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: value} of a nested config dict (`config.to_dict` output); lists stay whole values."""
    if not isinstance(cfg, Mapping):
        return {prefix.rstrip("."): cfg}
    out: dict[str, Any] = {}
    for key, value in cfg.items():
        if isinstance(value, Mapping) and value:
            out.update(flatten_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _param_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


class WandbBackend:
    """A W&B run (module doc): `config` logged at init, metrics with `step` as their x-axis."""

    name = "wandb"

    def __init__(self, cfg: LoggingConfig, run_dir: str, run_name: str, config: Mapping[str, Any],
                 run_id: Optional[str]):
        wandb = importlib.import_module("wandb")
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, name=run_name, dir=run_dir, config=dict(config),
                              tags=list(cfg.tags) or None, mode=cfg.wandb_mode, id=run_id,
                              resume="allow" if run_id else None)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.id = self.run.id

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log({**values, "step": step})

    def close(self, exit_code: int, status: str) -> None:
        self.run.finish(exit_code=exit_code)


class MlflowBackend:
    """An MLflow run through its own `MlflowClient` (module doc)."""

    name = "mlflow"
    BATCH = 100
    """Entries per `log_batch` call (MLflow servers take at most 100 params and 1000 metrics per batch)."""

    def __init__(self, cfg: LoggingConfig, run_dir: str, run_name: str, config: Mapping[str, Any],
                 run_id: Optional[str]):
        mlflow = importlib.import_module("mlflow")
        self.entities = importlib.import_module("mlflow.entities")
        self.client = mlflow.MlflowClient(tracking_uri=cfg.mlflow_tracking_uri)
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
        else:
            experiment = self.client.get_experiment_by_name(cfg.project)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self.client.create_experiment(cfg.project))
            run_id = self.client.create_run(experiment_id, run_name=run_name,
                                            tags={tag: "true" for tag in cfg.tags}).info.run_id
        self.id = run_id
        self._log_params(config)

    def _log_params(self, config: Mapping[str, Any]) -> None:
        """The config as params; on a resumed run only the keys it lacks (params cannot change)."""
        logged = self.client.get_run(self.id).data.params
        texts = {key: _param_text(value) for key, value in config.items()}
        cut = [key for key, text in texts.items() if len(text) > MLFLOW_PARAM_MAX]
        texts = {key: text[:MLFLOW_PARAM_MAX] for key, text in texts.items()}
        changed = sorted(key for key, text in texts.items() if key in logged and logged[key] != text)
        if cut:
            logger.warning("mlflow: %d config values cut to %d characters: %s", len(cut), MLFLOW_PARAM_MAX, cut)
        if changed:
            logger.warning("mlflow: run %s keeps its first values of %s (MLflow params cannot change)", self.id, changed)
        params = [self.entities.Param(key, text) for key, text in texts.items() if key not in logged]
        for i in range(0, len(params), self.BATCH):
            self.client.log_batch(self.id, params=params[i:i + self.BATCH])

    def log(self, step: int, values: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [self.entities.Metric(key, value, now, step) for key, value in values.items()]
        for i in range(0, len(metrics), self.BATCH):
            self.client.log_batch(self.id, metrics=metrics[i:i + self.BATCH])

    def close(self, exit_code: int, status: str) -> None:
        self.client.set_terminated(self.id, status)


BACKEND_CLASSES = {"wandb": WandbBackend, "mlflow": MlflowBackend}


class ExternalLoggers:
    """The W&B / MLflow backends `cfg` lists, opened on rank 0 by `MetricsLogger` (module doc).

    Args:
        cfg: the run's logging config.
        run_dir: the run directory (run ids file; W&B's offline files go to run_dir/wandb).
        config: the run's whole config as nested dicts (`megalign.config.to_dict`), logged flattened.
        resumed: the run resumes from its checkpoint: reopen the runs whose ids run_dir keeps.
    """

    def __init__(self, cfg: LoggingConfig, run_dir: str, config: Optional[Mapping[str, Any]] = None,
                 resumed: bool = False):
        self.path = os.path.join(run_dir, RUN_IDS_FILE)
        ids = self._read_ids() if resumed else {}
        run_name = cfg.run_name or os.path.basename(os.path.abspath(run_dir))
        flat = flatten_config(config or {})
        self.backends = []
        self.failures: dict[str, int] = {}
        try:
            for name in cfg.backends:
                if name in BACKEND_CLASSES:
                    self.backends.append(BACKEND_CLASSES[name](cfg, run_dir, run_name, flat, ids.get(name)))
        except BaseException:  # one that cannot start stops the run; those already open are closed as failed
            self.close()
            raise
        if self.backends:
            atomic_write_text(self.path, json.dumps({**ids, **{b.name: b.id for b in self.backends}}, indent=1) + "\n")

    def _read_ids(self) -> dict[str, str]:
        try:
            with open(self.path, encoding="utf-8") as f:
                ids = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            logger.warning("%s is unreadable (%s); the resumed run opens new logging runs", self.path, exc)
            return {}
        return {k: v for k, v in ids.items() if isinstance(v, str)} if isinstance(ids, dict) else {}

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for backend in self.backends:
            try:
                backend.log(step, values)
            except Exception:  # a logging service must not stop training (module doc)
                count = self.failures[backend.name] = self.failures.get(backend.name, 0) + 1
                if count == 1:
                    logger.warning("%s failed to log step %d; training goes on, later failures are counted",
                                   backend.name, step, exc_info=True)

    def close(self) -> None:
        """Finish every run: failed when an exception is propagating (this is called from `finally`)."""
        exc = sys.exc_info()[1]
        if exc is None:
            exit_code, status = 0, "FINISHED"
        elif isinstance(exc, SystemExit) and exc.code in (0, None):
            exit_code, status = 0, "FINISHED"
        elif isinstance(exc, (SystemExit, KeyboardInterrupt)):
            code = getattr(exc, "code", 1)
            exit_code, status = (code if isinstance(code, int) else 1), "KILLED"
        else:
            exit_code, status = 1, "FAILED"
        for backend in self.backends:
            try:
                backend.close(exit_code, status)
            except Exception:
                logger.warning("%s failed to close its run %s", backend.name, backend.id, exc_info=True)
        for name, count in self.failures.items():
            logger.warning("%s failed on %d log calls of this run", name, count)
        self.backends = []
