"""Multi-turn episodes in the online trainers (issue 28): with `rollout.env` set, `OnlineTrainer.rollout` samples G
episodes of each prompt against the environment (`megalign.rollout.multiturn`) instead of G single responses, and
GRPO / RLOO / PPO / online DPO train on them unchanged. `EpisodeRollout` is what the trainer holds for it.

Design choices:

- Layout: an episode (prompt, policy turns, observations) is one batch row of width 1 + R, R =
  `rollout.max_response_length`: its first token in column 0, the rest right-padded in the "response" part,
  where `response_mask` is 1 on the policy's tokens only (the prompt's other tokens and every observation are
  holes; the loss, GAE and the advantage estimators skip them). The row width is fixed per run whatever the
  environment's first observation renders to (a tools prompt is longer than the dataset prompt), so sampling
  rounds and steps concatenate like single-turn batches; the rollout's episode limit is 1 + R tokens
  (`EnvConfig.multiturn`). `rollout_logp` holds the engine's sampling log-probs of the policy's tokens, which
  the trainer's recomputed log-probs equal (the same weights on the same ids: tested).
- Reward: one number per episode, the sum of the environment's turn rewards (its final reward included), plus,
  with `rollout.env.score_final_turn`, the configured reward (`reward.terms`, models, judges) on the last
  policy turn's text. Where PPO finds it is `rollout.env.reward_placement`: `last_token` (default) puts the
  total at the episode's last policy token, as verl's agent loop (one trajectory score at the last response
  token) and OpenRLHF's agent episodes (the final step's reward), and GAE discounts it over the policy's tokens
  only (the holes are skipped), so tokens of earlier turns share it; `per_turn` puts each turn's environment
  reward at that turn's last policy token (`RolloutBatch.turn_rewards` [N, R], nothing on holes) and the rest
  of the total (the final-turn reward terms) at the episode's last, so GAE credits each turn with its own reward
  (verl's and NeMo-RL's per-turn rewards). GRPO / RLOO / REINFORCE++ / online DPO train on the episode's total
  under both placements: their advantages or preferences are per episode, and summing the turns is what
  per-turn credit reduces to there, so one `rollout.env` section serves every trainer. Refused: per_turn with
  PPO's `algo.reward_clip` (it clips the total, which per_turn no longer places as one number). The
  environment's part is logged as the term `env`.
- Failures: an environment that raises ends its episode, scored 0 in total (the reward terms too), logged
  and counted; the step's errors over its episodes, summed over dp, stop the run above
  `reward.max_failure_fraction` (the reward terms' rule), on every rank together.
- Metrics per step (sums over dp ranks): `env/episodes`, `env/turns_mean`, `env/errors`,
  `env/error_fraction`, `env/end/<why>` (the environment, max_turns, max_total_tokens, max_time, error),
  `env/truncated_turns` (turns at the per-turn budget), `env/policy_tokens_mean`,
  `env/observation_tokens_mean`, every numeric `info` key the environment returns summed (`env/tool_calls`,
  `env/tool_errors`, ...) and the share of episodes where it is nonzero (`env/share/tool_calls`: episodes that
  called a tool; `env/share/tool_errors`: episodes with a failed call).
- Evaluation: greedy episodes (one per held-out prompt) scored by `eval.metric` on the last policy turn.
- Tensor parallelism (actor.tp > 1): every tp rank of a dp rank rolls out the same episodes in lock step; the
  environments run on tp rank 0 only and their results are broadcast over the tp group
  (`megalign.rollout.multiturn`), so the counts and rewards are the same on every tp rank and the metrics sum
  over dp only.
- Refused at start-up before any model loads, naming the keys: actor.pp > 1 (the rollout runs the whole model on
  each rank), actor.ep > 1 (the episodes' decode is not lock-stepped over the ep group), process reward models (their step rewards read a single response), online DPO's pairwise judge (it
  reads single responses); sliding-window models at the first rollout. `rollout.pack` works (the rows' real
  tokens are packed like single responses).
"""
from __future__ import annotations

import collections
import logging
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from megalign.envs.base import EnvSpecError, env_factory
from megalign.parallel.collectives import all_reduce
from megalign.rewards import get_reward
from megalign.rollout import Episode, RolloutBatch, SamplingParams, multiturn_rollout
from megalign.rollout.multiturn import ENDS

logger = logging.getLogger(__name__)

