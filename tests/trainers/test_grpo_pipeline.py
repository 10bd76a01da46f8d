"""GRPO at actor.pp = 2: rollouts equal the pp = 1 engine's for the same seed, and one training step (rollout,
recomputed old log-probs and reference log-probs by the forward-only schedule, the 1F1B update) equals the
unpipelined step on the same prompts: metrics, gradient norm, updated weights. At pp = 2 x dp = 2 the global
batches are recorded once and replayed (each dp rank samples its own responses); stopped after step 2 and
resumed at pp = 2, step 3 equals the uninterrupted run's."""
import pytest
import torch
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import record_batches, tiny_config, tiny_policy, train_replayed
from trainers.helpers import compare_runs, metric_rows, whole_model

from megalign.models import from_pretrained, stage_from_pretrained
from megalign.parallel import ParallelLayout
from megalign.rollout import SamplingParams, pipeline_rollout, rollout
from megalign.trainers.grpo import GRPOTrainer, train_grpo

LAYERS = 2  # tiny_policy's decoder layers
GRPO_METRICS = ("reward/mean", "response_length/mean", "actor/loss", "actor/grad_norm", "actor/kl",
                "actor/entropy", "actor/clip_frac", "actor/approx_kl")


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("policy") / "hf")


def _rollouts_match(policy):
    layout = ParallelLayout.build(pp=2)
    stage, whole = stage_from_pretrained(policy, layout), from_pretrained(policy)
    ids = torch.tensor([[0, 0, 1, 7, 9], [1, 5, 6, 11, 12], [0, 1, 20, 21, 22]])
    mask = (ids != 0).long()
    mask[:, -3:] = 1
    for temperature in (1.0, 0.0):
        params = SamplingParams(max_new_tokens=8, temperature=temperature, eos_token_id=2, pad_token_id=0)
        got, stats = pipeline_rollout(stage, ids, mask, 4, params, 1234, layout)
        want, _ = rollout(whole, ids, mask, 4, params, 1234)
        assert torch.equal(got.sequences, want.sequences) and torch.equal(got.attention_mask, want.attention_mask)
        torch.testing.assert_close(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)
        assert stats.decode_tokens == int(want.attention_mask[:, ids.shape[1]:].sum())


def test_pipeline_rollout_equals_the_engine(policy):
    run_distributed(_rollouts_match, policy, world_size=2)


def _train(policy, run_dir, *overrides):
    train_grpo(tiny_config(policy, run_dir, *overrides))


@pytest.mark.parametrize("reference_pp", [2, 1])
def test_pp2_step_equals_unpipelined(policy, tmp_path, reference_pp):
    """The reference on the actor's layout (pp=2: its scores broadcast from its last stage), or at pp=1 beside
    it (dp=2 for the reference: each rank scores the whole batch its actor pp group holds)."""
    # padded forwards at pp=1 too (the pipeline's are; packed vs padded is tests/roles/test_packed_forward.py):
    # the same sums in the same order, so AdamW's step on near-zero gradients does not amplify their rounding
    overrides = ("algo.micro_batch_size=4", "algo.kl_coef=0.1", "rollout.old_logprobs=recompute", "save_every=1",
                 "export_hf=false", "rollout.pack=false")
    run_distributed(_train, policy, str(tmp_path / "ref"), *overrides, world_size=1)
    run_distributed(_train, policy, str(tmp_path / "pp2"), "actor.pp=2", f"reference.pp={reference_pp}", *overrides,
                    world_size=2)
    assert len(metric_rows(tmp_path / "ref")) == 2
    compare_runs(tmp_path / "ref", tmp_path / "pp2", 2, 1, LAYERS, GRPO_METRICS, role="actor")


def test_pp2_packed_step_equals_unpipelined(policy, tmp_path):
    """rollout.pack at pp=2 (one pack a pipeline micro-batch, `pipeline_packs`, every forward packed:
    pack_max_fill=1) equals the packed pp=1 step: the rollout's scores and the 1F1B update run on the same packs."""
    overrides = ("algo.micro_batch_size=4", "algo.kl_coef=0.1", "rollout.old_logprobs=recompute", "save_every=1",
                 "export_hf=false", "rollout.pack=true", "rollout.pack_max_fill=1.0")
    run_distributed(_train, policy, str(tmp_path / "ref"), *overrides, world_size=1)
    run_distributed(_train, policy, str(tmp_path / "pp2"), "actor.pp=2", "reference.pp=2", *overrides, world_size=2)
    # the pp = 2 packs are padded to one length, so their sums run in another order, which AdamW (lr 0.01) magnifies
    # in near-zero gradient elements; on an AVX-512 EPYC (torch's own kernels) one o_proj weight of 1024 sat 5.1e-5
    # from pp = 1 after step 1, and step 2's approx_kl 1.02e-6 (1e-5 of it is 5.6e-7). A 1% error in the packed
    # loss or scores moves the loss and grad norm by far more than these
    compare_runs(tmp_path / "ref", tmp_path / "pp2", 2, 1, LAYERS, GRPO_METRICS, role="actor", atol=1e-4,
                 metric_atol=3e-6)


