"""The judge role and the judge / rubric rewards (megalign.roles.judge, megalign.rewards.judge).

References: the logprob verdict against log-probabilities worked out by hand on a model whose logits
are set (attention and MLP outputs zeroed, so the last hidden state is the normed embedding of the
last token, and an LM head whose two answer rows read its first two coordinates); the generate mode
against `transformers` greedy `generate` + the same regex; RaR's aggregation sum_j w_j c_j / sum_j w_j
written out; tp = 2 against one process.
"""
import math
import re

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from megalign.data.tokenizer import CharTokenizer
from megalign.parallel import ParallelLayout
from megalign.rewards.judge import (JudgeReward, JudgeTemplate, PairwiseJudge, RubricReward, Verdicts,
                                    render_rubric, rubric_items)
from megalign.roles.judge import JudgeConfig, JudgeRewardConfig, load_judge
from tests.parallel.dist_utils import run_distributed

H, EPS, K = 8, 1e-5, 0.5
CHAR = CharTokenizer()


def _theta(token: int) -> float:
    return 0.37 * token


def set_logit_judge(path):
    """A 1-layer Llama + char tokenizer in `path` whose yes/no ('Y'/'N') logits are known (module doc)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=CHAR.vocab_size, hidden_size=H, intermediate_size=16,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                         max_position_embeddings=256, rms_norm_eps=EPS, tie_word_embeddings=False))
    with torch.no_grad():
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        emb = torch.zeros(CHAR.vocab_size, H)
        for t in range(CHAR.vocab_size):
            emb[t, 0], emb[t, 1] = math.cos(_theta(t)), math.sin(_theta(t))
        model.model.embed_tokens.weight.copy_(emb)
        model.model.norm.weight.fill_(1.0)
        head = model.lm_head.weight
        head.copy_(torch.randn_like(head))
        head[CHAR.encode("Y")[0]] = torch.tensor([K, 0.0] + [0.0] * (H - 2))
        head[CHAR.encode("N")[0]] = torch.tensor([0.0, K] + [0.0] * (H - 2))
    model.save_pretrained(path)
    CHAR.save(str(path))


def hand_p_yes(text: str) -> float:
    """p(Y) / (p(Y) + p(N)) after `text`: h = e / sqrt(mean(e^2) + eps) with |e| = 1, logits K h_0 and K h_1."""
    t = CHAR.encode(text)[-1]
    scale = 1.0 / math.sqrt(1.0 / H + EPS)
    l_yes, l_no = K * scale * math.cos(_theta(t)), K * scale * math.sin(_theta(t))
    return math.exp(l_yes) / (math.exp(l_yes) + math.exp(l_no))


def random_judge(path, seed=3):
    """A random 2-layer Llama over the char tokenizer, saved with it in `path`; returned (eval, fp32)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=CHAR.vocab_size, hidden_size=64, intermediate_size=96,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256, rms_norm_eps=1e-5, pad_token_id=0,
                                         bos_token_id=1, eos_token_id=2)).eval()
    model.save_pretrained(path)
    CHAR.save(str(path))
    return model


TEMPLATE = "Q:{prompt} A:{response}"
PROMPTS = ["1+1", "2*3", "7-4", "9+0", "1+1"]
RESPONSES = ["2", "six", "3", "y", "2"]


def _cfg(path, **kw) -> JudgeConfig:
    return JudgeConfig(**{"path": str(path), "template": TEMPLATE, "answers": ["Y", "N"], "chat_template": False,
                          "micro_batch_size": 2, **kw})


