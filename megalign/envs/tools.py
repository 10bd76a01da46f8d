"""Tool calls for multi-turn rollouts: a registry of Python functions with JSON-schema descriptions, the prompt
that shows them to the policy, the Hermes / Qwen `<tool_call>` parser and the tool messages that answer.

Design choices:

- A `Tool` is `(name, description, parameters, fn)` with `parameters` a JSON schema of an object (the
  OpenAI / HF "function" shape); `@tool` builds one from a function's type hints and its Google-style
  docstring (`transformers.utils.get_json_schema`, the helper HF chat templates are written against).
- Rendering (`render_chat`): a tokenizer whose chat template reads `tools` (Qwen2.5, Hermes, Llama 3.1,
  ...) gets them through `apply_chat_template(messages, tools=...)`, so the policy sees the exact text it
  was trained with; any other template (or none) gets `tools_system_prompt` prepended to the system
  message, the plain template below (Qwen2.5's wording, so both paths ask for the same format):

      # Tools

      You may call one or more functions to assist with the user query.

      You are provided with function signatures within <tools></tools> XML tags:
      <tools>
      {one JSON schema per line}
      </tools>

      For each function call, return a json object with function name and arguments within
      <tool_call></tool_call> XML tags:
      <tool_call>
      {"name": <function-name>, "arguments": <args-json-object>}
      </tool_call>

- Parsing (`ToolRegistry.parse`): every `<tool_call>...</tool_call>` in a turn is one call, in order; a
  `<tool_call>` left open at the end of the turn is a call too (malformed). A call that cannot run is
  answered with an error message the policy sees, counted by kind (ERROR_KINDS), never raised:
  `malformed_json` (not JSON, or an unclosed tag), `bad_format` (not `{"name": str, "arguments": object}`;
  arguments given as a JSON string holding an object are accepted, as OpenAI emits them), `unknown_tool`,
  `bad_arguments` (missing required, unexpected, or of the wrong JSON type / not in `enum`: the subset of
  JSON schema tool descriptions use), `tool_error` (the function raised). `too_many_calls` answers the
  calls past `max_calls_per_turn`.
- Results (`tool_message`): `{"role": "tool", "name": ..., "content": ...}`, the message HF chat templates
  render as a tool response; values that are not strings are JSON-encoded.

Built-in tools: `calculator` (arithmetic on an AST whitelist: numbers, + - * / // % **, unary +/-,
parentheses; bounded exponents and magnitudes; nothing is evaluated as Python) and `python_tool(sandbox)`
(runs code in `megalign.sandbox`, answers its stdout, and for a failed run its status and stderr's tail).
"""
from __future__ import annotations

import ast
import collections
import dataclasses
import json
import math
import operator
import re
from typing import Any, Callable, Mapping, Optional, Sequence

ERROR_KINDS = ("malformed_json", "bad_format", "unknown_tool", "bad_arguments", "tool_error", "too_many_calls")
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "object": (dict,),
               "array": (list,), "null": (type(None),)}


@dataclasses.dataclass(frozen=True)
class Tool:
    """A callable the policy may call: `fn(**arguments)` with arguments matching `parameters` (a JSON schema
    with type "object")."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    fn: Callable[..., Any]

    def __post_init__(self):
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", self.name or ""):
            raise ValueError(f"tool name {self.name!r} must be an identifier (letters, digits, _ . -)")
        if not isinstance(self.parameters, Mapping) or self.parameters.get("type") != "object":
            raise ValueError(f"tool {self.name!r}: parameters must be a JSON schema with type 'object', got {self.parameters!r}")
        if not callable(self.fn):
            raise ValueError(f"tool {self.name!r}: fn must be callable")

    def schema(self) -> dict:
        """The function description chat templates take (`tools=[...]`)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": dict(self.parameters)}}


def tool(fn: Callable) -> Tool:
    """`@tool` on a function with type hints and a Google-style docstring (an `Args:` line per parameter)."""
    from transformers.utils import get_json_schema

    described = get_json_schema(fn)["function"]
    return Tool(described["name"], described.get("description", ""), described["parameters"], fn)


@dataclasses.dataclass
class ToolCall:
    """One parsed call: `name` and `arguments` when it can run, else `error` (a kind of ERROR_KINDS) and
    `message` (what the policy is told)."""

    name: Optional[str]
    arguments: Optional[dict]
    error: Optional[str] = None
    message: str = ""