COUNTS = ("episodes", "turns", "policy_tokens", "observation_tokens", "env_errors", "turn_budget")


def check_episode_setup(cfg) -> None:
    """ValueError naming the keys for what episodes do not support yet (module doc), from the config alone."""
    env = cfg.rollout.env
    if cfg.actor.pp > 1:
        raise ValueError(f"rollout.env: multi-turn episodes run at actor.pp=1 for now (got actor.pp={cfg.actor.pp}): "
                         f"the rollout needs the whole model on each rank")
    if cfg.actor.ep > 1:
        raise ValueError(f"rollout.env: multi-turn episodes run at actor.ep=1 for now (got actor.ep={cfg.actor.ep}): "
                         f"every MoE forward is an all-to-all over the ep group, and the episodes' decode does not "
                         f"keep the group's ranks in lock step as the single-turn rollout does")
    process = [key for key, m in cfg.reward.reward_models() if m.kind == "process"]
    if process:
        raise ValueError(f"rollout.env: process reward models ({', '.join(process)}) read single responses; "
                         f"remove them or rollout.env")
    if getattr(cfg, "judge", None) is not None:
        raise ValueError("rollout.env: online DPO's pairwise judge (judge) reads single responses; rank the episodes "
                         "by their rewards (judge: null) or remove rollout.env")
    if env.reward_placement == "per_turn" and getattr(cfg.algo, "reward_clip", None) is not None:
        raise ValueError(f"rollout.env.reward_placement=per_turn with algo.reward_clip={cfg.algo.reward_clip}: the "
                         f"clip bounds an episode's total score, which per_turn spreads over the turns; drop one of "
                         f"them")
    if env.score_final_turn is False and (cfg.reward.reward_models() or cfg.reward.judges):
        raise ValueError("rollout.env.score_final_turn=false leaves reward.model(s) / reward.judges unused; "
                         "remove them or score the final turn")


def episode_rows(episodes: Sequence[Episode], width: int, pad_id: int) -> dict[str, torch.Tensor]:
    """The episodes as batch rows (module doc): `sequences` / `attention_mask` [N, 1 + width] (the episode from
    column 0, right-padded), `response_mask` / `rollout_logp` [N, width] (column j: token j + 1 of the episode),
    `lengths` [N] policy tokens. ValueError naming the episode when one is longer than 1 + width. An episode without
    ids is one attended pad token (no row attends to nothing, whose softmax would be NaN)."""
    n = len(episodes)
    seq = torch.full((n, 1 + width), pad_id, dtype=torch.long)
    attn = torch.zeros(n, 1 + width, dtype=torch.long)
    mask, logp = torch.zeros(n, width), torch.zeros(n, width)
    for i, e in enumerate(episodes):
        k = len(e.ids)
        if k > 1 + width:
            raise ValueError(f"episode {i} (prompt {e.prompt_index}, sample {e.sample}) has {k} tokens, more than "
                             f"rollout.max_response_length + 1 = {1 + width}")
        seq[i, :k] = torch.tensor(e.ids, dtype=torch.long)
        attn[i, :max(k, 1)] = 1  # no ids (reset failed, or the prompt left no room): one pad token, nothing trains
        mask[i, :max(k - 1, 0)] = torch.tensor(e.loss_mask[1:], dtype=torch.float32)
        logp[i, :max(k - 1, 0)] = torch.tensor(e.logprobs[1:], dtype=torch.float32)
    return {"sequences": seq, "attention_mask": attn, "response_mask": mask, "rollout_logp": logp,
            "lengths": mask.sum(-1)}


def turn_reward_rows(episodes: Sequence[Episode], width: int) -> torch.Tensor:
    """[N, width] fp32: each turn's environment reward (`Episode.turn_rewards`) at the column of the turn's last
    policy token (token j + 1 of the episode in column j, as `episode_rows`), 0 on every other column. A turn whose
    last token is the episode's first (column -1: never trained) places nothing: its reward stays in the total."""
    out = torch.zeros(len(episodes), width)
    for i, e in enumerate(episodes):
        for (_, end), reward in zip(e.action_ranges, e.turn_rewards):
            if end >= 2:
                out[i, end - 2] += reward
    return out


def last_turn_text(tokenizer, episode: Episode) -> str:
    """The text of the episode's last policy turn ("" when it has none: its environment failed at reset)."""
    if not episode.action_ranges:
        return ""
    start, end = episode.action_ranges[-1]
    return tokenizer.decode(episode.ids[start:end])


