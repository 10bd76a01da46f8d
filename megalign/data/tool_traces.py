"""Tool-using SFT traces for the embedded `tools` demonstration (issue 28): for each training problem of the
arithmetic task, the conversation the policy should have with `ToolEnv` (`megalign.envs.tool_env`):

    user       "123*456="
    assistant  '<tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call>'
    tool       "56088"                      (ToolEnv's own answer to that call)
    assistant  "\\boxed{56088}"

Design choices:

- Built by driving the real environment: `ToolEnv.reset` gives the first messages, `ToolEnv.step` on the call
  turn gives the tool message (the calculator's result, rendered by `tool_message`), and `step` on the answer
  turn must end the episode with reward 1 (`answer_reward`: `math_accuracy`). Nothing of the environment's side is written by
  hand, so a change in ToolEnv's messages changes the traces with it. A call that ToolEnv answers with an
  error, or an answer it does not score 1, is a `ValueError` naming the problem.
- Loss mask: the rows are `{"messages": [...]}` chats, which the SFT loader (`megalign.data.sft.encode_messages`)
  trains on the assistant turns only (each turn's content and its closing eos): the prompt, the tool message
  and the template's role headers are holes, as in the GRPO episodes.
- Byte-identity with the rollout: a GRPO episode (`megalign.rollout.multiturn`) is the first observation's ids
  (`first_observation_ids`), each policy turn's ids, and each observation rendered after it
  (`render_observation`, with the template's glue when the turn ended with eos). `episode_ids` rebuilds that
  sequence from a trace and `write_tool_traces` checks that it equals the chat template's rendering of the
  whole trace, which is what the SFT loader trains on. It does when every policy turn ends with the
  tokenizer's eos, i.e. GRPO runs without a stop string on '</tool_call>' (a stop string ends the call turn
  before its eos, and the episode then lacks the eos the template writes there): `launch/run_embedded.sh tools`
  sets `rollout.env.stop_strings=[]` for that reason, so the policy ends its call turn where the template does.
- The split is `make_splits(arith)` with the GRPO example's task (3-digit x 3-digit products, 5000 drawn, 1000
  held out): the SFT traces cover the GRPO training prompts, never a held-out one.

Files (`out_dir`): `tool_traces_train.jsonl` (the chats, with `answer`), `arith_train.jsonl` and
`arith_held_out.jsonl` (prompt rows, `arith.write_jsonl`: the prompts of both GRPO runs and of the comparison).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional, Sequence

from megalign.config import atomic_write_text, option
from megalign.data.arith import ArithProblem, ArithTaskConfig, make_splits, write_jsonl

CALL_TEMPLATE = "<tool_call>{call}</tool_call>"


def _default_task() -> ArithTaskConfig:
    return ArithTaskConfig(max_operand=999, ops=["*"], num_problems=5000)


def answer_reward(prompt: str, response: str, answer, metadata) -> float:
    """ToolEnv's reward signature around `math_accuracy` (builtin checker): 1.0 for the right `\\boxed{N}`."""
    from megalign.rewards.math import math_accuracy

    return math_accuracy(response, answer, "builtin")


def call_turn(problem: ArithProblem) -> str:
    """The policy's first turn: one `calculator` call on the problem's expression (the schema's one argument)."""
    expression = problem.prompt.rstrip("=")
    return CALL_TEMPLATE.format(call=json.dumps({"name": "calculator", "arguments": {"expression": expression}}))


def trace_messages(problem: ArithProblem, env=None) -> list[dict]:
    """The whole conversation of one problem with `env` (default: a fresh `ToolEnv` scored by math_accuracy),
    built by driving it (module doc); ValueError naming the problem if the env does not answer as expected."""
    from megalign.envs.tool_env import ToolEnv

    env = env or ToolEnv(reward=answer_reward, describe_tools=False)
    where = f"problem {problem.prompt!r}"
    conversation = env.reset({"prompt": problem.prompt, "answer": problem.answer}, seed=0)
    call = call_turn(problem)
    result = env.step([dict(m) for m in conversation], call)
    if result.done or result.info.get("tool_errors") or not result.observation:
        raise ValueError(f"{where}: ToolEnv did not answer the calculator call {call!r} with a result "
                         f"(done={result.done}, info={result.info})")
    conversation = conversation + [{"role": "assistant", "content": call}] + [dict(m) for m in result.observation]
    tool_answer = conversation[-1]["content"]
    if tool_answer != str(problem.answer):
        raise ValueError(f"{where}: the calculator answered {tool_answer!r}, expected {problem.answer}")
    final = problem.response
    done = env.step([dict(m) for m in conversation], final)
    if not done.done or done.reward != 1.0:
        raise ValueError(f"{where}: ToolEnv did not end the episode on {final!r} with reward 1 "
                         f"(done={done.done}, reward={done.reward})")
    return conversation + [{"role": "assistant", "content": final}]