def _single_rank(logit_path, random_path, hf_verdicts):
    layout = ParallelLayout.build(tp=1)
    judge = load_judge("judge", _cfg(logit_path, offload_weights=True), layout)
    reward = JudgeReward("j", judge)
    scores = reward(PROMPTS, RESPONSES, [None] * 5, verifier=[1.0, 0.0, 1.0, 0.0, 1.0])
    expected = [hand_p_yes(f"Q:{p} A:{r}") for p, r in zip(PROMPTS, RESPONSES)]
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(round(s, 4) for s in expected)) == 4  # the rows really differ
    agree = sum((s >= 0.5) == (v >= 0.5) for s, v in zip(expected, [1, 0, 1, 0, 1])) / 5
    metrics = reward.metrics()
    assert metrics["reward/j/cache_hits"] == 1 and metrics["reward/j/unparsed"] == 0  # row 4 repeats row 0
    assert metrics["reward/j/agreement"] == pytest.approx(agree)
    assert metrics["reward/j/mean"] == pytest.approx(sum(expected) / 5, abs=1e-6)
    reward(PROMPTS[:2], RESPONSES[:2], [None] * 2)  # the same step: both cached
    assert reward.metrics()["reward/j/cache_hits"] == 3
    judge.new_step()
    judge.need()  # offloaded: computing now fails on the empty weights
    assert judge.resident_bytes() == 0
    with pytest.raises(Exception):
        reward(PROMPTS[:1], RESPONSES[:1], [None])
    judge.need("weights")
    assert reward(PROMPTS, RESPONSES, [None] * 5) == scores  # offloaded then back equals resident
    assert reward.metrics()["reward/j/cache_hits"] == 4

    pattern = r"([0-9])"
    gen = load_judge("g", _cfg(random_path, mode="generate", pattern=pattern, max_new_tokens=12,
                               unparsed_score=-1.0), layout)
    out = gen.verdicts(gen.template, [{"prompt": p, "response": r} for p, r in zip(PROMPTS, RESPONSES)])
    want = []
    for text in hf_verdicts:
        m = re.search(pattern, text)
        want.append((float(m.group(1)), True) if m else (-1.0, False))
    assert list(zip(out.scores, out.parsed)) == want and out.cache_hits == 1
    assert 0 < out.parsed.count(False) < 5  # both outcomes exercised
    assert gen.parse("score: abc") == (-1.0, False)


def hf_greedy_verdicts(model, prompts, responses, max_new_tokens):
    """transformers greedy generate on each filled template (BOS + chars, no padding), decoded by the char tokenizer."""
    texts = []
    for p, r in zip(prompts, responses):
        ids = torch.tensor([CHAR.encode(f"Q:{p} A:{r}", add_bos=True)])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=2, pad_token_id=0)
        texts.append(CHAR.decode(out[0, ids.shape[1]:].tolist()))
    return texts


def test_judge_logprob_generate_cache_offload(tmp_path):
    set_logit_judge(tmp_path / "logit")
    model = random_judge(tmp_path / "random")
    hf = hf_greedy_verdicts(model, PROMPTS, RESPONSES, 12)
    run_distributed(_single_rank, tmp_path / "logit", tmp_path / "random", hf, world_size=1)


def _tp_ranks(random_path, expected_logprob, expected_generate):
    layout = ParallelLayout.build(tp=2)
    rows = [{"prompt": p, "response": r} for p, r in zip(PROMPTS, RESPONSES)]
    judge = load_judge("judge", _cfg(random_path), layout)
    assert judge.verdicts(judge.template, rows).scores == pytest.approx(expected_logprob, abs=1e-5)
    gen = load_judge("g", _cfg(random_path, mode="generate", pattern=r"([0-9])", max_new_tokens=12), layout)
    assert gen.verdicts(gen.template, rows).scores == expected_generate


def _one_process(random_path, out):
    layout = ParallelLayout.build(tp=1)
    rows = [{"prompt": p, "response": r} for p, r in zip(PROMPTS, RESPONSES)]
    judge = load_judge("judge", _cfg(random_path), layout)
    gen = load_judge("g", _cfg(random_path, mode="generate", pattern=r"([0-9])", max_new_tokens=12), layout)
    torch.save((judge.verdicts(judge.template, rows).scores, gen.verdicts(gen.template, rows).scores), out)


def test_judge_tp2_equals_one_process(tmp_path):
    random_judge(tmp_path / "random")
    run_distributed(_one_process, tmp_path / "random", tmp_path / "one.pt", world_size=1)
    logprob, generate = torch.load(tmp_path / "one.pt")
    run_distributed(_tp_ranks, tmp_path / "random", logprob, generate)