class EpisodeRollout:
    """The episodes path of an `OnlineTrainer` (module doc): `rollout` per sampling round, `step_metrics` once a step
    (in `collect`: the failure check and the counts), `evaluate` for the held-out prompts."""

    def __init__(self, trainer):
        """Built by the trainer once it has its tokenizer, before any model loads: the config's checks and the
        environment's (one is built) fail first."""
        cfg = trainer.cfg
        self.trainer, self.env = trainer, cfg.rollout.env
        check_episode_setup(cfg)
        try:
            self.factory = env_factory(self.env.name, self.env.kwargs)
        except EnvSpecError as exc:
            raise ValueError(f"rollout.env.name / rollout.env.kwargs: {exc}") from None
        self.multiturn = self.env.multiturn(cfg.rollout.max_response_length)
        self.params = SamplingParams(max_new_tokens=self.env.max_turn_tokens or cfg.rollout.max_response_length,
                                     temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                     eos_token_id=trainer.tokenizer.eos_id, pad_token_id=trainer.tokenizer.pad_id)
        self.reset_counts()

    def reset_counts(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self.last_error: Optional[str] = None

    def run(self, examples, group_size: int, params: SamplingParams, seed: int, keys: Sequence[int]):
        """(episodes, stats) of `group_size` episodes per example on the actor's weights (eval mode, autocast)."""
        actor = self.trainer.actor
        if actor.model.model.config.sliding_window is not None:
            raise ValueError(f"rollout.env: actor.path={self.trainer.cfg.actor.path} is a sliding-window model, which "
                             f"multi-turn episodes do not support yet")
        rows = [{"prompt": e.prompt_text, "answer": e.answer, "metadata": dict(e.metadata)} for e in examples]
        was_training = actor.model.training
        actor.model.eval()
        try:
            with actor.precision.autocast(self.trainer.layout.device):
                return multiturn_rollout(actor.model, self.trainer.tokenizer, self.factory, rows, group_size, params,
                                         seed, self.multiturn, prompt_keys=keys)
        finally:
            actor.model.train(was_training)

    def rollout(self, indices: list[int], first_group: int = 0) -> RolloutBatch:
        """G scored episodes for each prompt of `indices` (`OnlineTrainer.rollout`'s contract, module doc)."""
        t = self.trainer
        cfg, device, group_size = t.cfg, t.layout.device, t.cfg.rollout.group_size
        examples = [t.train_set[i] for i in indices]
        seed = int(torch.randint(0, 2 ** 62, (), generator=t.rollout_generator, device=t.rollout_generator.device))
        with t.phase("generate", actor=("weights",)):
            episodes, stats = self.run(examples, group_size, self.params, seed, indices)
        self.count(episodes, stats)
        empty = sum(not e.ids and e.end == "max_total_tokens" for e in episodes)
        if empty:
            logger.warning("%d of %d episodes have a first observation of %d tokens or more (rollout.max_response_length "
                           "+ 1): no turn, reward 0", empty, len(episodes), cfg.rollout.max_response_length + 1)
        rows = episode_rows(episodes, cfg.rollout.max_response_length, t.tokenizer.pad_id)
        rewards, terms = self.score(episodes, [examples[e.prompt_index] for e in episodes], rows)
        group = torch.tensor([first_group + e.prompt_index for e in episodes], dtype=torch.long)
        batch = RolloutBatch(**{k: v.to(device) for k, v in rows.items()},
                             finished=torch.tensor([e.end == "env" for e in episodes], device=device),
                             rewards=rewards.to(device), terms={k: v.to(device) for k, v in terms.items()},
                             group=group.to(device), group_size=group_size)
        if self.env.reward_placement == "per_turn":
            batch.turn_rewards = turn_reward_rows(episodes, cfg.rollout.max_response_length).to(device)
        t.shape_rewards(batch)
        return batch

    def score(self, episodes: Sequence[Episode], examples, rows: dict[str, torch.Tensor]):
        """(total rewards [N], {term: [N]}): the environment's (term `env`) plus, with score_final_turn, the reward
        role's on the last turn's text; an episode whose environment raised scores 0 in total."""
        t = self.trainer
        env = torch.tensor([e.reward for e in episodes], dtype=torch.float32)
        total, terms = env.clone(), {}
        if self.env.score_final_turn:
            texts = [last_turn_text(t.tokenizer, e) for e in episodes]
            with t.phase("reward", **t.reward.needs()):
                scored, terms = t.reward.score([x.prompt_text for x in examples], texts, [x.answer for x in examples],
                                               [x.metadata for x in examples], rows["sequences"], rows["attention_mask"])
            total = total + scored.float()
        failed = torch.tensor([e.end == "error" for e in episodes])
        return torch.where(failed, torch.zeros_like(total), total), {"env": env, **terms}

    def count(self, episodes: Sequence[Episode], stats) -> None:
        """Add one rollout's counts to the step's."""
        for name in COUNTS:
            self.counts[name] += getattr(stats, name)
        for end in ENDS:
            self.counts[f"end/{end}"] += stats.ends[end]
        for key, value in stats.env_info.items():
            self.counts[f"info/{key}"] += value
        for e in episodes:  # episodes with a nonzero count (e.g. that called a tool: env/share/tool_calls)
            for key, value in e.info.items():
                self.counts[f"share/{key}"] += float(value != 0)
        errors = [e.error for e in episodes if e.error]
        if errors:
            self.last_error = errors[-1]

    def step_metrics(self) -> dict[str, float]:
        """The step's episode metrics summed over dp (module doc); raises on every rank together when the
        environments failed on more than reward.max_failure_fraction of the step's episodes. Resets the counts."""
        t = self.trainer
        keys = sorted(self.counts)
        if t.layout.dp > 1:  # environments may return different info keys on different ranks
            gathered: list[Any] = [None] * t.layout.dp
            dist.all_gather_object(gathered, keys, group=t.layout.dp_group)
            keys = sorted(set().union(*gathered))
        values = torch.tensor([float(self.counts[k]) for k in keys], dtype=torch.float64)
        total = dict(zip(keys, all_reduce(values.to(t.layout.device), t.layout.dp_group).cpu().tolist()))
        last_error = self.last_error
        self.reset_counts()
        episodes, errors = total.get("episodes", 0.0), total.get("env_errors", 0.0)
        limit = t.cfg.reward.max_failure_fraction
        if episodes and errors / episodes > limit:
            raise RuntimeError(f"rollout.env {self.env.name!r} raised in {int(errors)} of {int(episodes)} episodes this "
                               f"step, more than reward.max_failure_fraction={limit}; last error on this rank: "
                               f"{last_error!r}")
        n = max(episodes, 1.0)
        out = {"env/episodes": episodes, "env/turns_mean": total.get("turns", 0.0) / n, "env/errors": errors,
               "env/error_fraction": errors / n, "env/truncated_turns": total.get("turn_budget", 0.0),
               "env/policy_tokens_mean": total.get("policy_tokens", 0.0) / n,
               "env/observation_tokens_mean": total.get("observation_tokens", 0.0) / n}
        out.update({f"env/end/{end}": total.get(f"end/{end}", 0.0) for end in ENDS})
        out.update({f"env/{k[len('info/'):]}": v for k, v in total.items() if k.startswith("info/")})
        out.update({f"env/share/{k[len('share/'):]}": v / n for k, v in total.items() if k.startswith("share/")})
        return out

    def evaluate(self, examples: Sequence[Any]) -> float:
        """Mean `eval.metric` of the last policy turn of one greedy episode per example (this rank's share: every
        dp-th from dp_rank), summed over dp."""
        t = self.trainer
        layout, cfg = t.layout, t.cfg
        mine = list(examples[layout.dp_rank::layout.dp])
        score = 0.0
        if mine:
            params = SamplingParams(max_new_tokens=self.params.max_new_tokens, temperature=0.0,
                                    eos_token_id=t.tokenizer.eos_id, pad_token_id=t.tokenizer.pad_id)
            episodes, _ = self.run(mine, 1, params, 0, list(range(len(mine))))
            texts = [last_turn_text(t.tokenizer, e) for e in episodes]
            scores = get_reward(cfg.eval.metric)([e.prompt_text for e in mine], texts, [e.answer for e in mine],
                                                 [e.metadata for e in mine])
            score = sum(0.0 if e.end == "error" else s for e, s in zip(episodes, scores))
        counts = all_reduce(torch.tensor([score, len(mine)], dtype=torch.float64, device=layout.device),
                            layout.dp_group)
        return float(counts[0] / counts[1].clamp(min=1))
