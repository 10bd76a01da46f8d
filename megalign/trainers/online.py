"""The online (RL) family on the trainer skeleton: colocated roles, rollouts and scoring; GRPO and PPO plug in here.

`OnlineTrainer` builds the actor (trained, and generating with its own tp weights), the frozen
reference (only when the algorithm needs one) and the reward role, the prompt data and the rollout
generator, and gives subclasses the pieces of an RL step:

    `collect()`: prompts from the sampler -> actor generates G responses each -> reward scores them
    (verifiers behind SafeReward; a term failing on more than `reward.max_failure_fraction` of a
    step's samples stops the run; reward-model roles, `megalign.roles.reward`; process reward models
    give per-token step rewards, `RolloutBatch.token_rewards`, only for trainers that set
    `token_level_rewards`) -> [`shape_rewards`] -> [`keep_groups`: e.g. dynamic sampling, more
    rounds] -> a `RolloutBatch` of whole groups
    `score_logprobs(role, batch)`: no-grad log-probs of the responses under a role, in micro-batches
    `train_role(...)`: the epochs x mini-batches x micro-batches update of a role on a loss per response
    token (GRPO, PPO), or per any other unit (`units`: online DPO's pairs)
    `rollout_sums(generated)` / `step_metrics(...)`: the metrics GRPO, PPO and online DPO share (reward, lengths,
    errors, data, timers, memory)

The algorithm (advantages, losses, updates, its metrics) is the subclass's `train_step`; a subclass
may add roles (PPO's critic, `megalign.trainers.ppo`) to `self.roles`, and phases then place them too;
`megalign.trainers.online_dpo` replaces the policy gradient by the DPO loss on pairs of the rollout.

Design choices:

- Shapes are fixed per run: prompts are left-padded to the longest prompt of the dataset and
  responses right-padded to `max_response_length`, so rounds of sampling concatenate without
  re-padding. The scoring and training forwards of the roles then pack each row's real tokens
  (`rollout.pack`, `megalign.roles.packing`; at pp > 1 one pack a pipeline micro-batch; only forwards
  whose rows' real tokens fill at most `rollout.pack_max_fill` of the padded rows), so long-tail
  lengths cost what they hold; with `rollout.pack=false` they run on the padded rows. At start-up the longest prompt plus the response
  length is checked against every model's `max_position_embeddings`.
- Data parallelism: each dp rank samples its own prompts (`PromptSampler` with the dp rank) and keeps
  its own groups. Sampling rounds are agreed over all ranks (one all-reduce per round) so sampler
  positions stay aligned: a rank that already has its groups still advances its sampler but
  generates nothing. Ranks may then hold different numbers of samples.
- Randomness of rollouts comes from one `torch.Generator` per rank seeded with (seed, dp rank) and
  checkpointed with the step, the sampler position and the reward error counters; each rollout draws
  its engine seed from it (`megalign.rollout.rollout`: one counter-based stream per sample).
- Rollouts go through `megalign.rollout.rollout`: each prompt is prefilled once for its G samples and
  finished rows leave the decode batch (`rollout.engine`); `rollout_metrics` holds the step's prefill
  and decode throughputs (this rank's) for the algorithm's metrics.
- Layouts: each role has its own tp x pp (`role_layout`, dp = world / (tp x pp)); a role's replica must lie
  inside one actor replica (`check_same_batch`), because data never moves between layouts: every rank of
  an actor tp x pp replica holds the replica's whole rollout batch (its stages sample the same prompts
  and get the same `pipeline_rollout` output), a pp = 1 role scores it on every rank, and a pp > 1
  role's scores (log-probs, the PPO critic's values) are broadcast from its last stage over its pp group
  (`PolicyRole.pipeline_scores`, through `score_responses`). The update at pp > 1 runs each mini-batch
  through 1F1B (`train_role`: `micro_loss(rows, hidden)` gets the last stage's hidden states); a trained
  role with more dp replicas than the actor (a pp = 1 critic beside a pp = 2 actor) trains each copy on
  the same batch and divides the summed gradient by the copies (`batch_copies`). Micro-batches are
  `algo.micro_batch_size` rows at every pp (`<role>.microbatches` must stay 0); with `rollout.pack` a
  pipelined forward takes one pack a micro-batch instead (`megalign.roles.packing.pipeline_packs`). A reward
  model at pp > 1 scores its pp group's batch by the forward-only schedule (`megalign.roles.reward`).
- Placement: every role lives on every rank; before each phase every role is told which of its parts
  the phase needs (`Role.need`), and roles offload the rest when their switch is on. Memory per role
  and phase is logged as `memory/<phase>/<role>_mib`.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable, Literal, Optional

import torch
import torch.distributed as dist

from megalign.algos.aggregation import aggregate_loss, loss_normalizer
from megalign.checkpoint import ModelState, OptimizerState, export_hf
from megalign.config import option
from megalign.data import PromptDataset, PromptSampler, Tokenizer, load_prompts, make_splits, write_jsonl
from megalign.models import ModelConfig, from_pretrained, stage_from_pretrained
from megalign.parallel import MicroBatchSums, MixedPrecision, ParallelLayout, Pipeline
from megalign.parallel.collectives import all_reduce
from megalign.roles import (DTYPES, Actor, ModelRoleConfig, Reference, Reward, RewardConfig, Role, TrainableRole,
                            TrainedRoleConfig)
from megalign.roles.reward import OutcomeReward, ProcessReward, RewardModelConfig, check_safety_field
from megalign.trainers.prm import load_prm_info
from megalign.rollout import EngineConfig, RolloutStats, SamplingParams
from megalign.trainers.base import (DataConfig, MetricSums, RunConfig, Trainer, check_model_path, check_same_batch,
                                    check_stages)
from megalign.trainers.evaluation import EvalConfig, eval_count, evaluate_generation
from megalign.trainers.logging import memory_report
from megalign.trainers.optim import OptimConfig, build_optimizer, set_lr

logger = logging.getLogger(__name__)


def check_microbatches(key: str, cfg: ModelRoleConfig) -> None:
    """ValueError naming `key`.microbatches unless it is 0: the online trainers' pipeline micro-batches are
    `algo.micro_batch_size` rows (module doc), so the key would be ignored."""
    if cfg.microbatches:
        raise ValueError(f"{key}.microbatches={cfg.microbatches}: the online trainers split each rank's responses "
                         f"into pipeline micro-batches of algo.micro_batch_size rows; leave {key}.microbatches at 0")


@dataclasses.dataclass
class ActorConfig(TrainedRoleConfig):
    """The policy: an HF checkpoint (e.g. the SFT export `run_dir/hf`), its layout, dtype and offload."""

    path: Optional[str] = option("runs/sft_arith/hf", doc="HF checkpoint folder of the initial policy")
    offload_optimizer: bool = option(False, doc="move the optimizer state to host memory outside the update phase")
    head_chunk_tokens: int = option(1024, doc="tokens per chunk of the fused LM head in the actor's log-probs: its only "
                                              "[tokens, vocab / tp] temporary is one [head_chunk_tokens, vocab / tp] "
                                              "logits chunk in the compute dtype (fp32 at vocab 151936: 594 MiB at "
                                              "1024, 148 MiB at 256); smaller saves memory, with smaller matmuls")

    def __post_init__(self):
        super().__post_init__()
        if not self.path:
            raise ValueError("actor.path (an HF checkpoint folder) is required")
        if self.head_chunk_tokens < 1:
            raise ValueError(f"actor.head_chunk_tokens must be >= 1, got {self.head_chunk_tokens}")


@dataclasses.dataclass
class PromptDataConfig(DataConfig):
    """Prompts with verifiable answers: the embedded arithmetic task, or JSONL / Parquet files."""

    path: Optional[str] = option(None, doc="prompt file (.jsonl / .parquet; rows: prompt or messages, answer); null: the arithmetic task's train split")
    max_prompt_length: int = option(64, doc="prompts with more tokens are dropped and counted")

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
    engine: EngineConfig = option(EngineConfig(), doc="how the rollout engine batches (max_batch, sync_every, static, "
                                                      "cuda_graphs); it never changes the samples")
    pack: bool = option(True, doc="scoring and training forwards (actor, reference, critic) run on the rows' real tokens "
                                  "packed (cu_seqlens) instead of padded rows; the same log-probs and values (at pp > 1: one pack a pipeline "
                                  "micro-batch)")
    pack_tokens: Optional[int] = option(None, doc="tokens per packed forward at most (null: one padded row, longest "
                                                  "prompt + max_response_length; larger pays off with flash-attn)")
    pack_max_fill: float = option(0.5, doc="pack a forward's rows only when their real tokens fill at most this fraction "
                                           "of the padded rows (1.0: always): packing runs one trunk forward per pack, "
                                           "which on nearly full rows costs more than it saves")

    def __post_init__(self):
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (advantages compare responses within a group), got {self.group_size}")
        if self.prompts_per_step < 1 or self.max_response_length < 1:
            raise ValueError("prompts_per_step and max_response_length must be >= 1")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.pack_tokens is not None and self.pack_tokens < 1:
            raise ValueError(f"pack_tokens must be >= 1 (or null), got {self.pack_tokens}")
        if not 0 <= self.pack_max_fill <= 1:
            raise ValueError(f"pack_max_fill must be in [0, 1], got {self.pack_max_fill}")


@dataclasses.dataclass
class OnlineConfig(RunConfig):
    """What every online run has besides its algorithm: roles, prompts, sampling, optimizer, evaluation."""

    actor: ActorConfig = option(ActorConfig(), doc="the policy")
    reference: ModelRoleConfig = option(ModelRoleConfig(), doc="the frozen reference (built only when the algorithm needs it)")
    reward: RewardConfig = option(RewardConfig(), doc="the reward")
    data: PromptDataConfig = option(PromptDataConfig(), doc="prompts")
    rollout: RolloutConfig = option(RolloutConfig(), doc="sampling")
    optim: OptimConfig = option(OptimConfig(lr=1e-4, schedule="constant", warmup_steps=5), doc="optimizer and LR schedule (per step)")
    eval: EvalConfig = option(EvalConfig(), doc="held-out greedy evaluation before training, every N steps and at the end")


@dataclasses.dataclass
class RolloutBatch:
    """N scored responses (N = groups x G, whole groups, group members adjacent) and what the update adds.

    Shapes: `sequences` / `attention_mask` [N, P + R] (left-padded prompt, right-padded response);
    [N, R]: `response_mask` (fp32 1 for response tokens that train), `rollout_logp` (sampling
    log-probs), and later `old_logp`, `ref_logp`, `advantages`; [N]: `lengths` (fp32 response
    tokens), `finished` (ended with EOS), `rewards` (fp32 total), `terms` {term: [N] values};
    `token_rewards` [N, R] fp32: the process reward models' step rewards (None without any).
    """

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    rollout_logp: torch.Tensor
    lengths: torch.Tensor
    finished: torch.Tensor
    rewards: torch.Tensor
    terms: dict[str, torch.Tensor]
    old_logp: Optional[torch.Tensor] = None
    ref_logp: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    token_rewards: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return self.rewards.numel()

    def select(self, rows) -> "RolloutBatch":
        """The rows `rows` (indices, a slice or a bool mask) of every per-response tensor."""
        pick = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return RolloutBatch(**{k: ({t: v[rows] for t, v in value.items()} if k == "terms" else
                                   None if value is None else value[rows]) for k, value in pick.items()})

    @staticmethod
    def concat(batches: list["RolloutBatch"]) -> "RolloutBatch":
        """Batches (of one run: fixed shapes) concatenated along the response dim 0."""
        out = {}
        for f in dataclasses.fields(RolloutBatch):
            values = [getattr(b, f.name) for b in batches]
            if f.name == "terms":
                out[f.name] = {t: torch.cat([v[t] for v in values]) for t in values[0]}
            else:
                out[f.name] = None if values[0] is None else torch.cat(values)
        return RolloutBatch(**out)


def prompt_datasets(cfg: PromptDataConfig, tokenizer: Tokenizer, run_dir: str) -> tuple[PromptDataset, Optional[PromptDataset]]:
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


class _RankState:
    """Per-rank trainer state for the checkpoint: the rollout generator and the reward error counters.

    Resumed on another dp size, a rank that has no saved entry keeps its fresh generator (seeded by
    seed and dp rank, as at step 0) and zero error counters; entries of ranks that no longer exist
    are not read, so the cumulative error counts restart from the remaining ranks' counts.
    """

    def __init__(self, rank: int, generator: torch.Generator, reward: Reward):
        self.key, self.generator, self.reward = f"rank{rank}", generator, reward

    def state_dict(self) -> dict[str, Any]:
        return {self.key: {"generator": self.generator.get_state(), "reward": self.reward.state_dict()}}

    def load_target(self, name: str, saved) -> dict[str, Any]:
        """What to read from checkpoint `saved` (`megalign.checkpoint.state.Reshardable`): this rank's entry, if any."""
        return self.state_dict() if self.key in {k.split(".")[0] for k in saved.under(name)} else {}

    def load_state_dict(self, state) -> None:
        if not state:
            return  # a rank new to this dp size (class doc)
        self.generator.set_state(state[self.key]["generator"])
        self.reward.load_state_dict(state[self.key]["reward"])


