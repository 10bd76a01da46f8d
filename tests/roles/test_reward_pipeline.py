"""Reward models at pp = 2 (2 gloo ranks, one decoder layer a stage) against the same checkpoint at pp = 1: an
outcome RM's scores and a PRM's step rewards on batches of 5 and 3 responses (neither a multiple of the 4
micro-batches, so the padded rows must not leak), on both stages' ranks; and a GRPO run with its reward model
at pp = 2 beside a pp = 2 actor equals the run with the reward model at pp = 1 (the reward term and every
metric), while a pp = 2 reward model beside a pp = 1 actor (two batches under one replica) stops at start-up."""
import pytest
import torch
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import policy_and_rm, tiny_config
from trainers.helpers import assert_rows_close, metric_rows, prompt_response_batch

from megalign.data import CharTokenizer
from megalign.models import from_pretrained, stage_from_pretrained
from megalign.parallel import ParallelLayout
from megalign.roles.reward import OutcomeReward, ProcessReward, RewardModelConfig
from megalign.trainers.grpo import train_grpo

TOK = CharTokenizer()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return policy_and_rm(tmp_path_factory.mktemp("models"))


def _scores_match(policy, rm):
    pp2, whole = ParallelLayout.build(pp=2), ParallelLayout.build()
    texts = ["1+2=3", "4*5=\\boxed{20}", "7-", "2+2=4\n4*1=4\n\\boxed{4}", "9"]
    prompts = [TOK.encode(f"q{i}", add_bos=True) for i in range(len(texts))]
    ids, att, width = prompt_response_batch(prompts, [TOK.encode(t) + [TOK.eos_id] for t in texts])
    cfg = RewardModelConfig(name="rm", path=rm)
    staged = OutcomeReward(cfg, stage_from_pretrained(rm, pp2, "reward"), pp2).score(ids, att)
    torch.testing.assert_close(staged, OutcomeReward(cfg, from_pretrained(rm, kind="reward"), whole).score(ids, att),
                               rtol=1e-5, atol=1e-6)
    assert staged.shape == (5,) and staged.std() > 0
    steps = ["2*3=6\n1+6=7\n\\boxed{7}", "4-1=3\n\\boxed{3}", "5\n6\n"]
    ids, att, width = prompt_response_batch(prompts[:3], [TOK.encode(s) + [TOK.eos_id] for s in steps])
    cfg = RewardModelConfig(name="prm", kind="process", path=policy)
    tokens, separator = (TOK.encode("-")[0], TOK.encode("+")[0]), TOK.encode("\n")
    got, got_ends = ProcessReward(cfg, stage_from_pretrained(policy, pp2), pp2, tokens, separator,
                                  TOK.eos_id).score(ids, att, width)
    want, ends = ProcessReward(cfg, from_pretrained(policy), whole, tokens, separator, TOK.eos_id).score(ids, att, width)
    assert torch.equal(got_ends, ends) and int(ends.sum()) == 7
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_pp2_reward_models_score_as_pp1(models):
    run_distributed(_scores_match, *models, world_size=2)


def _train(policy, rm, run_dir, *overrides):
    train_grpo(tiny_config(policy, run_dir, "algo.micro_batch_size=4", "rollout.pack=false", "export_hf=false",
                           *overrides))


def _refused(policy, rm, run_dir):
    with pytest.raises(ValueError, match=r"reward\.model replica must lie inside one actor replica"):
        _train(policy, rm, run_dir, f"reward.model.path={rm}", "reward.model.pp=2")


def test_grpo_with_a_pp2_reward_model_equals_pp1(models, tmp_path):
    policy, rm = models
    for reward_pp in (1, 2):
        run_distributed(_train, policy, rm, str(tmp_path / f"rm{reward_pp}"), "actor.pp=2", f"reward.model.path={rm}",
                        f"reward.model.pp={reward_pp}", world_size=2)
    rows = [metric_rows(tmp_path / f"rm{pp}") for pp in (1, 2)]
    assert len(rows[0]) == 2 and "reward/reward_model/mean" in rows[0][0]
    for a, b in zip(*rows, strict=True):
        assert_rows_close(a, b, across_layouts=True)
    run_distributed(_refused, policy, rm, str(tmp_path / "refused"), world_size=2)
