"""Multi-turn rollouts on the training weights: G episodes per dataset row, each a dialogue between the policy and
an environment (`megalign.envs.base`), with the KV cache carried across turns.

`multiturn_rollout(model, tokenizer, env_factory, rows, group_size, params, seed, config)` returns one `Episode`
per (row p, sample g), prompt-major (row p's episodes at [p G, (p + 1) G)), and `episodes_to_batch` lays them
out as a `RolloutBatch` for the online trainers (trainer integration is pending).

Design choices:

- What trains: only the policy's tokens. An episode is one token sequence, prompt + turn 1 + observation 1 +
  turn 2 + ...; `loss_mask` is 1 on the policy's tokens and 0 on the prompt and every observation (tool
  results, user messages: text the policy did not choose), so the loss, GAE (`megalign.ops.gae` skips masked
  positions) and the advantage estimators see holes where the environment spoke (verl's agent loop, OpenRLHF's
  `action_ranges`, TRL's `tool_mask`). `action_ranges` are the [start, end) of each turn in the sequence.
- Observations are prefilled into the same KV cache, one forward over all of their tokens: the cache is
  never rebuilt from the whole conversation and the environment's tokens are never generated, so each turn
  costs its new tokens only, and the policy's next turn is conditioned on exactly the ids that train later
  (no re-tokenisation drift between rollout and training).
- Simple and exact first: every live episode sits in one row of a `KVCache` whose rows are aligned; episodes
  move through the same phase together (all decode their turn; then the environments step on the host; then
  all their observations are prefilled in one right-padded forward). A row that finished its turn early, or
  has a shorter observation, leaves masked columns (`attention_mask` 0, positions count only real tokens), so
  its tokens see exactly the conversation's tokens, as a fresh forward over the finished episode does. Rows
  whose episode ended are dropped from the cache between phases. Identical first prompts (the G samples of a
  row) are prefilled once. The host reads each decode step's tokens (stop strings need the text): one sync
  per step, acceptable for agent rollouts whose environments run on the host anyway.
- Randomness: the engine's counter-based streams (`megalign.rollout.engine`): the uniform behind policy token
  s of sample g of prompt key p (s counts the episode's policy tokens over all its turns) comes from
  (seed, p, g, s), so an episode depends neither on the batch it ran in nor on the other episodes'
  lengths; greedy decoding (temperature 0) draws nothing. The environment's seed is another hash of
  (seed, p, g). Log-probs are the engine's: log softmax(logits / T) before top-k / top-p.
- Limits, each counted when it ends an episode: `max_turns` policy turns, `max_total_tokens` tokens in the
  episode (prompt, turns and observations: a turn stops there, and an observation that would not leave room
  for one policy token ends the episode before it is added), `max_time_s` wall seconds; a turn that reaches
  `params.max_new_tokens` ends (counted as `turn_budget`) and the environment still answers it. When the
  rollout ends an episode the environment did not, `Environment.finish` gives its last reward.
- Rewards: `turn_rewards[i]` is what the environment returned for turn i (plus `finish`'s reward on the last
  turn); the episode's `reward` is their sum. An environment that raises ends its episode with reward 0 and
  every turn reward 0, `end = "error"`, the error logged and counted (`env/errors`).
- Tensor parallelism: every tp rank runs the same schedule in lock step, as the engine does
  (`megalign.rollout.engine`): the logits are all-gathered exactly, each sampled token is tp rank 0's
  (`factory.broadcast_from_first`; log-probs are computed on every rank for the agreed token from identical
  logits) and the seed is broadcast once. The environments exist and run on tp rank 0 only: each phase's
  `reset` / `step` / `finish` calls (and the wall-time decisions of `max_time_s`, made on tp rank 0's clock) run
  there, and their results (first observations, observations, rewards, done, info, errors, the conversation's
  new messages) reach the other tp ranks in one `broadcast_object_list` over the tp group per phase, so the
  episodes are identical on every tp rank even with environments that are not deterministic (a sandbox, a
  clock). At tp > 1 what an environment returns must therefore pickle (messages, numbers, token ids do).
- Not yet: pipeline parallelism and sliding-window models (a masked column would shorten the window's
  distances) are refused at the start with a message.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from megalign.config import option
from megalign.envs.base import (as_messages, check_observation_ids, first_observation_ids, optional_float,
                                render_observation)
from megalign.models import CausalLM

from .batch import RolloutBatch
from .engine import pick_tokens, splitmix64_mix, stream_keys, stream_uniforms
from .generate import SamplingParams

logger = logging.getLogger(__name__)

ENDS = ("env", "max_turns", "max_total_tokens", "max_time", "error")
"""Why an episode ended: the environment said done, a limit truncated it, or the environment raised."""


@dataclass
class MultiTurnConfig:
    """Limits of a multi-turn episode (module doc); each truncation is counted in `MultiTurnStats`."""

    max_turns: int = option(8, doc="policy turns per episode at most; an episode still going after them is truncated")
    max_total_tokens: int = option(4096, doc="tokens per episode at most: prompt, policy turns and observations (and "
                                             "at most the model's max_position_embeddings)")
    max_time_s: float = option(0.0, doc="wall-clock seconds per episode, 0 = no limit (checked every decode step; a "
                                        "time limit makes episodes depend on the machine's speed)")
    stop_strings: list = option([], doc="texts that end a policy turn like a stop token when the turn's text contains "
                                        "them (e.g. '</tool_call>'); the token completing one is kept")

    def __post_init__(self):
        if not isinstance(self.max_turns, int) or self.max_turns < 1:
            raise ValueError(f"max_turns must be an integer >= 1, got {self.max_turns!r}")
        if not isinstance(self.max_total_tokens, int) or self.max_total_tokens < 2:
            raise ValueError(f"max_total_tokens must be an integer >= 2, got {self.max_total_tokens!r}")
        if not self.max_time_s >= 0:
            raise ValueError(f"max_time_s must be >= 0 (0 = no limit), got {self.max_time_s!r}")
        if not all(isinstance(s, str) and s for s in self.stop_strings):
            raise ValueError(f"stop_strings must be non-empty strings, got {self.stop_strings!r}")


@dataclass
class Episode:
    """One finished dialogue: sample `sample` of row `prompt_index`. Lists of length len(ids) unless stated."""

    prompt_index: int
    sample: int
    env_seed: int = 0
    """The seed its environment's `reset` got: a hash of (rollout seed, prompt key, sample), 63 bits."""
    ids: list[int] = dataclasses.field(default_factory=list)
    """The whole episode: prompt, then each policy turn followed by its observation (the last turn has none)."""
    prompt_length: int = 0
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    """1 on the policy's tokens (they train), 0 on the prompt and observation tokens."""
    logprobs: list[float] = dataclasses.field(default_factory=list)
    """Sampling log-probs of the policy's tokens (log softmax(logits / T), engine's definition); 0 elsewhere."""
    action_ranges: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    """[start, end) of each policy turn in `ids` (OpenRLHF's action_ranges)."""
    turn_rewards: list[float] = dataclasses.field(default_factory=list)
    """[turns] the environment's reward for each turn (`finish`'s added to the last)."""
    reward: float = 0.0
    end: str = "env"
    """Why it ended, one of ENDS."""
    conversation: list[dict] = dataclasses.field(default_factory=list)
    """The dialogue as messages (first observation, then assistant turns as text and observations)."""
    turn_truncated: list[bool] = dataclasses.field(default_factory=list)
    """[turns] the turn reached `params.max_new_tokens` without a stop token / string."""
    error: Optional[str] = None
    info: dict = dataclasses.field(default_factory=dict)
    """Numeric `StepResult.info` values summed over the episode's turns."""


