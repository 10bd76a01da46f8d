"""What every trainer on the skeleton promises at start-up and around the loop, tested on SFT and GRPO.

Each test reproduces a failure a new user hit (issue 9) and checks it now fails early and clearly,
or is counted and logged.
"""
import json
import os

import pytest
import torch
import torch.distributed as dist
import yaml
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import HERE, tiny_config, tiny_policy
from trainers.helpers import capture_warnings, checkpoint_params
from trainers.test_sft import tiny_config as sft_config

from megalign.config import ConfigError
from megalign.trainers.base import SkippedUpdatesError
from megalign.trainers.grpo import train_grpo
from megalign.trainers.sft import train_sft



@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("policy") / "hf")


def _rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _raises(train, cfg, error, match):
    with pytest.raises(error, match=match):
        train(cfg)


def test_missing_checkpoint_folder_names_the_key_and_the_command(tmp_path):
    cfg = tiny_config(str(tmp_path / "nowhere"), str(tmp_path / "run"))
    run_distributed(_raises, train_grpo, cfg, FileNotFoundError,
                    r"actor\.path=.*nowhere.* does not exist.*launch/run_embedded\.sh", world_size=1)


def test_prompt_plus_response_longer_than_the_model_fails_at_start_up(policy, tmp_path):
    # the tiny policy has 64 positions; prompts of the arithmetic task are ~6 tokens
    cfg = tiny_config(policy, str(tmp_path), "rollout.max_response_length=60")
    run_distributed(_raises, train_grpo, cfg, ValueError,
                    r"rollout\.max_response_length \(60\).*actor\.path has max_position_embeddings=64", world_size=1)
    assert not os.path.exists(os.path.join(tmp_path, "metrics.jsonl"))  # nothing ran


def test_sft_length_limit_longer_than_the_model_fails_at_start_up(tmp_path):
    cfg = sft_config(str(tmp_path), "data.max_length=80", "model.max_position_embeddings=64")
    run_distributed(_raises, train_sft, cfg, ValueError,
                    r"the objective's longest example is 80 tokens but model has max_position_embeddings=64", world_size=1)


def _resume_with_changed_config(root):
    train_sft(sft_config(root, "steps=2"))
    with pytest.raises(ConfigError, match=r"optim\.lr: 0\.01 -> 0\.02.*resume_changes=allow to resume"):
        train_sft(sft_config(root, "steps=4", "optim.lr=0.02"))
    with open(os.path.join(root, "config.yaml")) as f:
        assert yaml.safe_load(f)["steps"] == 2  # the refused resume left the run's config alone
    result = train_sft(sft_config(root, "steps=4", "optim.lr=0.02", "resume_changes=allow"))
    assert [row["step"] for row in result.metrics] == [3, 4]
    configs = sorted(name for name in os.listdir(root) if name.startswith("config"))
    assert configs == ["config.1.yaml", "config.yaml"]  # the earlier config is kept


def test_resume_with_a_changed_config_is_refused_unless_allowed(tmp_path):
    run_distributed(_resume_with_changed_config, str(tmp_path), world_size=1)


def test_reward_failing_on_every_sample_stops_the_run(policy, tmp_path):
    cfg = tiny_config(policy, str(tmp_path),
                      f"reward.terms=[{{name: '{HERE}/grpo_helpers.py:always_raises', weight: 1.0}}]")
    run_distributed(_raises, train_grpo, cfg, RuntimeError,
                    r"reward term 'always_raises' failed on 16 of 16 samples this step.*KeyError", world_size=1)


def _no_informative_group(policy, run_dir):
    warnings = capture_warnings("megalign.trainers")
    with pytest.raises(SkippedUpdatesError, match=r"GRPO: the policy was never updated: updated in 0 of 2 steps"):
        train_grpo(tiny_config(policy, run_dir, "algo.dynamic_sampling=true", "algo.max_sampling_rounds=2",
                               "save_every=1", f"reward.terms=[{{name: '{HERE}/grpo_helpers.py:constant_one', weight: 1.0}}]"))
    assert sum("kept no group" in w and "skipping the update" in w for w in warnings) == 2, warnings


