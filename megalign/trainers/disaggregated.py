"""Asynchronous online training on disaggregated ranks (`placement.mode: disaggregated`): rollout ranks generate and
score while training ranks train, with bounded staleness and exact resume.

The job's last `placement.rollout_ranks` ranks roll out (`megalign.parallel.placement`: each side has its own
default process group, the two meet on a `Bridge`). Both sides build the same online trainer class: the rollout
side's (`OnlineTrainer` with `rollout_side`) holds the actor's weights at `placement.rollout_tp` for generation, the
reward role (verifiers, reward models, judges), the prompt sampler and the rollout generator, and runs the
algorithm's own `collect` (sampling rounds, `shape_rewards`, `keep_groups`) in `RolloutWorker.run`; the training side
holds every trained role and the reference and takes each step's batch from its `RolloutFeed` instead of
generating it.

Schedule. Step t (0-based) trains on a batch sampled with weights version v(t) = max(0, t - k), k =
`placement.max_staleness`, version v being the weights after v updates. The version is fixed by the step, not by
whichever weights happen to have arrived, so a run is a deterministic function of its configuration:

- k = 0 is the synchronous schedule: step t's batch waits for the weights of update t - 1, and the run equals the
  colocated run at the same dp bit for bit (weights and metrics), the rollout side drawing its engine seeds from its
  own generator as the colocated trainer does (`OnlineTrainer.rollout_generator`);
- k >= 1 overlaps step t's update with the sampling of steps t + 1 .. t + k; the staleness of step t's samples is
  t - v(t) = min(t, k) versions, logged as `async/staleness`. The update corrects for it as configured
  (`algo.off_policy`, `megalign.algos.offpolicy`: with `rollout.old_logprobs: recompute` the proximal policy is the
  weights before this update and the behaviour policy the version that sampled).

Messages, all in an order both sides derive from (step, k, steps), so gloo's in-order matching never crosses:
the training leader sends `start` (first step, the rollout state to resume) and weights version v0; the rollout side
then produces batches t = first, first + 1, ...; before a batch whose version is newer than the weights it holds
it receives a `weights` control (then the version) or `stop`. The training side publishes version v after
update v - 1 only when a later batch needs it (v <= v(steps - 1)). At the end, or when the run stops early (a
signal), the training side first receives every batch the rollout side can still make with the versions it was
sent, then sends `stop`; nothing is left in flight.

Resume. A checkpoint after step s holds (`RolloutFeed.state_dict`) the batches of steps s .. s + k - 1 (already
sampled with versions < s; received before saving) and the rollout side's state after the last of them (each
rollout rank's sampler position, rollout generator and reward error counters). A resumed run replays the queue and
restarts the rollout side at step s + k with version s, so its later steps equal the uninterrupted run's; a kill
-9 at any point loses only the work since the last checkpoint.

Data. Each rollout rank collects its dp share (prompts_per_step / rollout dp groups); the leader gathers the parts
and sends them as one message, which the training leader broadcasts to its side. With equal dp on both sides
training rank d takes rollout part d (as the colocated run at that dp would); otherwise the parts' kept groups are
concatenated and split over the training dp ranks in order, and the generation metrics go to training dp rank 0.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import pickle
import time
from typing import Any, Callable, Literal, Optional

import torch
import torch.distributed as dist

from megalign.config import option
from megalign.models.hf_adapter import hf_tensor_stream, load_hf_tensors
from megalign.parallel.launch import resolve_launch
from megalign.parallel.layout import ParallelLayout, coords_rank
from megalign.parallel.placement import Bridge, Split
from megalign.rollout import RolloutBatch
from megalign.trainers.stopping import PREEMPTED_EXIT_STATUS, Preempted, StopSignals

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class PlacementConfig:
    """`placement`: where the roles run (module doc)."""

    mode: Literal["colocated", "disaggregated"] = option(
        "colocated", doc="colocated: every role on every rank, phases in turn; disaggregated: the last "
                         "placement.rollout_ranks ranks generate while the others train")
    rollout_ranks: int = option(1, doc="disaggregated: ranks that generate (the job's last ones)")
    rollout_tp: int = option(0, doc="disaggregated: tensor-parallel size of the rollout ranks' actor copy; 0: actor.tp")
    max_staleness: int = option(1, doc="disaggregated: k, step t samples with the weights after max(0, t - k) updates; "
                                       "0 is synchronous")
    weight_bucket_mb: int = option(256, doc="disaggregated: size of the buckets the weights are broadcast in")

    def __post_init__(self) -> None:
        if self.mode not in ("colocated", "disaggregated"):
            raise ValueError(f"placement.mode must be 'colocated' or 'disaggregated', got {self.mode!r}")
        for key, low in (("rollout_ranks", 1), ("rollout_tp", 0), ("max_staleness", 0), ("weight_bucket_mb", 1)):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"placement.{key} must be an int >= {low}, got {value!r}")

    @property
    def disaggregated(self) -> bool:
        return self.mode == "disaggregated"


def rollout_ranks(cfg: Any) -> int:
    """Ranks the job's rollout side takes for config `cfg` (0: colocated, or a config without `placement`)."""
    placement = getattr(cfg, "placement", None)
    return placement.rollout_ranks if placement is not None and placement.disaggregated else 0


