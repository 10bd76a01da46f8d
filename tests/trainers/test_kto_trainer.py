"""KTO trainer on the embedded unpaired arithmetic rows, from a tiny policy.

The first step from its own reference is hand-worked: r = 0 and z0 = 0 for every example, so each
loss is 1 - sigmoid(0) = 1/2; dp=2 equals dp=1 on the same global batch (z0 is averaged over both
ranks) and the cached reference equals the online one; desirable examples end up above undesirable.
"""
import pytest
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import tiny_policy
from trainers.helpers import assert_rows_close, metric_rows

from megalign.config import load_config
from megalign.trainers.kto import KTOConfig, train_kto


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("policy") / "hf")


def kto_config(policy, run_dir, *overrides) -> KTOConfig:
    return load_config(KTOConfig, None, [
        f"run_dir={run_dir}", f"model.path={policy}", "steps=2", "batch_size=8", "data.arith.max_operand=4",
        "data.max_length=40", "optim.lr=1e-3", "optim.warmup_steps=0", "eval.max_samples=0", "tensorboard=false",
        "export_hf=false", "save_every=0", *overrides])


def _train(policy, run_dir, *overrides):
    train_kto(kto_config(policy, run_dir, *overrides))


def test_first_step_from_its_own_reference_is_one_half(policy, tmp_path):
    run_distributed(_train, policy, str(tmp_path), "steps=1", world_size=1)
    row = metric_rows(str(tmp_path))[0]
    assert row["loss"] == pytest.approx(0.5, abs=1e-6) and row["kl"] == pytest.approx(0.0, abs=1e-6)
    assert row["rewards/chosen"] == pytest.approx(0.0, abs=1e-6) and row["examples"] == 8


def test_dp2_equals_dp1_and_cached_reference_equals_online(policy, tmp_path):
    run_distributed(_train, policy, f"{tmp_path}/dp1", world_size=1)
    run_distributed(_train, policy, f"{tmp_path}/dp2", world_size=2)
    run_distributed(_train, policy, f"{tmp_path}/online", "reference.mode=online", world_size=1)
    one, two, online = (metric_rows(f"{tmp_path}/{n}") for n in ("dp1", "dp2", "online"))
    assert len(one) == len(two) == len(online) == 2
    for a, b, c in zip(one, two, online):
        assert_rows_close(a, b)
        assert_rows_close(a, c)


def test_desirable_examples_rise_above_undesirable(policy, tmp_path):
    run_distributed(_train, policy, str(tmp_path), "steps=60", "algo.beta=1.0", "optim.lr=2e-3", world_size=1)
    rows = metric_rows(str(tmp_path))
    first, last = rows[:10], rows[-10:]
    assert sum(r["loss"] for r in last) < sum(r["loss"] for r in first)
    margin = [r["rewards/chosen"] - r["rewards/rejected"] for r in rows]
    assert sum(margin[-10:]) / 10 > 0.5, margin
