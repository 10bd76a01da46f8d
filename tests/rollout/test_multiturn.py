"""Multi-turn rollouts (`megalign.rollout.multiturn`) against hand-built conversations, a turn-by-turn transformers
greedy replay, a full forward over the finished episodes, the GAE recursion over the loss mask's holes, and the
counted failures and truncations; at tp = 2 against the tp = 1 episodes, with environments that run on tp rank 0 only."""
import itertools
import time

import pytest
import torch
import torch.distributed as dist
from models.hf_fixtures import make_causal_lm
from parallel.dist_utils import run_distributed
from transformers import GenerationConfig

from megalign.data.tokenizer import CharTokenizer
from megalign.envs.base import Environment, StepResult
from megalign.envs.tool_env import ToolEnv
from megalign.models import from_pretrained
from megalign.ops import gae
from megalign.parallel import ParallelLayout
from megalign.rollout import multiturn as multiturn_mod
from megalign.rollout import MultiTurnConfig, SamplingParams, episodes_to_batch, multiturn_rollout, rollout

TOK = CharTokenizer()
ROWS = [{"q": "hi"}, {"q": "what is 12 + 7?"}]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(folder, transformers model): a random Llama over the character vocabulary, saved in the folder."""
    path = tmp_path_factory.mktemp("llama")
    return path, make_causal_lm(path, "llama3_gqa", vocab_size=TOK.vocab_size, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def models(llama):
    path, hf = llama
    return hf, from_pretrained(path).eval()


class ScriptedUser(Environment):
    """Answers turn k with the user message "o<k>" (messages) or the text "[o<k>]" (text); done after `turns`;
    reward of turn k: k + (number of characters of the turn) / 100."""

    turns, kind, raise_at = 3, "messages", None

    def reset(self, row, seed):
        self.k, self.seed = 0, seed
        return [{"role": "user", "content": row["q"]}]

    def step(self, conversation, turn):
        self.k += 1
        if self.raise_at is not None and (self.seed % 2, self.k) == self.raise_at:
            raise RuntimeError("the environment broke")
        obs = [{"role": "user", "content": f"o{self.k}"}] if self.kind == "messages" else f"[o{self.k}]"
        return StepResult(obs, self.k + len(turn) / 100, self.k >= self.turns, {"steps": 1})


def _text_user(**kw):
    return type("TextUser", (ScriptedUser,), {"kind": "text", **kw})


def _free_tokens(hf, prompt, n=16):
    config = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=[], pad_token_id=0)
    with torch.no_grad():
        return hf.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt):].tolist()


def test_layout_of_a_hand_built_conversation(models):
    _, model = models
    params = SamplingParams(max_new_tokens=4, temperature=0.0, eos_token_id=TOK.eos_id)
    episodes, stats = multiturn_rollout(model, TOK, ScriptedUser, ROWS, 2, params, seed=1)
    assert [(e.prompt_index, e.sample) for e in episodes] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for e in episodes:
        prompt = TOK.apply_chat_template([{"role": "user", "content": ROWS[e.prompt_index]["q"]}])
        p = len(prompt)
        turns = [e.ids[a:b] for a, b in e.action_ranges]
        # by hand: each observation is the template's "user: o<k>\n" then the generation prompt "assistant: "
        obs = [TOK.encode(f"user: o{k}\nassistant: ") for k in (1, 2)]
        expected = prompt + turns[0] + obs[0] + turns[1] + obs[1] + turns[2]
        assert e.ids == expected and e.prompt_length == p
        t = [len(x) for x in turns]
        assert e.action_ranges == [(p, p + t[0]), (p + t[0] + 20, p + t[0] + 20 + t[1]),
                                   (p + t[0] + t[1] + 40, p + t[0] + t[1] + 40 + t[2])]  # len(obs) == 20
        assert e.loss_mask == [0] * p + [1] * t[0] + [0] * 20 + [1] * t[1] + [0] * 20 + [1] * t[2]
        assert all(lp == 0.0 for lp, m in zip(e.logprobs, e.loss_mask) if not m)
        assert all(lp <= 0.0 for lp, m in zip(e.logprobs, e.loss_mask) if m)
        texts = [TOK.decode(x) for x in turns]
        assert e.turn_rewards == pytest.approx([k + 1 + len(s) / 100 for k, s in enumerate(texts)])
        assert e.reward == pytest.approx(sum(e.turn_rewards)) and e.end == "env" and e.info == {"steps": 3}
        assert e.conversation == [{"role": "user", "content": ROWS[e.prompt_index]["q"]},
                                  {"role": "assistant", "content": texts[0]}, {"role": "user", "content": "o1"},
                                  {"role": "assistant", "content": texts[1]}, {"role": "user", "content": "o2"},
                                  {"role": "assistant", "content": texts[2]}]
    assert stats.turns == 12 and stats.ends["env"] == 4 and stats.observation_tokens == 8 * 20
    assert stats.metrics()["env/steps"] == 12.0
    batch = episodes_to_batch(episodes, 2, pad_token_id=0)
    width_p = max(e.prompt_length for e in episodes)
    for i, e in enumerate(episodes):
        r = len(e.ids) - e.prompt_length
        assert batch.sequences[i, width_p - e.prompt_length:width_p + r].tolist() == e.ids
        assert batch.response_mask[i, :r].tolist() == e.loss_mask[e.prompt_length:]
        assert batch.response_mask[i, r:].sum() == 0 and batch.attention_mask[i].sum() == len(e.ids)
        assert batch.lengths[i] == sum(e.loss_mask) and batch.rewards[i] == pytest.approx(e.reward)
    assert batch.group.tolist() == [0, 0, 1, 1] and batch.finished.all()


@pytest.mark.parametrize("family", ["llama3_gqa", "qwen2_untied"])
def test_greedy_equals_a_turn_by_turn_transformers_replay(models, tmp_path, family):
    if family == "llama3_gqa":
        hf, model = models
    else:
        hf = make_causal_lm(tmp_path, family, vocab_size=TOK.vocab_size, max_position_embeddings=1024)
        model = from_pretrained(tmp_path).eval()
    prompt = TOK.apply_chat_template([{"role": "user", "content": ROWS[1]["q"]}])
    free = _free_tokens(hf, prompt)
    stop = list(dict.fromkeys(t for t in free[1:] if t != free[0]))[:2]  # emitted mid-turn: turns end early
    params = SamplingParams(max_new_tokens=9, temperature=0.0, eos_token_id=TOK.eos_id, stop_token_ids=stop)
    env = _text_user(turns=4)
    episodes, stats = multiturn_rollout(model, TOK, env, ROWS, 2, params, seed=0)
    ends_early = 0
    assert [e.ids for e in episodes[::2]] == [e.ids for e in episodes[1::2]]  # greedy: a group's samples agree
    for e in episodes[::2]:
        for k, (a, b) in enumerate(e.action_ranges):
            config = GenerationConfig(do_sample=False, max_new_tokens=9, eos_token_id=[TOK.eos_id, *stop],
                                      pad_token_id=0)
            with torch.no_grad():
                ref = hf.generate(torch.tensor([e.ids[:a]]), generation_config=config)[0, a:].tolist()
            assert e.ids[a:b] == ref, (e.prompt_index, k)
            ends_early += b - a < 9
            if k + 1 < len(e.action_ranges):
                assert e.ids[b:e.action_ranges[k + 1][0]] == TOK.encode(f"[o{k + 1}]")
    assert ends_early > 0 and stats.turn_budget < stats.turns  # stop tokens ended some turns, the budget others


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 5)])
def test_rollout_logprobs_equal_a_full_forward(models, temperature, top_k):
    hf, model = models
    params = SamplingParams(max_new_tokens=6, temperature=temperature, top_k=top_k, eos_token_id=TOK.eos_id)
    episodes, _ = multiturn_rollout(model, TOK, ScriptedUser, ROWS, 3, params, seed=5)
    assert len({tuple(e.ids) for e in episodes}) == len(episodes)  # sampled: distinct episodes
    for e in episodes:
        with torch.no_grad():
            logits = hf(torch.tensor([e.ids])).logits[0].float()  # one transformers forward over the finished episode
        fresh = (logits[:-1] / temperature).log_softmax(-1).gather(-1, torch.tensor(e.ids[1:])[:, None])[:, 0]
        mask = torch.tensor(e.loss_mask[1:], dtype=torch.bool)
        torch.testing.assert_close(torch.tensor(e.logprobs[1:])[mask], fresh[mask], atol=1e-5, rtol=1e-5)


def test_episodes_do_not_depend_on_the_batch(models):
    _, model = models
    params = SamplingParams(max_new_tokens=5, temperature=1.0, eos_token_id=TOK.eos_id)
    both, _ = multiturn_rollout(model, TOK, ScriptedUser, ROWS, 2, params, seed=9)
    alone, _ = multiturn_rollout(model, TOK, ScriptedUser, ROWS[1:], 2, params, seed=9, prompt_keys=[1])
    assert [e.ids for e in alone] == [e.ids for e in both[2:]]
    assert [e.env_seed for e in alone] == [e.env_seed for e in both[2:]]  # the environments' seeds too
    assert len({e.env_seed for e in both}) == 4
    for a, b in zip(alone, both[2:]):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=1e-5)
    other, _ = multiturn_rollout(model, TOK, ScriptedUser, ROWS, 2, params, seed=10)
    assert [e.ids for e in other] != [e.ids for e in both]


def test_a_one_turn_episode_is_the_engines_sample(models):
    """The same per-sample streams as `rollout`: sample g of prompt key p draws the same tokens in both."""
    _, model = models
    one_turn = type("OneTurn", (ScriptedUser,), {"turns": 1})
    params = SamplingParams(max_new_tokens=7, temperature=0.9, top_p=0.95, eos_token_id=TOK.eos_id,
                            stop_token_ids=list(range(60, 70)))
    episodes, _ = multiturn_rollout(model, TOK, one_turn, ROWS, 3, params, seed=21)
    prompts = [TOK.apply_chat_template([{"role": "user", "content": r["q"]}]) for r in ROWS]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out, _ = rollout(model, ids, mask, 3, params, seed=21)
    assert any(e.action_ranges[0][1] - e.action_ranges[0][0] < 7 for e in episodes)  # some stopped early
    for i, e in enumerate(episodes):
        n = int(out.attention_mask[i, width:].sum())
        assert e.ids[e.prompt_length:] == out.sequences[i, width:width + n].tolist()
        torch.testing.assert_close(torch.tensor(e.logprobs[e.prompt_length:]), out.logprobs[i, :n], atol=1e-5, rtol=1e-5)


def test_gae_over_the_holes_equals_the_recursion(models):
    _, model = models
    params = SamplingParams(max_new_tokens=4, temperature=1.0, eos_token_id=TOK.eos_id)
    episodes, _ = multiturn_rollout(model, TOK, ScriptedUser, ROWS, 2, params, seed=2)
    batch = episodes_to_batch(episodes, 2)
    mask = batch.response_mask
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(mask.shape, generator=g), torch.randn(mask.shape, generator=g)
    gamma, lam = 0.9, 0.8
    adv, ret = gae(rewards, values, mask, gamma, lam)
    for i in range(len(episodes)):  # by hand: the recursion over the policy's tokens only, observations skipped
        valid = mask[i].nonzero()[:, 0].tolist()
        expect, nxt_v, nxt_a = torch.zeros(mask.shape[1], dtype=torch.float64), 0.0, 0.0
        for t in reversed(valid):
            delta = rewards[i, t].item() + gamma * nxt_v - values[i, t].item()
            nxt_a = delta + gamma * lam * nxt_a
            expect[t], nxt_v = nxt_a, values[i, t].item()
        torch.testing.assert_close(adv[i].double(), expect, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ret[i][mask[i].bool()].double(), (expect + values[i].double())[mask[i].bool()],
                                   atol=1e-5, rtol=1e-5)
        assert (adv[i][~mask[i].bool()] == 0).all()
    assert (mask[:, :4] == 1).all() and (mask[:, 4] == 0).all()  # a hole right after the first turn


def test_the_loss_mask_gives_environment_tokens_zero_gradient(models):
    hf, model = models
    params = SamplingParams(max_new_tokens=4, temperature=1.0, eos_token_id=TOK.eos_id)
    episodes, _ = multiturn_rollout(model, TOK, ScriptedUser, ROWS, 2, params, seed=3)
    batch = episodes_to_batch(episodes, 2)
    width_p = batch.sequences.shape[1] - batch.response_mask.shape[1]
    logits = hf(batch.sequences, attention_mask=batch.attention_mask).logits[:, width_p - 1:-1].float()
    logits.retain_grad()
    logp = logits.log_softmax(-1).gather(-1, batch.sequences[:, width_p:, None])[..., 0]
    torch.testing.assert_close(logp.detach() * batch.response_mask, batch.rollout_logp, atol=1e-5, rtol=1e-5)
    (-(logp * batch.response_mask).sum()).backward()
    per_token = logits.grad.abs().sum(-1)
    env_token = batch.attention_mask[:, width_p:].bool() & (batch.response_mask == 0)
    assert env_token.sum() == 2 * 2 * 2 * 20 and (per_token[env_token] == 0).all()  # 2 observations of 20 per episode
    assert (per_token[batch.response_mask.bool()] > 0).all()
    hf.zero_grad(set_to_none=True)


def test_an_environment_that_raises_is_counted_and_scored_zero(models, caplog):
    _, model = models
    params = SamplingParams(max_new_tokens=4, temperature=1.0, eos_token_id=TOK.eos_id)
    good, _ = multiturn_rollout(model, TOK, ScriptedUser, ROWS, 2, params, seed=4)
    broken = type("Broken", (ScriptedUser,), {"raise_at": (1, 2)})  # odd environment seeds raise at turn 2
    episodes, stats = multiturn_rollout(model, TOK, broken, ROWS, 2, params, seed=4)
    failed = [i for i, e in enumerate(episodes) if e.end == "error"]
    assert failed and stats.env_errors == len(failed) == stats.ends["error"]
    for i, e in enumerate(episodes):
        if i in failed:
            assert e.reward == 0 and e.turn_rewards == [0.0, 0.0] and "the environment broke" in e.error
            assert e.ids == good[i].ids[:e.action_ranges[-1][1]]  # stopped after the turn the env failed on
        else:
            assert e.ids == good[i].ids and e.reward == good[i].reward  # the others are untouched
    assert "the environment broke" in caplog.text and stats.metrics()["env/errors"] == len(failed)


class Endless(ScriptedUser):
    turns = 10 ** 6

    def finish(self, conversation, reason):
        return 100.0 + len(conversation)


def test_turn_and_token_limits_truncate_and_count(models):
    _, model = models
    params = SamplingParams(max_new_tokens=3, temperature=0.0, eos_token_id=TOK.eos_id)
    episodes, stats = multiturn_rollout(model, TOK, Endless, ROWS, 1, params, config=MultiTurnConfig(max_turns=2))
    for e in episodes:
        assert e.end == "max_turns" and len(e.action_ranges) == 2 and e.turn_truncated == [True, True]
        assert e.turn_rewards[-1] == pytest.approx(2 + 3 / 100 + 100 + 4)  # step + finish (4 messages)
        assert len(e.ids) == e.action_ranges[-1][1]  # no observation after the last turn
    assert stats.ends["max_turns"] == 2 and stats.turn_budget == 4
    # the tokens limit: the prompt of row 0, "<bos>user: hi\nassistant: ", has 21 tokens; 3 policy tokens and a
    # 20-token observation make 44; a limit of 46 cuts turn 2 after 2 tokens, then the rollout's finish scores it
    limit = lambda n: MultiTurnConfig(max_total_tokens=n)  # noqa: E731
    episodes, stats = multiturn_rollout(model, TOK, Endless, ROWS[:1], 1, params, config=limit(46))
    (e,) = episodes
    assert e.end == "max_total_tokens" and len(e.ids) == 46 and e.action_ranges == [(21, 24), (44, 46)]
    assert e.turn_rewards == pytest.approx([1 + 3 / 100, 0 + 100 + 4])  # the cut turn got no step, finish's reward
    assert stats.ends["max_total_tokens"] == 1
    # an observation that leaves no room for a policy token ends the episode before it
    episodes, _ = multiturn_rollout(model, TOK, Endless, ROWS[:1], 1, params, config=limit(44))
    assert episodes[0].end == "max_total_tokens" and len(episodes[0].ids) == 24
    episodes, stats = multiturn_rollout(model, TOK, Endless, ROWS[:1], 1, params, config=limit(21))
    assert episodes[0].end == "max_total_tokens" and episodes[0].ids == [] and stats.ends["max_total_tokens"] == 1
    # the time limit (checked after every policy token): an already spent budget cuts the first turn at one token
    episodes, stats = multiturn_rollout(model, TOK, Endless, ROWS, 1, params, config=MultiTurnConfig(max_time_s=1e-9))
    assert [(e.end, len(e.ids) - e.prompt_length) for e in episodes] == [("max_time", 1)] * 2
    assert [e.turn_rewards for e in episodes] == [[102.0], [102.0]] and stats.ends["max_time"] == 2


def test_stop_strings_end_a_turn(models):
    hf, model = models
    prompt = TOK.apply_chat_template([{"role": "user", "content": ROWS[0]["q"]}])
    text = TOK.decode(_free_tokens(hf, prompt, 12), skip_special=False)
    stop = text[3:5]  # completed at the 5th token at the latest
    params = SamplingParams(max_new_tokens=12, temperature=0.0, eos_token_id=TOK.eos_id)
    episodes, stats = multiturn_rollout(model, TOK, ScriptedUser, ROWS[:1], 1, params,
                                        config=MultiTurnConfig(stop_strings=[stop]))
    first = episodes[0].ids[slice(*episodes[0].action_ranges[0])]
    assert TOK.decode(first, skip_special=False) == text[:text.index(stop) + 2]
    assert not episodes[0].turn_truncated[0]


class ScriptedToolEnv(ToolEnv):
    """A `ToolEnv` whose policy turns are replaced by a script (a random model writes no tool calls)."""

    SCRIPT = ['<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>',
              '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>', "answer: 408"]

    def step(self, conversation, turn):
        return super().step(conversation, self.SCRIPT[sum(m["role"] == "assistant" for m in conversation)])


def test_tool_calls_are_answered_and_malformed_ones_counted(models):
    _, model = models
    reward = lambda prompt, response, answer, meta: float(response.endswith(str(answer)))  # noqa: E731
    env = lambda: ScriptedToolEnv(reward=reward)  # noqa: E731
    params = SamplingParams(max_new_tokens=3, temperature=0.0, eos_token_id=TOK.eos_id)
    episodes, stats = multiturn_rollout(model, TOK, env, [{"prompt": "12 * 34?", "answer": 408}], 1, params)
    (e,) = episodes
    assert e.end == "env" and e.reward == 1.0 and len(e.action_ranges) == 3
    (a1, b1), (a2, _), _ = e.action_ranges
    assert e.ids[b1:a2] == TOK.encode("tool: 408\nassistant: ")  # the result as a tool message, through the template
    assert e.conversation[-2]["content"].startswith("Error: the tool call is not valid JSON")
    assert stats.env_info["tool_calls"] == 2 and stats.env_info["tool_errors/malformed_json"] == 1
    assert TOK.decode(e.ids[:a1]).startswith("system: # Tools\n") and "<tools>" in TOK.decode(e.ids[:a1])


def test_bad_arguments_are_refused(models):
    _, model = models
    params = SamplingParams(max_new_tokens=3, temperature=0.0, eos_token_id=TOK.eos_id)
    with pytest.raises(ValueError, match="group_size"):
        multiturn_rollout(model, TOK, ScriptedUser, ROWS, 0, params)
    with pytest.raises(ValueError, match="prompt_keys"):
        multiturn_rollout(model, TOK, ScriptedUser, ROWS, 1, params, prompt_keys=[0])
    with pytest.raises(ValueError, match="max_turns"):
        MultiTurnConfig(max_turns=0)
    with pytest.raises(ValueError, match="whole groups"):
        episodes_to_batch([], 2)


class BrokenReset(ScriptedUser):
    def reset(self, row, seed):
        if row["q"] == "hi":
            raise KeyError("no such row")
        return super().reset(row, seed)


def test_a_reset_that_raises_is_counted_and_the_other_rows_run(models):
    _, model = models
    params = SamplingParams(max_new_tokens=3, temperature=0.0, eos_token_id=TOK.eos_id)
    episodes, stats = multiturn_rollout(model, TOK, BrokenReset, ROWS, 2, params)
    assert [e.end for e in episodes] == ["error", "error", "env", "env"] and stats.env_errors == 2
    assert episodes[0].ids == [] and episodes[0].reward == 0 and "reset: KeyError" in episodes[0].error
    batch = episodes_to_batch(episodes, 2)
    assert batch.attention_mask[:2].sum() == 0 and batch.response_mask[:2].sum() == 0


def test_the_simulated_user_zeroes_replies_that_break_the_format(models):
    from megalign.envs.user_sim import ArithmeticUser

    _, model = models  # a random model writes no <think> block: every dialogue ends after its first reply with 0
    params = SamplingParams(max_new_tokens=4, temperature=1.0, eos_token_id=TOK.eos_id)
    episodes, stats = multiturn_rollout(model, TOK, ArithmeticUser, [{"numbers": [3, 4], "op": "+"}], 3, params)
    assert all(e.end == "env" and e.reward == 0.0 and len(e.action_ranges) == 1 for e in episodes)
    assert stats.env_info["format_errors"] == 3


# ----- tensor parallelism: every tp rank in lock step, the environments on tp rank 0 only

TP_CASES = [  # (environment, sampling, limits): the reference runs them at tp = 1 with seed 7
    (ScriptedUser, SamplingParams(max_new_tokens=5, temperature=1.0, top_k=9, eos_token_id=TOK.eos_id),
     MultiTurnConfig(max_time_s=1e3)),
    (Endless, SamplingParams(max_new_tokens=3, temperature=0.0, eos_token_id=TOK.eos_id),
     MultiTurnConfig(max_turns=3, max_time_s=1e3)),
]


def _skewed_clock_on_tp_rank(layout, rank):
    """On tp rank `rank`, a clock that jumps 10^6 s per read: every `max_time_s` there would be spent at once, so
    episodes agree with tp rank 0's only if tp rank 0's time decisions are the ones used."""
    if layout.tp_rank == rank:
        ticks = itertools.count()
        multiturn_mod.time = type("SkewedClock", (), {"perf_counter": staticmethod(lambda: next(ticks) * 1e6)})


def _tp_equals_tp1(path, refs):
    layout = ParallelLayout.build(tp=2)
    model = from_pretrained(path, layout=layout, vocab_pad_multiple=64).eval()  # kv heads and vocab sharded
    _skewed_clock_on_tp_rank(layout, 1)
    for (env, params, config), (ref, ref_stats) in zip(TP_CASES, refs):
        episodes, stats = multiturn_rollout(model, TOK, env, ROWS, 2, params, seed=7 if layout.tp_rank == 0 else 99,
                                            config=config)  # tp rank 0's seed is the one used
        for got, want in zip(episodes, ref, strict=True):
            assert (got.ids, got.loss_mask, got.action_ranges) == (want.ids, want.loss_mask, want.action_ranges)
            assert (got.end, got.env_seed, got.conversation) == (want.end, want.env_seed, want.conversation)
            assert got.turn_rewards == pytest.approx(want.turn_rewards) and got.reward == pytest.approx(want.reward)
            torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), rtol=1e-5, atol=1e-5)
        assert (stats.turns, stats.ends, stats.turn_budget) == (ref_stats.turns, ref_stats.ends, ref_stats.turn_budget)


def test_tp2_episodes_equal_tp1(models, llama):
    _, model = models
    refs = [multiturn_rollout(model, TOK, env, ROWS, 2, params, seed=7, config=config)
            for env, params, config in TP_CASES]
    assert len({tuple(e.ids) for e in refs[0][0]}) == 4 and refs[0][1].ends["env"] == 4  # sampled, no time cut
    assert refs[1][1].ends["max_turns"] == 4  # greedy, cut by max_turns: finish's reward
    run_distributed(_tp_equals_tp1, llama[0], refs)


class Unrepeatable(ScriptedUser):
    """Not deterministic: observations name the global rank that stepped it, rewards read the wall clock, and
    odd environment seeds raise at turn 2, so tp ranks that each stepped their own copy would disagree. Building
    one anywhere but on tp rank 0 raises."""

    raise_at = (1, 2)

    def __init__(self):
        if dist.get_rank() != 0:
            raise AssertionError(f"an environment was built on rank {dist.get_rank()}")

    def reset(self, row, seed):
        self.k, self.seed = 0, seed
        return [{"role": "user", "content": f"{row['q']} @{dist.get_rank()}"}]

    def step(self, conversation, turn):
        result = super().step(conversation, turn)
        return StepResult(f"[o{self.k}@{dist.get_rank()}]", result.reward + time.time() % 1, result.done,
                          {"rank": dist.get_rank()})


def _unrepeatable_env(path):
    layout = ParallelLayout.build(tp=2)
    model = from_pretrained(path, layout=layout, vocab_pad_multiple=64).eval()
    _skewed_clock_on_tp_rank(layout, 1)
    params = SamplingParams(max_new_tokens=4, temperature=1.0, eos_token_id=TOK.eos_id)
    episodes, stats = multiturn_rollout(model, TOK, Unrepeatable, ROWS, 2, params, seed=3,
                                        config=MultiTurnConfig(max_time_s=1e3))
    mine = [(e.ids, e.loss_mask, e.logprobs, e.turn_rewards, e.reward, e.end, e.error, e.info, e.conversation)
            for e in episodes]
    both: list = [None, None]
    dist.all_gather_object(both, (mine, stats.env_errors, dict(stats.ends)), group=layout.tp_group)
    assert both[0] == both[1]  # identical on both tp ranks, log-probs to the bit (the same logits, the same token)
    failed = [e for e in episodes if e.end == "error"]
    assert 0 < len(failed) < len(episodes) and stats.env_errors == len(failed)
    assert all(e.error == "step: RuntimeError: the environment broke" for e in failed)
    assert all(e.end == "env" and len(e.action_ranges) == 3 for e in episodes if e not in failed)
    text = " ".join(m["content"] for e in episodes for m in e.conversation if m["role"] == "user")
    assert "@0" in text and "@1" not in text  # every observation came from tp rank 0's environments
    assert all(e.info == {"rank": 0} for e in episodes if e not in failed)


def test_tp2_environments_step_on_tp_rank_0_only(llama):
    """An environment that is not deterministic still gives the same episodes on both tp ranks: its calls, their
    errors and the time-limit decisions are tp rank 0's, broadcast over the tp group."""
    run_distributed(_unrepeatable_env, llama[0])
