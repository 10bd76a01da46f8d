"""PPO at pp = 2: the critic as pipeline stages (its head read from an RM export or drawn fresh, on the last stage
only), and one training step (rollout by `pipeline_rollout`, recomputed old log-probs, reference log-probs and old
values by the forward-only schedule, the critic's and the actor's updates by 1F1B) equals the unpipelined step on the
same prompts: metrics, gradient norms, the updated weights of both roles, and the HF exports reloaded in transformers.
Layouts: actor, reference and critic at pp = 2; the critic and the reference at pp = 1 beside a pp = 2 actor (the
critic's two dp replicas train on the same batch); tp = 2 x pp = 2 on 4 processes (slow); pp = 2 x dp = 2 on 4
processes, on global batches recorded once and replayed (each dp rank samples its own responses). A pp = 2 run
stopped after step 1 and resumed at pp = 2 equals the uninterrupted run; unsupported settings stop at start-up naming
the keys."""
import pytest
import torch
import transformers
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import policy_and_rm, record_batches, train_replayed
from trainers.helpers import compare_runs, metric_rows, whole_model
from trainers.test_ppo_trainer import _train, controller_betas, tiny_ppo_config

from megalign.models import scalar_head_from_pretrained
from megalign.parallel import ParallelLayout
from megalign.trainers.ppo import PPOTrainer

PPO_METRICS = ("reward/mean", "response_length/mean", "actor/loss", "actor/grad_norm", "actor/entropy",
               "actor/approx_kl", "actor/token_kl", "actor/rollout_kl", "actor/kl_coef", "critic/loss",
               "critic/grad_norm", "critic/value_mean", "critic/old_value_mean", "critic/return_mean")
# padded forwards at pp=1 too (the pipeline's are; packed vs padded is tests/roles/test_packed_forward.py): the same
# sums in the same order, so AdamW's step on near-zero gradients does not amplify their rounding. Adaptive KL in the
# reward, and 2 mini-batches of 2 micro-batches of 4 rows per update on 16 responses per step
COMMON = ("algo.micro_batch_size=4", "algo.kl_coef=0.05", "algo.kl_target=1.0", "algo.kl_horizon=50",
          "rollout.old_logprobs=recompute", "save_every=1", "rollout.pack=false")