@dataclass
class MultiTurnStats:
    """Counts of one `multiturn_rollout` call; `metrics()` for a trainer's logs."""

    episodes: int = 0
    turns: int = 0
    policy_tokens: int = 0
    observation_tokens: int = 0
    env_errors: int = 0
    ends: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    turn_budget: int = 0
    """Turns that reached params.max_new_tokens."""
    env_info: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    forward_s: float = 0.0
    env_s: float = 0.0

    def metrics(self) -> dict[str, float]:
        out = {"multiturn/episodes": self.episodes, "multiturn/turns": self.turns,
               "multiturn/policy_tokens": self.policy_tokens, "multiturn/observation_tokens": self.observation_tokens,
               "multiturn/truncated_turns": self.turn_budget, "env/errors": self.env_errors,
               "multiturn/forward_s": self.forward_s, "multiturn/env_s": self.env_s}
        out.update({f"multiturn/end/{k}": self.ends[k] for k in ENDS})
        out.update({f"env/{k}": v for k, v in self.env_info.items()})
        return {k: float(v) for k, v in out.items()}


class _Live:
    """Host state of one episode in flight (`env` is None on tp ranks other than 0: the environments run there)."""

    def __init__(self, episode: Episode, env: Any, key: int, env_seed: int):
        self.ep, self.env, self.key, self.env_seed = episode, env, key, env_seed
        self.steps = 0  # policy tokens so far: the random stream's counter
        self.fed = 0  # tokens in the cache (= the next token's position)
        self.pending: list[int] = []  # tokens to feed next
        self.turn_start = 0
        self.cut: Optional[str] = None  # the episode's token or time limit cut this turn: the limit's name
        self.t0 = time.perf_counter()


