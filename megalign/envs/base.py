"""The environment interface of multi-turn rollouts (issue 28): `reset(row, seed)` -> the first observation,
`step(conversation, turn)` -> the next observation, a per-turn reward and whether the episode is over.

Design choices:

- One environment object per episode (sample g of prompt p): the rollout builds it from a class named in the
  config (`"package.module:Class"` or `"path/to/file.py:Class"`, like user reward functions) with the config's
  keyword arguments (`env_factory(spec, kwargs)`: both checked at start-up, naming the spec), then calls
  `reset(row, seed)` once with the dataset row and a seed that depends only on (rollout seed, prompt key, g)
  (`megalign.rollout.multiturn`), so an episode is reproducible and a resumed run replays it. State lives on
  the object between steps.
- An environment with a `tools` attribute (`megalign.envs.tools.Tool`s, as `ToolEnv` has) gets them described
  in the prompt by the tokenizer's chat template when it reads `tools`, else by the documented plain template
  in the system message (`first_observation_ids`).
- Observations (`Observation`) are one of: a list of chat messages (`{"role", "content"}`: a user turn, tool
  results), rendered through the tokenizer's chat template (`render_observation`); a string, encoded as is
  (the environment owns its formatting: a documented plain template, a raw continuation); or token ids, used
  as they are. The first observation is the prompt: messages get the template's generation prompt.
- `step(conversation, turn)` sees the conversation so far (messages: the first observation and every turn
  and observation before this one, the policy's turns as `{"role": "assistant", "content": text}`) and the
  policy's turn as text (special tokens dropped). It returns a `StepResult`: the observation that follows
  (ignored when `done`), this turn's reward, `done`, and `info` (numbers in it are summed over the rollout's
  episodes into its metrics as `env/<key>`, e.g. tool-call errors).
- `finish(conversation, reason)`: when the rollout ends an episode the environment did not end (turn, token or
  time limits), the reward it still earns (default 0): a simulated user scores the dialogue so far.
- An exception raised by `reset`, `step` or `finish` never stops the rollout: the episode ends, scores 0, the
  error is logged and counted (`env/errors`); the caller compares the count with `reward.max_failure_fraction`.

Rendering messages mid-episode (`render_observation`): the ids a chat template gives to `messages` when they
follow an assistant turn are the difference of two renderings of a fixed dummy conversation, with and without
them (with the generation prompt): `template(base + messages)[len(template(base)):]`, `base` = one user and one
assistant message. What the template writes after the assistant's stop token (Qwen's "\\n" after
`<|im_end|>`) is in `template(base)` only; `glue` is those ids, prepended when the policy's turn ended with
the tokenizer's eos, so the episode's ids are the template's rendering of the whole conversation.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import os
from typing import Any, Callable, Mapping, Optional, Sequence, Union

Observation = Union[str, Sequence[int], Sequence[Mapping[str, Any]]]
"""Chat messages (rendered through the chat template), text (encoded as is) or token ids (used as they are)."""

_BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


class EnvSpecError(ValueError):
    """An environment spec that does not resolve to a usable environment class."""


@dataclasses.dataclass
class StepResult:
    """What `Environment.step` returns: the next `observation` (ignored when `done`), this turn's `reward`,
    `done`, and `info` (numeric values are summed into the rollout's metrics as `env/<key>`)."""

    observation: Observation = ()
    reward: float = 0.0
    done: bool = False
    info: dict = dataclasses.field(default_factory=dict)


class Environment:
    """Base class of environments (module doc). Subclasses implement `reset` and `step`; `finish` is optional."""

    def reset(self, row: Mapping[str, Any], seed: int) -> Observation:
        """The first observation (the prompt) for dataset row `row`; `seed` seeds any randomness of the episode."""
        raise NotImplementedError

    def step(self, conversation: list[dict], turn: str) -> StepResult:
        """React to the policy's `turn` (text) after `conversation` (messages so far, `turn` not included)."""
        raise NotImplementedError

    def finish(self, conversation: list[dict], reason: str) -> float:
        """The reward of an episode the rollout ended (`reason`: max_turns, max_total_tokens, max_time)."""
        return 0.0


def load_env_class(spec: str) -> type:
    """The environment class named by `spec` ("package.module:Class" or "path/to/file.py:Class"), checked to have
    callable `reset` and `step`; every failure is an `EnvSpecError` naming the spec."""
    from megalign.rewards.user import _import_file

    target, sep, attr = (spec or "").rpartition(":")
    if not sep or not target or not attr:
        raise EnvSpecError(f"environment {spec!r} must look like 'module:Class' or 'path/to/file.py:Class'")
    if target.endswith(".py") and not os.path.isfile(target):
        raise EnvSpecError(f"environment {spec!r}: file {target!r} does not exist")
    try:
        module = _import_file(target, spec) if target.endswith(".py") else importlib.import_module(target)
    except Exception as exc:
        raise EnvSpecError(f"environment {spec!r}: cannot import {target!r}: {type(exc).__name__}: {exc}") from exc
    cls = getattr(module, attr, None)
    if cls is None:
        raise EnvSpecError(f"environment {spec!r}: {target!r} has no attribute {attr!r}")
    if not inspect.isclass(cls):
        raise EnvSpecError(f"environment {spec!r}: {attr!r} is a {type(cls).__name__}, not a class")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise EnvSpecError(f"environment {spec!r}: class {attr!r} has no {' / '.join(missing)} method")
    return cls


def env_factory(spec: str, kwargs: Optional[Mapping[str, Any]] = None) -> Callable[[], Any]:
    """What `multiturn_rollout` takes as `env_factory`: `load_env_class(spec)` bound to the config's `kwargs`, checked
    at start-up (the arguments fit the constructor and one environment is built) so a typo stops the run before any
    episode, naming the spec."""
    cls = load_env_class(spec)
    kwargs = dict(kwargs or {})
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as exc:
        raise EnvSpecError(f"environment {spec!r}: its arguments {sorted(kwargs)} do not fit {cls.__name__}: "
                           f"{exc}") from None
    except ValueError:
        pass  # no introspectable signature: the trial build below decides
    try:
        cls(**kwargs)
    except Exception as exc:
        raise EnvSpecError(f"environment {spec!r}: {cls.__name__}(**{kwargs!r}) raised "
                           f"{type(exc).__name__}: {exc}") from exc
    return functools.partial(cls, **kwargs)


def render_observation(tokenizer, observation: Observation, after_stop: bool = True) -> list[int]:
    """Token ids of an observation that follows a policy turn (module doc); `after_stop`: the turn ended with the
    tokenizer's eos, so the template's text after the assistant's end marker (`glue`) comes first."""
    if isinstance(observation, str):
        return tokenizer.encode(observation) if observation else []
    observation = list(observation)
    if not observation:
        return []
    if all(isinstance(t, int) and not isinstance(t, bool) for t in observation):
        return [int(t) for t in observation]
    if not all(isinstance(m, Mapping) for m in observation):
        raise ValueError("an observation must be text, token ids or a list of {role, content} messages, got a list of "
                         f"{sorted({type(m).__name__ for m in observation})}")
    base = list(tokenizer.apply_chat_template(_BASE, add_generation_prompt=False))
    full = list(tokenizer.apply_chat_template(_BASE + [dict(m) for m in observation], add_generation_prompt=True))
    if full[:len(base)] != base:
        raise ValueError(f"the chat template of {tokenizer.name} renders a conversation differently once messages "
                         "follow it, so an observation cannot be appended as a suffix; return text or token ids")
    return (glue(tokenizer) if after_stop else []) + full[len(base):]


def glue(tokenizer) -> list[int]:
    """Ids the chat template writes after an assistant message's last stop token (eos): `[]` for most templates,
    Qwen's "\\n" after `<|im_end|>`."""
    base = list(tokenizer.apply_chat_template(_BASE, add_generation_prompt=False))
    stops = [i for i, t in enumerate(base) if t == tokenizer.eos_id]
    return base[stops[-1] + 1:] if stops else []


def first_observation_ids(tokenizer, observation: Observation, tools: Sequence = ()) -> list[int]:
    """Prompt ids of a first observation: messages through the chat template with its generation prompt, and the
    environment's `tools` (`megalign.envs.tools.Tool`s) described as `render_chat` does: through an HF template that
    reads `tools` (with the tokenizer's own template variables, e.g. enable_thinking), else by the plain template in
    the system message."""
    if isinstance(observation, str):
        return tokenizer.encode(observation)
    observation = list(observation)
    if not (observation and all(isinstance(m, Mapping) for m in observation)):
        return render_observation(tokenizer, observation)
    messages = [dict(m) for m in observation]
    if tools:
        from .tools import render_chat, template_reads_tools

        hf = getattr(tokenizer, "hf", None)  # megalign's HFTokenizer wraps the transformers tokenizer
        if hf is not None and template_reads_tools(hf):
            text = hf.apply_chat_template(messages, tools=[t.schema() for t in tools], tokenize=False,
                                          add_generation_prompt=True, **getattr(tokenizer, "template_kwargs", {}))
            return tokenizer.encode(text)
        messages = render_chat(messages, tools)
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def as_messages(observation: Observation, tokenizer, role: str = "user") -> list[dict]:
    """The observation as conversation messages (text and ids become one `role` message) for `step`'s history."""
    if isinstance(observation, str):
        return [{"role": role, "content": observation}] if observation else []
    observation = list(observation)
    if observation and all(isinstance(m, Mapping) for m in observation):
        return [dict(m) for m in observation]
    return [{"role": role, "content": tokenizer.decode(observation)}] if observation else []


def check_observation_ids(ids: Sequence[int], vocab_size: int, where: str) -> None:
    """Raise ValueError naming `where` unless every id is in [0, vocab_size)."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{where}: token ids {bad[:5]} are outside the model's vocabulary [0, {vocab_size})")


def optional_float(value: Any, where: str) -> float:
    """`value` as a finite float, else ValueError naming `where` (an environment's reward)."""
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where} must be a number, got {value!r}") from None
    if out != out or out in (float("inf"), float("-inf")):
        raise ValueError(f"{where} must be finite, got {value!r}")
    return out


__all__ = ["EnvSpecError", "Environment", "Observation", "StepResult", "as_messages", "check_observation_ids",
           "env_factory", "first_observation_ids", "glue", "load_env_class", "optional_float", "render_observation"]
