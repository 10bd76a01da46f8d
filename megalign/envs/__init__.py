"""Environments for multi-turn rollouts (issue 28) and what they use.

- `tools`: the tool registry (`Tool`, `@tool`, `ToolRegistry`), the tools prompt (`render_chat`: the
  tokenizer's template when it reads `tools`, else a documented plain template), the Hermes / Qwen
  `<tool_call>` parser whose errors become messages the policy sees (counted by kind), tool messages,
  and the built-in `calculator` and `python_tool` (code run in `megalign.sandbox`).
- `base`: the environment interface (`Environment.reset(row, seed)` / `step(conversation, turn)` /
  `finish`, `StepResult`), `load_env_class("module:Class")`, and how observations become token ids.
- `tool_env`: `ToolEnv`, tool calls over several turns until an answer.
- `user_sim`: `ArithmeticUser`, a simulated user in RLVER's shape (emotion score, think-then-say format).

Episodes run on the training weights in `megalign.rollout.multiturn`.

The code sandbox itself is `megalign.sandbox`; the `code_tests` reward is `megalign.rewards.code_tests`.
Submodules are imported directly (`from megalign.envs.tools import ToolRegistry`).
"""
