"""Tool registry, prompt rendering and the `<tool_call>` parser against hand-built strings and hand-worked results."""
import json

import pytest
from data.hf_tok_fixtures import save_char_level_hf_tokenizer

from megalign.envs.tools import (ERROR_KINDS, TOOLS_PROMPT, Tool, ToolRegistry, calculate, calculator, python_tool,
                                 render_chat, tool, tool_message, tools_system_prompt)


def _registry(**kw):
    return ToolRegistry([calculator], **kw)


def test_two_calls_in_one_turn_are_run_in_order():
    turn = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1234 * 567"}}\n</tool_call>\n'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "(2 + 3) * 4"}}</tool_call>')
    reg = _registry()
    assert reg.run(turn) == [{"role": "tool", "name": "calculator", "content": "699678"},
                             {"role": "tool", "name": "calculator", "content": "20"}]
    assert reg.metrics()["tools/calls"] == 2 and sum(reg.errors.values()) == 0


def test_no_call_gives_no_messages():
    reg = _registry()
    assert reg.run("The answer is 42.") == [] and reg.calls == 0


def test_arguments_as_a_json_string_are_accepted():
    turn = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"7 // 2\\"}"}</tool_call>'
    assert _registry().run(turn)[0]["content"] == "3"


@pytest.mark.parametrize("body, kind, says", [
    ('{"name": "calculator", "arguments": {"expression": "1+1"', "malformed_json", "not valid JSON"),
    ("calculator(1+1)", "malformed_json", "not valid JSON"),
    ('["calculator", {"expression": "1"}]', "bad_format", '{"name": <function-name>'),
    ('{"name": 3, "arguments": {}}', "bad_format", '{"name": <function-name>'),
    ('{"name": "calculator", "arguments": [1]}', "bad_format", '{"name": <function-name>'),
    ('{"name": "search", "arguments": {"q": "x"}}', "unknown_tool", "unknown tool 'search'; available: calculator"),
    ('{"name": "calculator", "arguments": {}}', "bad_arguments", "missing required argument(s): expression"),
    ('{"name": "calculator", "arguments": {"expression": "1", "x": 2}}', "bad_arguments", "unexpected argument(s): x"),
    ('{"name": "calculator", "arguments": {"expression": 12}}', "bad_arguments",
     "argument 'expression' must be of type string, got 12"),
    ('{"name": "calculator", "arguments": {"expression": "1/0"}}', "tool_error", "ZeroDivisionError"),
    ('{"name": "calculator", "arguments": {"expression": "__import__(\'os\').system(\'ls\')"}}', "tool_error",
     "only numbers"),
])
def test_a_bad_call_becomes_an_error_message_counted_by_kind(body, kind, says):
    reg = _registry()
    messages = reg.run(f"ok <tool_call>{body}</tool_call>")
    assert len(messages) == 1 and messages[0]["role"] == "tool"
    assert messages[0]["content"].startswith("Error:") and says in messages[0]["content"]
    assert reg.errors == {kind: 1}
    assert reg.metrics()[f"tools/errors/{kind}"] == 1.0


def test_an_unclosed_call_is_malformed_and_earlier_calls_still_run():
    reg = _registry()
    messages = reg.run('<tool_call>{"name": "calculator", "arguments": {"expression": "2**10"}}</tool_call> then '
                       '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}')
    assert [m["content"] for m in messages] == ["1024", "Error: <tool_call> is not closed by </tool_call>."]
    assert reg.errors == {"malformed_json": 1}


def test_calls_past_the_limit_are_refused():
    reg = _registry(max_calls_per_turn=2)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
    messages = reg.run(call * 3)
    assert [m["content"] for m in messages] == ["2", "2", "Error: at most 2 tool calls per turn."]
    assert reg.errors == {"too_many_calls": 1}


def test_metrics_name_every_error_kind():
    assert set(_registry().metrics()) == {"tools/calls"} | {f"tools/errors/{k}" for k in ERROR_KINDS}


@pytest.mark.parametrize("expression, expected", [
    ("1234 * 567", "699678"), ("-(3 - 10) ** 2", "-49"), ("7 / 2", "3.5"), ("8 / 2", "4"), ("17 % 5", "2"),
    ("2 ** -1", "0.5"), ("10 // -3", "-4"), (" 0.1 + 0.2 ", "0.30000000000000004"),
])
def test_calculator_arithmetic(expression, expected):
    assert calculate(expression) == expected


