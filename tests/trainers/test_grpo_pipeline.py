"""GRPO at actor.pp = 2: rollouts equal the pp = 1 engine's for the same seed, and one training step (rollout,
recomputed old log-probs and reference log-probs by the forward-only schedule, the 1F1B update) equals the
unpipelined step on the same prompts: metrics, gradient norm, updated weights."""
import pytest
import torch
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import tiny_config, tiny_policy
from trainers.helpers import compare_runs, metric_rows

from megalign.models import from_pretrained, stage_from_pretrained
from megalign.parallel import ParallelLayout
from megalign.rollout import SamplingParams, pipeline_rollout, rollout
from megalign.trainers.grpo import train_grpo

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
    overrides = ("algo.micro_batch_size=4", "algo.beta=0.1", "rollout.old_logprobs=recompute", "save_every=1",
                 "export_hf=false", "rollout.pack=false")
    run_distributed(_train, policy, str(tmp_path / "ref"), *overrides, world_size=1)
    run_distributed(_train, policy, str(tmp_path / "pp2"), "actor.pp=2", f"reference.pp={reference_pp}", *overrides,
                    world_size=2)
    assert len(metric_rows(tmp_path / "ref")) == 2
    compare_runs(tmp_path / "ref", tmp_path / "pp2", 2, 1, 2, GRPO_METRICS, role="actor")


@pytest.mark.slow
def test_tp2_pp2_step_equals_unpipelined(policy, tmp_path):
    """4 processes on 2 cores: actor and reference at tp=2 x pp=2 (dp=1)."""
    # padded forwards at pp=1 too (the pipeline's are; packed vs padded is tests/roles/test_packed_forward.py):
    # the same sums in the same order, so AdamW's step on near-zero gradients does not amplify their rounding
    overrides = ("algo.micro_batch_size=4", "algo.beta=0.1", "rollout.old_logprobs=recompute", "save_every=1",
                 "export_hf=false", "rollout.pack=false")
    run_distributed(_train, policy, str(tmp_path / "ref"), *overrides, world_size=1)
    run_distributed(_train, policy, str(tmp_path / "tp2pp2"), "actor.tp=2", "actor.pp=2", "reference.tp=2",
                    "reference.pp=2", *overrides, world_size=4)
    compare_runs(tmp_path / "ref", tmp_path / "tp2pp2", 2, 2, 2, GRPO_METRICS, role="actor")