def test_dynamic_sampling_without_informative_groups_skips_the_update_and_fails_the_run(policy, tmp_path):
    run_distributed(_no_informative_group, policy, str(tmp_path), world_size=1)
    rows = [r for r in _rows(str(tmp_path)) if "reward/mean" in r]
    assert [r["empty_updates"] for r in rows] == [1, 2] and all(r["sampling/kept_groups"] == 0 for r in rows)
    assert all(r["sampling/rounds"] == 2 for r in rows)
    initial = checkpoint_params(str(tmp_path), 1, role="actor")
    for name, value in checkpoint_params(str(tmp_path), 2, role="actor").items():
        torch.testing.assert_close(value, initial[name], rtol=0, atol=0)  # no optimizer step moved anything


def test_each_reward_term_and_a_configurable_eval_metric_are_logged(policy, tmp_path):
    terms = (f"reward.terms=[{{name: '{HERE}/grpo_helpers.py:digit_fraction', weight: 1.0}}, "
             f"{{name: format, weight: 0.5}}]")
    metric = f"eval.metric={HERE}/grpo_helpers.py:constant_one"
    run_distributed(train_grpo, tiny_config(policy, str(tmp_path), terms, metric, "eval.max_samples=4"), world_size=1)
    rows = _rows(str(tmp_path))
    for row in rows[:-1]:
        assert row["reward/mean"] == pytest.approx(row["reward/digit_fraction/mean"] + 0.5 * row["reward/format/mean"])
        assert not any(".py" in key for key in row)  # no file path in any metric name
    assert rows[-1] == {"step": 2, "eval/accuracy": 1.0}  # constant_one scores every response 1


def _grpo_dp1_then_dp2(policy, root):
    if dist.get_world_size() == 1:
        train_grpo(tiny_config(policy, root, "steps=2", "save_every=1"))
    else:
        result = train_grpo(tiny_config(policy, root, "steps=3", "save_every=1"))
        assert [row["step"] for row in result.metrics] == [3]


def test_grpo_resumes_on_another_dp_size(policy, tmp_path):
    run_distributed(_grpo_dp1_then_dp2, policy, str(tmp_path), world_size=1)
    run_distributed(_grpo_dp1_then_dp2, policy, str(tmp_path), world_size=2)
    rows = [r for r in _rows(str(tmp_path)) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # the one reward term, weight 1, over every sample of both ranks: the total is that term's mean exactly
    assert all(r["reward/mean"] == pytest.approx(r["reward/digit_fraction/mean"], abs=1e-12) for r in rows)
    assert [r["reward/digit_fraction/samples"] for r in rows[:2]] == [16, 32]
    assert rows[2]["reward/digit_fraction/samples"] == 16 * 3  # rank 0's counts carried on, rank 1 started at 0


@pytest.mark.parametrize("vocab_size, message", [
    (300, r"tokenizer \(char, 99 ids\) does not match actor\.path .*\(vocab_size 300\) and is not that model's own"),
    (64, r"tokenizer \(char, 99 ids\) does not match actor\.path .*\(vocab_size 64\): the model has no rows for ids 64\.\.98"),
])
def test_tokenizer_and_model_vocabularies_must_match(tmp_path, vocab_size, message):
    # before: vocab 300 crashed mid-rollout (CharTokenizer cannot decode id 142), vocab 64 with an IndexError
    policy = tiny_policy(tmp_path / "hf", vocab_size=vocab_size)
    run_distributed(_raises, train_grpo, tiny_config(policy, str(tmp_path / "run")), ValueError, message, world_size=1)


def _sft_export_is_usable_and_is_the_next_stage_tokenizer(root):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megalign.data import CharTokenizer
    from megalign.trainers.grpo import GRPOTrainer

    hf = train_sft(sft_config(f"{root}/sft", "export_hf=true", "steps=2")).hf_path
    if dist.get_rank() == 0:  # from transformers alone: tokenizer files and generation config are in the export
        tok, char = AutoTokenizer.from_pretrained(hf), CharTokenizer()
        text = "12+7=\\boxed{19}"
        assert tok.encode(text, add_special_tokens=False) == char.encode(text)
        model = AutoModelForCausalLM.from_pretrained(hf)
        out = model.generate(torch.tensor([char.encode("1+2=", add_bos=True)]), max_new_tokens=4, do_sample=False)
        assert out.shape[1] <= 5 + 4 and model.generation_config.eos_token_id == char.eos_id
    trainer = GRPOTrainer(tiny_config(hf, f"{root}/grpo"))
    assert trainer.tokenizer.name == f"hf {hf!r}"  # actor.path's own tokenizer is the default


def test_sft_export_is_usable_from_transformers_and_feeds_grpo(tmp_path):
    run_distributed(_sft_export_is_usable_and_is_the_next_stage_tokenizer, str(tmp_path), world_size=1)
