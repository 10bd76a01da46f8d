"""Tool-using SFT traces (`megalign.data.tool_traces`, issue 28's `tools` demonstration) and the table of
`megalign.tools.tool_compare`.

References: a trace written out by hand for one problem (messages, the character ids with their `<eos>` and role
headers, which tokens train), the products a * b computed here from the prompt text, ToolEnv's own call parser,
and a table of hand-picked accuracies.
"""
import json
import os

import pytest
import yaml

from megalign.data import ArithTaskConfig, CharTokenizer, make_splits
from megalign.data.arith import ArithProblem
from megalign.data.sft import encode_messages
from megalign.data.tool_traces import (ToolTracesConfig, check_byte_identical, episode_ids, trace_messages,
                                       write_tool_traces)
from megalign.envs.tool_env import ToolEnv
from megalign.envs.tools import Tool, ToolRegistry, calculator
from megalign.rewards.math import math_accuracy
from megalign.tools.tool_compare import comparison_lines

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "31*239"}}</tool_call>'


def test_one_trace_byte_for_byte():
    messages = trace_messages(ArithProblem(31, "*", 239))
    assert messages == [{"role": "user", "content": "31*239="},
                        {"role": "assistant", "content": CALL},
                        {"role": "tool", "name": "calculator", "content": "7409"},
                        {"role": "assistant", "content": "\\boxed{7409}"}]
    tok = CharTokenizer()
    pieces = [("<bos>", False), ("user: 31*239=\nassistant: ", False), (CALL, True), ("<eos>", True),
              ("tool: 7409\nassistant: ", False), ("\\boxed{7409}", True), ("<eos>", True)]
    want_ids, want_mask = [], []
    for text, trained in pieces:
        ids = {"<bos>": [tok.bos_id], "<eos>": [tok.eos_id]}.get(text) or tok.encode(text)
        want_ids += ids
        want_mask += [trained] * len(ids)
    ids, mask = episode_ids(messages, tok)
    assert (ids, mask) == (want_ids, want_mask)
    example = encode_messages(messages, tok)  # what the SFT trainer trains on
    assert (example.ids, example.loss_mask) == (want_ids, want_mask)
    assert len(ids) == 1 + 25 + len(CALL) + 1 + 22 + 12 + 1


def test_written_traces_parse_and_answer_right(tmp_path):
    task = ArithTaskConfig(max_operand=999, ops=["*"], num_problems=60)
    counts = write_tool_traces(ToolTracesConfig(out_dir=str(tmp_path), arith=task, max_traces=40))
    assert counts == {"traces": 40, "train_prompts": 48, "held_out_prompts": 12}
    rows = [json.loads(line) for line in open(tmp_path / "tool_traces_train.jsonl")]
    train, held_out = make_splits(task)
    assert [r["messages"][0]["content"] for r in rows] == [p.prompt for p in train[:40]]
    assert not {r["messages"][0]["content"] for r in rows} & {p.prompt for p in held_out}
    registry = ToolRegistry([calculator])
    for row in rows:
        user, call, result, answer = row["messages"]
        a, b = (int(x) for x in user["content"][:-1].split("*"))
        assert row["answer"] == a * b
        [parsed] = registry.parse(call["content"])
        assert parsed.error is None and parsed.name == "calculator"
        assert parsed.arguments == {"expression": f"{a}*{b}"}
        assert result == {"role": "tool", "name": "calculator", "content": str(a * b)}
        assert math_accuracy(answer["content"], a * b, "builtin") == 1.0 and answer["content"] == f"\\boxed{{{a * b}}}"
    held = [json.loads(line) for line in open(tmp_path / "arith_held_out.jsonl")]
    assert [r["prompt"] for r in held] == [p.prompt for p in held_out]


def test_the_traces_match_the_grpo_example_task():
    with open(os.path.join(ROOT, "examples", "grpo_tools_arith.yaml")) as f:
        grpo = yaml.safe_load(f)
    assert ArithTaskConfig(**grpo["data"]["arith"]) == ToolTracesConfig().arith
    assert grpo["rollout"]["env"]["kwargs"]["describe_tools"] is False  # the traces describe no tools either


def test_an_env_that_cannot_answer_the_call_names_the_problem():
    other = Tool("other", "not the calculator", {"type": "object", "properties": {}}, lambda: "x")
    with pytest.raises(ValueError, match=r"problem '2\*3=': ToolEnv did not answer the calculator call"):
        trace_messages(ArithProblem(2, "*", 3), ToolEnv(tools=[other], describe_tools=False))


def test_a_template_that_differs_from_the_rollout_is_refused():
    class NoEosAfterAssistant(CharTokenizer):  # ends assistant turns with a newline: the rollout's turns end at eos
        def apply_chat_template(self, messages, add_generation_prompt=True):
            ids = super().apply_chat_template(messages, add_generation_prompt)
            return [self.encode("\n")[0] if i == self.eos_id else i for i in ids]

    with pytest.raises(ValueError, match="renders the trace differently from the multi-turn rollout"):
        check_byte_identical(trace_messages(ArithProblem(2, "*", 3)), NoEosAfterAssistant())


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="max_traces"):
        ToolTracesConfig(max_traces=0)
    with pytest.raises(ValueError, match="tokenizer_path"):
        ToolTracesConfig(tokenizer_path="/nonexistent/folder")


def test_comparison_table_change_is_tools_minus_control():
    results = {"tools_before": {"accuracy": 0.40, "tool_called": 0.95, "tool_correct": 0.90},
               "tools_after": {"accuracy": 0.85, "tool_called": 1.0, "tool_correct": 0.99},
               "plain_before": {"accuracy": 0.01}, "plain_after": {"accuracy": 0.03}}
    lines = comparison_lines(results)
    assert lines[-1] == "change  +82.0 points"  # 85% - 3%
    assert "(+45.0 points)" in lines[2] and "correctly 99.0%" in lines[2]
    assert "(+2.0 points)" in lines[4]
