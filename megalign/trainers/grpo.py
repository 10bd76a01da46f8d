"""GRPO and its DAPO / Dr. GRPO variants, end to end on colocated roles: `train_grpo(cfg)`.

One step (every rank, after `megalign.trainers.cli.init_distributed`):

    sample prompts -> actor generates G responses each (temperature / top-p, its own tp weights)
    -> reward role scores them (verifiers behind SafeReward: a raising function scores 0, counted)
    -> [overlong penalty] -> [dynamic sampling: drop groups of equal rewards, generate more rounds]
    -> group advantages -> old log-probs (from the rollout, or recomputed) -> reference log-probs
    (only when beta > 0; otherwise the reference role does not exist) -> ppo_epochs x mini-batches
    of policy_loss + loss aggregation -> metrics -> checkpoint every save_every steps.

Design choices:

- Shapes are fixed per run: prompts are left-padded to the longest prompt of the dataset and
  responses right-padded to `max_response_length`, so rounds of dynamic sampling concatenate
  without re-padding and every forward sees one shape.
- Data parallelism: each dp rank samples its own prompts (`PromptSampler` with the dp rank) and
  keeps its own groups; losses are normalised by mini-batch counts all-reduced over dp and gradients
  are summed (`megalign.algos.grpo`). Rounds of dynamic sampling are agreed over all ranks (one
  all-reduce per round) so sampler positions stay aligned: a rank that already has its groups
  still advances its sampler but generates nothing. Ranks may then hold different numbers of
  samples; every mini-batch still runs its collectives on every rank, with empty parts skipped.
- Randomness of rollouts comes from one `torch.Generator` per rank seeded with (seed, dp rank)
  and checkpointed with the step, the sampler position, the reward error counters, the actor and
  its ZeRO-1 optimizer shards, so `resume=auto` continues exactly where the run stopped.
- Placement: actor, reference and reward model live on every rank; before each phase every role
  is told which of its parts the phase needs (`Role.need`), and roles offload the rest when their
  switch is on. Memory per role and phase is logged as `memory/<phase>/<role>_mib`.
- A step whose loss or gradient norm is non-finite on any rank skips that update (warned and
  counted as `nan_skips`); the weights, and so the checkpoints, never see it.
- Held-out accuracy (greedy, `math_accuracy`) is measured before training, every `eval.every`
  steps and at the end; the run ends with a before/after table.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Literal, Optional

import torch
import torch.distributed as dist

from megalign.algos.grpo import (LOSS_AGGREGATIONS, aggregate_loss, informative_groups, loss_normalizer,
                                 overlong_mask, overlong_penalty, response_advantages)
from megalign.checkpoint import CheckpointManager, ModelState, OptimizerState, RNGState, export_hf
from megalign.config import option, save_config
from megalign.data import (ArithTaskConfig, PromptDataset, PromptSampler, Tokenizer, TokenizerConfig, build_tokenizer,
                           load_prompts, make_splits, write_jsonl)
from megalign.models import from_pretrained
from megalign.ops.policy_loss import policy_loss
from megalign.parallel import MixedPrecision, ParallelLayout
from megalign.parallel.collectives import all_reduce
from megalign.roles import DTYPES, Actor, ModelRoleConfig, Reference, Reward, RewardConfig, Role
from megalign.rollout import SamplingParams
from megalign.trainers.logging import MetricsLogger, PhaseTimer, memory_report
from megalign.trainers.optim import OptimConfig, build_optimizer, lr_at, set_lr
from megalign.trainers.sft import EvalConfig, evaluate

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ActorConfig(ModelRoleConfig):
    """The policy: an HF checkpoint (e.g. the SFT export `run_dir/hf`), its layout, dtype and offload."""

    path: Optional[str] = option("runs/sft_arith/hf", doc="HF checkpoint folder of the initial policy")
    offload_optimizer: bool = option(False, doc="move the optimizer state to host memory outside the update phase")

    def __post_init__(self):
        super().__post_init__()
        if not self.path:
            raise ValueError("actor.path (an HF checkpoint folder) is required")


@dataclasses.dataclass
class GRPODataConfig:
    """Prompts with verifiable answers: the embedded arithmetic task, or JSONL / Parquet files."""

    path: Optional[str] = option(None, doc="prompt file (.jsonl / .parquet; rows: prompt or messages, answer); null: the arithmetic task's train split")
    eval_path: Optional[str] = option(None, doc="held-out prompt file; null: the arithmetic held-out split when path is null, else no evaluation")
    arith: ArithTaskConfig = option(ArithTaskConfig(), doc="the embedded arithmetic task (used when path is null)")
    tokenizer: TokenizerConfig = option(TokenizerConfig(), doc="tokenizer (the built-in character one by default)")
    max_prompt_length: int = option(64, doc="prompts with more tokens are dropped and counted")
    skip_invalid: bool = option(False, doc="skip and count malformed rows instead of failing on the first")
    template_prompts: bool = option(False, doc="wrap prompt strings as a user message through the chat template")
    shuffle: bool = option(True, doc="reshuffle the prompts every epoch (seeded by seed and epoch)")

    def __post_init__(self):
        if self.max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1, got {self.max_prompt_length}")


@dataclasses.dataclass
class RolloutConfig:
    """How responses are sampled."""

    group_size: int = option(8, doc="G: responses sampled per prompt")
    prompts_per_step: int = option(32, doc="prompts per step over all dp ranks (a multiple of dp)")
    temperature: float = option(1.0, doc="sampling temperature (> 0); log-probs use the same temperature")
    top_p: float = option(1.0, doc="nucleus sampling threshold (1 = off)")
    max_response_length: int = option(24, doc="generated tokens per response at most")
    old_logprobs: Literal["rollout", "recompute"] = option(
        "rollout", doc="old log-probs of the ratio: those recorded while sampling, or a fresh forward after it")

    def __post_init__(self):
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (advantages compare responses within a group), got {self.group_size}")
        if self.prompts_per_step < 1 or self.max_response_length < 1:
            raise ValueError("prompts_per_step and max_response_length must be >= 1")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclasses.dataclass
class AlgoConfig:
    """The objective: clipping, KL, loss aggregation, advantages, dynamic sampling, overlong handling, epochs."""

    eps_low: float = option(0.2, doc="lower clip: ratio >= 1 - eps_low")
    eps_high: Optional[float] = option(None, doc="upper clip, ratio <= 1 + eps_high (DAPO's clip-higher, e.g. 0.28); null: eps_low")
    dual_clip: Optional[float] = option(None, doc="dual-clip bound c > 1 for negative advantages (Ye et al. 2020); null: off")
    beta: float = option(0.0, doc="k3 KL coefficient against the reference; 0 skips the reference role entirely")
    loss_agg: str = option("token-mean", doc=f"loss aggregation: {', '.join(LOSS_AGGREGATIONS)}")
    advantage: Literal["grpo", "dr_grpo", "rloo"] = option("grpo", doc="group advantage mode")
    advantage_eps: float = option(1e-6, doc="added to the group std (grpo mode)")
    dynamic_sampling: bool = option(False, doc="drop groups whose rewards are all equal and generate more (DAPO)")
    max_sampling_rounds: int = option(3, doc="dynamic sampling: generation rounds per step at most")
    overlong: Literal["none", "mask", "penalty"] = option(
        "none", doc="responses cut at max_response_length: keep, mask out of the loss, or DAPO's soft length penalty")
    overlong_buffer: int = option(4, doc="penalty: tokens before the limit over which the penalty ramps to -1")
    mini_batches: int = option(1, doc="optimizer updates per epoch over the step's responses")
    ppo_epochs: int = option(1, doc="passes over the step's responses")
    micro_batch_size: int = option(64, doc="responses per forward on each rank (gradient accumulation)")

    def __post_init__(self):
        if self.loss_agg not in LOSS_AGGREGATIONS:
            raise ValueError(f"loss_agg must be one of {list(LOSS_AGGREGATIONS)}, got {self.loss_agg!r}")
        if self.beta < 0 or self.eps_low < 0 or (self.eps_high is not None and self.eps_high < 0):
            raise ValueError("beta, eps_low and eps_high must be >= 0")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip}")
        for name in ("max_sampling_rounds", "overlong_buffer", "mini_batches", "ppo_epochs", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclasses.dataclass
class GRPOEvalConfig:
    """Held-out greedy accuracy (`math_accuracy`) before training, every N steps and at the end."""

    every: int = option(0, doc="evaluate every N steps (0: only before and after training)")
    max_samples: Optional[int] = option(None, doc="evaluate the first N held-out prompts; null: all; 0: no evaluation")
    batch_size: int = option(128, doc="prompts per generation batch on each dp rank")

    def __post_init__(self):
        if self.every < 0 or self.batch_size < 1 or (self.max_samples is not None and self.max_samples < 0):
            raise ValueError("every and max_samples must be >= 0, batch_size >= 1")


@dataclasses.dataclass
class GRPOConfig:
    """One GRPO run (`launch/train_grpo.py --config ... key.sub=value`)."""

    run_dir: str = option("runs/grpo_arith", doc="output folder: config.yaml, metrics.jsonl, tensorboard/, checkpoints/, hf/")
    steps: int = option(60, doc="training steps (one rollout + its updates each)")
    seed: int = option(0, doc="seed of sampling, data order and every RNG")
    device: Literal["auto", "cpu", "cuda"] = option("auto", doc="auto: CUDA when available")
    actor: ActorConfig = option(ActorConfig(), doc="the policy")
    reference: ModelRoleConfig = option(ModelRoleConfig(), doc="the frozen reference (built only when algo.beta > 0)")
    reward: RewardConfig = option(RewardConfig(), doc="the reward")
    data: GRPODataConfig = option(GRPODataConfig(), doc="prompts")
    rollout: RolloutConfig = option(RolloutConfig(), doc="sampling")
    algo: AlgoConfig = option(AlgoConfig(), doc="objective")
    optim: OptimConfig = option(OptimConfig(lr=1e-4, schedule="constant", warmup_steps=5), doc="optimizer and LR schedule (per step)")
    eval: GRPOEvalConfig = option(GRPOEvalConfig(), doc="held-out evaluation")
    save_every: int = option(20, doc="checkpoint every N steps (and after the last); 0: only after the last")
    keep_last: int = option(2, doc="completed checkpoints to keep")
    resume: str = option("auto", doc="'auto' (latest checkpoint in run_dir, if any), 'none', a step number or a checkpoint folder")
    export_hf: bool = option(True, doc="write the final actor in HF format to run_dir/hf")
    tensorboard: bool = option(True, doc="also write TensorBoard scalars")

    def __post_init__(self):
        if self.steps < 1 or self.keep_last < 1 or self.save_every < 0 or self.seed < 0:
            raise ValueError("steps and keep_last must be >= 1, save_every and seed >= 0")


@dataclasses.dataclass
class GRPOResult:
    """What a run reports back."""

    step: int
    accuracy_before: Optional[float]
    """Held-out accuracy of the initial policy (measured at step 0, kept across resumes)."""
    accuracy_after: Optional[float]
    metrics: list[dict[str, float]]
    """This invocation's per-step metrics."""
    hf_path: Optional[str]