def _check_value(value: Any, schema: Mapping[str, Any], where: str) -> Optional[str]:
    """Why `value` does not fit `schema` (type, enum, nested properties / items), or None."""
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind else []
    if kinds and not any(isinstance(value, _JSON_TYPES.get(k, ())) and not (k in ("integer", "number") and isinstance(value, bool))
                         for k in kinds):
        return f"{where} must be of type {' or '.join(kinds)}, got {json.dumps(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where} must be one of {json.dumps(schema['enum'])}, got {json.dumps(value)}"
    if isinstance(value, dict) and "properties" in schema:
        return _check_object(value, schema, where)
    if isinstance(value, list) and "items" in schema:
        return next((e for i, v in enumerate(value) if (e := _check_value(v, schema["items"], f"{where}[{i}]"))), None)
    return None


def _check_object(args: Mapping[str, Any], schema: Mapping[str, Any], where: str = "argument") -> Optional[str]:
    props = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in args]
    if missing:
        return f"missing required {where}(s): {', '.join(missing)}"
    unexpected = [k for k in args if k not in props]
    if unexpected:
        return f"unexpected {where}(s): {', '.join(unexpected)}; expected: {', '.join(props) or 'none'}"
    return next((e for k, v in args.items() if (e := _check_value(v, props[k], f"{where} {k!r}"))), None)


class ToolRegistry:
    """Tools by name; parses a policy turn's calls, runs them and answers with tool messages, counting the
    errors by kind (`metrics()`)."""

    def __init__(self, tools: Sequence[Tool] = (), max_calls_per_turn: int = 8):
        if not isinstance(max_calls_per_turn, int) or max_calls_per_turn < 1:
            raise ValueError(f"max_calls_per_turn must be a positive integer, got {max_calls_per_turn!r}")
        self.tools: dict[str, Tool] = {}
        self.max_calls_per_turn = max_calls_per_turn
        self.calls = 0
        self.errors: collections.Counter = collections.Counter()
        for t in tools:
            self.register(t)

    def register(self, t: Tool) -> Tool:
        if not isinstance(t, Tool):
            raise TypeError(f"register takes a Tool, got {type(t).__name__}")
        if t.name in self.tools:
            raise ValueError(f"a tool named {t.name!r} is already registered")
        self.tools[t.name] = t
        return t

    def schemas(self) -> list[dict]:
        return [t.schema() for t in self.tools.values()]

    def _parse_one(self, body: str) -> ToolCall:
        try:
            call = json.loads(body)
        except json.JSONDecodeError as exc:
            return ToolCall(None, None, "malformed_json", f"Error: the tool call is not valid JSON ({exc.msg} at char {exc.pos}).")
        args = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(args, dict):
            return ToolCall(None, None, "bad_format",
                            'Error: a tool call must be {"name": <function-name>, "arguments": <args-json-object>}.')
        name = call["name"]
        if name not in self.tools:
            return ToolCall(name, args, "unknown_tool",
                            f"Error: unknown tool {name!r}; available: {', '.join(self.tools) or 'none'}.")
        problem = _check_object(args, self.tools[name].parameters)
        if problem:
            return ToolCall(name, args, "bad_arguments", f"Error: {name}: {problem}.")
        return ToolCall(name, args)

    def parse(self, text: str) -> list[ToolCall]:
        """The calls in one policy turn, in order (an unclosed trailing `<tool_call>` is a malformed one)."""
        calls = [self._parse_one(m.group(1).strip()) for m in TOOL_CALL.finditer(text)]
        tail = text[text.rfind("</tool_call>") + len("</tool_call>"):] if calls else text
        if "<tool_call>" in tail:
            calls.append(ToolCall(None, None, "malformed_json", "Error: <tool_call> is not closed by </tool_call>."))
        for extra in calls[self.max_calls_per_turn:]:
            extra.error, extra.message = "too_many_calls", f"Error: at most {self.max_calls_per_turn} tool calls per turn."
        return calls

    def run(self, text: str) -> list[dict]:
        """Parse `text`, run each valid call, and answer every call with a tool message (the result, or the
        error the policy sees). Never raises for anything the policy wrote."""
        messages = []
        for call in self.parse(text):
            self.calls += 1
            if call.error is None:
                try:
                    result = self.tools[call.name].fn(**call.arguments)
                    messages.append(tool_message(call.name, result))
                    continue
                except Exception as exc:
                    call.error, call.message = "tool_error", f"Error: {call.name} failed: {type(exc).__name__}: {exc}"
            self.errors[call.error] += 1
            messages.append(tool_message(call.name or "error", call.message))
        return messages

    def metrics(self) -> dict[str, float]:
        """Calls so far and errors by kind (`tools/calls`, `tools/errors/<kind>`)."""
        out = {"tools/calls": float(self.calls)}
        out.update({f"tools/errors/{kind}": float(self.errors[kind]) for kind in ERROR_KINDS})
        return out