def behaviour_version(step: int, k: int) -> int:
    """v(t): the weights version (updates done) step `step`'s batch is sampled with at staleness bound `k`."""
    return max(0, step - k)


def check_disaggregated(cfg: Any, split: Split) -> None:
    """ValueError naming the keys of what the disaggregated placement cannot run (before any model loads)."""
    placement = cfg.placement
    tp = placement.rollout_tp or cfg.actor.tp
    if split.rollout_ranks % tp:
        raise ValueError(f"placement.rollout_tp={tp} does not divide placement.rollout_ranks={split.rollout_ranks}")
    train_model = cfg.actor.tp * cfg.actor.pp
    if split.train_ranks % train_model:
        raise ValueError(f"actor.tp={cfg.actor.tp} x actor.pp={cfg.actor.pp} does not divide the {split.train_ranks} "
                         f"training ranks (world size - placement.rollout_ranks)")
    for side, dp in (("rollout", split.rollout_ranks // tp), ("training", split.train_ranks // train_model)):
        if cfg.rollout.prompts_per_step % dp:
            raise ValueError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must be a multiple of the "
                             f"{side} side's dp={dp} (placement.mode=disaggregated)")
    if cfg.actor.lora is not None:
        raise ValueError("placement.mode=disaggregated does not run actor.lora yet (the rollout ranks would need the "
                         "adapters); use placement.mode=colocated")


def job_split(cfg: Any) -> Optional[Split]:
    """This process's `Split` for a disaggregated run of `cfg` (None: colocated), checked (`check_disaggregated`)
    against the job and against the default process group, which must be this side's (`init_distributed` with
    the config's `placement.rollout_ranks`)."""
    ranks = rollout_ranks(cfg)
    if not ranks:
        return None
    launch = resolve_launch(os.environ)
    split = Split(launch.rank, launch.world_size, ranks)
    check_disaggregated(cfg, split)
    if dist.get_world_size() != split.side_size:
        raise RuntimeError(f"placement.mode=disaggregated: the default process group has {dist.get_world_size()} "
                           f"rank(s), this rank's {split.side} side {split.side_size}: start the job through "
                           f"megalign's entry points (launch/train_*.py), which give each side its own group")
    return split


def weight_senders(cfg: Any, split: Split) -> list[int]:
    """Global ranks that send the actor's weights, one per training pipeline stage: the stage's tp rank 0 of dp
    replica 0 (pure arithmetic, so both sides agree)."""
    tp, pp = cfg.actor.tp, cfg.actor.pp
    dp = split.train_ranks // (tp * pp)
    return [coords_rank(pp_rank=p, dp_rank=0, tp_rank=0, tp=tp, dp=dp) for p in range(pp)]


def connect(cfg: Any, split: Split, device_type: str) -> Bridge:
    """The job's bridge (collective over both sides)."""
    timeout = datetime.timedelta(minutes=max(cfg.watchdog_minutes, 1) * 2)
    return Bridge(split, weight_senders(cfg, split), device_type, timeout)


def _leader_broadcast(obj: Any, device: torch.device) -> Any:
    """`obj` of this side's rank 0, on every rank of the side."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=device)
    return box[0]


class Placement:
    """The disaggregated placement's part of an `OnlineTrainer` (a mixin; module doc). Reads `split` (`job_split`),
    `cfg`, `device_type`, `progress` of the trainer; sets `bridge`, `feed` (training side) and `remote_errors`."""

    @property
    def rollout_side(self) -> bool:
        return self.split is not None and self.split.side == "rollout"

    def rollout_layout(self) -> ParallelLayout:
        """The rollout ranks' layout: the actor's copy that generates, at `placement.rollout_tp` (pp = 1)."""
        return self.layout_for(self.cfg.placement.rollout_tp or self.cfg.actor.tp, 1, "placement.rollout")

    def connect_sides(self) -> None:
        """After the roles are built: the bridge (a collective over both sides) and, on the training side, the feed
        and its checkpoint state; nothing when colocated."""
        self.bridge = connect(self.cfg, self.split, self.device_type) if self.split is not None else None
        self.feed = RolloutFeed(self, self.bridge) if self.bridge is not None and not self.rollout_side else None
        self.remote_errors: Optional[dict[str, float]] = None  # the rollout side's reward error counts (feed)
        if self.feed is not None:
            self.register_state("async", self.feed)

    def owns_run_dir(self) -> bool:
        return not self.rollout_side

    def on_train_start(self) -> None:
        if self.feed is not None:
            self.feed.start()

    def train_placed(self, train: Callable[[], Any]) -> Any:
        """`train()` (the trainer's lifecycle) on the training side, the rollout side stopped when it ends or is
        preempted; the rollout loop on the rollout side (None). The bridge closes at the end, the two sides together
        when both reached their planned end (a preemption included)."""
        if self.bridge is None:
            return train()
        ended = False
        try:
            result = self._run_side(train)
            ended = True
            return result
        except Preempted:
            ended = True
            raise
        finally:
            self.bridge.close(meet=ended)

    def _run_side(self, train: Callable[[], Any]) -> Any:
        if self.rollout_side:
            return RolloutWorker(self, self.bridge).run()
        try:
            result = train()
        except Preempted:
            self.feed.stop(preempted=True)
            raise
        self.feed.stop()
        return result


class RolloutFeed:
    """The training side's end (module doc): each step's batch, the weights it publishes, the checkpointed queue.

    `t`: the training side's `OnlineTrainer`. Every training rank holds the same queue and rollout state (the
    leader receives, its side gets a broadcast), so a checkpoint saves it once whatever the dp."""

    def __init__(self, t, bridge: Bridge):
        self.t, self.bridge = t, bridge
        self.k, self.steps = t.cfg.placement.max_staleness, t.cfg.steps
        self.queue: dict[int, dict] = {}
        self.rollout_state: Optional[list] = None
        self.received = -1  # last step whose batch arrived
        self.published = -1  # last weights version sent
        self.stopped = False

    @property
    def last_version(self) -> int:
        """The newest version any batch of the run is sampled with."""
        return behaviour_version(self.steps - 1, self.k)

    def start(self) -> None:
        """After the checkpoint is loaded: tell the rollout side where to start (after the queued batches) and send
        it the current weights, version s = the step (the version the first batch it makes needs, v(s + k) = s)."""
        step = self.t.progress["step"]
        first = max(self.queue) + 1 if self.queue else step
        self.received = first - 1
        if self.t.rank == 0:
            self.bridge.send({"kind": "start", "first": first, "state": self.rollout_state})
        self.publish(step)

    def publish(self, version: int) -> None:
        """Send weights `version` (the actor's current weights) to the rollout ranks if a batch still needs it."""
        if version <= self.published or (version > self.last_version and self.published >= 0):
            return
        t = self.t
        with t.timer("publish_weights"):
            self._send_weights(version)
        self.published = version

    def _send_weights(self, version: int) -> None:
        t = self.t
        if t.rank == 0:
            self.bridge.send({"kind": "weights", "version": version})
        if t.layout.dp_rank == 0:
            t.actor.need("weights")
            stream = hf_tensor_stream(t.actor.model, to_cpu=False)
            if t.layout.tp_rank == 0:
                self.bridge.send_weights(t.layout.pp_rank, stream, version, t.cfg.placement.weight_bucket_mb << 20)
            else:
                for _ in stream:  # the tp gathers: this rank's shards go to tp rank 0
                    pass

    def _receive(self) -> None:
        t = self.t
        message = self.bridge.recv() if t.rank == 0 else None
        message = _leader_broadcast(message, t.layout.device)
        signal = message.pop("signal")  # acted on once, here, never replayed from a checkpoint's queue
        if signal and t.signals is not None and t.signals.received is None:
            t.signals.received = f"{signal} on a rollout rank"  # the job stops at this step's end, with a checkpoint
        self.received = message["step"]
        self.queue[message["step"]] = message
        self.rollout_state = message["state"]

    def take(self, step: int) -> dict:
        """Step `step`'s message (waiting for it), off the queue."""
        with self.t.timer("wait_rollout"):
            while self.received < step:
                self._receive()
        return self.queue.pop(step)

    def drain(self, upto: int) -> None:
        """Receive every batch up to step `upto` (bounded by what the published versions allow and the run's
        steps)."""
        limit = min(upto, self.published + self.k, self.steps - 1)
        while self.received < limit:
            self._receive()

    def stop(self, preempted: bool = False) -> None:
        """Receive what the rollout side can still make, then tell it to stop (module doc); `preempted`: the run
        stopped on a signal with its checkpoint, and the rollout ranks exit with the same status."""
        if self.stopped:
            return
        self.drain(self.steps)
        if self.t.rank == 0:
            self.bridge.send({"kind": "stop", "preempted": preempted})
            self.bridge.flush()
        self.bridge.wait_weights()
        self.stopped = True

    def state_dict(self) -> dict[str, Any]:
        """The queue of the next k steps' batches (received first) and the rollout state after them, as one pickled
        blob: its structure varies with the queue, which DCP's key-by-key loading cannot follow."""
        self.drain(self.t.progress["step"] + self.k - 1)
        return {"blob": pickle.dumps({"queue": self.queue, "rollout_state": self.rollout_state})}

    def load_target(self, name: str, saved) -> dict[str, Any]:
        """What `CheckpointManager.load` reads (`megalign.checkpoint.state.Reshardable`): the blob; no draining."""
        return {"blob": b""}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = pickle.loads(state["blob"])
        self.queue, self.rollout_state = saved["queue"], saved["rollout_state"]

    def batch(self, step: int) -> tuple[RolloutBatch, RolloutBatch, dict[str, float]]:
        """(training batch, generated responses, sampling counts) of this training rank for step `step` (module doc:
        how rollout parts map to training dp ranks), with the rollout side's metrics and phase times recorded on
        the trainer."""
        t = self.t
        message = self.take(step)
        parts, dp, rank = message["parts"], t.layout.dp, t.layout.dp_rank
        device = t.layout.device
        if len(parts) == dp:
            mine = parts[rank]
            train, generated, counts = mine["train"], mine["generated"], dict(mine["counts"])
        else:
            train = RolloutBatch.concat([p["train"] for p in parts])
            groups = torch.arange(len(train) // train.group_size)
            chunk = torch.tensor_split(groups, dp)[rank]
            train = train.select((chunk[:, None] * train.group_size + torch.arange(train.group_size)).reshape(-1))
            generated = RolloutBatch.concat([p["generated"] for p in parts])
            generated = generated if rank == 0 else generated.select(slice(0, 0))
            counts = {"rounds": max(p["counts"]["rounds"] for p in parts), "kept_groups": len(chunk),
                      "dropped_groups": sum(p["counts"]["dropped_groups"] for p in parts) if rank == 0 else 0}
        t.rollout_metrics = {**message["metrics"], "async/staleness": float(step - message["version"]),
                             "async/version": float(message["version"])}
        t.remote_errors = message["errors"]
        for phase, seconds in message["seconds"].items():
            t.timer.seconds[phase] = t.timer.seconds.get(phase, 0.0) + seconds
        return train.to(device), generated.to(device), counts


class RolloutWorker:
    """The rollout side's loop (module doc); `t` is the rollout side's `OnlineTrainer`."""

    def __init__(self, t, bridge: Bridge):
        self.t, self.bridge = t, bridge
        self.k, self.steps = t.cfg.placement.max_staleness, t.cfg.steps
        self.version = -1

    def _control(self) -> dict:
        message = self.bridge.recv() if self.t.rank == 0 else None
        return _leader_broadcast(message, self.t.layout.device)

    def _weights(self, version: int) -> None:
        where = f"the training side's weights (version {version})"
        for stage in range(len(self.bridge.senders)):
            received = self.bridge.receive_weights(stage)
            load_hf_tensors(self.t.actor.model, ((name, tensor) for v, name, tensor in received
                                                 if _same(v, version, where)), where)
        self.version = version

    def _state(self) -> dict[str, Any]:
        t = self.t
        return {"sampler": t.sampler.state_dict(), "generator": t.rollout_generator.get_state(),
                "reward": t.reward.state_dict()}

    def _restore(self, states: Optional[list]) -> None:
        if states is None:
            return
        t = self.t
        if len(states) != t.layout.dp:
            raise ValueError(f"the checkpoint's rollout state is of {len(states)} rollout dp ranks; this job has "
                             f"{t.layout.dp} (placement.rollout_ranks / placement.rollout_tp must stay as saved)")
        state = states[t.layout.dp_rank]
        t.sampler.load_state_dict(state["sampler"])
        t.rollout_generator.set_state(state["generator"])
        t.reward.load_state_dict(state["reward"])

    def run(self) -> None:
        """The rollout loop (module doc). SIGTERM / SIGUSR1 do not end it: they are reported to the training side with
        the next batch, which stops the job at a step boundary with a checkpoint (`megalign.trainers.stopping`) and
        then this loop, which raises `Preempted` too."""
        with StopSignals() as self.signals:
            stop = self._run()
        if stop.get("preempted"):
            logger.warning("the training side stopped on a signal with its checkpoint; the rollout side is exiting with "
                           "status %d too (resume=auto continues)", PREEMPTED_EXIT_STATUS)
            raise Preempted()

    def _run(self) -> dict:
        t = self.t
        start = self._control()
        self._restore(start["state"])
        control = self._control()
        self._weights(control["version"])
        step = start["first"]
        while step < self.steps:
            if behaviour_version(step, self.k) > self.version:
                control = self._control()
                if control["kind"] == "stop":
                    break
                self._weights(control["version"])
            self._produce(step)
            step += 1
        else:
            control = self._control()  # the training side's stop
        if t.rank == 0:
            self.bridge.flush()
        return control

    def _produce(self, step: int) -> None:
        """Collect step `step`'s batch on every rollout rank; the leader sends the parts (module doc)."""
        t = self.t
        t.timer.reset()
        start = time.perf_counter()
        train, generated, counts = t.collect()
        errors = t.reward_error_metrics()  # over the rollout side's dp (a collective)
        part = {"train": train.to("cpu"), "generated": generated.to("cpu"), "counts": counts,
                "state": self._state(), "metrics": t.rollout_metrics, "seconds": dict(t.timer.seconds)}
        parts: list = [None] * dist.get_world_size() if t.rank == 0 else None
        dist.gather_object((part, self.signals.received), parts, dst=0)
        if t.rank == 0:
            signal = next((received for _, received in parts if received), None)  # any rollout rank's
            parts = [p for p, _ in parts[::t.layout.tp]]  # tp rank 0 of each dp replica, in dp order (pp = 1)
            metrics = {**parts[0]["metrics"], "time/rollout_step": time.perf_counter() - start}
            self.bridge.send({"step": step, "version": self.version, "state": [p.pop("state") for p in parts],
                              "parts": parts, "metrics": metrics, "seconds": parts[0]["seconds"],
                              "errors": errors, "signal": signal})


def _same(version: int, expected: int, where: str) -> bool:
    if version != expected:
        raise RuntimeError(f"{where}: a bucket of version {version} arrived")
    return True
