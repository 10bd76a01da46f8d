"""Disaggregated placement with bounded staleness (issue 29, `megalign.trainers.disaggregated`): rollout ranks apart
from the training ranks, started by torchrun as users start them. References: the colocated run (k = 0, bit for bit),
a colocated run that samples from a snapshot of the weights k updates old (k = 1, bit for bit), the uninterrupted run
(resume after kill -9), the trainer's own recomputation (weights resharded to another tp)."""
import copy
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import tiny_config, tiny_overrides, tiny_policy
from trainers.helpers import checkpoint_params, metric_rows

from megalign.algos.registry import get as get_algorithm
from megalign.checkpoint import CheckpointManager
from megalign.config import load_config
from megalign.parallel.placement import Split, _buckets
from megalign.trainers.disaggregated import PlacementConfig, behaviour_version, check_disaggregated
from megalign.trainers.grpo import GRPOTrainer

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
ASYNC = ("async/",)


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("policy") / "hf")


def algo_overrides(algo, policy, run_dir, *overrides):
    """The tiny test config of `algo` (GRPO's `tiny_overrides`; PPO adds its critic's lr; online DPO samples pairs)."""
    base = tiny_overrides(policy, run_dir, "export_hf=false", *overrides)
    if algo == "ppo":
        return base + ["critic.optim.lr=0.01"]
    if algo == "online_dpo":
        return [o for o in base if not o.startswith(("algo.", "rollout.group_size"))] + ["rollout.group_size=2"]
    return base


def torchrun(run_dir, policy, *overrides, nproc=2, log=None, wait=True, algo="grpo"):
    """launch/train_`algo`.py under torchrun on `nproc` processes (the last one rolls out unless told otherwise)."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            os.path.join(ROOT, "launch", f"train_{algo}.py"),
            *algo_overrides(algo, policy, run_dir, "placement.mode=disaggregated", *overrides)]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    out = open(log or os.path.join(os.path.dirname(run_dir), os.path.basename(run_dir) + ".log"), "w")
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    if not wait:
        return proc
    assert proc.wait(timeout=300) == 0, open(out.name).read()
    return proc


def descendants(pid):
    """`pid` and its descendants, parents first."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    order, stack = [], [pid]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(children.get(node, []))
    return order


def kill_tree(pid):
    """SIGKILL `pid`'s descendants (torchrun's workers, which run in sessions of their own), then `pid`."""
    for node in reversed(descendants(pid)):
        try:
            os.kill(node, signal.SIGKILL)
        except ProcessLookupError:
            pass


def without(rows, prefixes):
    return [{k: v for k, v in row.items() if not k.startswith(prefixes)} for row in rows]


def same_weights(run_a, run_b, step):
    expected = checkpoint_params(str(run_b), step, role="actor")
    for name, value in checkpoint_params(str(run_a), step, role="actor").items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)


# ----- pure pieces

def test_split_sides_and_versions():
    sides = [Split(rank, 5, 2) for rank in range(5)]
    assert [s.side for s in sides] == ["train"] * 3 + ["rollout"] * 2
    assert [s.side_rank for s in sides] == [0, 1, 2, 0, 1] and sides[4].side_size == 2 and sides[0].rollout_leader == 3
    with pytest.raises(ValueError, match="at least one rollout and one training rank"):
        Split(0, 2, 2)
    assert [behaviour_version(t, 0) for t in range(4)] == [0, 1, 2, 3]
    assert [behaviour_version(t, 2) for t in range(5)] == [0, 0, 0, 1, 2]


def test_buckets_keep_every_tensor_aligned_and_exact():
    tensors = [("a", torch.randn(3, 5)), ("b", torch.randn(7).to(torch.bfloat16)), ("c", torch.arange(5)),
               ("d", torch.randn(1, dtype=torch.float64)), ("e", torch.randn(40))]
    out = {}
    for entries, flat in _buckets(tensors, bucket_bytes=64):
        assert flat.dtype == torch.uint8
        for name, dtype, shape, offset, nbytes in entries:
            assert offset % 16 == 0
            out[name] = flat[offset:offset + nbytes].view(dtype).view(shape)
    assert list(out) == [n for n, _ in tensors]
    for name, tensor in tensors:
        assert torch.equal(out[name], tensor), name


