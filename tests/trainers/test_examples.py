"""Every examples/*.yaml, loaded the way `launch/train.py` loads it and run for one step, so config drift fails here.

Each example runs from a folder holding the `runs/` tree its YAML names (the checkpoints, data and
exports that `launch/run_embedded.sh`'s earlier stages leave), made tiny: a 2-layer random policy
for every SFT export, a reward model from it with `reward_stats.json`, a PRM export (made by the
`prm_chain` example itself), and the chain data files. Overrides shrink only sizes (batch, prompts,
response length, a from-scratch model) and switch off evaluation, checkpoints and the HF export;
the verifier-only GRPO and online-DPO examples score digits instead, which a random policy gets
partly right, so their step has informative groups and really updates.
"""
import glob
import json
import math
import os
import shutil

import pytest
import yaml
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import HERE, policy_and_rm
from trainers.test_moe_online import tiny_moe

from megalign.algos.registry import load as load_algorithm
from megalign.data import (ArithChainConfig, ArithTaskConfig, CharTokenizer, make_chain_splits, make_splits, write_jsonl,
                           write_stepwise_jsonl, write_unpaired_jsonl)
from megalign.data.judge_rows import JUDGE_TEMPLATE, judge_items, rubric_prompt_rows, sft_row, synthetic_candidates
from megalign.data.tool_traces import ToolTracesConfig, write_tool_traces
from megalign.data.user_sim_traces import UserSimTracesConfig, write_user_sim_traces
from megalign.rewards.judge import JudgeTemplate

ROOT = os.path.dirname(os.path.dirname(HERE))
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "*.yaml")))
QUICK = ["steps=1", "save_every=0", "export_hf=false", "tensorboard=false", "eval.max_samples=0", "device=cpu"]
SUPERVISED = ["batch_size=4"]
SCRATCH = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1", "model.num_heads=2",
           "model.num_kv_heads=1"]
ONLINE = ["rollout.prompts_per_step=2", "rollout.max_response_length=8"]
DIGITS = [f"reward.terms=[{{name: '{HERE}/grpo_helpers.py:digit_fraction', weight: 1.0}}]"]
OVERRIDES = {
    "sft_arith": SUPERVISED + SCRATCH, "sft_chain": SUPERVISED + SCRATCH,
    "dpo_arith": SUPERVISED, "kto_arith": SUPERVISED, "rm_arith": SUPERVISED,
    "prm_chain": SUPERVISED + ["data.max_length=60"],  # the tiny policy has 64 positions
    "grpo_arith": ONLINE + DIGITS, "grpo_lora_arith": ONLINE + DIGITS, "online_dpo_arith": ONLINE + DIGITS,
    "ppo_arith": ONLINE + ["algo.critic_warmup=0"], "ppo_chain_prm": ONLINE + ["algo.critic_warmup=0"],
    "ppo_verifier_arith": ONLINE + DIGITS + ["algo.critic_warmup=0"],
    # multi-turn episodes against ToolEnv (64 positions: an episode of 41 tokens, cut by the token limit)
    "grpo_tools_arith": ONLINE + DIGITS + ["actor.path=runs/sft_arith/hf",  # its own 5000 drawn prompts
                                           "rollout.max_response_length=40", "rollout.env.max_turn_tokens=8"],
    "judge_sft_arith": SUPERVISED + ["model.path=runs/judge_arith/hf"],  # the policy copy with 128 positions
    # the judge's binary rubric score is the reward; a random judge's 0/1 verdicts tie whole groups, so the digits
    # term joins the reward (and replaces the weight-0 verifier the judge's agreement is checked against)
    "grpo_rubric_arith": ONLINE + DIGITS + ["reward.check_with=digit_fraction"],
    "sft_tools_arith": SUPERVISED + SCRATCH,  # traces of runs/tool_traces, written in build_runs
    "sft_user_sim": SUPERVISED + SCRATCH,  # traces of runs/user_sim_data, written in build_runs
    # dialogues with ArithmeticUser on the 128-position policy copy (the user's first message is 77 tokens); a random
    # policy writes no <think> block (the user scores 0), so the digits term on the last turn gives informative groups
    "grpo_user_sim": ONLINE + DIGITS + ["actor.path=runs/judge_arith/hf", "rollout.max_response_length=100",
                                        "rollout.env.max_turn_tokens=8", "rollout.env.score_final_turn=true"],
    # the embedded MoE run on the tiny Qwen3-MoE of runs/moe_init at ep = 1 (one process here; ep = 2 runs in
    # tests/rollout/test_expert_parallel_generation.py)
    "sft_moe_arith": SUPERVISED + ["model.ep=1"], "grpo_moe_arith": ONLINE + DIGITS + ["actor.ep=1"],
}


