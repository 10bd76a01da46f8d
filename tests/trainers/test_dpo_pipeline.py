"""DPO with the policy at model.pp = 2 and the frozen reference at pp = 1 beside it (it scores on both stages'
ranks the batch their pp group holds): one step equals the unpipelined step on the same pairs (loss, gradient
norm, DPO's reward statistics, updated weights), also at tp = 2 x pp = 2 and at pp = 2 x dp = 2."""
import pytest
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import tiny_policy
from trainers.helpers import compare_runs

from megalign.config import load_config
from megalign.trainers.preference import DPOConfig, train_dpo

LAYERS = 2  # tiny_policy's decoder layers
DPO_METRICS = ("loss", "grad_norm", "pairs", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
               "rewards/margins", "logps/chosen", "logps/rejected")


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("policy") / "hf")


def _train(policy, run_dir, *overrides):
    train_dpo(load_config(DPOConfig, None, [
        f"run_dir={run_dir}", f"model.path={policy}", "steps=2", "batch_size=8", "data.arith.max_operand=4",
        "data.max_length=40", "optim.lr=1e-3", "optim.warmup_steps=0", "eval.max_samples=0", "tensorboard=false",
        "export_hf=false", "save_every=1", "keep_last=10", *overrides,
        # Adam's eps above the rounding of the gradients. Its first step moves an element by lr * g / (|g| + eps),
        # so a gradient element far below eps (a rare token's embedding row) moves by about lr * g / eps: a
        # reduction-order difference dg between two layouts shows up as lr * dg / eps in the weights. At eps=1e-6
        # one element of 3168 differed by 1.6e-5 (atol 1e-5) on an AVX-512 Xeon with the avx512 kernels, whose
        # 16-lane sums round differently from the tp-sharded ones; eps=1e-5 scales that amplification down 10x.
        "optim.eps=1e-5"]))


@pytest.fixture(scope="module")
def unpipelined(policy, tmp_path_factory):
    """The tp=1 x pp=1 run (one process, cached reference scores) the 4-process layouts are compared with."""
    run_dir = str(tmp_path_factory.mktemp("unpipelined") / "run")
    run_distributed(_train, policy, run_dir, world_size=1)
    return run_dir


@pytest.mark.parametrize("mode", ["cache", "online"])
def test_pp2_step_equals_unpipelined(policy, tmp_path, mode):
    run_distributed(_train, policy, str(tmp_path / "ref"), f"reference.mode={mode}", world_size=1)
    run_distributed(_train, policy, str(tmp_path / "pp2"), "model.pp=2", f"reference.mode={mode}", world_size=2)
    compare_runs(tmp_path / "ref", tmp_path / "pp2", 2, 1, LAYERS, DPO_METRICS)


def test_tp2_pp2_step_equals_unpipelined(policy, unpipelined, tmp_path):
    """4 processes: the policy at tp=2 x pp=2 (dp=1), the reference at tp=2 x pp=1 (dp=2: each replica scores the
    whole batch)."""
    run_distributed(_train, policy, str(tmp_path / "tp2pp2"), "model.tp=2", "model.pp=2", "reference.tp=2",
                    world_size=4)
    compare_runs(unpipelined, tmp_path / "tp2pp2", 2, 2, LAYERS, DPO_METRICS)


def test_pp2_dp2_step_equals_unpipelined(policy, unpipelined, tmp_path):
    """4 processes: the policy at pp=2 x dp=2 (4 pairs per dp rank, 2 per micro-batch), the reference at pp=1
    (dp=4: each rank scores its pp group's pairs)."""
    run_distributed(_train, policy, str(tmp_path / "pp2dp2"), "model.pp=2", world_size=4)
    compare_runs(unpipelined, tmp_path / "pp2dp2", 2, 1, LAYERS, DPO_METRICS)
