"""The online (RL) family on the trainer skeleton: `OnlineTrainer`, a step template that GRPO, PPO and online DPO fill in.

`OnlineTrainer` builds the actor (trained, and generating with its own tp x pp weights), the frozen reference
(only when the algorithm needs one), the reward role with its reward models and judges (`megalign.trainers.online_roles`),
the prompts and the rollout generator. One step:

    collect    prompts -> the actor generates G responses each -> the reward scores them (verifiers behind
               SafeReward: a term failing on more than `reward.max_failure_fraction` of the step's samples
               stops the run; reward models; judge and rubric terms (`reward.judges`, each read from its own
               judge role); process reward models' step rewards for algorithms that set
               `token_level_rewards`) -> `shape_rewards` -> `keep_groups` (e.g. dynamic sampling: more
               rounds) -> a `RolloutBatch` of whole groups (`megalign.rollout.batch`)
    score      old log-probs (the rollout's, or recomputed) and the reference's; the recomputed (or, with the
               rollout's, the first micro-batch's in the update) against the rollout's: `rollout/logprob_*`
    advantages the algorithm's (`advantages`)
    update     the algorithm's (`update`): `train_role(role, lr, batch, RoleLoss, ...)` runs epochs x
               mini-batches of one loss per unit, accumulated over micro-batches by `megalign.trainers.updates`
               (padded or packed rows, pp = 1 or 1F1B at pp > 1); `update_actor` trains the actor or, with
               nothing to learn from (no informative group, the critic's warm-up), leaves it out
    metrics    the algorithm's (`metrics`) beside the shared ones (`rollout_sums`, `step_metrics`)

The configuration (roles, prompts, sampling, and the `UpdateSchedule` every `algo` section extends) is
`megalign.trainers.online_config`; GRPO and PPO share the policy-gradient loss (`megalign.trainers.policy_gradient`).

Design choices:

- Shapes are fixed per run: prompts left-padded to the dataset's longest, responses right-padded to
  `max_response_length`, so sampling rounds concatenate; the roles' forwards pack each row's real tokens
  (`rollout.pack`, `megalign.roles.packing`) when that pays. Every model's `max_position_embeddings` is checked
  against the longest prompt plus the response length at start-up (with `rollout.env`: against an episode's row,
  1 + `max_response_length` tokens, which holds its prompt).
- Data parallelism: each dp rank samples its own prompts and keeps its own groups; sampling rounds are agreed
  over all ranks (one all-reduce a round), so ranks may hold different numbers of samples; losses are normalised
  by counts all-reduced over dp (`megalign.algos.aggregation`), so the split never changes the gradient.
- Randomness comes from one `torch.Generator` per rank seeded with (seed, dp rank), checkpointed with the step,
  the sampler position and the reward error counters; each rollout draws its engine seed from it.
- Layouts: each role has its own tp x pp (`role_layout`); a role's replica lies inside one actor replica
  (`check_same_batch`), so data never moves between layouts: a pp = 1 role scores the batch on every rank, a
  pp > 1 role's scores are broadcast from its last stage, and a trained role with more dp replicas than the actor
  divides its summed gradient by the copies (`batch_copies`). Micro-batches are `algo.micro_batch_size` units at
  every pp (`<role>.microbatches` must stay 0).
- Placement: every role lives on every rank; before each phase each role is told which of its parts the phase
  needs (`Role.need`) and offloads the rest when its switch is on; memory per role and phase is logged as
  `memory/<phase>/<role>_mib`.
- LoRA (`actor.lora`, `megalign.trainers.online_lora`): adapters on the actor, its base frozen; the reference is
  the actor with adapters off (its phases keep the actor's weights in); the rollout runs the LoRA forward as is;
  checkpoints hold the adapters and the base's fingerprint; export merged or as a PEFT adapter folder.
- `actor.batch_invariant` (`megalign.models.batch_invariant`): the whole `train()` runs in the batch-invariant mode,
  so the rollout's log-probs, the recomputed ones and the training forward's agree bit for bit.
- `placement.mode: disaggregated` (`megalign.trainers.disaggregated`): rollout ranks apart, bounded staleness.
- MoE actors (`megalign.trainers.online_moe`): the rollout records each sample's experts (`RolloutBatch.routing`);
  `actor.routing_replay` / `reference.routing_replay` reuse them in the recomputed and trained forwards, otherwise
  `moe/router_agreement` is logged; `actor.moe_aux_loss_coef` adds the load-balancing loss to the actor's.
- Multi-turn episodes (`rollout.env`, `megalign.trainers.episodes`): `rollout` samples G episodes per prompt against
  the environment, one row each with holes in the response mask where the environment spoke; `evaluate` runs
  greedy episodes.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megalign.algos.aggregation import aggregate_loss, loss_normalizer
from megalign.checkpoint import ModelState, OptimizerState, export_hf
from megalign.checkpoint.hf_export import export_peft_adapter
from megalign.data import PromptSampler
from megalign.models.batch_invariant import batch_invariant
from megalign.parallel import MixedPrecision, ParallelLayout
from megalign.roles import DTYPES, Actor, Reference, Reward, Role, TrainableRole
from megalign.roles.adapter_reference import AdapterOffReference
from megalign.roles.reward import check_safety_field
from megalign.rollout import RolloutBatch, RolloutStats, SamplingParams
from megalign.rollout.mismatch import MismatchMeter
from megalign.trainers.base import MetricSums, Trainer, check_model_path
from megalign.trainers.disaggregated import Placement, job_split
from megalign.trainers.episodes import EpisodeRollout
from megalign.trainers.evaluation import eval_count, evaluate_generation
from megalign.trainers.online_lora import apply_role_lora, base_fingerprint
from megalign.trainers.online_metrics import OnlineMetrics
from megalign.trainers.online_moe import MoEOnline
from megalign.trainers.online_roles import OnlineRoles
from megalign.trainers.online_state import RankState
from megalign.trainers.online_config import OnlineConfig, check_actor, prompt_datasets
from megalign.trainers.optim import OptimConfig, build_optimizer, lr_at, set_lr
from megalign.trainers.updates import RoleLoss, accumulate

logger = logging.getLogger(__name__)


class OnlineTrainer(OnlineRoles, OnlineMetrics, Placement, Trainer):
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
        self.split = job_split(cfg)  # disaggregated placement: which side this rank is on (None: colocated)
        super().__init__(cfg)
        self.batch_invariant = check_actor(cfg, self.device_type, self.needs_reference())  # before any model loads
        self.layout = self.rollout_layout() if self.rollout_side else self.layout_for(
            cfg.actor.tp, cfg.actor.pp, "actor", cfg.actor.stage_split("actor"), cfg.actor.ep, cfg.actor.path)
        if cfg.rollout.prompts_per_step % self.layout.dp:
            raise ValueError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must be a multiple of dp={self.layout.dp}")
        check_model_path(cfg.actor.path, "actor.path")
        self.tokenizer = self.build_tokenizer(cfg.data.tokenizer, cfg.actor.path)
        self.episodes = EpisodeRollout(self) if cfg.rollout.env is not None else None  # checked before any model loads
        self.check_role_folders()
        self.train_set, self.held_out = prompt_datasets(cfg.data, self.tokenizer, cfg.run_dir)
        if cfg.reward.gated is not None:
            check_safety_field(self.train_set.examples, cfg.reward.gated.safety_field)
        self.prompt_width = max(len(e.prompt_ids) for e in self.train_set.examples)
        self.longest = longest, what = self.longest_sequence()  # also for roles a subclass adds (the PPO critic)
        model = self.load_role_model("actor", cfg.actor, self.layout,
                                     activation_checkpointing=cfg.actor.activation_checkpointing)
        self.check_model(model, "actor.path", cfg.actor.path, longest, what)
        apply_role_lora(model, cfg.actor.lora, cfg.seed)  # before the optimizer: it holds the adapters only
        precision = MixedPrecision(DTYPES[cfg.actor.dtype] if cfg.actor.dtype != "fp32" else None)
        self.actor = Actor(model, self.layout, precision, cfg.actor.offload_weights, cfg.actor.offload_optimizer,
                           build_optimizer(model, cfg.optim, self.layout), cfg.optim.grad_clip,
                           head_chunk_tokens=cfg.actor.head_chunk_tokens, **self.packing("actor", self.layout))
        self.reference = None
        wants_reference = self.needs_reference() and not self.rollout_side  # the rollout ranks only generate
        if wants_reference and cfg.actor.lora is not None:  # no second copy (online_lora)
            self.reference = AdapterOffReference(model, self.layout, precision, **self.packing("reference", self.layout))
        elif wants_reference:
            ref_layout = self.role_layout("reference", cfg.reference)
            ref_model = self.load_role_model("reference", cfg.reference, ref_layout, cfg.reference.path or cfg.actor.path,
                                             dtype=DTYPES[cfg.reference.dtype])
            self.check_model(ref_model, "reference.path", cfg.reference.path or cfg.actor.path, longest, what)
            self.reference = Reference(ref_model, ref_layout, cfg.reference.offload_weights,
                                       **self.packing("reference", ref_layout))
        self.reward = Reward(cfg.reward, [self.reward_model(key, model_cfg, longest, what)
                                          for key, model_cfg in cfg.reward.reward_models()], self.judge_roles())
        self.roles: list[Role] = [r for r in (self.actor, self.reference) if r is not None] + self.reward.models
        self.moe = MoEOnline(self)  # routing replay, router agreement, the aux loss (`online_moe`)
        self.sampler = PromptSampler(len(self.train_set), seed=cfg.seed, shuffle=cfg.data.shuffle,
                                     rank=self.layout.dp_rank, world_size=self.layout.dp)
        seed = cfg.seed * 1000003 + self.layout.dp_rank  # engine seeds apart from the update order: `disaggregated`
        self.rollout_generator, self.generator = (torch.Generator(self.layout.device).manual_seed(s)
                                                  for s in (seed, seed + 500009))
        self.register_state("actor", ModelState(model, self.layout))
        if cfg.actor.lora is not None:
            self.register_state("actor_base", base_fingerprint(self, "actor.path", cfg.actor.path))
        self.register_state("optim", OptimizerState(model, self.actor.optimizer, self.layout))
        self.register_state("sampler", self.sampler)
        self.register_state("trainer", RankState(self.rank, self.rollout_generator, self.generator, self.reward))
        self.memory: dict[str, float] = {}
        self.rollout_stats, self.rollout_metrics = RolloutStats(), {}
        self.mismatch = MismatchMeter()  # rollout vs trainer log-probs, every step (`megalign.rollout.mismatch`)
        self.params = SamplingParams(max_new_tokens=cfg.rollout.max_response_length,
                                     temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                     eos_token_id=self.tokenizer.eos_id, pad_token_id=self.tokenizer.pad_id)
        self.connect_sides()

    def longest_sequence(self) -> tuple[int, str]:
        """(tokens, what they are) of the longest sequence a role's model must hold, for `check_model`: the longest
        training prompt plus max_response_length, or the held-out one plus the evaluation's tokens when longer; with
        `rollout.env` an episode's row, 1 + max_response_length (it holds its prompt)."""
        cfg = self.cfg
        if self.episodes is not None:
            return (1 + cfg.rollout.max_response_length,
                    f"a multi-turn episode, 1 + rollout.max_response_length ({cfg.rollout.max_response_length})")
        longest = self.prompt_width + cfg.rollout.max_response_length
        what = f"the longest prompt plus rollout.max_response_length ({cfg.rollout.max_response_length})"
        if self.held_out is not None and len(self.held_out):
            eval_longest = (max(len(e.prompt_ids) for e in self.held_out.examples)
                            + (cfg.eval.max_new_tokens or cfg.rollout.max_response_length))
            if eval_longest > longest:
                longest, what = eval_longest, "the longest held-out prompt plus the evaluation's max_new_tokens"
        return longest, what
    def train(self):
        """`Trainer.train`, in the batch-invariant mode when the run asks for it (`online_config.batch_invariant_switch`);
        on a disaggregated run's rollout ranks the rollout loop instead (None), and on its training ranks the rollout
        side is stopped once training ends or is preempted (`megalign.trainers.disaggregated`)."""
        with batch_invariant() if self.batch_invariant else contextlib.nullcontext():
            return self.train_placed(super().train)

    def packing(self, key: str, layout: ParallelLayout) -> dict[str, Any]:
        """Role `key`'s packing switches (`megalign.roles.packing`), from `rollout.pack`, `pack_tokens`,
        `pack_max_fill` (at pp > 1: one pack a pipeline micro-batch, `pipeline_packs`)."""
        rollout = self.cfg.rollout
        return {"pack": rollout.pack, "pack_tokens": rollout.pack_tokens, "pack_max_fill": rollout.pack_max_fill}

    def batch_copies(self, layout: ParallelLayout) -> int:
        """How many dp replicas of a role on `layout` hold the same batch: its dp over the actor's (`check_same_batch`
        put each of its replicas inside one actor replica); `TrainableRole` divides its summed gradient by it."""
        return layout.dp // self.layout.dp

    # ----- phases

    def place(self, name: str, **needs: tuple[str, ...]) -> None:
        """Before phase `name`: each role gets the parts listed for it (none otherwise); record memory. The LoRA
        reference's weights are the actor's: a phase that needs them keeps the actor's in (`online_lora`)."""
        if isinstance(self.reference, AdapterOffReference) and "reference" in needs:
            needs["actor"] = tuple(needs.get("actor", ())) + tuple(needs["reference"])
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
        """Adjust a sampling round's `batch` in place after scoring (e.g. DAPO's overlong penalty on `rewards`, its
        overlong mask on `response_mask`); default: nothing."""

    def keep_groups(self, batch: RolloutBatch) -> torch.Tensor:
        """bool [groups]: which groups of a sampling round train (e.g. DAPO's dynamic sampling); default: all."""
        return torch.ones(len(batch) // batch.group_size, dtype=torch.bool, device=batch.rewards.device)

    def sampling_rounds(self) -> int:
        """Sampling rounds a step may take to fill its groups (more than one only when `keep_groups` drops some)."""
        return 1

    def rollout(self, indices: list[int], first_group: int = 0) -> RolloutBatch:
        """G responses for each prompt of `indices`, scored (N = len(indices) * G rows; groups numbered from
        `first_group`)."""
        if self.episodes is not None:
            return self.episodes.rollout(indices, first_group)
        cfg, tok, device = self.cfg, self.tokenizer, self.layout.device
        group_size = cfg.rollout.group_size
        prompts = [self.train_set[i] for i in indices]
        examples = [e for e in prompts for _ in range(group_size)]
        prompt_ids = torch.full((len(prompts), self.prompt_width), tok.pad_id, dtype=torch.long)
        prompt_mask = torch.zeros_like(prompt_ids)
        for row, e in enumerate(prompts):
            prompt_ids[row, self.prompt_width - len(e.prompt_ids):] = torch.tensor(e.prompt_ids)
            prompt_mask[row, self.prompt_width - len(e.prompt_ids):] = 1
        with self.phase("generate", actor=("weights",)):
            recorder = self.moe.recorder()
            out, stats = self.actor.generate(prompt_ids.to(device), prompt_mask.to(device), group_size,
                                             self.params, self.rollout_generator, cfg.rollout.engine, routing=recorder)
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
        group = torch.arange(first_group, first_group + len(prompts), device=device).repeat_interleave(group_size)
        batch = RolloutBatch(sequences=sequences, attention_mask=attention, response_mask=response_mask.float(),
                             rollout_logp=torch.nn.functional.pad(out.logprobs, (0, pad)), lengths=lengths.float(),
                             finished=finished, rewards=rewards.to(device),
                             terms={name: values.to(device) for name, values in terms.items()}, group=group,
                             group_size=group_size, token_rewards=None if step_rewards is None else step_rewards.to(device),
                             routing=self.moe.batch_routing(recorder, pad))
        self.shape_rewards(batch)
        return batch

    def collect(self) -> tuple[RolloutBatch, RolloutBatch, dict[str, float]]:
        """(training batch of whole kept groups, every generated response, sampling counts) for this rank.

        Raises when a reward term failed on too many of this step's samples (module doc).
        """
        if self.feed is not None:
            return self.feed.batch(self.progress["step"])
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
                batch = self.rollout(indices, first_group=per_rank * (rounds - 1))
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
        if self.episodes is not None:  # the environments' failure check (over dp) and counts
            self.rollout_metrics.update(self.episodes.step_metrics())
        train = RolloutBatch.concat(kept).select(slice(0, per_rank * group))
        return train, RolloutBatch.concat(generated), {"rounds": rounds, "dropped_groups": dropped,
                                                       "kept_groups": len(train) // group}

    def logprob_inputs(self, batch: RolloutBatch, rows):
        """(sequences, attention mask, response length) of `rows`: the arguments of a role's log-prob forward."""
        return batch.sequences[rows], batch.attention_mask[rows], self.cfg.rollout.max_response_length

    # ----- the step template: collect -> score -> advantages -> update -> metrics

    def train_step(self) -> dict[str, float]:
        """One step (module doc); its metrics, reduced over ranks. The algorithm fills in `advantages`, `update` and
        `metrics`; everything else is shared."""
        self.timer.reset()
        self.memory.clear()
        start = time.perf_counter()
        batch, generated, counts = self.collect()
        self.mismatch.start(measure_in_loss=self.cfg.rollout.old_logprobs == "rollout", skip=int(self.layout.pp > 1))
        self.moe.start_step()
        self.score(batch)
        self.advantages(batch)
        sums = self.rollout_sums(generated)
        norms = self.update(batch, sums, counts)
        if self.feed is not None:
            self.feed.publish(self.progress["step"] + 1)
        total = sums.reduce(self.layout.dp_group, self.layout.device)
        metrics = self.step_metrics(total, generated.terms, self.metrics(total, norms, counts), start)
        return {**metrics, **self.mismatch.metrics(self.layout.device), **self.moe.metrics()}

    def score(self, batch: RolloutBatch) -> None:
        """`batch.old_logp` (recorded while sampling, or recomputed: `rollout.old_logprobs`) and, with a reference,
        `batch.ref_logp` [N, R]."""
        micro = self.cfg.algo.micro_batch_size
        if self.cfg.rollout.old_logprobs == "recompute":
            with self.phase("old_logprobs", actor=("weights",)), \
                    self.moe.actor_forwards(batch, slice(None), training=False):  # MoE: replay or agreement
                batch.old_logp = self.score_logprobs(self.actor, batch, micro)
            self.mismatch.add(batch.old_logp, batch.rollout_logp, batch.response_mask)
        else:
            batch.old_logp = batch.rollout_logp
        if self.reference is not None:
            with self.phase("reference", reference=("weights",)), self.moe.reference_forwards(batch, slice(None)):
                batch.ref_logp = self.score_logprobs(self.reference, batch, micro)

    def advantages(self, batch: RolloutBatch) -> None:
        """Fill `batch.advantages` (and what else the update reads) from the scored batch."""
        raise NotImplementedError

    def update(self, batch: RolloutBatch, sums: MetricSums, counts: dict[str, float]) -> dict[str, list[torch.Tensor]]:
        """Train the roles on the batch (`train_role`, `update_actor`), adding their sums to `sums`; returns each
        trained role's gradient norms by name."""
        raise NotImplementedError

    def metrics(self, total: dict[str, float], norms: dict[str, list[torch.Tensor]],
                counts: dict[str, float]) -> dict[str, float]:
        """The algorithm's metrics from the sums reduced over dp (`total`), the norms `update` returned and the
        sampling counts of `collect`."""
        raise NotImplementedError

    def lr(self, optim: Optional[OptimConfig] = None) -> float:
        """This step's learning rate of `optim` (default: the actor's, `optim`)."""
        return lr_at(optim or self.cfg.optim, self.progress["step"], self.cfg.steps)

    # ----- the update loop, one for every algorithm, padded, packed and pipelined

    def train_role(self, role: TrainableRole, lr: float, batch: RolloutBatch, loss: RoleLoss, sums: MetricSums,
                   prefix: str) -> list[torch.Tensor]:
        """`algo.ppo_epochs` x `algo.mini_batches` optimizer updates of `role` on this rank's batch.

        Each micro-batch's loss (`RoleLoss.fn`) is aggregated with `algo.loss_agg` over the mini-batch's global count
        (`loss_normalizer`, every dp rank), so micro-batching, packing, pp and dp do not change the gradient
        (`accumulate`). The loss and the named sums are added to `sums` as `prefix/<name>`, kept on the device (no
        host sync per micro-batch). Returns the gradient norm of each update. A rank with fewer rows than another
        still joins every collective (its empty micro-batches are skipped).
        """
        algo, dp = self.cfg.algo, self.layout.dp_group
        set_lr(role.optimizer, lr)
        local = torch.zeros(len(loss.stats), dtype=torch.float64, device=self.layout.device)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.layout.device)
        norms = []
        mask = batch.response_mask if loss.units is None else loss.units

        def share_of(micro: torch.Tensor, normalizer: torch.Tensor,
                     hidden: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
            """(this micro-batch's share of the mini-batch loss, its sums [len(stats)] fp64)."""
            per_unit, stats = loss.fn(micro, hidden)
            if stats.keys() != set(loss.stats):
                raise RuntimeError(f"{role.name} loss returned the sums {sorted(stats)}, declared {sorted(loss.stats)}")
            share = aggregate_loss(per_unit, mask[micro], algo.loss_agg, normalizer,
                                   self.cfg.rollout.max_response_length)
            return share, torch.stack([stats[name].detach().double() for name in loss.stats])

        for _ in range(algo.ppo_epochs):
            order = torch.randperm(mask.shape[0], generator=self.generator, device=self.generator.device)
            for rows in torch.tensor_split(order, algo.mini_batches):
                normalizer = loss_normalizer(mask[rows], algo.loss_agg, dp)
                mini_loss, stats = accumulate(role, algo.micro_batch_size, batch, rows, normalizer, share_of,
                                              len(loss.stats), loss.unit_inputs)
                local += stats
                stepped, norm = role.optimizer_step(mini_loss)
                loss_sum += mini_loss.double()
                norms.append(norm)
                if not stepped:
                    self.skip_update("nan_skips", f"{role.name}: non-finite loss or gradient norm")
        if role.layout.pp > 1:  # the sums were taken on the last stage, where the loss runs; every pp rank logs them
            dist.broadcast(local, src=role.layout.stage_rank(role.layout.pp - 1), group=role.layout.pp_group)
        sums.add(f"{prefix}/loss", loss_sum)
        for name, value in zip(loss.stats, local):
            sums.add(f"{prefix}/{name}", value)
        return norms

    def update_actor(self, batch: RolloutBatch, sums: MetricSums, loss: RoleLoss, skip: Optional[str] = None,
                     counter: str = "empty_updates") -> list[torch.Tensor]:
        """The actor's update on `loss` (`train_role` in the "update" phase), unless `skip` says why not: then its sums
        are added as zeros (`left_out`), the step counted as `counter` (none when empty) and warned
        with `skip` (a step on zero gradients would still move AdamW's weights through its momentum). Returns the
        actor's gradient norms ([0] when skipped)."""
        if skip is None:
            with self.phase("update", actor=("weights", "optimizer")):
                return self.train_role(self.actor, self.lr(), batch, loss, sums, "actor")
        if counter:
            self.skip_update(counter, skip)
        return self.left_out(loss, sums, "actor")

    @staticmethod
    def left_out(loss: RoleLoss, sums: MetricSums, prefix: str) -> list[torch.Tensor]:
        """A role left out of this step's update: its sums (`prefix`/loss and `loss.stats`) added as zeros so every
        rank's sums line up; its gradient norms ([0])."""
        for name in ("loss",) + loss.stats:
            sums.add(f"{prefix}/{name}", 0.0)
        return [torch.zeros(())]

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

    # ----- evaluation and export

    def evaluate(self) -> Optional[float]:
        if not eval_count(self.cfg.eval, self.held_out.examples if self.held_out is not None else None):
            return None
        with self.phase("eval", actor=("weights",)):
            if self.episodes is not None:
                return self.episodes.evaluate(self.held_out.examples[:self.eval_prompts()])
            accuracy, _ = evaluate_generation(self.actor.model, self.held_out.examples, self.tokenizer, self.cfg.eval,
                                              self.cfg.rollout.max_response_length, self.layout)
        return accuracy

    def eval_every(self) -> int:
        return self.cfg.eval.every

    def eval_prompts(self) -> int:
        return eval_count(self.cfg.eval, self.held_out.examples if self.held_out is not None else None)

    def export(self) -> Optional[str]:
        self.actor.need("weights")
        path = os.path.join(self.cfg.run_dir, "hf")
        if self.cfg.actor.lora is not None and self.cfg.actor.lora_export == "peft":
            return export_peft_adapter(self.actor.model, path, self.cfg.actor.path, self.layout)
        return export_hf(self.actor.model, path, self.layout, tokenizer=self.tokenizer)

    def describe(self) -> str:
        cfg = self.cfg
        return (f"{self.name}: {len(self.train_set)} training prompts, {len(self.held_out) if self.held_out else 0} "
                f"held-out, G={cfg.rollout.group_size}, {cfg.rollout.prompts_per_step} prompts/step, layout "
                f"tp={self.layout.tp} pp={self.layout.pp} dp={self.layout.dp}, roles {[r.name for r in self.roles]}")