LAYERS = 2  # tiny_policy's decoder layers


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(policy folder, reward-model folder: the policy's trunk with a score head)."""
    return policy_and_rm(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def unpipelined(models, tmp_path_factory):
    """The tp=1 x pp=1 run (one process) every layout is compared with: 2 steps, checkpoints, HF exports."""
    run_dir = str(tmp_path_factory.mktemp("unpipelined") / "run")
    run_distributed(_train, models[0], run_dir, *COMMON, world_size=1, timeout_s=300)
    assert len(metric_rows(run_dir)) == 2
    return run_dir


def _stage_heads(policy, rm):
    layout = ParallelLayout.build(pp=2)
    for path, fresh_expected in ((policy, True), (rm, False)):
        stage, fresh = scalar_head_from_pretrained(path, "value", layout, seed=3)
        whole, _ = scalar_head_from_pretrained(path, "value", ParallelLayout.build(pp=1), seed=3)
        assert fresh == fresh_expected
        assert (stage.head is not None) == layout.is_last_stage
        assert stage.model.layer_range == ((0, 1) if layout.is_first_stage else (1, 2))
        if stage.head is not None:  # read from the RM, or drawn from the seed as at pp=1
            torch.testing.assert_close(stage.head.score.weight, whole.head.score.weight, rtol=0, atol=0)


def test_critic_stage_head_read_or_fresh(models):
    run_distributed(_stage_heads, *models, world_size=2)


def _compare_exports(ref_dir, run_dir):
    """The HF exports of both roles reload in transformers with the same outputs as the unpipelined run's."""
    ids = torch.randint(3, 99, (2, 9), generator=torch.Generator().manual_seed(0))
    classes = {"hf": transformers.AutoModelForCausalLM, "critic_hf": transformers.AutoModelForTokenClassification}
    for folder, cls in classes.items():
        want, got = (cls.from_pretrained(f"{d}/{folder}").eval() for d in (ref_dir, run_dir))
        with torch.no_grad():
            torch.testing.assert_close(got(input_ids=ids).logits, want(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


def test_pp2_step_equals_unpipelined(models, unpipelined, tmp_path):
    """Actor, reference and critic at pp=2 on 2 ranks (dp=1): scores broadcast from each role's last stage."""
    run_dir = str(tmp_path / "pp2")
    run_distributed(_train, models[0], run_dir, "actor.pp=2", "reference.pp=2", "critic.pp=2", *COMMON,
                    timeout_s=300)
    compare_runs(unpipelined, run_dir, 2, 1, LAYERS, PPO_METRICS, role="actor")
    compare_runs(unpipelined, run_dir, 2, 1, LAYERS, (), role="critic")
    rows = metric_rows(run_dir)
    assert rows[0]["critic/grad_norm"] > 0 and rows[0]["actor/grad_norm"] > 0  # both roles trained at step 1
    assert [row["actor/kl_coef"] for row in rows] == pytest.approx(controller_betas(rows, 0.05, 1.0, 50, 16), rel=1e-9)
    _compare_exports(unpipelined, run_dir)


def test_pp1_critic_beside_pp2_actor_equals_unpipelined(models, unpipelined, tmp_path):
    """The critic and the reference at pp=1 (dp=2) beside a pp=2 actor: each rank scores and trains the critic on the
    whole batch of its actor replica, and the critic's gradient summed over its 2 replicas is halved."""
    run_dir = str(tmp_path / "mixed")
    run_distributed(_train, models[0], run_dir, "actor.pp=2", *COMMON, timeout_s=300)
    compare_runs(unpipelined, run_dir, 2, 1, LAYERS, PPO_METRICS, role="actor")
    compare_runs(unpipelined, run_dir, 1, 1, LAYERS, (), role="critic")


@pytest.mark.slow
def test_tp2_pp2_step_equals_unpipelined(models, unpipelined, tmp_path):
    """4 processes on 2 cores: actor, reference and critic at tp=2 x pp=2 (dp=1)."""
    run_dir = str(tmp_path / "tp2pp2")
    layout = [f"{role}.{key}=2" for role in ("actor", "reference", "critic") for key in ("tp", "pp")]
    run_distributed(_train, models[0], run_dir, *layout, *COMMON, world_size=4, timeout_s=600)
    compare_runs(unpipelined, run_dir, 2, 2, LAYERS, PPO_METRICS, role="actor")
    # measured: tp=2 alone (critic.tp=2 x pp=1) already puts 2 of the critic's 21792 weights up to 6.6e-5 away from
    # tp=1 after step 1 (isolated elements, the metrics and gradient norms equal to 1e-5: AdamW scaling up the
    # rounding of tp's other summation order, cf. test_ppo_parallel.py), and tp=2 x pp=2 is within 1.2e-6 of that
    compare_runs(unpipelined, run_dir, 2, 2, LAYERS, (), role="critic", atol=1e-4)
    _compare_exports(unpipelined, run_dir)


# one mini-batch per epoch: each rank shuffles its own rows into mini-batches, so with more than one the global
# mini-batches would hold other rows than dp=1's. Two epochs (the second's ratios differ from 1) of 2 micro-batches of
# 4 rows per rank (16 responses per step, 8 per dp rank: the pp=2 pipeline's 2 micro-batches)
REPLAYED = (*COMMON, "algo.mini_batches=1", "algo.ppo_epochs=2", "export_hf=false")


def _record_then_replay(policy, run_dir, batch_file):
    """One rank: sample and score 2 steps' global batches with the real trainer, save them, then train on them."""
    record_batches(PPOTrainer(tiny_ppo_config(policy, f"{run_dir}_record", *REPLAYED)), 2, batch_file)
    _replay(policy, run_dir, batch_file)


def _replay(policy, run_dir, batch_file, *layout):
    train_replayed(PPOTrainer, tiny_ppo_config(policy, run_dir, *REPLAYED, *layout), batch_file)


def test_pp2_dp2_step_equals_unpipelined(models, tmp_path):
    """4 processes on 2 cores: actor, reference and critic at pp=2 x dp=2, on the batches the one-process run trained
    on: the advantages whitened over both dp ranks, both roles' losses normalised by the global counts and their
    gradients summed over dp, the adaptive KL coefficient from the global KL."""
    batch_file = str(tmp_path / "batches.pt")
    run_distributed(_record_then_replay, models[0], str(tmp_path / "ref"), batch_file, world_size=1, timeout_s=300)
    run_distributed(_replay, models[0], str(tmp_path / "pp2dp2"), batch_file, "actor.pp=2", "reference.pp=2",
                    "critic.pp=2", world_size=4, timeout_s=600)
    # dp = 2 sums each rank's half of the gradient, another order than one rank's; AdamW magnifies that rounding in
    # near-zero gradient elements: on an AVX-512 EPYC one actor o_proj weight of 1024 sat 2.1e-5 from dp = 1
    compare_runs(tmp_path / "ref", tmp_path / "pp2dp2", 2, 1, LAYERS, PPO_METRICS, role="actor", atol=1e-4)
    compare_runs(tmp_path / "ref", tmp_path / "pp2dp2", 2, 1, LAYERS, (), role="critic", atol=1e-4)
    rows = metric_rows(tmp_path / "ref")
    assert len(rows) == 2 and rows[0]["critic/grad_norm"] > 0  # the critic trained at step 1
    assert [row["actor/kl_coef"] for row in rows] == pytest.approx(controller_betas(rows, 0.05, 1.0, 50, 16), rel=1e-9)


def _straight_then_resumed(policy, root):
    pp2 = ("actor.pp=2", "reference.pp=2", "critic.pp=2", *COMMON, "export_hf=false")
    _train(policy, f"{root}/straight", "steps=3", *pp2)
    _train(policy, f"{root}/resumed", "steps=1", *pp2)
    _train(policy, f"{root}/resumed", "steps=3", *pp2)


def test_pp2_resume_is_exact(models, tmp_path):
    """Stopped after step 1 and resumed at pp=2 (the stages' shards of both roles, both optimizers, the adaptive KL
    coefficient): steps 2 and 3 equal the uninterrupted pp=2 run's, metrics and weights."""
    run_distributed(_straight_then_resumed, models[0], str(tmp_path), timeout_s=300)
    straight, resumed = (metric_rows(str(tmp_path / name)) for name in ("straight", "resumed"))
    assert [row["step"] for row in straight] == [row["step"] for row in resumed] == [1, 2, 3]
    assert straight == resumed
    for role in ("actor", "critic"):
        a, b = (whole_model(str(tmp_path / name), 3, 2, 1, LAYERS, role) for name in ("straight", "resumed"))
        assert a.keys() == b.keys() and a
        for name in a:
            assert torch.equal(a[name][0], b[name][0]), (role, name)


def _start_up_errors(policy, root):
    with pytest.raises(ValueError, match=r"actor\.pp=2: each rank's 16 responses .* must split into "
                                         r"algo\.mini_batches=2 mini-batches of at least pp=2 micro-batches of "
                                         r"algo\.micro_batch_size=8 rows"):
        _train(policy, f"{root}/split", "critic.pp=2", "actor.pp=2", "algo.micro_batch_size=8")
    with pytest.raises(ValueError, match=r"critic\.microbatches=4: .* leave critic\.microbatches at 0"):
        _train(policy, f"{root}/micro", "actor.pp=2", "critic.pp=2", "critic.microbatches=4")
    with pytest.raises(ValueError, match=r"critic\.tp=1 x critic\.pp=2 does not fit actor\.tp=1 x actor\.pp=1"):
        _train(policy, f"{root}/fit", "critic.pp=2")


def test_start_up_errors_name_the_keys(models, tmp_path):
    run_distributed(_start_up_errors, models[0], str(tmp_path), world_size=2)
