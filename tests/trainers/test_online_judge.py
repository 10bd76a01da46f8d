"""Judges in the online trainers (issue 27): the judge and rubric terms of `reward.judges` in GRPO, the judge role at
dp = 2 and offloaded, start-up checks, and online DPO ranking its pairs with a pairwise judge.

References: each reward the trainer logged is recomputed from the rows the reward role was given by a separately
loaded `Judge` (`load_judge`): its raw verdicts on the templates filled by hand, combined by the formulas written
out here (RaR's sum_j w_j c_j / sum_j w_j; the total as verifier + sum of weight x score), not by the reward classes
under test.
"""
import json
import os

import pytest
import torch
from parallel.dist_utils import run_distributed
from trainers.grpo_helpers import digit_fraction, tiny_config, tiny_policy, write_rows
from trainers.helpers import metric_rows

from megalign.data import CharTokenizer
from megalign.parallel import ParallelLayout
from megalign.rewards.judge import JudgeTemplate
from megalign.roles.judge import JudgeConfig, load_judge
from megalign.trainers.grpo import GRPOTrainer

JUDGE_TEMPLATE = "Q:{prompt} A:{response} ok?"
RUBRIC_TEMPLATE = "{response} meets {criterion}?"
RUBRICS = [[{"criterion": "is 7", "category": "essential"}, {"criterion": "short", "weight": 2.0}],
           [{"criterion": "digits", "category": "important"}],
           [{"criterion": "no x", "category": "pitfall"}, {"criterion": "is 7", "category": "optional"}]]
CATEGORY = {"essential": 1.0, "important": 0.7, "optional": 0.3, "pitfall": 0.9}  # RaR's weights, written out


def judge_folder(path, seed):
    """A random 2-layer Llama over the char vocabulary with the char tokenizer saved beside it (its own tokenizer)."""
    tiny_policy(path, seed=seed, std=0.5)
    CharTokenizer().save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("judge_models")
    policy = tiny_policy(root / "policy")
    prompts = write_rows(root / "prompts.jsonl", [{"prompt": f"{a}+{b}=", "answer": a + b, "rubric": RUBRICS[(a + b) % 3]}
                                                  for a in range(4) for b in range(3)])
    return policy, judge_folder(root / "judge", 5), judge_folder(root / "rubric_judge", 6), prompts


def judge_entry(name, path, template, offload=False, **extra):
    """One `reward.judges` entry as YAML flow text."""
    more = "".join(f", {k}: {v}" for k, v in extra.items())
    return (f"{{name: {name}, weight: 0.5{more}, judge: {{path: '{path}', template: '{template}', answers: [Y, N], "
            f"chat_template: false, micro_batch_size: 3, offload_weights: {str(offload).lower()}}}}}")


def judge_overrides(folders, *more, offload=False):
    policy, judge, rubric_judge, prompts = folders
    judges = f"reward.judges=[{judge_entry('j', judge, JUDGE_TEMPLATE, offload)}, " \
             f"{judge_entry('rar', rubric_judge, RUBRIC_TEMPLATE, offload, kind='rubric')}]"
    return [f"data.path={prompts}", judges, "export_hf=false", *more]