def test_config_errors_name_the_keys(policy, tmp_path):
    with pytest.raises(ValueError, match=r"placement.max_staleness must be an int >= 0, got -1"):
        PlacementConfig(max_staleness=-1)
    cfg = tiny_config(policy, tmp_path, "rollout.prompts_per_step=3", "placement.mode=disaggregated")
    with pytest.raises(ValueError, match=r"rollout.prompts_per_step=3 must be a multiple of the training side's dp=2"):
        check_disaggregated(cfg, Split(0, 3, 1))
    cfg = tiny_config(policy, tmp_path, "placement.mode=disaggregated", "placement.rollout_tp=2")
    with pytest.raises(ValueError, match=r"placement.rollout_tp=2 does not divide placement.rollout_ranks=1"):
        check_disaggregated(cfg, Split(0, 2, 1))
    cfg = tiny_config(policy, tmp_path, "placement.mode=disaggregated", "actor.lora.rank=4")
    with pytest.raises(ValueError, match=r"does not run actor.lora"):
        check_disaggregated(cfg, Split(0, 2, 1))


# ----- whole runs under torchrun

def _colocated(algo, policy, run_dir, *overrides):
    spec = get_algorithm(algo)
    spec.train_fn()(load_config(spec.config_class(), None, algo_overrides(algo, policy, run_dir, *overrides)))


EPISODES = (f"rollout.env={{name: '{TESTS}/trainers/multiturn_envs.py:DigitEnv', max_turn_tokens: 4}}",
            "rollout.max_response_length=24")


@pytest.mark.parametrize("algo", ["grpo", pytest.param("ppo", marks=pytest.mark.slow),
                                  pytest.param("online_dpo", marks=pytest.mark.slow), "grpo_episodes"])
def test_staleness_0_equals_the_colocated_run_bit_for_bit(policy, tmp_path, algo):
    algo, extra = ("grpo", EPISODES) if algo == "grpo_episodes" else (algo, ())
    torchrun(str(tmp_path / "async"), policy, "steps=3", "placement.max_staleness=0", *extra, algo=algo)
    run_distributed(_colocated, algo, policy, str(tmp_path / "sync"), "steps=3", *extra, world_size=1)
    rows = metric_rows(tmp_path / "async")
    assert bool(extra) == any(key.startswith("env/") for key in rows[0])  # multi-turn episodes ran where asked
    assert [r["async/staleness"] for r in rows] == [0.0, 0.0, 0.0]
    assert [r["async/version"] for r in rows] == [0.0, 1.0, 2.0]
    assert without(rows, ASYNC) == metric_rows(tmp_path / "sync")
    same_weights(tmp_path / "async", tmp_path / "sync", 3)


class StaleGRPO(GRPOTrainer):
    """The reference of staleness k: colocated GRPO whose step t samples with a snapshot of the weights after
    max(0, t - k) updates (the trainer's own weights are put back for the update)."""

    k = 1

    def __init__(self, cfg):
        super().__init__(cfg)
        self.versions = {0: copy.deepcopy(self.actor.model.state_dict())}

    def collect(self):
        model = self.actor.model
        current = copy.deepcopy(model.state_dict())
        model.load_state_dict(self.versions[behaviour_version(self.progress["step"], self.k)])
        try:
            return super().collect()
        finally:
            model.load_state_dict(current)

    def train_step(self):
        metrics = super().train_step()
        self.versions[self.progress["step"] + 1] = copy.deepcopy(self.actor.model.state_dict())
        return metrics


def _stale(policy, run_dir, *overrides):
    StaleGRPO(tiny_config(policy, run_dir, "export_hf=false", *overrides)).train()