def _layout(tp: int, device_type: str, layouts: dict[int, ParallelLayout]) -> ParallelLayout:
    if tp not in layouts:
        layouts[tp] = ParallelLayout.build(tp=tp, device_type=device_type)
    return layouts[tp]


def _check_role_tp(name: str, tp: int, actor_tp: int) -> None:
    """A role sees the actor's batches; its tp group must lie inside one actor tp group (same data)."""
    if actor_tp % tp:
        raise ValueError(f"{name}.tp={tp} must divide actor.tp={actor_tp}: a role's tp ranks must hold the same "
                         f"batch, which they do inside one actor tp group")


def prompt_datasets(cfg: GRPODataConfig, tokenizer: Tokenizer, run_dir: str) -> tuple[PromptDataset, Optional[PromptDataset]]:
    """(training prompts, held-out prompts or None); the arithmetic splits are written to run_dir/data first."""
    load = dict(tokenizer=tokenizer, max_prompt_length=cfg.max_prompt_length, skip_invalid=cfg.skip_invalid,
                template_prompts=cfg.template_prompts)
    path, eval_path = cfg.path, cfg.eval_path
    if path is None:
        train, held_out = make_splits(cfg.arith)
        path = os.path.join(run_dir, "data", "arith_train.jsonl")
        write_jsonl(train, path)  # atomic: ranks racing to write the same file are safe
        if eval_path is None:
            eval_path = os.path.join(run_dir, "data", "arith_held_out.jsonl")
            write_jsonl(held_out, eval_path)
    return load_prompts(path, **load), (load_prompts(eval_path, **load) if eval_path is not None else None)