@pytest.mark.slow
def test_tp2_pp2_step_equals_unpipelined(policy, tmp_path):
    """4 processes on 2 cores: actor and reference at tp=2 x pp=2 (dp=1)."""
    # tp = 2 sums the row-parallel layers and the vocabulary in another order than tp = 1. With AdamW's eps 1e-8 a
    # gradient element near 1e-8 turns that rounding into an lr-sized step (on an AVX-512 EPYC an o_proj weight
    # 9e-5 from tp = 1 after step 1, step 2's approx_kl 3.3e-5 relative); eps 1e-6 keeps the update linear in such
    # elements (measured: weights within 1.7e-5, metrics within 4e-6 relative; on an AMD EPYC with AVX-512, 2026-12-06,
    # one embedding weight of 3168 sat 1.9e-5 from tp = 1 after step 2), so the weights get 5e-5 and the metrics keep
    # compare_runs' tolerance
    overrides = ("algo.micro_batch_size=4", "algo.kl_coef=0.1", "rollout.old_logprobs=recompute", "save_every=1",
                 "export_hf=false", "rollout.pack=false", "optim.eps=1e-6")
    run_distributed(_train, policy, str(tmp_path / "ref"), *overrides, world_size=1)
    run_distributed(_train, policy, str(tmp_path / "tp2pp2"), "actor.tp=2", "actor.pp=2", "reference.tp=2",
                    "reference.pp=2", *overrides, world_size=4)
    compare_runs(tmp_path / "ref", tmp_path / "tp2pp2", 2, 2, LAYERS, GRPO_METRICS, role="actor", atol=5e-5)


def _record_then_replay(policy, run_dir, batch_file, *overrides):
    """One rank: sample and score 2 steps' global batches with the real trainer, save them, then train on them."""
    record_batches(GRPOTrainer(tiny_config(policy, f"{run_dir}_record", *overrides)), 2, batch_file)
    _replay(policy, run_dir, batch_file, *overrides)


def _replay(policy, run_dir, batch_file, *overrides):
    train_replayed(GRPOTrainer, tiny_config(policy, run_dir, *overrides), batch_file)


def test_pp2_dp2_step_equals_unpipelined(policy, tmp_path):
    """4 processes: actor and reference at pp=2 x dp=2, on the batches the one-process run trained on."""
    # one mini-batch per epoch: each rank shuffles its own rows into mini-batches, so with more than one the global
    # mini-batches would hold other rows than dp=1's. Two epochs (the second's ratios differ from 1, clipping) of
    # 2 micro-batches of 4 rows per rank (16 responses per step, 8 per dp rank: the pp=2 pipeline's 2 micro-batches)
    overrides = ("algo.micro_batch_size=4", "algo.mini_batches=1", "algo.ppo_epochs=2", "algo.kl_coef=0.1",
                 "rollout.old_logprobs=recompute", "save_every=1", "export_hf=false", "rollout.pack=false")
    batch_file = str(tmp_path / "batches.pt")
    run_distributed(_record_then_replay, policy, str(tmp_path / "ref"), batch_file, *overrides, world_size=1)
    run_distributed(_replay, policy, str(tmp_path / "pp2dp2"), batch_file, "actor.pp=2", "reference.pp=2", *overrides,
                    world_size=4)
    assert len(metric_rows(tmp_path / "ref")) == 2
    compare_runs(tmp_path / "ref", tmp_path / "pp2dp2", 2, 1, LAYERS, GRPO_METRICS, role="actor")


def _straight_then_resumed(policy, root):
    pp2 = ("actor.pp=2", "reference.pp=2", "algo.micro_batch_size=4", "algo.kl_coef=0.1", "rollout.old_logprobs=recompute",
           "export_hf=false", "optim.schedule=constant")  # constant: the lr does not depend on `steps`
    _train(policy, f"{root}/straight", "steps=3", *pp2)
    _train(policy, f"{root}/resumed", "steps=2", *pp2)
    _train(policy, f"{root}/resumed", "steps=3", *pp2)


def test_pp2_resumes_exactly(policy, tmp_path):
    """Stopped after step 2 and resumed at pp=2 (both stages' actor shards and optimizer states, the sampler, each
    rank's generator): step 3 equals the uninterrupted run's, its metrics and checkpointed weights bit for bit."""
    run_distributed(_straight_then_resumed, policy, str(tmp_path))
    straight, resumed = (metric_rows(tmp_path / name) for name in ("straight", "resumed"))
    assert [row["step"] for row in straight] == [1, 2, 3] and [row["step"] for row in resumed] == [1, 2, 3]
    assert straight[2] == resumed[2]
    a, b = (whole_model(tmp_path / name, 3, 2, 1, LAYERS, "actor") for name in ("straight", "resumed"))
    assert sorted(a) == sorted(b) and a
    for name in a:
        torch.testing.assert_close(b[name][0], a[name][0], rtol=0, atol=0, msg=name)