class _MultiTurn:
    """One `multiturn_rollout` call (module doc)."""

    def __init__(self, model: CausalLM, tokenizer, params: SamplingParams, seed: int, config: MultiTurnConfig):
        self.model, self.tok, self.params, self.cfg = model, tokenizer, params, config
        self.device = next(model.parameters()).device
        factory = model.model.factory
        self.agree = factory.broadcast_from_first  # tp rank 0's tensor on every tp rank (identity at tp = 1)
        self.group = factory.group if factory.tp_size > 1 else None  # the tp group the environments' results cross
        self.leader = factory.tp_rank == 0  # the tp rank whose environments run
        self.seed = int(self.agree(torch.tensor([seed], dtype=torch.long, device=self.device)).item())
        self.vocab = model.model.config.vocab_size
        self.stop_ids = set(params.stop_ids)
        self.max_total = min(config.max_total_tokens, model.model.config.max_position_embeddings)
        self.stats = MultiTurnStats()
        self.rows: list[_Live] = []  # cache row r holds self.rows[r]
        self.cache = None
        self.valid: Optional[torch.Tensor] = None  # [rows, cache.max_len] keys each row attends

    # ----- environment calls (on tp rank 0 only, through `_on_leader`)

    def _on_leader(self, calls: Sequence[tuple[_Live, Callable[[], Any]]]) -> list[Any]:
        """Each `call()` of `calls` (one per episode: environment calls that set its episode's `conversation`,
        `turn_rewards`, `end`, `error`, `info`) run on tp rank 0 only; every tp rank gets the calls' results and
        those fields in one broadcast over the tp group (module doc). Returns the results, in order."""
        t0 = time.perf_counter()
        if self.group is None:
            results = [call() for _, call in calls]
        else:
            box: list[Any] = [None]
            if self.leader:
                before = [len(x.ep.conversation) for x, _ in calls]
                out = [call() for _, call in calls]
                box = [[(r, x.ep.conversation[n:], x.ep.turn_rewards, x.ep.end, x.ep.error, x.ep.info)
                        for r, (x, _), n in zip(out, calls, before)]]
            dist.broadcast_object_list(box, group_src=0, group=self.group, device=self.device)
            results = []
            for (live, _), (result, added, rewards, end, error, info) in zip(calls, box[0]):
                if not self.leader:
                    live.ep.conversation.extend(added)
                    live.ep.turn_rewards, live.ep.end, live.ep.error, live.ep.info = rewards, end, error, info
                results.append(result)
        self.stats.env_s += time.perf_counter() - t0
        return results

    def _fail(self, live: _Live, where: str, exc: BaseException) -> None:
        ep = live.ep
        ep.end, ep.error = "error", f"{where}: {type(exc).__name__}: {exc}"
        ep.turn_rewards = [0.0] * len(ep.action_ranges)
        logger.warning("environment %s raised in %s (prompt %d, sample %d): %s: %s; episode scored 0",
                       type(live.env).__name__, where, ep.prompt_index, ep.sample, type(exc).__name__, exc)

    def _end(self, live: _Live, reason: str) -> None:
        """End an episode the environment did not end: `finish` gives its last reward."""
        ep = live.ep
        ep.end = reason
        ep.turn_rewards += [0.0] * (len(ep.action_ranges) - len(ep.turn_rewards))  # a cut turn earns no step reward
        try:
            reward = optional_float(live.env.finish(ep.conversation, reason), "finish's reward")
            if ep.turn_rewards:
                ep.turn_rewards[-1] += reward
        except Exception as exc:  # noqa: BLE001 - any environment failure scores the episode 0
            self._fail(live, "finish", exc)

    def _reset(self, live: _Live, row: Mapping) -> Optional[list[int]]:
        """The environment's first observation as ids (its conversation set), or None: it raised (scored 0)."""
        try:
            obs = live.env.reset(row, live.env_seed)
            ids = first_observation_ids(self.tok, obs, getattr(live.env, "tools", ()))
            if not ids:
                raise ValueError("the first observation (the prompt) is empty")
            check_observation_ids(ids, self.vocab, "the first observation")
            live.ep.conversation = as_messages(obs, self.tok)
        except Exception as exc:  # noqa: BLE001
            self._fail(live, "reset", exc)
            return None
        return ids

    def _open(self, live: _Live, ids: Optional[list[int]]) -> bool:
        """Start the episode on its first observation `ids` (None: reset failed); False: it ends before a turn."""
        if ids is None:
            return False
        if len(ids) >= self.max_total:
            live.ep.end = "max_total_tokens"  # no room for a policy token: no turn, reward 0
            return False
        live.ep.ids, live.ep.prompt_length = ids, len(ids)
        live.ep.loss_mask, live.ep.logprobs = [0] * len(ids), [0.0] * len(ids)
        return True

    def _step_env(self, live: _Live) -> Optional[list[int]]:
        """The environment answers the turn just ended: the observation ids to prefill, or None: the episode ends."""
        ep = live.ep
        turn_ids = ep.ids[live.turn_start:]
        text = self.tok.decode(turn_ids, skip_special=True)
        if live.cut:  # the turn itself was cut by the episode's token or time limit: no step
            ep.conversation.append({"role": "assistant", "content": text})
            self._end(live, live.cut)
            return None
        try:
            result = live.env.step([dict(m) for m in ep.conversation], text)
            reward = optional_float(result.reward, "the step's reward")
            ep.conversation.append({"role": "assistant", "content": text})
            ep.turn_rewards.append(reward)
            for k, v in (result.info or {}).items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    ep.info[k] = ep.info.get(k, 0) + v
            if result.done:
                ep.end = "env"
                return None
            after_eos = bool(turn_ids) and turn_ids[-1] == self.tok.eos_id
            obs = render_observation(self.tok, result.observation, after_stop=after_eos)
            check_observation_ids(obs, self.vocab, "the observation")
            messages = as_messages(result.observation, self.tok)
        except Exception as exc:  # noqa: BLE001
            self._fail(live, "step", exc)
            return None
        if len(ep.action_ranges) >= self.cfg.max_turns:
            self._end(live, "max_turns")
            return None
        if len(ep.ids) + len(obs) >= self.max_total:
            self._end(live, "max_total_tokens")
            return None
        if self._timed_out(live):
            self._end(live, "max_time")
            return None
        ep.conversation.extend(messages)
        return obs

    def _timed_out(self, live: _Live) -> bool:
        return self.cfg.max_time_s > 0 and time.perf_counter() - live.t0 > self.cfg.max_time_s

    def _late(self, lives: list[_Live]) -> list[bool]:
        """Which of `lives` ran past `max_time_s`, decided on tp rank 0's clock for every tp rank."""
        if self.cfg.max_time_s == 0:
            return [False] * len(lives)
        late = torch.tensor([self._timed_out(x) for x in lives], dtype=torch.uint8, device=self.device)
        return self.agree(late).bool().tolist()

    # ----- the cache

    def _forward(self, tokens: torch.Tensor, valid_new: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed `tokens` `[B, W]` (`valid_new` `[B, W]`: real ones, at `positions`) to the cache rows -> `[B, W, H]`."""
        width = tokens.shape[1]
        start = self.cache.length
        if start + width > self.cache.max_len:  # grow: double the capacity
            grown = self.model.model.new_kv_cache(len(self.rows), max(2 * self.cache.max_len, start + width))
            for new, old in zip(grown.k + grown.v, self.cache.k + self.cache.v):
                new[:, :, :start] = old[:, :, :start]
            grown.length = start
            more = self.valid.new_zeros(len(self.rows), grown.max_len - self.valid.shape[1])
            self.valid = torch.cat([self.valid, more], 1)
            self.cache = grown
        self.valid[:, start:start + width] = valid_new
        t0 = time.perf_counter()
        hidden = self.model.model(tokens, attention_mask=self.valid[:, :start + width], position_ids=positions,
                                  kv_cache=self.cache)
        self.stats.forward_s += time.perf_counter() - t0
        return hidden

    def _keep(self, keep: list[int]) -> None:
        """Keep cache rows `keep` (ascending), in that order."""
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.cache.k = [k[index] for k in self.cache.k]
        self.cache.v = [v[index] for v in self.cache.v]
        self.valid = self.valid[index]
        self.rows = [self.rows[r] for r in keep]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head.gather_logits(self.model.lm_head(hidden)).float()

    # ----- tokens

    def _pick(self, logits: torch.Tensor, lives: list[_Live]) -> None:
        """Draw each episode's next policy token from its logits `[m, V]` and record it."""
        uniforms = None
        if self.params.temperature != 0:
            keys = torch.tensor([x.key for x in lives], dtype=torch.long, device=self.device)
            steps = torch.tensor([x.steps for x in lives], dtype=torch.long, device=self.device)
            uniforms = stream_uniforms(keys, steps)
        tokens, logp = pick_tokens(logits, self.params, uniforms, self.agree)
        for live, token, lp, late in zip(lives, tokens.tolist(), logp.tolist(), self._late(lives)):
            ep = live.ep
            ep.ids.append(token)
            ep.loss_mask.append(1)
            ep.logprobs.append(lp)
            live.steps += 1
            live.pending = [token]
            self.stats.policy_tokens += 1
            if token in self.stop_ids or self._stop_string(ep.ids[live.turn_start:]):
                pass  # the turn is complete
            elif len(ep.ids) - live.turn_start >= self.params.max_new_tokens:
                self.stats.turn_budget += 1
                ep.turn_truncated[-1] = True
            elif len(ep.ids) >= self.max_total:
                live.cut = "max_total_tokens"
            elif late:
                live.cut = "max_time"
            else:
                continue
            live.pending.append(-1)  # marks the turn as over (the token is still fed before an observation)

    def _stop_string(self, turn: list[int]) -> bool:
        if not self.cfg.stop_strings:
            return False
        text = self.tok.decode(turn, skip_special=False)
        return any(s in text for s in self.cfg.stop_strings)

    def _begin_turn(self, live: _Live) -> None:
        live.turn_start = len(live.ep.ids)
        live.cut = None
        live.ep.turn_truncated.append(False)

    # ----- phases

    def start(self, lives: list[_Live], rows: Sequence[Mapping]) -> None:
        """Reset the environments, prefill the distinct first prompts once, draw every first token."""
        firsts = self._on_leader([(x, functools.partial(self._reset, x, row)) for x, row in zip(lives, rows)])
        lives = [x for x, ids in zip(lives, firsts) if self._open(x, ids)]
        if not lives:
            return
        distinct = list(dict.fromkeys(tuple(x.ep.ids) for x in lives))
        width = max(len(p) for p in distinct)
        ids = torch.full((len(distinct), width), self.params.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(distinct):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        self.cache = self.model.model.new_kv_cache(len(distinct), width + self.params.max_new_tokens + 1)
        self.rows = [None] * len(distinct)  # the distinct prompts first; `_keep` then gives each episode its row
        self.valid = torch.zeros(len(distinct), self.cache.max_len, dtype=torch.bool, device=self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0).to(self.device)
        hidden = self._forward(ids.to(self.device), mask.bool().to(self.device), positions)
        last = self._logits(hidden[:, -1])
        which = {p: i for i, p in enumerate(distinct)}
        source = [which[tuple(x.ep.ids)] for x in lives]
        self._keep(source)
        self.rows = lives
        for x in lives:
            x.fed = x.ep.prompt_length
            self._begin_turn(x)
        self._pick(last[torch.tensor(source, device=self.device)], lives)

    def decode(self) -> None:
        """Decode until every row's turn is over; rows whose turn ended feed masked padding meanwhile."""
        while True:
            going = [r for r, x in enumerate(self.rows) if x.pending[-1] != -1]
            if not going:
                return
            tokens = torch.tensor([x.pending[0] if x.pending[-1] != -1 else self.params.pad_token_id
                                   for x in self.rows], dtype=torch.long, device=self.device)[:, None]
            valid = torch.tensor([x.pending[-1] != -1 for x in self.rows], device=self.device)[:, None]
            positions = torch.tensor([x.fed for x in self.rows], dtype=torch.long, device=self.device)[:, None]
            hidden = self._forward(tokens, valid, positions)
            for r in going:
                self.rows[r].fed += 1
            index = torch.tensor(going, device=self.device)
            self._pick(self._logits(hidden[index, -1]), [self.rows[r] for r in going])

    def observe(self) -> None:
        """Every environment answers its turn; the episodes that go on prefill [last turn token] + observation and
        draw the first token of their next turn; the others leave the cache."""
        for live in self.rows:
            live.ep.action_ranges.append((live.turn_start, len(live.ep.ids)))
            self.stats.turns += 1
        answers = self._on_leader([(x, functools.partial(self._step_env, x)) for x in self.rows])
        feeds: dict[int, list[int]] = {}
        for r, (live, obs) in enumerate(zip(self.rows, answers)):
            if obs is not None:
                feeds[r] = [live.pending[0]] + obs
                live.ep.ids += obs
                live.ep.loss_mask += [0] * len(obs)
                live.ep.logprobs += [0.0] * len(obs)
                self.stats.observation_tokens += len(obs)
        keep = sorted(feeds)
        self._keep(keep)
        if not keep:
            return
        width = max(len(feeds[r]) for r in keep)
        tokens = torch.full((len(keep), width), self.params.pad_token_id, dtype=torch.long)
        valid = torch.zeros(len(keep), width, dtype=torch.bool)
        for i, r in enumerate(keep):
            tokens[i, :len(feeds[r])] = torch.tensor(feeds[r])
            valid[i, :len(feeds[r])] = True
        positions = torch.tensor([x.fed for x in self.rows])[:, None] + torch.arange(width)[None]
        hidden = self._forward(tokens.to(self.device), valid.to(self.device), positions.to(self.device))
        lasts = torch.tensor([len(feeds[r]) - 1 for r in keep], device=self.device)
        for i, r in enumerate(keep):
            self.rows[i].fed += len(feeds[r])
            self._begin_turn(self.rows[i])
        last = hidden[torch.arange(len(keep), device=self.device), lasts]
        self._pick(self._logits(last), self.rows)


def _check_model(model: CausalLM) -> None:
    decoder = model.model
    if decoder.embed is None or decoder.norm is None:
        raise ValueError("multiturn_rollout needs the whole model on this rank (pp = 1); pipeline stages are not "
                         "supported yet")
    if decoder.config.sliding_window is not None:
        raise ValueError("multiturn_rollout does not support sliding-window models yet: masked columns of finished "
                         "rows would shorten the window's distances")


@torch.no_grad()
def multiturn_rollout(model: CausalLM, tokenizer, env_factory: Callable[[], Any], rows: Sequence[Mapping[str, Any]],
                      group_size: int, params: SamplingParams, seed: int = 0, config: Optional[MultiTurnConfig] = None,
                      prompt_keys: Optional[Sequence[int]] = None) -> tuple[list[Episode], MultiTurnStats]:
    """G = `group_size` episodes of each dataset row of `rows` (module doc).

    `env_factory()` makes one environment per episode (an environment class, or a `functools.partial` of one
    with the config's arguments); `tokenizer` is megalign's `Tokenizer` (encode, decode, apply_chat_template,
    eos_id); `params` are the per-turn sampling parameters (`max_new_tokens`: the turn budget; stop tokens end
    a turn); `seed` and `prompt_keys` (default 0..len(rows)-1) fix every sample and every environment seed.
    With a tensor-parallel `model`, every tp rank calls it with the same rows and gets the same episodes (tp rank
    0's `seed` is used; `env_factory` is called on tp rank 0 only, where the environments run).
    Returns (episodes, prompt-major: row p's at [p G, (p + 1) G); the counts).
    """
    config = config or MultiTurnConfig()
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an integer >= 1, got {group_size!r}")
    if not callable(env_factory):
        raise ValueError(f"env_factory must be callable (an environment class), got {type(env_factory).__name__}")
    keys = list(range(len(rows))) if prompt_keys is None else [int(k) for k in prompt_keys]
    if len(keys) != len(rows):
        raise ValueError(f"prompt_keys must hold one key per row ({len(rows)}), got {len(keys)}")
    _check_model(model)
    run = _MultiTurn(model, tokenizer, params, seed, config)
    p = torch.tensor(keys, dtype=torch.long).repeat_interleave(group_size)
    g = torch.arange(group_size).repeat(len(rows))
    streams = stream_keys(run.seed, p, g)
    env_seeds = (splitmix64_mix(streams) & ((1 << 63) - 1)).tolist()
    episodes = [Episode(i // group_size, i % group_size, s) for i, s in enumerate(env_seeds)]
    lives = [_Live(ep, env_factory() if run.leader else None, key, s)
             for ep, key, s in zip(episodes, streams.tolist(), env_seeds)]
    run.start(lives, [rows[i // group_size] for i in range(len(p))])
    while run.rows:
        run.decode()
        run.observe()
    for ep in episodes:
        ep.reward = float(sum(ep.turn_rewards))
        run.stats.ends[ep.end] += 1
        run.stats.env_errors += ep.end == "error"
        for k, v in ep.info.items():
            run.stats.env_info[k] += v
    run.stats.episodes = len(episodes)
    return episodes, run.stats


def episodes_to_batch(episodes: Sequence[Episode], group_size: int, pad_token_id: int = 0) -> RolloutBatch:
    """Episodes (prompt-major, whole groups) as a `RolloutBatch`: `sequences` `[N, P + R]` with each prompt
    left-padded to P and the rest of the episode (turns and observations) right-padded to R; `response_mask`
    `[N, R]` 1 on the policy's tokens only (observations sit inside the response with 0); `rollout_logp`
    `[N, R]`; `lengths`: policy tokens; `finished`: the environment ended the episode; `rewards`: the episode
    rewards (also `terms["env"]`); `group`: the row of each episode. On the CPU (`.to` it where the update runs)."""
    if not episodes or len(episodes) % group_size:
        raise ValueError(f"episodes_to_batch needs whole groups of {group_size} episodes, got {len(episodes)}")
    n = len(episodes)
    width_p = max(1, max(e.prompt_length for e in episodes))
    width_r = max(1, max(len(e.ids) - e.prompt_length for e in episodes))
    seq = torch.full((n, width_p + width_r), pad_token_id, dtype=torch.long)
    attn = torch.zeros(n, width_p + width_r, dtype=torch.long)
    resp_mask = torch.zeros(n, width_r)
    logp = torch.zeros(n, width_r)
    for i, e in enumerate(episodes):
        p, r = e.prompt_length, len(e.ids) - e.prompt_length
        seq[i, width_p - p:width_p + r] = torch.tensor(e.ids, dtype=torch.long)
        attn[i, width_p - p:width_p + r] = 1
        resp_mask[i, :r] = torch.tensor(e.loss_mask[p:], dtype=torch.float32)
        logp[i, :r] = torch.tensor(e.logprobs[p:], dtype=torch.float32)
    rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float32)
    return RolloutBatch(sequences=seq, attention_mask=attn, response_mask=resp_mask, rollout_logp=logp,
                        lengths=resp_mask.sum(-1), finished=torch.tensor([e.end == "env" for e in episodes]),
                        rewards=rewards, terms={"env": rewards.clone()}, group_size=group_size,
                        group=torch.tensor([e.prompt_index for e in episodes], dtype=torch.long))