def tool_message(name: str, content: Any) -> dict:
    """A tool result as a chat message; non-string results are JSON-encoded."""
    return {"role": "tool", "name": name, "content": content if isinstance(content, str) else json.dumps(content)}


def tools_system_prompt(tools: Sequence[Tool], system: str = "") -> str:
    """`system` followed by the plain tools template (module docstring), for templates that do not read `tools`."""
    block = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t.schema()) for t in tools))
    return f"{system}\n\n{block}" if system else block


def template_reads_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template uses the `tools` variable (HF templates that support tool use do)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and re.search(r"\btools\b", template) is not None


def render_chat(messages: Sequence[Mapping[str, Any]], tools: Sequence[Tool], tokenizer=None,
                add_generation_prompt: bool = True) -> Any:
    """The prompt text with `tools` described: through the tokenizer's template when it reads `tools`, else
    with `tools_system_prompt` merged into the first system message (one is added when there is none);
    without a tokenizer, the messages with that system message (for a caller's own template)."""
    if tokenizer is not None and template_reads_tools(tokenizer):
        return tokenizer.apply_chat_template(list(messages), tools=[t.schema() for t in tools], tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    messages = [dict(m) for m in messages]
    if messages and messages[0].get("role") == "system":
        messages[0]["content"] = tools_system_prompt(tools, messages[0]["content"])
    else:
        messages.insert(0, {"role": "system", "content": tools_system_prompt(tools)})
    if tokenizer is None:
        return messages
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_DIGITS = 1000
"""The calculator refuses results (and powers whose result would be) longer than this many digits."""


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(left) > 1 and right * math.log10(abs(left)) > MAX_DIGITS:
            raise ValueError(f"the power has more than {MAX_DIGITS} digits")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, complex):
            raise ValueError("the result is not a real number")
        if isinstance(value, int) and abs(value) >= 10 ** MAX_DIGITS:
            raise ValueError(f"the result has more than {MAX_DIGITS} digits")
        return value
    what = type(getattr(node, "op", node)).__name__
    raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, got {what}")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(1234 * 567) - 89"
    """
    if len(expression) > 1000:
        raise ValueError("expression is longer than 1000 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {exc.msg}") from None
    value = _evaluate(tree)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("the result is not finite")
        return repr(int(value)) if value.is_integer() and abs(value) < 2 ** 53 else repr(value)
    return str(value)


calculator = Tool("calculator", "Evaluate an arithmetic expression: numbers with + - * / // % ** and parentheses.",
                  {"type": "object",
                   "properties": {"expression": {"type": "string", "description": 'e.g. "(1234 * 567) - 89"'}},
                   "required": ["expression"]},
                  calculate)


def python_tool(sandbox=None) -> Tool:
    """A `python` tool running code in `sandbox` (default `Sandbox()`): the answer is its stdout, and for a
    failed run also `[status]` (error, timeout, cpu_limit, ...) and the last five lines of stderr."""
    from megalign.sandbox import Sandbox

    box = sandbox or Sandbox()

    def run_python(code: str) -> str:
        outcome = box.run(code)
        if outcome.status == "ok":
            return outcome.stdout
        stderr_tail = "\n".join(outcome.stderr.rstrip().splitlines()[-5:])
        return f"{outcome.stdout}[{outcome.status}]\n{stderr_tail}".strip()

    return Tool("python", "Run a Python program (standard library only, no network, no files outside its own empty "
                "directory) and return what it prints.",
                {"type": "object", "properties": {"code": {"type": "string", "description": "the program's source"}},
                 "required": ["code"]},
                run_python)
