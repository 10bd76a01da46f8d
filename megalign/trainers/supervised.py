"""The supervised family on the trainer skeleton: one trainer, an objective plugged in (SFT in `sft`, the pairwise
preference losses and the reward model in `preference`, KTO in `kto`, the process reward model in `prm`).

`SupervisedTrainer(cfg, objective_cls, name)` builds the tokenizer, the trained model (a policy, or a
reward model: `Objective.model_kind`) as a `TrainableRole` (ZeRO-1 AdamW, bf16 autocast when
`model.dtype` is bf16) over the `model.tp` x `model.pp` x dp layout, the frozen reference when the
objective needs one, asks the objective for its data, and runs the `Trainer` lifecycle with this step:

    lr -> batch_size / dp examples from the sampler -> objective.collate -> the objective's
    normaliser count all-reduced over dp -> [reference scores: from the cache, or the reference
    role] -> objective.prepare -> objective.inputs -> the trunk, then objective.loss on its
    output (per micro-batch), over the global count -> backward
    -> role.optimizer_step (gradients summed over dp, global-norm clip, skipped when non-finite)
    -> loss and the objective's statistics reduced over dp (`MetricSums`).

Design choices:

- One loss path (`Objective`): an objective states its inputs once (`inputs`: token ids, attention
  mask and per-row tensors) and its loss once, on the final hidden states of a micro-batch (`loss`:
  the *summed* loss and its statistics). pp = 1 is the one-stage case: the trunk runs on the whole
  batch as one micro-batch. At pp > 1 (dp = world / (tp x pp)) every rank of a pp group collates the
  same whole batch and `Pipeline.train_step` runs 1F1B over `model.microbatches` micro-batches of
  consecutive rows, the loss on the last stage. A quantity of the whole batch (KTO's z0) comes first,
  in `prepare`, from `forward_scores` (no gradient; the forward-only schedule at pp > 1), which
  held-out scoring (RM, PRM) also uses. Statistics are summed once per micro-batch (`MicroBatchSums`)
  and, at pp > 1, broadcast from the last stage.
- Global-batch normalisation (Megatron's): the trainer all-reduces the objective's `count` (response
  tokens for SFT, pairs for preference losses) before the forward, divides the summed loss by it and
  sums gradients over dp, so every example weighs the same whatever the padding, the split over
  ranks or the micro-batches, and results do not depend on dp or pp.
- From-scratch models (`model.path: null`) are initialised dense, from `seed`, on every rank, and
  each tp / pp rank keeps its slice, so a tiny model starts from the same weights at any layout. A
  checkpoint loads as this rank's stage (`stage_from_pretrained`); a reward model's head comes from
  `scalar_head_from_pretrained`.
- The frozen reference stays at pp = 1 and scores (`Objective.scores`) on every rank the batch its
  pp group holds: once per training example before training (`reference.mode: cache`, checkpointed)
  or per batch.
- LoRA (`model.lora`, `megalign.models.lora`): adapters on the policy's linears, the base frozen, so the
  optimizer (built over parameters with requires_grad) holds only adapter state and checkpoints only the
  adapters (`ModelState`; the base is rebuilt from `model.path` or the seed first). The reference of DPO /
  KTO is the policy with its adapters off (`AdapterOffReference`: no second copy of the weights), so a
  LoRA run refuses a `reference.path` other than `model.path` and a model at pp > 1 beside a reference
  (which scores at pp = 1). The export is merged into HF weights, or a PEFT adapter folder
  (`model.lora_export: peft`, in `<run_dir>/hf`, the base named by `model.path`).
- Exact resume: model and ZeRO-1 optimizer shards, every rank's RNG, the sampler position, the
  reference cache and the progress counters are checkpoint state; the learning rate is a function of
  the step (`megalign.trainers.optim.lr_at`).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable, Generic, Literal, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist

from megalign.checkpoint import ModelState, OptimizerState, export_hf
from megalign.checkpoint.hf_export import export_peft_adapter
from megalign.config import option
from megalign.data import PromptExample, PromptSampler, Tokenizer
from megalign.models import CausalLM, ModelConfig, from_pretrained, stage_from_pretrained
from megalign.models.hf_adapter import scalar_head_from_pretrained
from megalign.models.lora import LoRAConfig, adapters_disabled, apply_lora
from megalign.parallel import MicroBatchSums, MixedPrecision, ParallelLayout, Pipeline
from megalign.parallel.collectives import all_reduce
from megalign.roles import DTYPES, ModelRoleConfig, Reference, TrainedRoleConfig
from megalign.roles.actor import TrainableRole
from megalign.roles.adapter_reference import AdapterOffReference
from megalign.trainers.base import MetricSums, RunConfig, Trainer, check_model_path, check_same_batch, check_stages
from megalign.trainers.evaluation import EvalConfig, eval_count, evaluate_generation
from megalign.trainers.logging import memory_report
from megalign.trainers.model_checks import check_tokenizer
from megalign.trainers.optim import OptimConfig, build_optimizer, lr_at, set_lr
from megalign.trainers.scratch import scratch_config, scratch_model  # noqa: F401 (scratch_config: read from here)

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class PolicyModelConfig(TrainedRoleConfig):
    """The trained model: an HF checkpoint folder, or a small decoder built from scratch; its layout and dtype."""

    path: Optional[str] = option(None, doc="HF checkpoint folder to start from; null: build from scratch with the fields below")
    model_type: Literal["llama", "qwen2", "qwen3", "mistral"] = option("llama", doc="from scratch: architecture family (written to the HF export)")
    hidden_size: int = option(128, doc="from scratch: model width H")
    intermediate_size: int = option(384, doc="from scratch: SwiGLU inner width")
    num_layers: int = option(3, doc="from scratch: decoder layers")
    num_heads: int = option(4, doc="from scratch: query heads (head_dim = hidden_size / num_heads)")
    num_kv_heads: int = option(4, doc="from scratch: key/value heads (GQA when fewer than num_heads)")
    max_position_embeddings: int = option(256, doc="from scratch: longest sequence (RoPE tables)")
    tie_word_embeddings: bool = option(False, doc="from scratch: LM head shares the embedding matrix")
    init_std: float = option(0.02, doc="from scratch: std of the normal init of every matrix (norm gains start at 1)")
    lora: Optional[LoRAConfig] = option(None, doc="LoRA adapters {rank, alpha, dropout, target_modules}; the base is frozen "
                                                  "and the reference is the model with adapters off; null: full fine-tuning")
    lora_export: Literal["merged", "peft"] = option(
        "merged", doc="with lora: export the adapters merged into HF weights, or as a PEFT adapter folder over model.path")

    def __post_init__(self):
        super().__post_init__()
        if self.lora_export == "peft" and (self.lora is None or self.path is None):
            raise ValueError("model.lora_export: peft needs model.lora and model.path (the adapter's base model)")
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        if not self.init_std > 0:
            raise ValueError(f"init_std must be > 0, got {self.init_std}")


@dataclasses.dataclass
class ReferenceConfig(ModelRoleConfig):
    """The frozen reference of objectives that compare with one (DPO, KTO): its weights, layout, and when it scores."""

    path: Optional[str] = option(None, doc="HF checkpoint folder; null: model.path (the policy's initial weights)")
    mode: Literal["cache", "online"] = option(
        "cache", doc="'cache': score every training example once before training (kept in the checkpoint); "
                     "'online': score each batch when it is used (no pass over the data; the same numbers)")


@dataclasses.dataclass
class SupervisedConfig(RunConfig):
    """What every supervised run has besides its data: batch, model, optimizer, evaluation."""

    batch_size: int = option(64, doc="examples per step over all dp ranks (a multiple of dp)")
    model: PolicyModelConfig = option(PolicyModelConfig(), doc="the trained model and its layout (tp)")
    optim: OptimConfig = option(OptimConfig(), doc="optimizer and LR schedule")
    eval: EvalConfig = option(EvalConfig(), doc="held-out evaluation by greedy generation")

    def __post_init__(self):
        super().__post_init__()
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")


E = TypeVar("E")
ScoreHead = Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]
"""(trunk output [b, T, H], that micro-batch's rows) -> per-row scores [b, ...] (`SupervisedTrainer.forward_scores`)."""
ForwardScores = Callable[..., torch.Tensor]
"""`SupervisedTrainer.forward_scores(input_ids, attention_mask, head, rows, shape)` -> [B, *shape]."""


class Objective(Generic[E]):
    """What a supervised trainer is given (module doc); one subclass per objective.

    Built as `objective_cls(cfg, tokenizer)` once the tokenizer exists; `cfg` is the whole run config.
    An objective that compares with a frozen reference (DPO, KTO) says so in `needs_reference` and
    implements `scores`: the trainer then fills `batch.ref_scores` before `prepare`, from a cache
    computed once before training or from the reference role on the fly (`reference.mode`).
    """

    def __init__(self, cfg: Any, tokenizer: Tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer

    num_scores = 0
    """k of `scores` (the reference's numbers per example), for objectives with a reference."""
    count_name = "tokens"
    """What `count` counts, as logged (`tokens`, `tokens_per_s`; `pairs`, `pairs_per_s`)."""

    def needs_reference(self) -> bool:
        """Whether `loss` reads `batch.ref_scores` (the reference role and its cache exist only then)."""
        return False

    def scores(self, model: CausalLM, batch, layout: ParallelLayout) -> torch.Tensor:
        """[B, k] per-example scores the reference contributes (e.g. k = 2 summed log-probs of chosen and
        rejected), computed without gradient by the trainer; row i belongs to the batch's example i."""
        raise NotImplementedError

    def examples(self) -> tuple[Sequence[E], Optional[Sequence[PromptExample]]]:
        """(training examples, held-out prompts with answers or None)."""
        raise NotImplementedError

    def max_length(self) -> int:
        """The longest sequence (tokens) a training example may have; checked against the model at start-up."""
        raise NotImplementedError

    def collate(self, examples: Sequence[E], device: torch.device):
        """A typed batch of `examples` on `device`."""
        raise NotImplementedError

    def count(self, batch) -> torch.Tensor:
        """This rank's share (0-dim) of the count the loss is normalised by; the trainer sums it over dp."""
        raise NotImplementedError

    def prepare(self, model: CausalLM, batch, layout: ParallelLayout, forward_scores: "ForwardScores") -> None:
        """Compute what `loss` needs of the whole batch before its micro-batches (KTO's z0 over every mismatched pair)
        with `forward_scores` (`SupervisedTrainer.forward_scores`: no gradient, on every rank, at any pp) and keep it
        on `batch` for `inputs`; called before `inputs` at every step. Default: nothing."""

    def inputs(self, batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(input_ids [B, T], attention_mask [B, T], {name: [B, ...]} per-row tensors `loss` reads) of `batch`: the
        rows the trunk runs on. A micro-batch is `B / microbatches` consecutive rows (the whole batch at pp = 1), so
        rows `loss` reads together (a pair) must be neighbours."""
        raise NotImplementedError

    def loss(self, model: CausalLM, hidden: torch.Tensor, rows: dict[str, torch.Tensor],
             layout: ParallelLayout) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """(the *summed* loss (0-dim fp32) of one micro-batch, its statistics as {name: (total, count)} like
        `MetricSums.add_means` takes) from `hidden` (the trunk's output [b, T, H], on the last stage at pp > 1; the
        head is `model.lm_head`, a reward model's `model.head`) and that micro-batch's rows of `inputs`' tensors.

        The trainer divides it by the global `count`, so the sum over micro-batches and dp ranks is the mean loss
        of the global batch.
        """
        raise NotImplementedError

    def metrics(self, totals: dict[str, float]) -> dict[str, float]:
        """Logged metrics from the dp-reduced `stats` totals of a step; default: the means `stats.add_means` added."""
        return MetricSums.means(totals)

    model_kind = "causal_lm"
    """What the trained model is (`megalign.models.from_pretrained` kinds): a policy, or a 'reward' model."""

    def evaluate(self, trainer: "SupervisedTrainer") -> Optional[float]:
        """Held-out score in [0, 1] (same on every rank), or None without held-out data; default: greedy
        generation on the held-out prompts scored by `eval.metric` (`megalign.trainers.evaluation`)."""
        cfg = self.cfg.eval
        if not eval_count(cfg, trainer.held_out):
            return None
        accuracy, samples = evaluate_generation(trainer.policy.model, trainer.held_out, self.tokenizer, cfg,
                                                self.max_length(), trainer.layout)
        if trainer.rank == 0:
            for prompt, response, answer in samples:
                logger.info("held-out sample: %r -> %r (answer %s)", prompt, response, answer)
        return accuracy

    def eval_label(self, count: int) -> str:
        """The heading of the closing table."""
        return f"held-out accuracy ({count} prompts, greedy)"

    def after_export(self, trainer: "SupervisedTrainer", path: str) -> None:
        """Add what later stages need beside the exported weights (e.g. a reward model's reward statistics)."""


class SupervisedTrainer(Trainer):
    """A supervised run of one objective (module doc)."""

    def __init__(self, cfg: SupervisedConfig, objective_cls: type[Objective], name: str):
        super().__init__(cfg)
        self.name = name
        self.eval_before = cfg.model.path is not None  # a trained starting point is worth comparing with
        self.layout = layout = self.layout_for(cfg.model.tp, cfg.model.pp, "model", cfg.model.stage_split("model"),
                                               cfg.model.ep, cfg.model.path)
        if cfg.batch_size % layout.dp:
            raise ValueError(f"batch_size={cfg.batch_size} must be a multiple of dp={layout.dp}")
        if cfg.model.path is not None:
            check_model_path(cfg.model.path, "model.path")
        self.tokenizer = self.build_tokenizer(cfg.data.tokenizer, cfg.model.path)
        self.objective = objective_cls(cfg, self.tokenizer)
        if layout.pp > 1:
            self._check_pipeline(cfg)
        self.train_set, self.held_out = self.objective.examples()
        if not self.train_set:
            raise ValueError(f"{name}: no training examples left after loading (see the data/ counts in the log)")
        model = self._build_model(cfg)
        precision = MixedPrecision(DTYPES[cfg.model.dtype] if cfg.model.dtype != "fp32" else None)
        self.policy = TrainableRole("policy", model, layout, precision, cfg.model.offload_weights, False,
                                    build_optimizer(model, cfg.optim, layout), cfg.optim.grad_clip)
        # the trunk only: the head runs in the objective's `loss`
        self.pipeline = Pipeline(model.model, layout, cfg.model.n_microbatches) if layout.pp > 1 else None
        self.reference = self._build_reference(cfg) if self.objective.needs_reference() else None
        self.sampler = PromptSampler(len(self.train_set), seed=cfg.seed, shuffle=cfg.data.shuffle,
                                     rank=layout.dp_rank, world_size=layout.dp)
        self.register_state("model", ModelState(model, layout))
        self.register_state("optim", OptimizerState(model, self.policy.optimizer, layout))
        self.register_state("sampler", self.sampler)

    def _build_model(self, cfg: SupervisedConfig) -> torch.nn.Module:
        """This rank's trained model (its pipeline stage at pp > 1), checked against the objective, in train mode."""
        kind, layout = self.objective.model_kind, self.layout
        recompute = cfg.model.activation_checkpointing
        if cfg.model.path is None:
            if kind != "causal_lm":
                raise ValueError(f"model.path is required: a {kind} model starts from a checkpoint (e.g. an SFT export)")
            model = scratch_model(cfg.model, self.tokenizer, layout, cfg.seed)
        elif kind != "causal_lm":
            model, _ = scalar_head_from_pretrained(cfg.model.path, kind, layout, cfg.seed, activation_checkpointing=recompute)
        elif layout.pp > 1:
            model = stage_from_pretrained(cfg.model.path, layout, activation_checkpointing=recompute)
        else:
            model = from_pretrained(cfg.model.path, layout=layout, activation_checkpointing=recompute)
        self.check_model(model, "model.path" if cfg.model.path else "model", cfg.model.path,
                         self.objective.max_length(), "the objective's longest example")
        if cfg.model.lora is not None:
            if kind != "causal_lm":
                raise ValueError(f"model.lora: LoRA trains policies only; a {kind} model's new head must train whole")
            apply_lora(model, cfg.model.lora, seed=cfg.seed)
        return model.train()

    def _build_reference(self, cfg: SupervisedConfig) -> Reference:
        """The frozen reference (at pp = 1, module doc) and its score cache: one row per training example, filled
        before the first step (`reference.mode: cache`, then checkpointed)."""
        if cfg.model.lora is not None:
            return self._adapter_off_reference(cfg)
        ref_path = cfg.reference.path or cfg.model.path
        if ref_path is None:
            raise ValueError("reference.path (or model.path) is required: the objective compares with a frozen reference")
        check_model_path(ref_path, "reference.path" if cfg.reference.path else "model.path")
        if cfg.reference.path is not None:
            check_tokenizer(self.tokenizer, "reference.path", cfg.reference.path)
        if cfg.reference.pp > 1:
            raise ValueError(f"reference.pp={cfg.reference.pp}: the supervised trainers score with a reference "
                             f"at pp=1 only (beside a model at any pp); set reference.pp=1")
        ref_layout = self.layout_for(cfg.reference.tp, cfg.reference.pp, "reference")
        check_same_batch(ref_layout, "reference", self.layout, "model")
        ref_model = from_pretrained(ref_path, layout=ref_layout, dtype=DTYPES[cfg.reference.dtype])
        self.check_model(ref_model, "reference.path", ref_path, self.objective.max_length(),
                         "the objective's longest example")
        self._register_reference_cache(cfg)
        return Reference(ref_model, ref_layout, cfg.reference.offload_weights)

    def _adapter_off_reference(self, cfg: SupervisedConfig) -> AdapterOffReference:
        """A LoRA run's reference: the policy with its adapters off (module doc), in the policy's layout and precision."""
        if cfg.reference.path not in (None, cfg.model.path):
            raise ValueError(f"reference.path={cfg.reference.path!r}: with model.lora the reference is model.path's base "
                             f"model (the policy with adapters off); leave reference.path null or equal to model.path")
        if self.layout.pp > 1:
            raise ValueError(f"model.pp={self.layout.pp}: with model.lora the reference is the policy itself, and the "
                             f"supervised trainers score a reference at pp=1; set model.pp=1")
        self._register_reference_cache(cfg)
        return AdapterOffReference(self.policy.model, self.layout, self.policy.precision)

    def _register_reference_cache(self, cfg: SupervisedConfig) -> None:
        """The reference's score cache: one row per training example, checkpointed with `reference.mode: cache`."""
        self.ref_cache = {"scores": torch.zeros(len(self.train_set), self.objective.num_scores), "ready": False}
        if cfg.reference.mode == "cache":
            self.register_state("reference_cache", self.ref_cache, derived_from=("data", "reference", "model.path"))

    def _check_pipeline(self, cfg: SupervisedConfig) -> None:
        """Start-up checks of model.pp > 1, naming the settings: the layers split over the stages (evenly, or as
        model.first_stage_layers / last_stage_layers / stage_layers say), and each dp
        rank's batch splits into the pipeline's micro-batches."""
        pp, micro = cfg.model.pp, cfg.model.n_microbatches
        if micro < pp:
            raise ValueError(f"model.microbatches={micro} must be >= model.pp={pp} (1F1B fills every stage first)")
        local = cfg.batch_size // self.layout.dp
        if local % micro:
            raise ValueError(f"batch_size={cfg.batch_size} / dp={self.layout.dp} = {local} examples per rank do not "
                             f"split into model.microbatches={micro} equal micro-batches (0 means model.pp)")
        if cfg.model.path is None:
            check_stages(cfg.model.num_layers, pp, "model", "model.num_layers", self.layout.stages)
        else:
            check_stages(ModelConfig.from_hf(cfg.model.path).num_hidden_layers, pp, "model",
                         f"model.path {cfg.model.path!r}", self.layout.stages)

    def trained_models(self) -> list[tuple[str, Optional[str]]]:
        return [("model.path", self.cfg.model.path)]

    def free_keys(self) -> tuple[str, ...]:
        keys = ("model.offload_weights",)
        has_reference = isinstance(getattr(self.cfg, "reference", None), ReferenceConfig)  # called before the roles exist
        return keys + (("reference.offload_weights", "reference.mode") if has_reference else ())

    def _reference_scores(self, batch) -> torch.Tensor:
        """[B, k] reference scores of `batch`, without gradient; the reference's weights come on device and go back."""
        self.reference.need("weights")
        with torch.no_grad(), adapters_disabled(self.reference.model), self.reference.precision.autocast(
                self.reference.layout.device):  # adapters_disabled: the adapter-off reference of LoRA; else nothing
            scores = self.objective.scores(self.reference.model, batch, self.reference.layout).float()
        self.reference.need()
        return scores

    def on_train_start(self) -> None:
        """With `reference.mode: cache`, score every training example once with the reference (each dp rank its
        share, summed over dp), unless a resumed checkpoint already holds the scores."""
        if self.reference is None or self.cfg.reference.mode != "cache" or self.ref_cache["ready"]:
            return
        layout, n = self.layout, len(self.train_set)
        mine = list(range(layout.dp_rank, n, layout.dp))
        parts = []
        with self.timer("reference_cache"):
            for start in range(0, len(mine), self.cfg.batch_size):
                chunk = mine[start:start + self.cfg.batch_size]
                batch = self.objective.collate([self.train_set[i] for i in chunk], layout.device)
                parts.append((chunk, self._reference_scores(batch)))
                self.timer.beat()  # a pass over the whole training set: one phase, progress per batch
            table = torch.zeros(n, self.objective.num_scores, dtype=torch.float64)
            for chunk, scores in parts:
                table[chunk] = scores.double().cpu()
            table = all_reduce(table.to(layout.device), layout.dp_group).cpu()  # each row from exactly one rank
        self.ref_cache.update(scores=table.float(), ready=True)
        logger.info("reference scores of %d training examples cached (%.1f s)", n,
                    self.timer.seconds.get("reference_cache", 0.0))

    def policy_role(self) -> TrainableRole:
        return self.policy

    def describe(self) -> str:
        return (f"{self.name}: {len(self.train_set)} training examples, {len(self.held_out or [])} held-out prompts, "
                f"{sum(p.numel() for p in self.policy.parameters())} parameters per rank, "
                f"layout tp={self.layout.tp} pp={self.layout.pp} dp={self.layout.dp}")

    def train_step(self) -> dict[str, float]:
        cfg, layout, timer = self.cfg, self.layout, self.timer
        timer.reset()
        start = time.perf_counter()
        lr = lr_at(cfg.optim, self.progress["step"], cfg.steps)
        set_lr(self.policy.optimizer, lr)
        with timer("data"):
            indices = self.sampler.next_indices(cfg.batch_size // layout.dp)
            batch = self.objective.collate([self.train_set[i] for i in indices], layout.device)
            count = all_reduce(self.objective.count(batch), layout.dp_group)
        if self.reference is not None:
            with timer("reference"):
                batch.ref_scores = (self.ref_cache["scores"][indices].to(layout.device)
                                    if cfg.reference.mode == "cache" else self._reference_scores(batch))
        stats = MetricSums()
        with timer("forward_backward"), self.policy.precision.autocast(layout.device):
            loss = self._forward_backward(batch, count, stats)
        with timer("update"):
            stepped, grad_norm = self.policy.optimizer_step(loss)
            global_loss = all_reduce(loss.detach(), layout.dp_group)
            if not stepped:
                self.skip_update("nan_skips", f"non-finite loss ({float(global_loss)}) or gradient norm "
                                              f"({float(grad_norm)})")
        totals = stats.reduce(layout.dp_group, layout.device)
        elapsed = time.perf_counter() - start
        name = self.objective.count_name
        return {"loss": float(global_loss), "lr": lr, "grad_norm": float(grad_norm), name: float(count),
                f"{name}_per_s": float(count) / elapsed, **self.objective.metrics(totals),
                "epoch": float(self.sampler.epoch), **timer.metrics(), **memory_report()}

    def _forward_backward(self, batch, count: torch.Tensor, stats: MetricSums) -> torch.Tensor:
        """This rank's share of the loss (detached, on every pp rank) after one forward + backward of `batch`: the
        objective's summed micro-batch losses (`Objective.loss`) over the global `count` (module doc). pp = 1: the
        whole batch is the one micro-batch; pp > 1: `Pipeline.train_step` (1F1B, the loss on the last stage).

        The statistics go to `stats` on every pp rank (summed per micro-batch once, `MicroBatchSums`; at pp > 1
        broadcast from the last stage: one host sync per step)."""
        model, layout = self.policy.model, self.layout
        self.objective.prepare(model, batch, layout, self.forward_scores)
        input_ids, attention_mask, rows = self.objective.inputs(batch)
        sums = MicroBatchSums(1 if self.pipeline is None else self.cfg.model.n_microbatches, len(input_ids),
                              layout.device)

        def loss_fn(hidden: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
            loss, metrics = self.objective.loss(model, hidden, mb, layout)
            for name, values in metrics.items():
                sums.put(name, mb["slot"], torch.stack([torch.as_tensor(v, dtype=torch.float64, device=layout.device)
                                                        for v in values]))
            return loss

        rows = {**rows, "slot": sums.slots}
        if self.pipeline is None:
            loss = loss_fn(model.model(input_ids, attention_mask), rows) / count.clamp(min=1)
            loss.backward()
            totals = sums.sums()
        else:
            loss = self.pipeline.train_step(input_ids, loss_fn, count.clamp(min=1), attention_mask=attention_mask,
                                            batch=rows)
            box = [{name: values.tolist() for name, values in sums.sums().items()}]
            dist.broadcast_object_list(box, src=layout.stage_rank(layout.pp - 1), group=layout.pp_group)
            totals = box[0]
        stats.add_means(totals)
        return loss.detach()

    @torch.no_grad()
    def forward_scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, head: ScoreHead,
                       rows: Optional[dict[str, torch.Tensor]] = None, shape: tuple[int, ...] = ()) -> torch.Tensor:
        """[B, *shape] fp32 per-row scores of the trained model, without gradient, on every rank, at any pp.

        `head(hidden [b, T, H], {name: that micro-batch's rows [b, ...] of rows}) -> [b, *shape]` runs on the
        trunk's output: of the whole batch at pp = 1; at pp > 1 on the last stage, per micro-batch of the
        forward-only schedule (`Pipeline.score_broadcast` over `model.microbatches`: batches of any size, the
        result on every rank).
        """
        model, layout = self.policy.model, self.layout
        with self.policy.precision.autocast(layout.device):
            if self.pipeline is None:
                return head(model.model(input_ids, attention_mask), rows or {}).float()
            return self.pipeline.score_broadcast(input_ids, head, shape, attention_mask=attention_mask, batch=rows)

    def evaluate(self) -> Optional[float]:
        return self.objective.evaluate(self)

    def eval_label(self) -> str:
        return self.objective.eval_label(self.eval_prompts())

    def eval_every(self) -> int:
        return self.cfg.eval.every

    def eval_prompts(self) -> int:
        return eval_count(self.cfg.eval, self.held_out)

    def export(self) -> Optional[str]:
        path = os.path.join(self.cfg.run_dir, "hf")
        if self.cfg.model.lora is not None and self.cfg.model.lora_export == "peft":
            path = export_peft_adapter(self.policy.model, path, self.cfg.model.path, self.layout)
        else:
            path = export_hf(self.policy.model, path, self.layout, tokenizer=self.tokenizer)
        self.objective.after_export(self, path)
        return path