def test_start_up_checks_name_the_field_and_the_answer(tmp_path):
    random_judge(tmp_path / "random")

    def build(**kw):
        run_distributed(lambda: load_judge("judge", _cfg(tmp_path / "random", **kw), ParallelLayout.build(tp=1)),
                        world_size=1)

    with pytest.raises(Exception, match="answer 'yes' is 3 tokens"):
        build(answers=["yes", "no"])
    with pytest.raises(ValueError, match=r"exactly one group"):
        _cfg(tmp_path, pattern=r"(\d)(\d)")
    with pytest.raises(ValueError, match=r"not a file"):
        _cfg(tmp_path, template="no fields here")
    stub = _Stub({}, "{prompt} {respnse}")
    with pytest.raises(ValueError, match=r"field \{respnse\}.*did you mean \{response\}"):
        JudgeReward("j", stub)
    with pytest.raises(ValueError, match=r"field \{criterion\} is not one"):
        JudgeReward("j", _Stub({}, "{response} {criterion}"))
    with pytest.raises(ValueError, match=r"field \{rubric\} is not one"):
        RubricReward("r", _Stub({}, "{response} {rubric}"), mode="explicit")
    with pytest.raises(ValueError, match=r"needs the field \{response_b\}"):
        PairwiseJudge("p", _Stub({}, "{response_a}"))
    file = tmp_path / "t.txt"
    file.write_text("Is {response} right? {criterion}")
    assert JudgeTemplate(str(file)).fields == ("response", "criterion")


class _Stub:
    """A judge whose verdict for a filled template is looked up in `table` (by criterion, else rubric text)."""

    def __init__(self, table, template):
        self.table, self.template, self.seen = table, JudgeTemplate(template), []

    def verdicts(self, template, rows):
        self.seen += rows
        return Verdicts([self.table[r.get("criterion") or r.get("rubric")] for r in rows], [True] * len(rows))


def test_rubric_explicit_and_implicit_against_the_paper():
    rubric = [{"criterion": "gives 6", "category": "Essential"},
              {"criterion": "shows the product", "category": "important"},
              {"criterion": "avoids units", "category": "pitfall"},
              {"criterion": "is short", "weight": 2.0}]
    c = {"gives 6": 1.0, "shows the product": 0.0, "avoids units": 1.0, "is short": 0.5}
    reward = RubricReward("rar", _Stub(c, "{prompt}|{response}|{criterion}"))
    meta = [{"rubric": rubric}, {"rubric": rubric[:1]}]
    scores = reward(["2*3", "2*3"], ["6", "7"], [6, 6], meta, verifier=[1.0, 0.0])
    # RaR: sum_j w_j c_j / sum_j w_j with Essential 1.0, Important 0.7, Pitfall 0.9 (satisfied = avoided)
    assert scores[0] == pytest.approx((1.0 * 1 + 0.7 * 0 + 0.9 * 1 + 2.0 * 0.5) / (1.0 + 0.7 + 0.9 + 2.0))
    assert scores[1] == pytest.approx(1.0)
    assert reward.item_scores == [[1.0, 0.0, 1.0, 0.5], [1.0]]
    m = reward.metrics()
    assert m["reward/rar/essential"] == 1.0 and m["reward/rar/important"] == 0.0 and m["reward/rar/weighted"] == 0.5
    # per response and category: the mean verdict of its items of it, None (NaN) when it has none
    want = {"essential": [1.0, 1.0], "important": [0.0, None], "optional": [None, None], "pitfall": [1.0, None],
            "weighted": [0.5, None]}
    assert {k: [None if math.isnan(x) else x for x in v] for k, v in reward.category_scores.items()} == want
    assert "reward/rar/optional" not in m
    # binary: RaR's 0/1 verdicts, each score thresholded at 1/2 before the weighted sum (0.5 -> 1)
    hard = RubricReward("rar", _Stub({**c, "is short": 0.4}, "{prompt}|{response}|{criterion}"), binary=True)
    assert hard(["2*3"], ["6"], [6], meta[:1]) == [pytest.approx((1.0 + 0.9) / (1.0 + 0.7 + 0.9 + 2.0))]
    assert JudgeReward("j", _Stub({"q": 0.5}, "{response} {criterion}"), criterion="q", binary=True)(["p"], ["r"], [1]) == [1.0]
    assert m["reward/rar/agreement"] == 0.5 and m["reward/rar/verdicts"] == 5

    text = render_rubric(rubric_items(rubric, "row"))
    assert text == ("- (Essential) gives 6\n- (Important) shows the product\n- (Pitfall) avoids units\n"
                    "- (weight 2) is short")
    implicit = RubricReward("rar", _Stub({text: 0.8}, "{response} {rubric}"), mode="implicit")
    assert implicit(["2*3"], ["6"], [6], [{"rubric": rubric}]) == [0.8]
    for bad, match in [([{"criterion": "x", "category": "vital"}], "category 'vital'"),
                       ([{"criterion": "x", "weight": -1}], "weight > 0"), ([], "non-empty list")]:
        with pytest.raises(ValueError, match=match):
            reward(["p"], ["r"], [None], [{"rubric": bad}])
    with pytest.raises(ValueError, match="no rubric column 'rubric'"):
        reward(["p"], ["r"], [None], [{}])


