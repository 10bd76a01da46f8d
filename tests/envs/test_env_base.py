"""The environment interface (`megalign.envs.base`), `ToolEnv` and the RLVER-shaped simulated user against
hand-written conversations and hand-worked dialogues."""
import string

import pytest
from data.hf_tok_fixtures import save_char_level_hf_tokenizer

from megalign.data.tokenizer import CharTokenizer, HFTokenizer
from megalign.envs.base import (EnvSpecError, Environment, StepResult, env_factory, first_observation_ids, glue,
                                load_env_class, render_observation)
from megalign.envs.tool_env import ToolEnv
from megalign.envs.user_sim import ArithmeticUser, answer_accuracy, split_think_say

# ChatML as Qwen writes it: "<|im_end|>\n" closes every message, so "\n" follows the assistant's stop token
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    path = save_char_level_hf_tokenizer(tmp_path_factory.mktemp("chatml"), ["<unk>", "<|im_start|>", "<|im_end|>"],
                                        string.printable, CHATML, eos_token="<|im_end|>")
    return HFTokenizer(path)


# ----- the interface


def test_load_env_class_by_module_and_by_file(tmp_path):
    assert load_env_class("megalign.envs.user_sim:ArithmeticUser") is ArithmeticUser
    path = tmp_path / "my_env.py"
    path.write_text("from megalign.envs.base import Environment\nclass Mine(Environment):\n    pass\n"
                    "class Half:\n    def reset(self, row, seed): return 'x'\nvalue = 3\n")
    assert load_env_class(f"{path}:Mine").__name__ == "Mine"
    for spec, says in [("no_colon", "must look like"), ("megalign.envs.nope:X", "cannot import"),
                       (f"{tmp_path}/missing.py:X", "does not exist"), (f"{path}:Other", "has no attribute 'Other'"),
                       (f"{path}:value", "not a class"), (f"{path}:Half", "has no step method")]:
        with pytest.raises(EnvSpecError, match=says):
            load_env_class(spec)


def test_env_factory_binds_and_checks_the_arguments():
    make = env_factory("megalign.envs.user_sim:ArithmeticUser", {"initial_score": 80})
    assert make().initial_score == 80 and make() is not make()  # one environment per episode
    with pytest.raises(EnvSpecError, match="do not fit ArithmeticUser"):
        env_factory("megalign.envs.user_sim:ArithmeticUser", {"initial_scor": 80})
    with pytest.raises(EnvSpecError, match=r"ArithmeticUser\(\*\*\{'initial_score': 0\}\) raised ValueError"):
        env_factory("megalign.envs.user_sim:ArithmeticUser", {"initial_score": 0})


def test_observations_render_as_the_template_renders_the_whole_conversation(chatml):
    conversation = [{"role": "user", "content": "what is 2+3?"}]
    turn = [{"role": "assistant", "content": '<tool_call>{"name": "calc"}</tool_call>'}]
    tool = [{"role": "tool", "content": "5"}]
    prompt = first_observation_ids(chatml, conversation)
    assert prompt == chatml.apply_chat_template(conversation, add_generation_prompt=True)
    policy = chatml.encode(turn[0]["content"]) + [chatml.eos_id]  # the policy stops at <|im_end|>
    episode = prompt + policy + render_observation(chatml, tool, after_stop=True)
    assert episode == chatml.apply_chat_template(conversation + turn + tool, add_generation_prompt=True)
    assert glue(chatml) == chatml.encode("\n")
    # by hand: the observation's text
    assert chatml.decode(render_observation(chatml, tool), skip_special=False) == (
        "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n")
    assert render_observation(chatml, tool, after_stop=False)[0] == chatml.encode("<|im_start|>")[0]
    tok = CharTokenizer()  # no glue: "assistant: ...<eos>" then the next message
    assert glue(tok) == [] and render_observation(tok, [{"role": "user", "content": "ok"}]) == tok.encode(
        "user: ok\nassistant: ")


