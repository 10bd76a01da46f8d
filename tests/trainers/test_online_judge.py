"""Judges in the online trainers (issue 27): the judge and rubric terms of `reward.judges` in GRPO, the judge role at
dp = 2 and offloaded, start-up checks, and online DPO ranking its pairs with a pairwise judge.

The pairwise judge's reference is worked by hand: its logits are set (`tests/rewards/test_judge.py`'s
`set_logit_judge`, p(Y) a closed form of the last token) and its template ends with response A, so the verdict on
each order and their average are computed from the decoded texts alone.

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
from rewards.test_judge import CHAR, hand_p_yes, set_logit_judge
from trainers.grpo_helpers import digit_fraction, tiny_config, tiny_overrides, tiny_policy, write_rows
from trainers.helpers import metric_rows

from megalign.config import load_config
from megalign.data import CharTokenizer
from megalign.parallel import ParallelLayout
from megalign.rewards.judge import JudgeTemplate
from megalign.roles.judge import JudgeConfig, load_judge
from megalign.trainers.grpo import GRPOTrainer
from megalign.trainers.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

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


def recording(trainer_cls):
    """`trainer_cls` keeping what its reward role was given and returned each call: (prompts, responses, answers,
    metadata, total, terms)."""

    class Recording(trainer_cls):
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
    return Recording


def _grpo(policy, run_dir, out, *overrides, trainer_cls=GRPOTrainer, config=tiny_config):
    trainer = recording(trainer_cls)(config(policy, run_dir, *overrides))
    trainer.train()
    torch.save(trainer.seen, f"{out}.{trainer.layout.dp_rank}")


def reference_rewards(judge_path, rubric_path, seen):
    """[(total, j, rar, j_agreement, {category: mean verdict of the row's items of it, NaN: none})] per recorded row,
    from separately loaded judges (module doc)."""
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
            by_category = {}
            for cat in (*CATEGORY, "weighted"):
                mine = [ci for it, ci in zip(items, c) if it.get("category", "weighted") == cat]
                by_category[cat] = sum(mine) / len(mine) if mine else float("nan")
            out.append((verifier + 0.5 * j + 0.5 * rar, j, rar, float((j >= 0.5) == (verifier >= 0.5)), by_category))
    return out


def _reference(folders, seen_files, out):
    """Checks every recorded row against `reference_rewards`; saves the reference rows, in recorded order."""
    _, judge, rubric_judge, _ = folders
    seen = [row for f in seen_files for row in torch.load(f, weights_only=False)]
    want = reference_rewards(judge, rubric_judge, seen)
    got = [(t, terms["j"][n], terms["rar"][n], terms["j_agreement"][n])
           for *_, total, terms in seen for n, t in enumerate(total.tolist())]
    assert len(got) == len(want) > 0
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor([w[:4] for w in want],
                                                                                     dtype=torch.float64),
                               rtol=1e-5, atol=1e-5)
    for cat in want[0][4]:  # each rubric category's term: the row's mean verdict on its items of it, NaN without any
        got_cat = [v for *_, terms in seen for v in terms[f"rar_{cat}"].tolist()]
        torch.testing.assert_close(torch.tensor(got_cat, dtype=torch.float64),
                                   torch.tensor([w[4][cat] for w in want], dtype=torch.float64),
                                   rtol=1e-5, atol=1e-5, equal_nan=True)
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
        for cat in mine[0][4]:  # means over the responses whose rubric has the category (NaN when none has)
            known = [m[4][cat] for m in mine if m[4][cat] == m[4][cat]]
            got = row[f"reward/rar_{cat}/mean"]  # NaN is written as null
            assert got == pytest.approx(sum(known) / len(known), abs=1e-5) if known else got is None, (step, cat)
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


# ----- online DPO with a pairwise judge

PAIR_TEMPLATE = "{prompt}>{response_b}<{response_a}"
"""The last token of the filled template is the last character of response A, so the hand-set judge's verdict on
(A, B) is a function of A's last character and on (B, A) of B's (`hand_p_yes`)."""


def hand_preference(prompt, a, b):
    """p(A better than B) by hand: the mean of p(Y) on (A, B) and 1 - p(Y) on (B, A) (online_dpo's module doc)."""
    return (hand_p_yes(f"{prompt}>{b}<{a}") + 1.0 - hand_p_yes(f"{prompt}>{a}<{b}")) / 2


def _dpo_config(policy, run_dir, *overrides):
    base = [o for o in tiny_overrides(policy, run_dir) if not o.startswith(("algo.", "rollout.group_size"))]
    return load_config(OnlineDPOConfig, None, [*base, "rollout.group_size=2", "export_hf=false", *overrides])


def pair_judge(path, *extra, template=PAIR_TEMPLATE):
    """`judge=` of online DPO as YAML flow text; `extra`: more `key: value` of its judge model."""
    more = "".join(f", {e}" for e in extra)
    return (f"judge={{judge: {{path: '{path}', template: '{template}', answers: [Y, N], chat_template: false, "
            f"micro_batch_size: 4{more}}}}}")


def _dpo_step(policy, judge, run_dir, out, *overrides):
    trainer = OnlineDPOTrainer(_dpo_config(policy, run_dir, pair_judge(judge, *overrides), "rollout.prompts_per_step=8"))
    seen = {}
    score = trainer.score

    def recording(batch):
        score(batch)
        seen["batch"], seen["pairs"] = batch, [t.cpu() for t in trainer.pairs[:3]]
    trainer.score = recording
    seen["metrics"] = trainer.train_step()
    with trainer.phase("judge", pair_judge=("weights",)):  # an offloaded judge is resident only in its phase
        seen["constructed"] = trainer.judge_preferences(["1+1="] * 4, ["5", "x", "27", "3"],
                                                        ["5", "3", "2", "x"]).tolist()
    trainer.place("idle")  # a phase that needs no role: an offloaded judge then holds nothing
    seen["offloaded_after"] = trainer.roles[-1].resident_bytes()
    torch.save(seen, f"{out}.{trainer.layout.dp_rank}")


def decoded(batch, response_len):
    """(prompt, response) texts of the batch's rows, decoded here with the char tokenizer."""
    width = batch.sequences.shape[1] - response_len
    prompts = [CHAR.decode(row[:width][m[:width].bool()].tolist()) for row, m in zip(batch.sequences, batch.attention_mask)]
    responses = [CHAR.decode(row[width:width + int(n)].tolist()) for row, n in zip(batch.sequences, batch.lengths)]
    return prompts, responses


def check_pairs(seen):
    """This rank's pairs against the hand-worked judge; returns (p [K], tied [K], agreeing, decided, margins)."""
    prompts, responses = decoded(seen["batch"], 8)
    p = [hand_preference(prompts[i], responses[i], responses[i + 1]) for i in range(0, len(prompts), 2)]
    first = [x > 0.5 + 1e-6 for x in p]
    tied = [abs(x - 0.5) <= 1e-6 for x in p]
    chosen, rejected, got_tied = seen["pairs"]
    assert got_tied.tolist() == tied
    assert chosen.tolist() == [2 * i + (0 if first[i] else 1) for i in range(len(p)) if not tied[i]]
    assert rejected.tolist() == [2 * i + (1 if first[i] else 0) for i in range(len(p)) if not tied[i]]
    verifier = [digit_fraction(None, r, None, None) for r in responses]
    decided = [i for i in range(len(p)) if verifier[2 * i] != verifier[2 * i + 1] and not tied[i]]
    agree = sum(first[i] == (verifier[2 * i] > verifier[2 * i + 1]) for i in decided)
    margins = [abs(2 * x - 1) for x, t in zip(p, tied) if not t]
    # constructed pairs: identical responses tie exactly (1/2), swapping A and B gives 1 - p
    want = [hand_preference("1+1=", a, b) for a, b in [("5", "5"), ("x", "3"), ("27", "2"), ("3", "x")]]
    assert seen["constructed"] == pytest.approx(want, abs=1e-6) and seen["constructed"][0] == 0.5
    assert seen["constructed"][1] + seen["constructed"][3] == pytest.approx(1.0)
    return p, tied, agree, len(decided), margins


def check_dpo_metrics(m, ranks):
    """The step's metrics (reduced over dp) against `check_pairs` of every rank."""
    p = [x for r in ranks for x in r[0]]
    tied, agree, decided = sum(sum(r[1]) for r in ranks), sum(r[2] for r in ranks), sum(r[3] for r in ranks)
    margins = [x for r in ranks for x in r[4]]
    assert m["pairs/trained"] == len(p) - tied and m["pairs/tied"] == tied
    assert m["reward/pair_judge/mean"] == pytest.approx(sum(p) / len(p), abs=1e-5)
    assert m["reward/pair_judge/verdicts"] == 2 * len(p)  # both orders
    assert m["reward/pair_judge/unparsed"] == 0
    assert m["reward/pair_judge/agreement"] == pytest.approx(agree / max(decided, 1))
    assert m["objective/scores_margin"] == pytest.approx(sum(margins) / max(len(margins), 1), abs=1e-5)


def test_online_dpo_pairs_follow_the_pairwise_judge(folders, tmp_path):
    set_logit_judge(tmp_path / "pair_judge")
    out = str(tmp_path / "step")
    run_distributed(_dpo_step, folders[0], str(tmp_path / "pair_judge"), str(tmp_path / "run"), out, world_size=1)
    seen = torch.load(f"{out}.0", weights_only=False)
    one = check_pairs(seen)
    assert 0 < sum(x > 0.5 for x in one[0]) < len(one[0])  # both positions win somewhere
    check_dpo_metrics(seen["metrics"], [one])
    # dp = 2 with the judge offloaded: each rank's pairs follow the judge; the metrics reduce over both ranks
    run_distributed(_dpo_step, folders[0], str(tmp_path / "pair_judge"), str(tmp_path / "dp2"), f"{out}_dp2",
                    "offload_weights: true")
    ranks = [torch.load(f"{out}_dp2.{r}", weights_only=False) for r in range(2)]
    check_dpo_metrics(ranks[0]["metrics"], [check_pairs(seen) for seen in ranks])
    assert seen["offloaded_after"] > 0 and ranks[0]["offloaded_after"] == 0  # resident vs offloaded outside its phase


def test_pair_judge_config_checks():
    policy = "/nowhere"  # the config fails before any folder is read
    with pytest.raises(ValueError, match=r"judge\.judge\.template: field \{respons_b\}.*did you mean \{response_b\}"):
        _dpo_config(policy, "/tmp/x", pair_judge("/nowhere", template="{prompt} {response_a} {respons_b}"))
    with pytest.raises(ValueError, match=r"group_size must be 2"):
        _dpo_config(policy, "/tmp/x", pair_judge("/nowhere"), "rollout.group_size=4")


# ----- best-of-N reranked by a judge

def _best_of_n(policy, prm, judge, out_file):
    import megalign.tools.best_of_n as bon

    cfg = load_config(bon.BestOfNConfig, None, [
        f"policy={policy}", f"prm={prm}", "orm=null", f"out={out_file}", "chain.max_ops=2", "chain.max_operand=4",
        "chain.num_problems=60", "num_prompts=4", "n=2", "sampling.max_new_tokens=4", "device=cpu",
        f"judges=[{{name: jb, judge: {{path: '{judge}', template: '{{prompt}} {{response}}', answers: [Y, N], "
        f"chat_template: false}}}}]"])
    chains = cfg.prompts(bon.make_chain_splits(cfg.chain)[1])
    real = bon.continue_texts

    def constructed(model, tokenizer, prefixes, params, generator, layout, batch_size):
        if generator is None:  # greedy: the policy's own
            return real(model, tokenizer, prefixes, params, generator, layout, batch_size)
        assert len(prefixes) == 2 * len(chains)
        return [text for c in chains for text in candidates(c.answer, chains.index(c))]
    bon.continue_texts = constructed
    try:
        bon.best_of_n(cfg)
    finally:
        bon.continue_texts = real


def ending(rank):
    """The letter whose hand-set verdict p(Y) (`hand_p_yes`) is the `rank`-th lowest of a..z (0: lowest, -1: highest)."""
    return sorted("abcdefghijklmnopqrstuvwxyz", key=lambda ch: hand_p_yes(ch))[rank]


def candidates(answer, r):
    """Prompt r's two samples: the right answer ending with the letter the judge likes most on prompts 0-2 and least
    on prompt 3, then a wrong answer ending with a middling letter."""
    return [f"\\boxed{{{answer}}}{ending(-1 if r < 3 else 0)}", f"\\boxed{{{answer + 1}}}{ending(13)}"]


def test_best_of_n_reranks_with_a_judge(folders, tmp_path):
    set_logit_judge(tmp_path / "judge")
    prm = tiny_policy(tmp_path / "prm")
    with open(tmp_path / "prm" / "prm.json", "w") as f:
        json.dump({"negative_token_id": CHAR.encode("-")[0], "positive_token_id": CHAR.encode("+")[0],
                   "negative_token": "-", "positive_token": "+", "separator": "\n", "supervise": "steps"}, f)
    run_distributed(_best_of_n, folders[0], prm, str(tmp_path / "judge"), str(tmp_path / "bon.json"), world_size=1)
    with open(tmp_path / "bon.json") as f:
        summary = json.load(f)
    # the judge's pick (the higher p(Y), decided by the last letter) is right on prompts 0-2: 3 of 4
    assert summary["jb"] == 0.75 and summary["pass"] == 1.0 and summary["sample_mean"] == 0.5
    assert summary["judges"] == ["jb"]
    from megalign.tools.best_of_n import best_of_n_table
    assert "best-of-2, judge jb" in best_of_n_table(summary)


def _ppo(policy, run_dir, out, *overrides):
    from trainers.test_ppo_trainer import tiny_ppo_config

    from megalign.trainers.ppo import PPOTrainer
    _grpo(policy, run_dir, out, *overrides, trainer_cls=PPOTrainer, config=tiny_ppo_config)


def test_ppo_with_judge_terms_equals_the_judges_verdicts(folders, tmp_path):
    out = str(tmp_path / "seen")
    run_distributed(_ppo, folders[0], str(tmp_path / "run"), out, *judge_overrides(folders), world_size=1)
    run_distributed(_reference, folders, [f"{out}.0"], str(tmp_path / "want.pt"), world_size=1)
    _logged_means_match(str(tmp_path / "run"), torch.load(tmp_path / "want.pt"), steps=2, per_step=16)