def episode_ids(messages: Sequence[dict], tokenizer, tools: Sequence = ()) -> tuple[list[int], list[bool]]:
    """(ids, trained mask) of `messages` laid out as the multi-turn rollout lays out an episode whose policy turns
    each end with eos: first observation (`first_observation_ids`, with `tools` described), then per assistant
    turn its ids + eos (trained), then the observations after it (`render_observation`, not trained)."""
    from megalign.envs.base import first_observation_ids, render_observation

    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns or turns[0] == 0:
        raise ValueError("a trace needs a first observation and at least one assistant turn")
    ids = list(first_observation_ids(tokenizer, [dict(m) for m in messages[:turns[0]]], tools))
    mask = [False] * len(ids)
    for k, i in enumerate(turns):
        turn = tokenizer.encode(messages[i]["content"]) + [tokenizer.eos_id]
        end = turns[k + 1] if k + 1 < len(turns) else len(messages)
        observation = render_observation(tokenizer, [dict(m) for m in messages[i + 1:end]], after_stop=True)
        ids += turn + observation
        mask += [True] * len(turn) + [False] * len(observation)
    return ids, mask


def check_byte_identical(messages: Sequence[dict], tokenizer) -> None:
    """ValueError unless the chat template's rendering of the whole trace (what SFT trains on) equals the rollout's
    episode ids (`episode_ids`) with the same trained tokens (module doc)."""
    from megalign.data.sft import encode_messages

    ids, mask = episode_ids(messages, tokenizer)
    example = encode_messages(list(messages), tokenizer)
    if example.ids != ids or example.loss_mask != mask:
        first = next((j for j, (a, b) in enumerate(zip(example.ids, ids)) if a != b), min(len(ids), len(example.ids)))
        raise ValueError(f"the chat template of {tokenizer.name} renders the trace differently from the multi-turn "
                         f"rollout (ids differ from position {first}), so SFT would train on other text than GRPO's "
                         f"episodes")


@dataclasses.dataclass
class ToolTracesConfig:
    """Where and for which task `write_tool_traces` writes (module doc)."""

    out_dir: str = option("runs/tool_traces", doc="folder of tool_traces_train.jsonl and the prompt files")
    arith: ArithTaskConfig = option(_default_task(), doc="the task; examples/grpo_tools_arith.yaml's data.arith")
    max_traces: Optional[int] = option(None, doc="traces from the first N training problems; null: all")
    tokenizer_path: Optional[str] = option(None, doc="HF folder of the policy's tokenizer the byte-identity check "
                                                     "uses; null: the built-in character tokenizer")
    device: str = option("cpu", doc="the launch's process group (the files are written on the host either way)")

    def __post_init__(self):
        if self.max_traces is not None and self.max_traces < 1:
            raise ValueError(f"max_traces must be >= 1 or null, got {self.max_traces}")
        if self.tokenizer_path is not None and not os.path.isdir(self.tokenizer_path):
            raise ValueError(f"tokenizer_path={self.tokenizer_path!r} is not a folder")


def write_tool_traces(cfg: ToolTracesConfig) -> dict[str, int]:
    """Write the traces and prompt files (module doc) and return the row counts. Every trace is checked against
    ToolEnv (`trace_messages`) and against the rollout's layout (`check_byte_identical`)."""
    from megalign.data.tokenizer import CharTokenizer, HFTokenizer

    tokenizer = CharTokenizer() if cfg.tokenizer_path is None else HFTokenizer(cfg.tokenizer_path)
    train, held_out = make_splits(cfg.arith)
    problems = train if cfg.max_traces is None else train[:cfg.max_traces]
    rows = []
    for problem in problems:
        messages = trace_messages(problem)
        check_byte_identical(messages, tokenizer)
        rows.append({"messages": messages, "answer": problem.answer})
    os.makedirs(cfg.out_dir, exist_ok=True)
    atomic_write_text(os.path.join(cfg.out_dir, "tool_traces_train.jsonl"),
                      "".join(json.dumps(row) + "\n" for row in rows))
    write_jsonl(train, os.path.join(cfg.out_dir, "arith_train.jsonl"))
    write_jsonl(held_out, os.path.join(cfg.out_dir, "arith_held_out.jsonl"))
    counts = {"traces": len(rows), "train_prompts": len(train), "held_out_prompts": len(held_out)}
    print(json.dumps({"out_dir": cfg.out_dir, **counts}), flush=True)
    return counts