def test_tools_are_described_by_a_template_that_reads_them_else_by_the_plain_one(tmp_path):
    from megalign.envs.tools import calculator, tools_system_prompt

    user = [{"role": "user", "content": "hi"}]
    tok = CharTokenizer()  # its template does not read tools: the plain template in a system message
    assert first_observation_ids(tok, user, [calculator]) == tok.apply_chat_template(
        [{"role": "system", "content": tools_system_prompt([calculator])}] + user)
    reads = ("{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}"
             "<|im_end|>\n{% endif %}" + CHATML)
    path = save_char_level_hf_tokenizer(tmp_path, ["<unk>", "<|im_start|>", "<|im_end|>"], string.printable, reads,
                                        eos_token="<|im_end|>")
    hf = HFTokenizer(path)
    assert hf.decode(first_observation_ids(hf, user, [calculator]), skip_special=False) == (
        "<|im_start|>system\nTOOLS:calculator;<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert first_observation_ids(hf, user) == hf.apply_chat_template(user)  # no tools: the template alone


def test_text_and_id_observations_are_used_as_they_are():
    tok = CharTokenizer()
    assert render_observation(tok, "[5]") == tok.encode("[5]") and render_observation(tok, [7, 8]) == [7, 8]
    assert render_observation(tok, "") == [] and render_observation(tok, ()) == []
    with pytest.raises(ValueError, match="text, token ids or a list of"):
        render_observation(tok, [1, {"role": "user"}])


def test_the_base_class_finishes_with_zero():
    assert Environment().finish([], "max_turns") == 0.0
    with pytest.raises(NotImplementedError):
        Environment().reset({}, 0)


# ----- ToolEnv


def test_tool_env_answers_calls_counts_malformed_ones_and_scores_the_answer():
    reward = lambda prompt, response, answer, meta: float(str(answer) in response)  # noqa: E731
    env = ToolEnv(reward=reward)
    first = env.reset({"prompt": "What is 1234 * 567?", "answer": 699678}, seed=0)
    assert first == [{"role": "user", "content": "What is 1234 * 567?"}] and env.tools[0].name == "calculator"
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1234 * 567"}}</tool_call>'
    result = env.step(first, call)
    assert result == StepResult([{"role": "tool", "name": "calculator", "content": "699678"}], 0.0, False,
                                {"tool_calls": 1, "tool_errors": 0, **{f"tool_errors/{k}": 0 for k in
                                 ("malformed_json", "bad_format", "unknown_tool", "bad_arguments", "tool_error",
                                  "too_many_calls")}})
    bad = env.step(first, '<tool_call>{"name": "calculator", "arguments": {"expression": 1}}</tool_call><tool_call>{')
    assert not bad.done and [m["content"][:6] for m in bad.observation] == ["Error:", "Error:"]
    assert bad.info["tool_errors"] == 2 and bad.info["tool_errors/bad_arguments"] == 1
    assert bad.info["tool_errors/malformed_json"] == 1
    final = env.step(first, "The product is 699678.")
    assert final.done and final.reward == 1.0 and final.info["tool_calls"] == 0
    assert ToolEnv().step(first, "no call").reward == 0.0  # no reward function: 0
    with pytest.raises(ValueError, match="'messages' .* or 'prompt'"):
        ToolEnv().reset({"question": "x"}, 0)


# ----- the simulated user (RLVER shape)


@pytest.mark.parametrize("turn, parts", [
    ("<think>a</think>hello", ("a", "hello")),
    ("  <think>\nplan\n</think>\n answer: 3 ", ("\nplan\n", "answer: 3")),
    ("hello", None),                                   # no thinking
    ("<think>a</think>   ", None),                     # nothing said
    ("<think>a</think>hi <think>b</think>", None),     # a second think block
    ("<think>a<think>b</think>hi", None),              # nested
    ("<think>a", None),                                # never closed
])
def test_think_then_say_format(turn, parts):
    assert split_think_say(turn) == parts


def test_a_dialogue_that_ends_early_at_zero():
    user = ArithmeticUser()
    first = user.reset({"numbers": [12, 7, 5], "op": "+"}, seed=3)
    assert first == [{"role": "user", "content": "Add up my numbers; I will tell you one at a time. First: 12."}]
    r = user.step(first, "<think>need the rest</think>Sure, what is the next number?")
    assert (user.score, r.done, r.reward) == (55, False, 0.0)          # 50 + 5
    assert r.observation == [{"role": "user", "content": "Next: 7."}]
    r = user.step(first, "<think>12+7</think>So far, answer: 19")
    assert (user.score, r.done, r.info["premature_answers"]) == (35, False, 1)  # 55 - 20
    assert r.observation[0]["content"] == "Wait, there is more. Last: 5."
    r = user.step(first, "<think>answer: 24</think>Let me think about it.")  # the thought is hidden from the user
    assert (user.score, r.done) == (25, False)                          # 35 - 10: no answer seen
    assert r.observation[0]["content"] == "Just tell me the answer."
    r = user.step(first, "<think>oops</think>answer: 23")
    assert (user.score, r.done, r.reward, r.observation) == (0, True, 0.0, ())  # 25 - 30 -> 0: the dialogue ends
    assert user.scores == [50, 55, 35, 25, 0]


def test_a_solved_dialogue_scores_the_final_emotion():
    user = ArithmeticUser(initial_score=60)
    first = user.reset({"numbers": [3, 4], "op": "*"}, seed=0)
    assert first[0]["content"].startswith("Multiply my numbers")
    r = user.step(first, "<think>x</think>Go on.")
    assert r.observation[0]["content"] == "Last: 4."
    r = user.step(first, "<think>3*4=12</think>The answer: 12. Answer = 12")
    assert (user.score, r.done, r.info["solved"]) == (100, True, 1)     # 65 + 40, clipped at 100
    assert r.reward == 1.0
    user.reset({"numbers": [3, 4], "op": "*"}, seed=0)
    user.step(first, "<think>x</think>Go on.")
    r = user.step(first, "<think>x</think>answer: 13")
    assert (user.score, r.done) == (35, False) and user.finish(first, "max_turns") == 0.35  # truncated: e_t / 100


def test_a_format_violation_scores_zero():
    user = ArithmeticUser()
    first = user.reset({"numbers": [3], "op": "+"}, seed=0)
    assert first[0]["content"] == "Add up my numbers. The only one: 3."
    r = user.step(first, "answer: 3")  # right answer, but no thinking block
    assert (r.done, r.reward, r.info["format_errors"], r.info["format_ok"]) == (True, 0.0, 1, 0)


def test_the_row_fields_may_come_as_a_trainer_row_metadata():
    user = ArithmeticUser()  # the trainer passes {prompt, answer, metadata: the row's other columns}
    first = user.reset({"prompt": "ignored", "answer": 7, "metadata": {"numbers": [3, 4], "op": "+"}}, seed=0)
    assert first[0]["content"].endswith("First: 3.") and user.goal == 7


@pytest.mark.parametrize("turn, answer, expected", [("<think>3+4=7</think>answer: 7", 7, 1.0),
                                                    ("<think>answer: 7</think>I think 8. answer: 8", 7, 0.0),
                                                    ("<think>x</think>answer: 5, no, answer = 7", "7", 1.0),
                                                    ("answer: 7", 7, 0.0), ("<think>x</think>seven", 7, 0.0)])
def test_answer_accuracy_reads_the_last_visible_answer(turn, answer, expected):
    assert answer_accuracy("p", turn, answer, {}) == expected


@pytest.mark.parametrize("row, says", [({"numbers": []}, "non-empty list of integers"),
                                       ({"numbers": [1, True]}, "non-empty list of integers"),
                                       ({"numbers": [1], "op": "/"}, "'op' must be one of")])
def test_bad_rows_are_refused(row, says):
    with pytest.raises(ValueError, match=says):
        ArithmeticUser().reset(row, 0)