def test_pairwise_judge_and_reward_config():
    stub = _Stub({"be concise": 0.25}, "{prompt}\nA: {response_a}\nB: {response_b}\n{criterion}")
    pair = PairwiseJudge("pair", stub, criterion="be concise")
    assert pair.rank(["q"], ["a"], ["b"], verifier=[1.0]) == [0.25]
    assert pair.metrics()["reward/pair/agreement"] == 0.0
    with pytest.raises(ValueError, match="kind must be"):
        JudgeRewardConfig(name="j", judge=_cfg("x"), kind="score")


def _reward_role(logit_path):
    from megalign.rewards import RewardTerm
    from megalign.roles.reward import Reward, RewardConfig

    judged = JudgeRewardConfig(name="j", judge=_cfg(logit_path), weight=0.5)
    cfg = RewardConfig(terms=[RewardTerm("math_accuracy", 1.0)], judges=[judged])
    with pytest.raises(ValueError, match="lists 1 judges but 0 judge roles"):
        Reward(cfg, [])
    judge = load_judge("j", judged.judge, ParallelLayout.build(tp=1))
    reward = Reward(cfg, [], [judge])
    assert reward.needs() == {"j": ("weights",)} and reward.models == [judge]
    prompts, responses, answers = ["1+1", "2*3"], ["\\boxed{2}", "\\boxed{5}"], ["2", "6"]
    total, terms = reward.score(prompts, responses, answers, [{}, {}], torch.zeros(2, 1), torch.ones(2, 1))
    p = [hand_p_yes(f"Q:{q} A:{r}") for q, r in zip(prompts, responses)]
    assert terms["math_accuracy"].tolist() == [1.0, 0.0]
    assert terms["j"].tolist() == pytest.approx(p, abs=1e-5)
    assert total.tolist() == pytest.approx([1.0 + 0.5 * p[0], 0.5 * p[1]], abs=1e-5)
    assert terms["j_agreement"].tolist() == [float(p[0] >= 0.5), float(p[1] < 0.5)]
    counts = reward.error_counts()
    assert counts["reward/j/verdicts"] == 2 and counts["reward/j/unparsed"] == 0
    reward.score(prompts, responses, answers, [{}, {}], torch.zeros(2, 1), torch.ones(2, 1))
    assert reward.error_counts()["reward/j/cache_hits"] == 0  # a new step: the cache was cleared
    # a weight-0 verifier named by check_with: it adds nothing to the total, and the agreement is measured against it
    watched = RewardConfig(terms=[RewardTerm("math_accuracy", 0.0)], judges=[judged], check_with="math_accuracy")
    total, terms = Reward(watched, [], [judge]).score(prompts, responses, answers, [{}, {}], torch.zeros(2, 1),
                                                      torch.ones(2, 1))
    assert total.tolist() == pytest.approx([0.5 * p[0], 0.5 * p[1]], abs=1e-5)
    assert terms["j_agreement"].tolist() == [float(p[0] >= 0.5), float(p[1] < 0.5)]


def test_reward_role_scores_judge_terms(tmp_path):
    set_logit_judge(tmp_path / "logit")
    run_distributed(_reward_role, tmp_path / "logit", world_size=1)