def _concat(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Batches of one set of keys, concatenated along the response dim 0 (shapes are fixed per run)."""
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


class _RankState:
    """Per-rank trainer state for the checkpoint: the rollout generator and the reward error counters."""

    def __init__(self, rank: int, generator: torch.Generator, reward: Reward):
        self.key, self.generator, self.reward = f"rank{rank}", generator, reward

    def state_dict(self) -> dict[str, Any]:
        return {self.key: {"generator": self.generator.get_state(), "reward": self.reward.state_dict()}}

    def load_state_dict(self, state) -> None:
        self.generator.set_state(state[self.key]["generator"])
        self.reward.load_state_dict(state[self.key]["reward"])


class GRPOTrainer:
    """The roles, data and loop of one run; `train()` runs it (see the module doc)."""

    def __init__(self, cfg: GRPOConfig):
        self.cfg = cfg
        device_type = "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"
        layouts: dict[int, ParallelLayout] = {}
        self.layout = _layout(cfg.actor.tp, device_type, layouts)
        if cfg.rollout.prompts_per_step % self.layout.dp:
            raise ValueError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must be a multiple of dp={self.layout.dp}")
        self.rank = dist.get_rank()
        if self.rank == 0:
            os.makedirs(cfg.run_dir, exist_ok=True)
            save_config(cfg, os.path.join(cfg.run_dir, "config.yaml"))
        torch.manual_seed(cfg.seed)
        self.tokenizer = build_tokenizer(cfg.data.tokenizer)
        self.train_set, self.held_out = prompt_datasets(cfg.data, self.tokenizer, cfg.run_dir)
        self.prompt_width = max(len(e.prompt_ids) for e in self.train_set.examples)

        model = from_pretrained(cfg.actor.path, layout=self.layout)
        precision = MixedPrecision(DTYPES[cfg.actor.dtype] if cfg.actor.dtype != "fp32" else None)
        self.actor = Actor(model, self.layout, precision, cfg.actor.offload_weights, cfg.actor.offload_optimizer,
                           build_optimizer(model, cfg.optim, self.layout), cfg.optim.grad_clip)
        self.reference = None
        if cfg.algo.beta > 0:
            _check_role_tp("reference", cfg.reference.tp, cfg.actor.tp)
            ref_layout = _layout(cfg.reference.tp, device_type, layouts)
            ref_model = from_pretrained(cfg.reference.path or cfg.actor.path, layout=ref_layout,
                                        dtype=DTYPES[cfg.reference.dtype])
            self.reference = Reference(ref_model, ref_layout, cfg.reference.offload_weights)
        reward_model, reward_layout = None, None
        if cfg.reward.model is not None:
            _check_role_tp("reward.model", cfg.reward.model.tp, cfg.actor.tp)
            reward_layout = _layout(cfg.reward.model.tp, device_type, layouts)
            reward_model = from_pretrained(cfg.reward.model.path, kind="reward", layout=reward_layout,
                                           dtype=DTYPES[cfg.reward.model.dtype])
        self.reward = Reward(cfg.reward, reward_model, reward_layout)
        self.roles: list[Role] = [r for r in (self.actor, self.reference, self.reward) if r is not None]

        self.sampler = PromptSampler(len(self.train_set), seed=cfg.seed, shuffle=cfg.data.shuffle,
                                     rank=self.layout.dp_rank, world_size=self.layout.dp)
        self.generator = torch.Generator(device=self.layout.device).manual_seed(cfg.seed * 1000003 + self.layout.dp_rank)
        self.progress = {"step": 0, "nan_skips": 0, "accuracy_before": -1.0}  # accuracy < 0: not measured
        self.checkpoints = CheckpointManager(cfg.run_dir, keep_last=cfg.keep_last)
        self.state = {"actor": ModelState(model, self.layout), "optim": OptimizerState(model, self.actor.optimizer, self.layout),
                      "rng": RNGState(), "sampler": self.sampler, "progress": self.progress,
                      "trainer": _RankState(self.rank, self.generator, self.reward)}
        self.timer = PhaseTimer()
        self.memory: dict[str, float] = {}
        self.params = SamplingParams(max_new_tokens=cfg.rollout.max_response_length,
                                     temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                     eos_token_id=self.tokenizer.eos_id, pad_token_id=self.tokenizer.pad_id)

    # ----- phases

    def _phase(self, name: str, **needs: tuple[str, ...]):
        """Enter phase `name`: each role gets the parts listed for it (none otherwise); record memory; time it."""
        for role in self.roles:
            role.need(*needs.get(role.name, ()))
        for role in self.roles:
            self.memory[f"memory/{name}/{role.name}_mib"] = role.resident_bytes() / 2**20
        return self.timer(name)

    def _rollout(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """G responses for each prompt of `indices`, scored: a dict of [N, ...] tensors (N = len * G)."""
        cfg, tok, device = self.cfg, self.tokenizer, self.layout.device
        examples = [self.train_set[i] for i in indices for _ in range(cfg.rollout.group_size)]
        ids = torch.full((len(examples), self.prompt_width), tok.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, e in enumerate(examples):
            ids[row, self.prompt_width - len(e.prompt_ids):] = torch.tensor(e.prompt_ids)
            mask[row, self.prompt_width - len(e.prompt_ids):] = 1
        with self._phase("generate", actor=("weights",)):
            out = self.actor.generate(ids.to(device), mask.to(device), self.params, self.generator)
        pad = cfg.rollout.max_response_length - out.logprobs.shape[1]
        response = torch.nn.functional.pad(out.sequences[:, self.prompt_width:], (0, pad), value=tok.pad_id)
        response_mask = torch.nn.functional.pad(out.attention_mask[:, self.prompt_width:], (0, pad))
        lengths = response_mask.sum(-1)
        last = response.gather(1, (lengths - 1).clamp(min=0)[:, None])[:, 0]
        finished = (lengths > 0) & (last == tok.eos_id)
        texts = [tok.decode(row[:n]) for row, n in zip(response.tolist(), lengths.tolist())]
        sequences = torch.cat([ids.to(device), response], 1)
        attention = torch.cat([mask.to(device), response_mask], 1)
        with self._phase("reward", reward=("weights",)):
            rewards, terms = self.reward.score([e.prompt_text for e in examples], texts, [e.answer for e in examples],
                                               [e.metadata for e in examples], sequences, attention)
        batch = {"sequences": sequences, "attention_mask": attention, "response_mask": response_mask.float(),
                 "rollout_logp": torch.nn.functional.pad(out.logprobs, (0, pad)), "lengths": lengths.float(),
                 "finished": finished, "rewards": rewards.to(device),
                 **{f"term/{name}": values.to(device) for name, values in terms.items()}}
        if cfg.algo.overlong == "penalty":
            batch["rewards"] = batch["rewards"] + overlong_penalty(lengths, cfg.rollout.max_response_length,
                                                                   cfg.algo.overlong_buffer)
        return batch

    def _collect(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, float]]:
        """(training batch of whole groups, every generated response, sampling counts) for this rank."""
        cfg = self.cfg
        per_rank, group = cfg.rollout.prompts_per_step // self.layout.dp, cfg.rollout.group_size
        kept: list[dict[str, torch.Tensor]] = []
        generated: list[dict[str, torch.Tensor]] = []
        have, rounds, dropped = 0, 0, 0
        rounds_allowed = cfg.algo.max_sampling_rounds if cfg.algo.dynamic_sampling else 1
        while True:
            indices = self.sampler.next_indices(per_rank)
            rounds += 1
            if have < per_rank:
                batch = self._rollout(indices)
                generated.append(batch)
                keep = torch.ones(per_rank, dtype=torch.bool, device=batch["rewards"].device)
                if cfg.algo.dynamic_sampling:
                    keep = informative_groups(batch["rewards"], group)
                    dropped += int((~keep).sum())
                rows = keep.repeat_interleave(group)
                kept.append({k: v[rows] for k, v in batch.items()})
                have += int(keep.sum())
            done = torch.tensor(float(have >= per_rank or rounds >= rounds_allowed))
            dist.all_reduce(done, op=dist.ReduceOp.MIN)  # every rank takes the same number of rounds
            if done.item():
                break
        train = {k: v[: per_rank * group] for k, v in _concat(kept).items()}
        return train, _concat(generated), {"rounds": rounds, "dropped_groups": dropped,
                                       "kept_groups": train["rewards"].numel() // group}

    def _logprob_inputs(self, batch, rows):
        return batch["sequences"][rows], batch["attention_mask"][rows], self.cfg.rollout.max_response_length

    def _score_logprobs(self, role, batch) -> torch.Tensor:
        """[N, R] no-grad log-probs of the batch's responses under `role`, in micro-batches."""
        n, step = batch["rewards"].numel(), self.cfg.algo.micro_batch_size
        parts = [role.logprobs(*self._logprob_inputs(batch, slice(s, s + step)), self.cfg.rollout.temperature)
                 for s in range(0, n, step)]
        return torch.cat(parts) if parts else batch["rollout_logp"].new_zeros(0, self.cfg.rollout.max_response_length)

    def _update(self, batch: dict[str, torch.Tensor], lr: float) -> dict[str, torch.Tensor]:
        """ppo_epochs x mini_batches optimizer updates on this rank's batch; local metric sums."""
        cfg, algo = self.cfg, self.cfg.algo
        set_lr(self.actor.optimizer, lr)
        n = batch["rewards"].numel()
        sums = torch.zeros(6, dtype=torch.float64)  # loss, then over tokens: clipped, approx kl, kl, entropy, count
        norms, skipped = [], 0
        for _ in range(algo.ppo_epochs):
            order = torch.randperm(n, generator=self.generator, device=self.generator.device)
            for rows in torch.tensor_split(order, algo.mini_batches):
                normalizer = loss_normalizer(batch["response_mask"][rows], algo.loss_agg, self.layout.dp_group)
                mini_loss = torch.zeros((), device=self.layout.device)
                for micro in torch.split(rows, algo.micro_batch_size):
                    if micro.numel() == 0:
                        continue  # this rank kept fewer responses; it still joins the collectives below
                    logp, entropy = self.actor.logprobs_with_grad(*self._logprob_inputs(batch, micro),
                                                                  cfg.rollout.temperature)
                    mask = batch["response_mask"][micro]
                    loss, stats = policy_loss(logp, batch["old_logp"][micro], batch["advantages"][micro], mask,
                                              algo.eps_low, algo.eps_high, algo.dual_clip, algo.beta,
                                              batch["ref_logp"][micro] if "ref_logp" in batch else None)
                    share = aggregate_loss(loss, mask, algo.loss_agg, normalizer, cfg.rollout.max_response_length)
                    share.backward()
                    mini_loss = mini_loss + share.detach()
                    count = stats.count
                    sums[1:] += torch.stack([stats.clip_frac * count, stats.approx_kl * count, stats.kl_mean * count,
                                             (entropy.detach() * mask).sum(), count]).double().cpu()
                stepped, norm = self.actor.optimizer_step(mini_loss)
                sums[0] += float(mini_loss)
                norms.append(norm)
                if not stepped:
                    skipped += 1
                    # progress["step"] counts finished steps: this is step + 1, as in metrics.jsonl and the checkpoints
                    logger.warning("step %d: non-finite loss or gradient norm; skipping this update",
                                   self.progress["step"] + 1)
        self.progress["nan_skips"] += skipped
        return {"sums": sums, "grad_norm": torch.stack(norms).mean(), "updates": algo.ppo_epochs * algo.mini_batches}

    def step(self) -> dict[str, float]:
        """One GRPO step (module doc); returns its metrics, reduced over ranks."""
        cfg, dp = self.cfg, self.layout.dp_group
        self.timer.reset()
        self.memory.clear()
        start = time.perf_counter()
        batch, generated, counts = self._collect()
        if cfg.algo.overlong == "mask":
            batch["response_mask"] = overlong_mask(batch["response_mask"], batch["finished"])
        batch["advantages"] = response_advantages(batch["rewards"], batch["response_mask"], cfg.rollout.group_size,
                                                  cfg.algo.advantage, cfg.algo.advantage_eps)
        if cfg.rollout.old_logprobs == "recompute":
            with self._phase("old_logprobs", actor=("weights",)):
                batch["old_logp"] = self._score_logprobs(self.actor, batch)
        else:
            batch["old_logp"] = batch["rollout_logp"]
        if self.reference is not None:
            with self._phase("reference", reference=("weights",)):
                batch["ref_logp"] = self._score_logprobs(self.reference, batch)
        lr = lr_at(cfg.optim, self.progress["step"], cfg.steps)
        with self._phase("update", actor=("weights", "optimizer")):
            update = self._update(batch, lr)
        # global statistics over dp: generated responses, then the update sums
        rewards, lengths = generated["rewards"].double().cpu(), generated["lengths"].double().cpu()
        accuracy = generated.get("term/math_accuracy", torch.zeros_like(generated["rewards"])).double().cpu()
        local = torch.cat([torch.tensor([rewards.sum(), (rewards ** 2).sum(), accuracy.sum(), lengths.sum(),
                                         (~generated["finished"].cpu()).double().sum(), rewards.numel(),
                                         counts["dropped_groups"], counts["kept_groups"]], dtype=torch.float64),
                           update["sums"]])
        total = all_reduce(local.to(self.layout.device), dp).cpu()
        n = total[5].clamp(min=1)
        tokens = total[13].clamp(min=1)
        elapsed = time.perf_counter() - start
        mean = total[0] / n
        metrics = {
            "reward/mean": mean, "reward/std": (total[1] / n - mean ** 2).clamp(min=0).sqrt(),
            "accuracy": total[2] / n, "response_length/mean": total[3] / n, "response_length/clip_ratio": total[4] / n,
            "sampling/rounds": counts["rounds"], "sampling/dropped_groups": total[6], "sampling/kept_groups": total[7],
            "actor/loss": total[8] / update["updates"], "actor/clip_frac": total[9] / tokens,
            "actor/approx_kl": total[10] / tokens, "actor/entropy": total[12] / tokens,
            "actor/grad_norm": update["grad_norm"], "actor/lr": lr, "nan_skips": self.progress["nan_skips"],
            "tokens_per_s": total[3] / max(self.timer.seconds.get("generate", 0.0), 1e-9), "time/step": elapsed,
        }
        if self.reference is not None:
            metrics["actor/kl"] = total[11] / tokens
        errors = torch.tensor(list(self.reward.error_counts().values()), dtype=torch.float64)
        if errors.numel():
            errors = all_reduce(errors.to(self.layout.device), dp).cpu()
            metrics.update(dict(zip(self.reward.error_counts(), errors.tolist())))
        metrics.update(self.train_set.stats.as_dict())  # rows left out at load (invalid, too long), every step
        metrics.update(self.timer.metrics())
        metrics.update(self.memory)
        metrics.update(memory_report())
        return {k: float(v) for k, v in metrics.items()}

    def evaluate(self) -> Optional[float]:
        """Held-out greedy accuracy of the actor (None without held-out prompts or with max_samples 0)."""
        if self.held_out is None or self.cfg.eval.max_samples == 0:
            return None
        with self._phase("eval", actor=("weights",)):
            accuracy, _ = evaluate(self.actor.model, self.held_out.examples, self.tokenizer,
                                   EvalConfig(max_samples=self.cfg.eval.max_samples, batch_size=self.cfg.eval.batch_size,
                                              max_new_tokens=self.cfg.rollout.max_response_length), self.layout)
        return accuracy

    def train(self) -> GRPOResult:
        cfg = self.cfg
        resume = self.checkpoints.resolve_resume(cfg.resume)
        if resume is not None:
            self.actor.need("weights", "optimizer")
            self.checkpoints.load(resume, self.state)
            logger.info("resumed from %s at step %d", resume, self.progress["step"])
        logger.info("GRPO: %d training prompts, %d held-out, G=%d, %d prompts/step, layout tp=%d dp=%d, roles %s",
                    len(self.train_set), len(self.held_out) if self.held_out else 0, cfg.rollout.group_size,
                    cfg.rollout.prompts_per_step, self.layout.tp, self.layout.dp, [r.name for r in self.roles])
        if self.progress["step"] == 0:
            before = self.evaluate()
            self.progress["accuracy_before"] = -1.0 if before is None else before
        history: list[dict[str, float]] = []
        log = MetricsLogger(cfg.run_dir, rank=self.rank, tensorboard=cfg.tensorboard, progress_total=cfg.steps,
                            initial_step=self.progress["step"])
        try:
            while self.progress["step"] < cfg.steps:
                metrics = self.step()
                self.progress["step"] += 1
                step = self.progress["step"]
                if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.steps:
                    metrics["eval/accuracy"] = self.evaluate()
                log.log(step, metrics)
                history.append({"step": step, **metrics})
                if step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0):
                    with self._phase("checkpoint", actor=("weights", "optimizer")):
                        self.checkpoints.save(step, self.state)
            self.actor.need("weights")
            hf_path = export_hf(self.actor.model, os.path.join(cfg.run_dir, "hf"), self.layout) if cfg.export_hf else None
            after = self.evaluate()
            if after is not None:
                log.log(self.progress["step"], {"eval/accuracy": after})
        finally:
            log.close()
        before = self.progress["accuracy_before"] if self.progress["accuracy_before"] >= 0 else None
        if self.rank == 0 and after is not None:
            evaluated = len(self.held_out) if cfg.eval.max_samples is None else min(cfg.eval.max_samples, len(self.held_out))
            print(accuracy_table(before, after, self.progress["step"], evaluated), flush=True)
        return GRPOResult(self.progress["step"], before, after, history, hf_path)


def accuracy_table(before: Optional[float], after: float, steps: int, prompts: int) -> str:
    """The before/after held-out accuracy table printed at the end of a run."""
    rows = [("initial policy (SFT)", "-" if before is None else f"{before:6.1%}"), (f"GRPO, {steps} steps", f"{after:6.1%}")]
    if before is not None:
        rows.append(("change", f"{(after - before) * 100:+.1f} points"))
    width = max(len(name) for name, _ in rows)
    lines = [f"held-out accuracy ({prompts} prompts, greedy)"] + [f"  {name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines)


def train_grpo(cfg: GRPOConfig) -> GRPOResult:
    """Run GRPO as configured; every rank calls it after `init_distributed`."""
    return GRPOTrainer(cfg).train()
