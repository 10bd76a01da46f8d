"""`ToolEnv`: the policy calls tools over several turns, then answers (issue 28).

Episode: `reset(row, seed)` gives the row's conversation (`row["messages"]`, or `row["prompt"]` as one user
message); the rollout describes the env's `tools` in the prompt (`megalign.envs.base.first_observation_ids`):
through the tokenizer's chat template when it reads `tools`, else by the documented plain template in the
system message (`megalign.envs.tools.tools_system_prompt`; Qwen2.5's wording, so both read alike).
Each policy turn is parsed for Hermes / Qwen `<tool_call>{json}</tool_call>` calls (`ToolRegistry.run`): a turn with calls is answered with one tool message per call (the result, or for a
malformed call the error message the policy sees: never a crash), rendered through the chat template as the
observation; a turn without a call is the final answer and ends the episode, scored by `reward` (a user reward
function `(prompt, response, answer, metadata) -> float`, or its `"module:function"` spec; none: 0).

`info` per turn: `tool_calls`, `tool_errors` and `tool_errors/<kind>` (ERROR_KINDS), summed by the rollout into
`env/...` metrics, so the fraction of episodes whose calls parse and run is logged per step.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence, Union

from .base import Environment, StepResult
from .tools import ERROR_KINDS, Tool, ToolRegistry


class ToolEnv(Environment):
    """Tool calls until an answer without one (module doc). `tools`: the `Tool`s offered (default: `calculator`);
    `describe_tools=False` leaves their description out of the prompt (a policy taught the calls by SFT traces, or a
    short-context model the JSON schemas would not fit), the calls still run."""

    def __init__(self, tools: Optional[Sequence[Tool]] = None, reward: Union[None, str, Callable] = None,
                 max_calls_per_turn: int = 8, system: str = "", describe_tools: bool = True):
        from .tools import calculator

        self.registry = ToolRegistry(list(tools) if tools is not None else [calculator], max_calls_per_turn)
        self.tools = list(self.registry.tools.values()) if describe_tools else []
        if isinstance(reward, str):
            from megalign.rewards.user import load_function
            reward = load_function(reward)
        if reward is not None and not callable(reward):
            raise ValueError(f"reward must be a reward function or its 'module:function' spec, "
                             f"got {type(reward).__name__}")
        self.reward_fn = reward
        self.system = system
        self.row: Mapping[str, Any] = {}

    def reset(self, row: Mapping[str, Any], seed: int) -> list[dict]:
        if not isinstance(row, Mapping):
            raise ValueError(f"ToolEnv rows must be mappings with 'messages' or 'prompt', got {type(row).__name__}")
        if isinstance(row.get("messages"), (list, tuple)):
            messages = [dict(m) for m in row["messages"]]
        elif isinstance(row.get("prompt"), str):
            messages = [{"role": "user", "content": row["prompt"]}]
        else:
            raise ValueError(f"ToolEnv row needs 'messages' (a list) or 'prompt' (a string); it has {sorted(row)}")
        if self.system and not (messages and messages[0].get("role") == "system"):
            messages.insert(0, {"role": "system", "content": self.system})
        self.row = row
        return messages

    def step(self, conversation: list[dict], turn: str) -> StepResult:
        errors_before = dict(self.registry.errors)
        messages = self.registry.run(turn)
        new_errors = {k: self.registry.errors[k] - errors_before.get(k, 0) for k in ERROR_KINDS}
        info = {"tool_calls": len(messages), "tool_errors": sum(new_errors.values()),
                **{f"tool_errors/{k}": v for k, v in new_errors.items()}}
        if messages:
            return StepResult(messages, 0.0, False, info)
        reward = 0.0
        if self.reward_fn is not None:
            prompt = next((m["content"] for m in reversed(conversation) if m.get("role") == "user"), "")
            reward = float(self.reward_fn(prompt, turn, self.row.get("answer"), dict(self.row.get("metadata") or {})))
        return StepResult((), reward, True, info)