def test_staleness_1_equals_a_colocated_run_sampling_from_weights_one_update_old(policy, tmp_path):
    overrides = ("steps=4", "algo.off_policy.mode=tis", "rollout.old_logprobs=recompute")
    torchrun(str(tmp_path / "async"), policy, *overrides, "placement.max_staleness=1")
    run_distributed(_stale, policy, str(tmp_path / "stale"), *overrides, world_size=1)
    rows = metric_rows(tmp_path / "async")
    assert [r["async/staleness"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert [r["async/version"] for r in rows] == [0.0, 0.0, 1.0, 2.0]
    assert without(rows, ASYNC) == metric_rows(tmp_path / "stale")
    assert rows[1]["offpolicy/weight_max"] != 1.0  # stale samples: the behaviour weights are not 1
    same_weights(tmp_path / "async", tmp_path / "stale", 4)


@pytest.mark.slow
def test_kill_9_mid_run_then_resume_equals_the_uninterrupted_run(policy, tmp_path):
    steps = ("steps=30", "save_every=1", "placement.max_staleness=2")
    killed = str(tmp_path / "killed")
    proc = torchrun(killed, policy, *steps, wait=False)
    try:
        deadline = time.monotonic() + 240
        while max(CheckpointManager(killed).steps(), default=0) < 3:  # the rollout side ahead of the training
            assert proc.poll() is None and time.monotonic() < deadline, open(killed + ".log").read()
            time.sleep(0.01)
    finally:
        kill_tree(proc.pid)  # the workers and torchrun, at whatever point they are
    proc.wait(timeout=60)
    saved = CheckpointManager(killed).steps()
    assert saved and saved[-1] < 30, saved
    torchrun(killed, policy, *steps, log=killed + ".resumed.log")  # resume=auto: the latest checkpoint
    assert f"at step {saved[-1]}" in open(killed + ".resumed.log").read()
    torchrun(str(tmp_path / "straight"), policy, *steps)
    assert metric_rows(killed) == metric_rows(tmp_path / "straight")
    same_weights(killed, tmp_path / "straight", 30)


def rollout_worker(pid):
    """The pid of torchrun `pid`'s worker that rolls out (the job's last rank, LOCAL_RANK=1 of 2)."""
    for node in descendants(pid):
        try:
            environ = open(f"/proc/{node}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"LOCAL_RANK=1" in environ and b"RANK=1" in environ:
            return node
    raise AssertionError("no rollout worker found")


@pytest.mark.slow
@pytest.mark.parametrize("who", ["torchrun", "rollout"])
def test_a_signal_stops_both_sides_with_a_checkpoint_and_resume_equals_the_straight_run(policy, tmp_path, who):
    """SIGTERM to torchrun (forwarded to every worker), or SIGUSR1 to the rollout rank alone (reported to the training
    side with its next batch): the training side stops at a step boundary with a checkpoint, stops the rollout
    side, both exit with status 75, and resume=auto continues as if nothing had happened."""
    steps = ("steps=30", "save_every=0", "placement.max_staleness=1")
    stopped = str(tmp_path / "stopped")
    proc = torchrun(stopped, policy, *steps, wait=False)
    metrics = os.path.join(stopped, "metrics.jsonl")
    try:
        deadline = time.monotonic() + 240
        while not (os.path.exists(metrics) and os.path.getsize(metrics)):
            assert proc.poll() is None and time.monotonic() < deadline, open(stopped + ".log").read()
            time.sleep(0.01)
        if who == "torchrun":
            proc.send_signal(signal.SIGTERM)
        else:
            os.kill(rollout_worker(proc.pid), signal.SIGUSR1)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    text = open(stopped + ".log").read()
    assert text.count("exiting with status 75") == 2, text  # the training rank and the rollout rank
    saved = CheckpointManager(stopped).steps()
    assert len(saved) == 1 and 1 <= saved[0] < 30, (saved, text)
    torchrun(stopped, policy, *steps, log=stopped + ".resumed.log")
    torchrun(str(tmp_path / "straight"), policy, *steps)
    assert metric_rows(stopped) == metric_rows(tmp_path / "straight")
    same_weights(stopped, tmp_path / "straight", 30)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [("actor.tp=2", "placement.rollout_tp=1"),  # train tp 2 -> rollout tp 1
                                    ("placement.rollout_ranks=2", "placement.rollout_tp=2"),  # tp 1 -> tp 2
                                    ("placement.rollout_ranks=2", "placement.rollout_tp=1")])  # rollout dp 2 -> dp 1
def test_rollout_ranks_at_another_layout_sample_with_the_trainers_weights(policy, tmp_path, layout):
    """Three ranks, the two sides on different layouts: the rollout's log-probs agree with the trainer's
    recomputation to rounding at every step, which they would not if the weights were not resharded and sent after
    every update (lr 0.01 moves them far more), and every step trains the whole batch of 4 prompts x 4."""
    torchrun(str(tmp_path / "run"), policy, "steps=3", "placement.max_staleness=0", "rollout.old_logprobs=recompute",
             *layout, nproc=3)
    rows = metric_rows(tmp_path / "run")
    assert len(rows) == 3
    for row in rows:
        assert row["rollout/logprob_max_abs_diff"] < 1e-4, row
        assert row["sampling/kept_groups"] == 4.0, row