def _train(root, example, run_dir, *overrides):
    """One rank: `example` as `launch/train.py` reads it (registry), from the folder `root`, into `run_dir`."""
    os.chdir(root)  # the YAML's relative paths (runs/sft_arith/hf, ...) resolve here
    algo, cfg = load_algorithm(example, [f"run_dir={run_dir}", *QUICK, *overrides])
    assert algo.train_fn()(cfg).step == 1


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return build_runs(tmp_path_factory.mktemp("examples"))


def build_runs(root):
    """`root` (a pathlib.Path) made the folder with the tiny `runs/` tree every example reads (module doc)."""
    policy, rm = policy_and_rm(root)
    with open(os.path.join(rm, "reward_stats.json"), "w") as f:
        json.dump({"reward_mean": 0.1, "reward_std": 0.5}, f)
    judge = shutil.copytree(policy, root / "judge")
    CharTokenizer().save(judge)  # a judge reads its own tokenizer from its folder
    with open(os.path.join(judge, "config.json")) as f:
        hf = json.load(f)
    with open(os.path.join(judge, "config.json"), "w") as f:  # room for the judge rows (RoPE has no position weights)
        json.dump({**hf, "max_position_embeddings": 128}, f)
    moe = tiny_moe(root / "moe", k=2)
    for run, folder in (("sft_arith", policy), ("sft_chain", policy), ("rm_self", rm), ("judge_arith", judge),
                        ("sft_moe_arith", moe)):
        os.makedirs(root / "runs" / run)
        os.symlink(folder, root / "runs" / run / "hf")
    os.symlink(moe, root / "runs" / "moe_init")
    data = root / "runs" / "prm_data"
    os.makedirs(data)
    train, held_out = make_chain_splits(ArithChainConfig(max_ops=2, max_operand=4, num_problems=40))
    write_jsonl(train, data / "chain_train.jsonl")
    write_jsonl(held_out, data / "chain_held_out.jsonl")
    write_stepwise_jsonl(train, data / "mc_steps.jsonl")
    write_judge_rows(root / "runs" / "judge_data")
    # launch/sample_pairs.py's KTO rows (same columns; here the arithmetic ones, no policy samples) and held-out prompts
    train, held_out = make_splits(ArithTaskConfig(max_operand=4))
    write_unpaired_jsonl(train, root / "runs" / "kto_samples" / "unpaired.jsonl")
    write_jsonl(held_out, root / "runs" / "kto_samples" / "data" / "arith_held_out.jsonl")
    write_tool_traces(ToolTracesConfig(str(root / "runs" / "tool_traces"), ArithTaskConfig(999, ["*"], num_problems=20)))
    write_user_sim_traces(UserSimTracesConfig(str(root / "runs" / "user_sim_data"), num_rows=24, held_out=4))
    # the PRM export ppo_chain_prm scores with, made by its own stage
    prm_overrides = [*OVERRIDES["prm_chain"], "export_hf=true"]
    run_distributed(_train, str(root), os.path.join(ROOT, "examples", "prm_chain.yaml"), "runs/prm_chain",
                    *prm_overrides, world_size=1, timeout_s=300)
    return str(root)


def write_judge_rows(folder):
    """The files of `launch/judge_tools.py data` (no policy samples) for a small arithmetic task."""
    os.makedirs(folder)
    splits = dict(zip(("train", "held_out"), make_splits(ArithTaskConfig(max_operand=4))))
    template = JudgeTemplate(JUDGE_TEMPLATE)
    for split, problems in splits.items():
        rows = [sft_row(item, template) for p in problems for item in judge_items(p, synthetic_candidates(p), "synthetic")]
        for name, out in ((f"judge_{split}", rows), (f"prompts_{split}", rubric_prompt_rows(problems))):
            with open(folder / f"{name}.jsonl", "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in out)


def test_every_example_has_its_overrides():
    assert sorted(OVERRIDES) == sorted(os.path.basename(p)[:-len(".yaml")] for p in EXAMPLES)


@pytest.mark.parametrize("example", EXAMPLES, ids=os.path.basename)
def test_example_runs_one_step(runs, example, tmp_path):
    name = os.path.basename(example)[:-len(".yaml")]
    run_distributed(_train, runs, example, str(tmp_path), *OVERRIDES[name], world_size=1, timeout_s=300)
    with open(tmp_path / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    (row,) = rows
    bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
    assert row["step"] == 1 and not bad, bad
    assert row.get("grad_norm", row.get("actor/grad_norm")) > 0  # the step updated the model
    assert row["nan_skips"] == row["empty_updates"] == 0
    with open(tmp_path / "config.yaml") as f:
        written = yaml.safe_load(f)["algorithm"]
    with open(example) as f:
        assert written == yaml.safe_load(f)["algorithm"]  # the resolved config names it: the planner reads it back