class OnlineTrainer(Trainer):
    """Roles, prompts and rollouts of an RL run (module doc); subclasses implement `train_step`."""

    eval_before = True
    token_level_rewards = False
    """Whether the algorithm trains on per-token rewards (`RolloutBatch.token_rewards`); process reward
    models are refused otherwise (their step rewards would be dropped)."""

    def needs_reference(self) -> bool:
        """Whether the algorithm uses the frozen reference (it is built only then)."""
        return False

    def trained_models(self) -> list[tuple[str, Optional[str]]]:
        return [("actor.path", self.cfg.actor.path)]

    def free_keys(self) -> tuple[str, ...]:
        keys = ("actor.offload_weights", "actor.offload_optimizer", "reference.offload_weights")
        return keys + (("reward.model.offload_weights",) if self.cfg.reward.model is not None else ())

    def __init__(self, cfg: OnlineConfig):
        super().__init__(cfg)
        check_microbatches("actor", cfg.actor)
        self.layout = self.layout_for(cfg.actor.tp, cfg.actor.pp, "actor")
        if cfg.rollout.prompts_per_step % self.layout.dp:
            raise ValueError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must be a multiple of dp={self.layout.dp}")
        check_model_path(cfg.actor.path, "actor.path")
        if self.needs_reference() and cfg.reference.path is not None:
            check_model_path(cfg.reference.path, "reference.path")
        for key, model_cfg in cfg.reward.reward_models():
            check_model_path(model_cfg.path, f"{key}.path")
            if model_cfg.kind == "process" and not self.token_level_rewards:
                raise ValueError(f"{key} ({model_cfg.name!r}) is a process reward model, whose step rewards need an "
                                 f"algorithm that trains on per-token rewards (PPO); {self.name} uses one score per response")
        self.tokenizer = self.build_tokenizer(cfg.data.tokenizer, cfg.actor.path)
        self.train_set, self.held_out = prompt_datasets(cfg.data, self.tokenizer, cfg.run_dir)
        if cfg.reward.gated is not None:
            check_safety_field(self.train_set.examples, cfg.reward.gated.safety_field)
        self.prompt_width = max(len(e.prompt_ids) for e in self.train_set.examples)
        longest = self.prompt_width + cfg.rollout.max_response_length
        what = f"the longest prompt plus rollout.max_response_length ({cfg.rollout.max_response_length})"
        if self.held_out is not None and len(self.held_out):
            eval_longest = (max(len(e.prompt_ids) for e in self.held_out.examples)
                            + (cfg.eval.max_new_tokens or cfg.rollout.max_response_length))
            if eval_longest > longest:
                longest, what = eval_longest, "the longest held-out prompt plus the evaluation's max_new_tokens"

        self.longest = (longest, what)  # for roles a subclass adds (the PPO critic): `check_model`'s length
        model = self.load_role_model("actor", cfg.actor, self.layout,
                                     activation_checkpointing=cfg.actor.activation_checkpointing)
        self.check_model(model, "actor.path", cfg.actor.path, longest, what)
        precision = MixedPrecision(DTYPES[cfg.actor.dtype] if cfg.actor.dtype != "fp32" else None)
        self.actor = Actor(model, self.layout, precision, cfg.actor.offload_weights, cfg.actor.offload_optimizer,
                           build_optimizer(model, cfg.optim, self.layout), cfg.optim.grad_clip,
                           head_chunk_tokens=cfg.actor.head_chunk_tokens, **self.packing("actor", self.layout))
        self.reference = None
        if self.needs_reference():
            ref_layout = self.role_layout("reference", cfg.reference)
            ref_model = self.load_role_model("reference", cfg.reference, ref_layout, cfg.reference.path or cfg.actor.path,
                                             dtype=DTYPES[cfg.reference.dtype])
            self.check_model(ref_model, "reference.path", cfg.reference.path or cfg.actor.path, longest, what)
            self.reference = Reference(ref_model, ref_layout, cfg.reference.offload_weights,
                                       **self.packing("reference", ref_layout))
        self.reward = Reward(cfg.reward, [self.reward_model(key, model_cfg, longest, what)
                                          for key, model_cfg in cfg.reward.reward_models()])
        self.roles: list[Role] = [r for r in (self.actor, self.reference) if r is not None] + self.reward.models

        self.sampler = PromptSampler(len(self.train_set), seed=cfg.seed, shuffle=cfg.data.shuffle,
                                     rank=self.layout.dp_rank, world_size=self.layout.dp)
        self.generator = torch.Generator(device=self.layout.device).manual_seed(cfg.seed * 1000003 + self.layout.dp_rank)
        self.register_state("actor", ModelState(model, self.layout))
        self.register_state("optim", OptimizerState(model, self.actor.optimizer, self.layout))
        self.register_state("sampler", self.sampler)
        self.register_state("trainer", _RankState(self.rank, self.generator, self.reward))
        self.memory: dict[str, float] = {}
        self.rollout_stats, self.rollout_metrics = RolloutStats(), {}
        self.params = SamplingParams(max_new_tokens=cfg.rollout.max_response_length,
                                     temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                     eos_token_id=self.tokenizer.eos_id, pad_token_id=self.tokenizer.pad_id)

    def role_layout(self, key: str, cfg: ModelRoleConfig) -> ParallelLayout:
        """The layout of role `key` (its `tp` x `pp`), checked to see the actor's batches (`check_same_batch`: a
        role at pp = 1 beside a pp > 1 actor scores the batch on every rank of the actor's pp group)."""
        check_microbatches(key, cfg)
        layout = self.layout_for(cfg.tp, cfg.pp, key)
        check_same_batch(layout, key, self.layout, "actor")
        return layout

    def load_role_model(self, key: str, cfg: ModelRoleConfig, layout: ParallelLayout, path: Optional[str] = None,
                        **kwargs):
        """Role `key`'s model from `path` (default `cfg.path`) on `layout`: this rank's pipeline stage when pp > 1
        (layers split evenly, checked naming the key), else the whole (tp-sharded) model."""
        path = path or cfg.path
        if layout.pp == 1:
            return from_pretrained(path, layout=layout, **kwargs)
        check_stages(ModelConfig.from_hf(path).num_hidden_layers, layout.pp, key, f"{key} {path!r}")
        return stage_from_pretrained(path, layout, **kwargs)

    def reward_model(self, key: str, cfg: RewardModelConfig, longest: int, what: str):
        """The reward-model role of config `key` on its own layout (its pipeline stage at pp > 1) and dtype, checked
        against the run."""
        layout = self.role_layout(key, cfg)
        if cfg.kind == "outcome":
            model = self.load_role_model(key, cfg, layout, kind="reward", dtype=DTYPES[cfg.dtype])
            self.check_model(model, f"{key}.path", cfg.path, longest, what)
            return OutcomeReward(cfg, model, layout)
        info = load_prm_info(cfg.path)
        tokens = {}
        for side in ("negative", "positive"):
            encoded = self.tokenizer.encode(info[f"{side}_token"])
            if encoded != [info[f"{side}_token_id"]]:
                raise ValueError(f"{key}.path={cfg.path!r}: its prm.json {side}_token {info[f'{side}_token']!r} is id "
                                 f"{info[f'{side}_token_id']} but the run's tokenizer encodes it as {encoded}: the PRM "
                                 f"was trained with another tokenizer")
            tokens[side] = encoded[0]
        separator = self.tokenizer.encode(info["separator"])
        if not separator:
            raise ValueError(f"{key}.path={cfg.path!r}: its step separator {info['separator']!r} encodes to no token")
        model = self.load_role_model(key, cfg, layout, dtype=DTYPES[cfg.dtype])
        # a finished response's last step is read with the separator in place of its EOS (`prm_inputs`)
        self.check_model(model, f"{key}.path", cfg.path, longest + len(separator) - 1, what + " and the step separator")
        return ProcessReward(cfg, model, layout, (tokens["negative"], tokens["positive"]), separator,
                             self.tokenizer.eos_id)

    def packing(self, key: str, layout: ParallelLayout) -> dict[str, Any]:
        """Role `key`'s packing switches (`megalign.roles.packing`), from `rollout.pack`, `pack_tokens`,
        `pack_max_fill` (at pp > 1: one pack a pipeline micro-batch, `pipeline_packs`)."""
        rollout = self.cfg.rollout
        return {"pack": rollout.pack, "pack_tokens": rollout.pack_tokens, "pack_max_fill": rollout.pack_max_fill}

    def batch_copies(self, layout: ParallelLayout) -> int:
        """How many dp replicas of a role on `layout` hold the same batch: its dp over the actor's (`check_same_batch`
        put each of its replicas inside one actor replica); `TrainableRole` divides its summed gradient by it."""
        return layout.dp // self.layout.dp

    def check_pipeline_batch(self, key: str, layout: ParallelLayout, trained: bool, per_prompt: Optional[int] = None,
                             unit: str = "responses") -> None:
        """Start-up check of role `key` at pp > 1, naming the settings: each rank's responses (a fixed number when
        every step keeps all its groups; `per_prompt` units of `unit` a prompt in place of the group's responses,
        e.g. online DPO's one pair) split into pipeline micro-batches of `algo.micro_batch_size` units, at least
        pp of them per scoring forward and, for a `trained` role, per mini-batch."""
        cfg, algo = self.cfg, self.cfg.algo
        per_prompt = cfg.rollout.group_size if per_prompt is None else per_prompt
        rows = cfg.rollout.prompts_per_step * per_prompt // self.layout.dp
        mini = algo.mini_batches if trained else 1
        if layout.pp == 1 or (rows % mini == 0 and (rows // mini) % algo.micro_batch_size == 0
                              and rows // mini // algo.micro_batch_size >= layout.pp):
            return
        what = f"algo.mini_batches={mini} mini-batches of " if trained else ""
        times = f"rollout.group_size={cfg.rollout.group_size}" if unit == "responses" else f"{per_prompt}"
        raise ValueError(f"{key}.pp={layout.pp}: each rank's {rows} {unit} (rollout.prompts_per_step="
                         f"{cfg.rollout.prompts_per_step} x {times} / dp={self.layout.dp}) must split into "
                         f"{what}at least pp={layout.pp} micro-batches of algo.micro_batch_size={algo.micro_batch_size} "
                         f"{'rows' if unit == 'responses' else unit}")

    # ----- phases

    def place(self, name: str, **needs: tuple[str, ...]) -> None:
        """Before phase `name`: each role gets the parts listed for it (none otherwise); record memory."""
        for role in self.roles:
            role.need(*needs.get(role.name, ()))
        for role in self.roles:
            self.memory[f"memory/{name}/{role.name}_mib"] = role.resident_bytes() / 2**20

    def phase(self, name: str, **needs: tuple[str, ...]):
        """`place` the roles for phase `name`, then time it: `with self.phase("update", actor=(...)):`."""
        self.place(name, **needs)
        return self.timer(name)

    def prepare_checkpoint_io(self) -> None:
        self.place("checkpoint", actor=("weights", "optimizer"))

    def policy_role(self) -> Actor:
        return self.actor

    def shape_rewards(self, batch: RolloutBatch) -> None:
        """Adjust `batch.rewards` in place after scoring (e.g. DAPO's overlong penalty); default: nothing."""

    def keep_groups(self, batch: RolloutBatch) -> torch.Tensor:
        """bool [groups]: which groups of a sampling round train (e.g. DAPO's dynamic sampling); default: all."""
        return torch.ones(len(batch) // self.cfg.rollout.group_size, dtype=torch.bool, device=batch.rewards.device)

    def sampling_rounds(self) -> int:
        """Sampling rounds a step may take to fill its groups (more than one only when `keep_groups` drops some)."""
        return 1

    def rollout(self, indices: list[int]) -> RolloutBatch:
        """G responses for each prompt of `indices`, scored (N = len(indices) * G rows)."""
        cfg, tok, device = self.cfg, self.tokenizer, self.layout.device
        prompts = [self.train_set[i] for i in indices]
        examples = [e for e in prompts for _ in range(cfg.rollout.group_size)]
        prompt_ids = torch.full((len(prompts), self.prompt_width), tok.pad_id, dtype=torch.long)
        prompt_mask = torch.zeros_like(prompt_ids)
        for row, e in enumerate(prompts):
            prompt_ids[row, self.prompt_width - len(e.prompt_ids):] = torch.tensor(e.prompt_ids)
            prompt_mask[row, self.prompt_width - len(e.prompt_ids):] = 1
        with self.phase("generate", actor=("weights",)):
            out, stats = self.actor.generate(prompt_ids.to(device), prompt_mask.to(device), cfg.rollout.group_size,
                                             self.params, self.generator, cfg.rollout.engine)
        self.rollout_stats += stats
        ids, mask = out.sequences[:, :self.prompt_width], out.attention_mask[:, :self.prompt_width]
        pad = cfg.rollout.max_response_length - out.logprobs.shape[1]
        response = torch.nn.functional.pad(out.sequences[:, self.prompt_width:], (0, pad), value=tok.pad_id)
        response_mask = torch.nn.functional.pad(out.attention_mask[:, self.prompt_width:], (0, pad))
        lengths = response_mask.sum(-1)
        last = response.gather(1, (lengths - 1).clamp(min=0)[:, None])[:, 0]
        finished = (lengths > 0) & (last == tok.eos_id)
        texts = [tok.decode(row[:n]) for row, n in zip(response.tolist(), lengths.tolist())]
        sequences = torch.cat([ids, response], 1)
        attention = torch.cat([mask, response_mask], 1)
        with self.phase("reward", **self.reward.needs()):
            rewards, terms = self.reward.score([e.prompt_text for e in examples], texts, [e.answer for e in examples],
                                               [e.metadata for e in examples], sequences, attention)
            step_rewards, step_terms = self.reward.step_rewards(sequences, attention, cfg.rollout.max_response_length)
        terms.update(step_terms)
        batch = RolloutBatch(sequences=sequences, attention_mask=attention, response_mask=response_mask.float(),
                             rollout_logp=torch.nn.functional.pad(out.logprobs, (0, pad)), lengths=lengths.float(),
                             finished=finished, rewards=rewards.to(device),
                             terms={name: values.to(device) for name, values in terms.items()},
                             token_rewards=None if step_rewards is None else step_rewards.to(device))
        self.shape_rewards(batch)
        return batch

    def collect(self) -> tuple[RolloutBatch, RolloutBatch, dict[str, float]]:
        """(training batch of whole kept groups, every generated response, sampling counts) for this rank.

        Raises when a reward term failed on too many of this step's samples (module doc).
        """
        cfg = self.cfg
        per_rank, group = cfg.rollout.prompts_per_step // self.layout.dp, cfg.rollout.group_size
        counters = self.reward.counters()
        self.rollout_stats = RolloutStats()
        kept: list[RolloutBatch] = []
        generated: list[RolloutBatch] = []
        have, rounds, dropped, rounds_allowed = 0, 0, 0, self.sampling_rounds()
        while True:
            indices = self.sampler.next_indices(per_rank)
            rounds += 1
            if have < per_rank:
                batch = self.rollout(indices)
                generated.append(batch)
                keep = self.keep_groups(batch)
                dropped += int((~keep).sum())
                kept.append(batch.select(keep.repeat_interleave(group)))
                have += int(keep.sum())
            done = torch.tensor(float(have >= per_rank or rounds >= rounds_allowed))
            dist.all_reduce(done, op=dist.ReduceOp.MIN)  # every rank takes the same number of rounds
            if done.item():
                break
        self.reward.check_failures(counters, self.layout.dp_group, self.layout.device)
        self.rollout_metrics = self.rollout_stats.metrics()
        train = RolloutBatch.concat(kept).select(slice(0, per_rank * group))
        return train, RolloutBatch.concat(generated), {"rounds": rounds, "dropped_groups": dropped,
                                                       "kept_groups": len(train) // group}

    def logprob_inputs(self, batch: RolloutBatch, rows):
        """(sequences, attention mask, response length) of `rows`: the arguments of a role's log-prob forward."""
        return batch.sequences[rows], batch.attention_mask[rows], self.cfg.rollout.max_response_length

    def train_role(self, role: TrainableRole, lr: float, batch: RolloutBatch, names: tuple[str, ...],
                   micro_loss: Callable[..., tuple[torch.Tensor, list[torch.Tensor]]],
                   sums: MetricSums, prefix: str, units: Optional[torch.Tensor] = None,
                   unit_inputs: Optional[Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = None
                   ) -> list[torch.Tensor]:
        """`algo.ppo_epochs` x `algo.mini_batches` optimizer updates of `role` on this rank's batch.

        `micro_loss(rows)` gives the per-token loss [b, R] of a micro-batch and the sums named `names`
        (0-d tensors); at `role.layout.pp > 1` it is called as `micro_loss(rows, hidden)` on the last stage,
        with the trunk's output [b, P + R, H] for those rows (`_pipeline_update`). Each loss is aggregated
        with `algo.loss_agg` over the mini-batch's global count (`loss_normalizer`, every dp rank), so
        micro-batching, pp and dp do not change the gradient. The loss and the sums are added to `sums` as
        `prefix/<name>`, kept on the device (no host sync per micro-batch). Returns the gradient norm of each update. A rank with fewer rows than another still
        joins every collective (its empty micro-batches are skipped).

        `units` [n, T]: what the loss is aggregated over when it is not one row per response, in place of
        `batch.response_mask`; `micro_loss` then takes rows of `units`. Online DPO passes [pairs, 1] ones
        (one loss per pair, `loss_agg` token-mean: the mean over the global pairs). `unit_inputs(units rows)` ->
        (sequences, attention mask) [k b, T] are the pipeline's inputs for b units at pp > 1 (default: the batch's
        rows), k consecutive rows a unit: online DPO's interleaved chosen / rejected pair; `micro_loss` then gets
        the hidden states of those k b rows.
        """
        algo, dp = self.cfg.algo, self.layout.dp_group
        set_lr(role.optimizer, lr)
        local = torch.zeros(len(names), dtype=torch.float64, device=self.layout.device)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.layout.device)
        norms = []
        mask = batch.response_mask if units is None else units

        def share_of(micro: torch.Tensor, normalizer: torch.Tensor,
                     hidden: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
            """(this micro-batch's share of the mini-batch loss, its sums [len(names)] fp64)."""
            loss, stats = micro_loss(micro) if hidden is None else micro_loss(micro, hidden)
            share = aggregate_loss(loss, mask[micro], algo.loss_agg, normalizer,
                                   self.cfg.rollout.max_response_length)
            return share, torch.stack([s.detach().double() for s in stats])

        for _ in range(algo.ppo_epochs):
            order = torch.randperm(mask.shape[0], generator=self.generator, device=self.generator.device)
            for rows in torch.tensor_split(order, algo.mini_batches):
                normalizer = loss_normalizer(mask[rows], algo.loss_agg, dp)
                mini_loss = torch.zeros((), device=self.layout.device)
                if role.layout.pp > 1:
                    mini_loss, stats = self._pipeline_update(role, batch, rows, normalizer, share_of, len(names),
                                                             unit_inputs)
                    local += stats
                for micro in (torch.split(rows, algo.micro_batch_size) if role.layout.pp == 1 else ()):
                    if micro.numel() == 0:
                        continue
                    share, stats = share_of(micro, normalizer)
                    share.backward()
                    mini_loss = mini_loss + share.detach()
                    local += stats
                stepped, norm = role.optimizer_step(mini_loss)
                loss_sum += mini_loss.double()
                norms.append(norm)
                if not stepped:
                    self.skip_update("nan_skips", f"{role.name}: non-finite loss or gradient norm")
        if role.layout.pp > 1:  # the sums were taken on the last stage, where the loss runs; every pp rank logs them
            dist.broadcast(local, src=role.layout.stage_rank(role.layout.pp - 1), group=role.layout.pp_group)
        sums.add(f"{prefix}/loss", loss_sum)
        for name, value in zip(names, local):
            sums.add(f"{prefix}/{name}", value)
        return norms

    def _pipeline_update(self, role: TrainableRole, batch: RolloutBatch, rows: torch.Tensor, normalizer: torch.Tensor,
                         share_of: Callable, n_stats: int, unit_inputs: Optional[Callable] = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """One 1F1B forward + backward of mini-batch `rows` through `role`'s pipeline stages (pp > 1): micro-batches
        of `algo.micro_batch_size` rows, the trunk pipelined and `share_of(micro rows, normalizer, hidden)` (the
        algorithm's `micro_loss` on the last stage's hidden states, aggregated over the mini-batch's global
        count) as each micro-batch's loss, so the gradient equals the unpipelined loop's.

        Returns (the mini-batch loss, detached, on every pp rank; the summed statistics [n_stats] on the last
        stage, each micro-batch counted once: `MicroBatchSums`)."""
        size, layout = self.cfg.algo.micro_batch_size, role.layout
        if len(rows) % size or len(rows) // size < layout.pp:
            raise ValueError(f"{role.name} at pp={layout.pp}: a mini-batch of {len(rows)} responses must split into at "
                             f"least pp micro-batches of algo.micro_batch_size={size} (rollout.prompts_per_step x "
                             f"group_size / dp / algo.mini_batches)")
        sequences, attention_mask = ((batch.sequences[rows], batch.attention_mask[rows]) if unit_inputs is None
                                     else unit_inputs(rows))
        packs = role.pipeline_packs(sequences, attention_mask) if unit_inputs is None else None
        if packs is not None:
            return self._packed_pipeline_update(role, rows, packs, normalizer, share_of, n_stats)
        span = len(sequences) // len(rows)  # input rows a unit
        sums = MicroBatchSums(len(rows) // size, len(sequences), layout.device)

        def loss_fn(hidden: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
            share, stats = share_of(mb["rows"][::span], normalizer, hidden)
            sums.put("stats", mb["slot"], stats)
            return share

        with role.precision.autocast(layout.device):
            loss = Pipeline(role.model.model, layout, len(rows) // size).train_step(
                sequences, loss_fn, 1.0, attention_mask=attention_mask,
                batch={"rows": rows.repeat_interleave(span), "slot": sums.slots})
        return loss, sums.sums().get("stats", torch.zeros(n_stats, dtype=torch.float64, device=layout.device))

    def _packed_pipeline_update(self, role: TrainableRole, rows: torch.Tensor, packs, normalizer: torch.Tensor,
                                share_of: Callable, n_stats: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`_pipeline_update` with one pack of the mini-batch's rows a micro-batch (`PolicyRole.pipeline_packs`):
        on the last stage each pack's output goes back to its rows' padded layout (`PipelinePacks.unpack`) and
        `share_of` runs on those rows as on a padded micro-batch; a pack added to reach pp micro-batches holds no
        row and adds 0 (times its output, so its backward runs)."""
        layout, n = role.layout, len(packs.rows)
        sums = MicroBatchSums(n, n, layout.device)

        def loss_fn(hidden: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
            pack = int(mb["pack"][0])
            if not len(packs.rows[pack]):
                return hidden.sum() * 0.0
            share, stats = share_of(rows[packs.rows[pack]], normalizer, packs.unpack(pack, hidden))
            sums.put("stats", mb["slot"], stats)
            return share

        with role.precision.autocast(layout.device):
            loss = Pipeline(role.model.model, layout, n).train_step(
                packs.input_ids, loss_fn, 1.0, cu_seqlens=packs.cu_seqlens,
                batch={"pack": torch.arange(n, device=layout.device), "slot": sums.slots})
        return loss, sums.sums().get("stats", torch.zeros(n_stats, dtype=torch.float64, device=layout.device))

    def score_logprobs(self, role, batch: RolloutBatch, micro_batch_size: int) -> torch.Tensor:
        """[N, R] no-grad log-probs of the batch's responses under `role`, in micro-batches."""
        temperature = self.cfg.rollout.temperature
        return self.score_responses(role, batch, micro_batch_size,
                                    lambda *inputs: role.logprobs(*inputs, temperature),
                                    lambda *inputs: role.pipeline_logprobs(*inputs[:3], temperature, inputs[3]))

    def score_responses(self, role: Role, batch: RolloutBatch, micro_batch_size: int, score: Callable[..., torch.Tensor],
                        pipeline_score: Callable[..., torch.Tensor]) -> torch.Tensor:
        """[N, R] no-grad scores of the batch's responses under `role` (log-probs, values): at pp = 1
        `score(sequences, attention_mask, R)` per micro-batch of `micro_batch_size` rows, at pp > 1
        `pipeline_score(sequences, attention_mask, R, micro_batch_size)` on the whole batch (the forward-only
        schedule, the result on every rank of the role's pp group)."""
        response_len = self.cfg.rollout.max_response_length
        if role.layout.pp > 1:
            return pipeline_score(batch.sequences, batch.attention_mask, response_len, micro_batch_size)
        parts = [score(*self.logprob_inputs(batch, slice(s, s + micro_batch_size)))
                 for s in range(0, len(batch), micro_batch_size)]
        return torch.cat(parts) if parts else batch.rollout_logp.new_zeros(0, response_len)

    # ----- metrics shared by the algorithms

    @staticmethod
    def rollout_sums(generated: RolloutBatch) -> MetricSums:
        """The sums over every generated response that `step_metrics` turns into means (reward, terms, lengths)."""
        sums = MetricSums()
        rewards = generated.rewards.double()
        sums.add("reward", rewards.sum())
        sums.add("reward_sq", (rewards ** 2).sum())
        for name, values in generated.terms.items():
            sums.add(f"term/{name}", values.double().sum())
        sums.add("length", generated.lengths.sum())
        sums.add("unfinished", (~generated.finished).sum())
        sums.add("responses", len(generated))
        return sums

    def step_metrics(self, total: dict[str, float], terms, algorithm: dict[str, Any], start: float) -> dict[str, float]:
        """A step's metrics: the rollout's means (from `rollout_sums`, reduced into `total`; `terms`: the reward
        term names), the algorithm's own, reward error counts over dp, data, timer, memory and throughput."""
        n = max(total["responses"], 1.0)
        mean = total["reward"] / n
        metrics = {
            "reward/mean": mean, "reward/std": max(total["reward_sq"] / n - mean ** 2, 0.0) ** 0.5,
            **{f"reward/{name}/mean": total[f"term/{name}"] / n for name in terms},
            "response_length/mean": total["length"] / n, "response_length/clip_ratio": total["unfinished"] / n,
            **algorithm,
            "tokens_per_s": total["length"] / max(self.timer.seconds.get("generate", 0.0), 1e-9),
        }
        if self.cfg.eval.metric in terms:
            metrics["accuracy"] = metrics[f"reward/{self.cfg.eval.metric}/mean"]
        errors = torch.tensor(list(self.reward.error_counts().values()), dtype=torch.float64)
        if errors.numel():
            errors = all_reduce(errors.to(self.layout.device), self.layout.dp_group).cpu()
            metrics.update(dict(zip(self.reward.error_counts(), errors.tolist())))
        metrics.update(self.train_set.stats.as_dict())  # rows left out at load (invalid, too long), every step
        metrics.update(self.timer.metrics())
        metrics.update(self.memory)
        metrics.update(self.rollout_metrics)
        metrics.update(memory_report())
        metrics["time/step"] = time.perf_counter() - start
        return {k: float(v) for k, v in metrics.items()}

    # ----- evaluation and export

    def evaluate(self) -> Optional[float]:
        if not eval_count(self.cfg.eval, self.held_out.examples if self.held_out is not None else None):
            return None
        with self.phase("eval", actor=("weights",)):
            accuracy, _ = evaluate_generation(self.actor.model, self.held_out.examples, self.tokenizer, self.cfg.eval,
                                              self.cfg.rollout.max_response_length, self.layout)
        return accuracy

    def eval_every(self) -> int:
        return self.cfg.eval.every

    def eval_prompts(self) -> int:
        return eval_count(self.cfg.eval, self.held_out.examples if self.held_out is not None else None)

    def export(self) -> Optional[str]:
        self.actor.need("weights")
        return export_hf(self.actor.model, os.path.join(self.cfg.run_dir, "hf"), self.layout, tokenizer=self.tokenizer)

    def describe(self) -> str:
        cfg = self.cfg
        return (f"{self.name}: {len(self.train_set)} training prompts, {len(self.held_out) if self.held_out else 0} "
                f"held-out, G={cfg.rollout.group_size}, {cfg.rollout.prompts_per_step} prompts/step, layout "
                f"tp={self.layout.tp} pp={self.layout.pp} dp={self.layout.dp}, roles {[r.name for r in self.roles]}")