@pytest.mark.parametrize("expression, says", [
    ("abs(-1)", "only numbers"), ("x + 1", "only numbers"), ("(1).real", "only numbers"), ("1 < 2", "only numbers"),
    ("'a' * 3", "only numbers"), ("9 ** 9999", "more than 1000 digits"), ("(10 ** 999) * 10", "more than 1000 digits"),
    ("(-8) ** 0.5", "not a real number"), ("1 +", "not an arithmetic expression"),
])
def test_calculator_refuses_anything_else(expression, says):
    with pytest.raises(ValueError, match=says):
        calculate(expression)


def test_tool_decorator_builds_the_schema_from_hints_and_docstring():
    @tool
    def weather(city: str, days: int = 1):
        """Forecast for a city.

        Args:
            city: the city's name
            days: how many days ahead
        """
        return {"city": city, "days": days}

    assert weather.schema() == {"type": "function", "function": {
        "name": "weather", "description": "Forecast for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city's name"},
                                                        "days": {"type": "integer", "description": "how many days ahead"}},
                       "required": ["city"]}}}
    reg = ToolRegistry([weather])
    assert reg.run('<tool_call>{"name": "weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>') == [
        {"role": "tool", "name": "weather", "content": '{"city": "Oslo", "days": 2}'}]
    assert reg.run('<tool_call>{"name": "weather", "arguments": {"city": "Oslo", "days": true}}</tool_call>')[0][
        "content"] == "Error: weather: argument 'days' must be of type integer, got true."


def test_bad_tool_definitions_are_named():
    with pytest.raises(ValueError, match="tool name"):
        Tool("two words", "", {"type": "object"}, print)
    with pytest.raises(ValueError, match="parameters"):
        Tool("t", "", {"type": "string"}, print)
    with pytest.raises(ValueError, match="already registered"):
        ToolRegistry([calculator, calculator])


def test_plain_prompt_without_a_tokenizer():
    messages = render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
                           [calculator])
    schema = ('{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic '
              'expression: numbers with + - * / // % ** and parentheses.", "parameters": {"type": "object", '
              '"properties": {"expression": {"type": "string", "description": "e.g. \\"(1234 * 567) - 89\\""}}, '
              '"required": ["expression"]}}}')
    assert messages == [{"role": "system", "content": "Be brief.\n\n# Tools\n\nYou may call one or more functions to "
                         "assist with the user query.\n\nYou are provided with function signatures within "
                         "<tools></tools> XML tags:\n<tools>\n" + schema + "\n</tools>\n\nFor each function call, "
                         "return a json object with function name and arguments within <tool_call></tool_call> XML "
                         'tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'},
                        {"role": "user", "content": "2+2?"}]
    assert render_chat([{"role": "user", "content": "hi"}], [calculator])[0] == {
        "role": "system", "content": tools_system_prompt([calculator])}


PLAIN = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
         "{% if add_generation_prompt %}<assistant>{% endif %}")
WITH_TOOLS = "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}" + PLAIN


def _tokenizer(tmp_path, template):
    from transformers import AutoTokenizer
    path = save_char_level_hf_tokenizer(tmp_path, ["<unk>"], "abc", template)
    return AutoTokenizer.from_pretrained(path)


def test_a_template_that_reads_tools_gets_them(tmp_path):
    text = render_chat([{"role": "user", "content": "hi"}], [calculator], _tokenizer(tmp_path, WITH_TOOLS))
    assert text == "TOOLS:calculator;<user>hi\n<assistant>"  # HF renders with trim_blocks: no newline after endfor


def test_a_template_without_tools_gets_the_plain_system_prompt(tmp_path):
    text = render_chat([{"role": "user", "content": "hi"}], [calculator], _tokenizer(tmp_path, PLAIN))
    assert text == "<system>" + TOOLS_PROMPT.format(tools=json.dumps(calculator.schema())) + "\n<user>hi\n<assistant>"


def test_tool_message_encodes_non_strings():
    assert tool_message("f", [1, 2]) == {"role": "tool", "name": "f", "content": "[1, 2]"}


def test_python_tool_runs_in_the_sandbox():
    from megalign.sandbox import Sandbox, unavailable_reason
    if unavailable_reason() is not None:
        pytest.skip(f"no sandbox here: {unavailable_reason()}")
    box = Sandbox(timeout_s=3, cpu_s=1, memory_mb=256)
    reg = ToolRegistry([python_tool(box)])
    call = '<tool_call>{{"name": "python", "arguments": {{"code": {}}}}}</tool_call>'
    ok, loop, crash = (reg.run(call.format(json.dumps(code)))[0]["content"] for code in
                       ("print(2 ** 10)", "while True: pass", "print('partial')\nraise KeyError('k')"))
    assert ok == "1024\n"
    assert loop == "[cpu_limit]"
    assert crash.startswith("partial\n[error]\n") and crash.endswith("KeyError: 'k'")
    box.close()