class Recording(GRPOTrainer):
    """GRPO that keeps what its reward role was given and returned each call: (prompts, responses, answers,
    metadata, total, terms)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.seen = []
        score = self.reward.score

        def recorded(prompts, responses, answers, metadata, sequences, attention):
            total, terms = score(prompts, responses, answers, metadata, sequences, attention)
            self.seen.append((list(prompts), list(responses), list(answers), [dict(m) for m in metadata],
                              total.clone(), {k: v.clone() for k, v in terms.items()}))
            return total, terms
        self.reward.score = recorded


def _grpo(policy, run_dir, out, *overrides):
    trainer = Recording(tiny_config(policy, run_dir, *overrides))
    trainer.train()
    torch.save(trainer.seen, f"{out}.{trainer.layout.dp_rank}")


def reference_rewards(judge_path, rubric_path, seen):
    """[(total, j, rar, j_agreement)] per recorded row, from separately loaded judges (module doc)."""
    layout = ParallelLayout.build(tp=1)
    cfg = dict(answers=["Y", "N"], chat_template=False)
    judge = load_judge("ref_j", JudgeConfig(path=judge_path, template=JUDGE_TEMPLATE, **cfg), layout)
    rubric = load_judge("ref_rar", JudgeConfig(path=rubric_path, template=RUBRIC_TEMPLATE, **cfg), layout)
    filled = JudgeTemplate("{text}")  # the reference fills the templates by hand

    def ask(role, texts):
        return role.verdicts(filled, [{"text": t} for t in texts]).scores

    out = []
    for prompts, responses, _, metadata, _, _ in seen:
        p_j = ask(judge, [f"Q:{p} A:{r} ok?" for p, r in zip(prompts, responses)])
        for prompt, response, meta, j in zip(prompts, responses, metadata, p_j):
            items = meta["rubric"]
            c = ask(rubric, [f"{response} meets {it['criterion']}?" for it in items])
            w = [it.get("weight") or CATEGORY[it["category"]] for it in items]
            rar = sum(wi * ci for wi, ci in zip(w, c)) / sum(w)
            verifier = digit_fraction(prompt, response, None, meta)
            out.append((verifier + 0.5 * j + 0.5 * rar, j, rar, float((j >= 0.5) == (verifier >= 0.5))))
    return out


def _reference(folders, seen_files, out):
    """Checks every recorded row against `reference_rewards`; saves the reference rows, in recorded order."""
    _, judge, rubric_judge, _ = folders
    seen = [row for f in seen_files for row in torch.load(f, weights_only=False)]
    want = reference_rewards(judge, rubric_judge, seen)
    got = [(t, terms["j"][n], terms["rar"][n], terms["j_agreement"][n])
           for *_, total, terms in seen for n, t in enumerate(total.tolist())]
    assert len(got) == len(want) > 0
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                               rtol=1e-5, atol=1e-5)
    torch.save(want, out)


def _logged_means_match(run_dir, want, steps, per_step):
    """metrics.jsonl's reward/j/mean, reward/rar/mean and reward/mean of each step equal the reference's means over
    that step's rows (`want` holds each rank's rows step after step, the ranks one after the other)."""
    rows = [r for r in metric_rows(run_dir) if "reward/mean" in r]
    assert len(rows) == steps
    ranks = len(want) // (steps * per_step)
    for step, row in enumerate(rows):
        mine = [want[(rank * steps + step) * per_step + i] for rank in range(ranks) for i in range(per_step)]
        for k, key in enumerate(("reward/mean", "reward/j/mean", "reward/rar/mean", "reward/j_agreement/mean")):
            assert row[key] == pytest.approx(sum(m[k] for m in mine) / len(mine), abs=1e-5), (step, key)
        assert row["reward/j/verdicts"] == (step + 1) * len(mine) and row["reward/j/unparsed"] == 0
    return rows


def test_grpo_with_judge_and_rubric_terms_equals_the_judges_verdicts(folders, tmp_path):
    policy = folders[0]
    out = str(tmp_path / "seen")
    run_distributed(_grpo, policy, str(tmp_path / "run"), out, *judge_overrides(folders), world_size=1)
    run_distributed(_reference, folders, [f"{out}.0"], str(tmp_path / "want.pt"), world_size=1)
    want = torch.load(tmp_path / "want.pt")
    assert len({round(w[1], 4) for w in want}) > 3 and len({round(w[2], 4) for w in want}) > 3  # verdicts differ
    rows = _logged_means_match(str(tmp_path / "run"), want, steps=2, per_step=16)
    seen = torch.load(f"{out}.0", weights_only=False)
    assert rows[1]["reward/rar/verdicts"] == sum(len(m["rubric"]) for call in seen for m in call[3])  # one an item
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        first = json.loads(f.readline())
    assert first["memory/reward/j_mib"] > 0 and first["memory/reward/rar_mib"] > 0  # the judges are placed roles


def _dp2(folders, root):
    policy = folders[0]
    _grpo(policy, f"{root}/dp", f"{root}/seen", *judge_overrides(folders, "rollout.prompts_per_step=2"))


def _resident_and_offloaded(folders, root):
    policy = folders[0]
    _grpo(policy, f"{root}/resident", f"{root}/resident_seen", *judge_overrides(folders))
    _grpo(policy, f"{root}/offloaded", f"{root}/offloaded_seen", *judge_overrides(folders, offload=True))


def test_judges_at_dp2_and_offloaded(folders, tmp_path):
    # dp = 2: each rank's judges score its own samples; every row equals the reference judges' verdicts and the
    # logged means (reduced over dp) equal the reference's means over both ranks' rows
    run_distributed(_dp2, folders, str(tmp_path))
    run_distributed(_reference, folders, [f"{tmp_path}/seen.0", f"{tmp_path}/seen.1"], str(tmp_path / "want.pt"),
                    world_size=1)
    _logged_means_match(str(tmp_path / "dp"), torch.load(tmp_path / "want.pt"), steps=2, per_step=4)
    # offloaded judges (weights moved out between phases) give what resident ones give, and hold nothing while idle
    run_distributed(_resident_and_offloaded, folders, str(tmp_path), world_size=1)
    assert metric_rows(str(tmp_path / "resident")) == metric_rows(str(tmp_path / "offloaded"))
    with open(tmp_path / "offloaded" / "metrics.jsonl") as f:
        row = json.loads(f.readline())
    assert row["memory/generate/j_mib"] == 0 and row["memory/update/rar_mib"] == 0 and row["memory/reward/j_mib"] > 0


def test_start_up_errors_name_the_judge_key(folders, tmp_path):
    policy, judge, _, _ = folders
    bad = f"reward.judges=[{judge_entry('j', tmp_path / 'nowhere', 'Q:{prompt} A:{respnse}')}]"
    # a misspelt field fails when the config loads, before any model (here: no judge folder at all) is read
    with pytest.raises(ValueError, match=r"reward\.judges\[0\]\.judge\.template: field \{respnse\}.*did you mean "
                                         r"\{response\}"):
        tiny_config(policy, str(tmp_path / "run"), bad)

    def start(path):
        GRPOTrainer(tiny_config(policy, str(tmp_path / "run"), f"reward.judges=[{judge_entry('j', path, JUDGE_TEMPLATE)}]"))

    with pytest.raises(Exception, match=r"reward\.judges\[0\]\.judge\.path=.*nowhere.* does not exist"):
        run_distributed(start, str(tmp_path / "nowhere"), world_size=1)
    no_tokenizer = tiny_policy(tmp_path / "bare")
    with pytest.raises(Exception, match=r"reward\.judges\[0\]\.judge\.path=.*bare.* holds no tokenizer files"):
        run_distributed(start, no_tokenizer, world_size=1)
