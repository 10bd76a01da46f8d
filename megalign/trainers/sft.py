"""Supervised fine-tuning: the first stage of SFT -> RL, and the warm start of the embedded GRPO task.

`train_sft(cfg)` runs the whole stage on an initialised process group (`megalign.trainers.cli.
init_distributed`): builds or loads the model over a tp x dp layout, trains on (prompt, response)
pairs with the loss on response tokens only, checkpoints and resumes, exports the final model to
`run_dir/hf` and measures held-out accuracy by greedy generation.

Design choices:

- Loss: the mean negative log-likelihood per response token over the *global* batch (all dp ranks):
  each rank sums its tokens' -log p and divides by the global token count (one all-reduce of an
  integer before the forward), and gradients are summed over dp (`allreduce_gradients(average=False)`).
  Every token weighs the same whatever the padding or the split over ranks, so the loss and the
  update do not depend on dp. Log-probs come from `vocab_parallel_token_logprob` on the LM head's
  vocab-sharded logits (no gather of the vocabulary at tp > 1; no collective at tp = 1).
- From-scratch models are initialised dense, from `seed`, on every rank, and each tp rank keeps its
  slice, so a tiny model starts from the same weights at tp = 1 and tp = 2.
- Exact resume: the checkpoint holds the model and ZeRO-1 optimizer shards, every rank's RNG, the
  sampler's stream position and the step counters; the learning rate is a function of the step
  (`megalign.trainers.optim.lr_at`). A run stopped after step k and resumed gives the same losses and
  weights as one that never stopped.
- A non-finite loss or gradient norm (checked on all ranks together, `all_finite`) skips the update
  with a warning and is counted (`nan_skips`); the step still consumes its batch and counts, so
  the schedule stays aligned with the data.
- The embedded default (`examples/sft_arith.yaml`, the defaults here) is sized to land at *partial*
  held-out accuracy on the arithmetic task in a few CPU minutes, leaving room for GRPO to improve it.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
import time
from typing import Any, Literal, Optional

import numpy as np
import torch
import torch.distributed as dist

from megalign.checkpoint import CheckpointManager, ModelState, OptimizerState, RNGState, all_finite, export_hf
from megalign.config import option, save_config
from megalign.data import (ArithTaskConfig, PromptExample, PromptSampler, Tokenizer, TokenizerConfig, build_tokenizer,
                           load_prompts, make_splits)
from megalign.data.sft import SFTExample, collate_sft, encode_sft, load_sft_jsonl
from megalign.models import CausalLM, ModelConfig, TensorParallelFactory, from_pretrained, tensor_parallel_config
from megalign.parallel import (ParallelLayout, allreduce_gradients, clip_grad_norm_, tp_sharded_parameters,
                               vocab_parallel_token_logprob)
from megalign.parallel.collectives import all_reduce
from megalign.rewards import math_accuracy
from megalign.rollout.generate import SamplingParams, generate
from megalign.trainers.logging import MetricsLogger, PhaseTimer, memory_report
from megalign.trainers.optim import OptimConfig, build_optimizer, lr_at, set_lr

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SFTModelConfig:
    """The model to train: an HF checkpoint folder, or a small decoder built from scratch."""

    path: Optional[str] = option(None, doc="HF checkpoint folder to start from; null: build from scratch with the fields below")
    model_type: Literal["llama", "qwen2", "mistral"] = option("llama", doc="from scratch: architecture family (written to the HF export)")
    hidden_size: int = option(128, doc="from scratch: model width H")
    intermediate_size: int = option(384, doc="from scratch: SwiGLU inner width")
    num_layers: int = option(3, doc="from scratch: decoder layers")
    num_heads: int = option(4, doc="from scratch: query heads (head_dim = hidden_size / num_heads)")
    num_kv_heads: int = option(4, doc="from scratch: key/value heads (GQA when fewer than num_heads)")
    max_position_embeddings: int = option(256, doc="from scratch: longest sequence (RoPE tables)")
    tie_word_embeddings: bool = option(False, doc="from scratch: LM head shares the embedding matrix")
    init_std: float = option(0.02, doc="from scratch: std of the normal init of every matrix (norm gains start at 1)")

    def __post_init__(self):
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        if not self.init_std > 0:
            raise ValueError(f"init_std must be > 0, got {self.init_std}")


@dataclasses.dataclass
class SFTDataConfig:
    """Training pairs and held-out prompts: the embedded arithmetic task, or JSONL files."""

    path: Optional[str] = option(None, doc="SFT JSONL (rows: prompt, response); null: the train split of the arithmetic task")
    eval_path: Optional[str] = option(None, doc="held-out JSONL (rows: prompt, answer) for accuracy; null: the arithmetic held-out split when path is null, else no evaluation")
    arith: ArithTaskConfig = option(ArithTaskConfig(), doc="the embedded arithmetic task (used when path is null)")
    tokenizer: TokenizerConfig = option(TokenizerConfig(), doc="tokenizer (the built-in character one by default)")
    max_length: int = option(64, doc="rows with more prompt + response + EOS tokens are dropped and counted")
    skip_invalid: bool = option(False, doc="skip and count malformed JSONL rows instead of failing on the first")
    template_prompts: bool = option(False, doc="wrap prompts as a user message through the chat template")
    shuffle: bool = option(True, doc="reshuffle the training pairs every epoch (seeded by seed and epoch)")

    def __post_init__(self):
        if self.max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {self.max_length}")


@dataclasses.dataclass
class ParallelConfig:
    """How the ranks split: tp-way tensor parallel, the rest data parallel (no pipeline for SFT)."""

    tp: int = option(1, doc="tensor-parallel size; dp = world_size / tp")

    def __post_init__(self):
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")


@dataclasses.dataclass
class EvalConfig:
    """Held-out accuracy by greedy generation, scored with the `math_accuracy` verifier."""

    max_samples: Optional[int] = option(None, doc="evaluate the first N held-out prompts; null: all; 0: no evaluation")
    batch_size: int = option(128, doc="prompts per generation batch on each dp rank")
    max_new_tokens: int = option(24, doc="generation length limit")

    def __post_init__(self):
        if self.max_samples is not None and self.max_samples < 0:
            raise ValueError(f"max_samples must be >= 0 or null, got {self.max_samples}")
        if self.batch_size < 1 or self.max_new_tokens < 1:
            raise ValueError(f"batch_size and max_new_tokens must be >= 1, got {self.batch_size}, {self.max_new_tokens}")


@dataclasses.dataclass
class SFTConfig:
    """One SFT run (`launch/train_sft.py --config ... key.sub=value`)."""

    run_dir: str = option("runs/sft_arith", doc="output folder: config.yaml, metrics.jsonl, tensorboard/, checkpoints/, hf/")
    steps: int = option(400, doc="optimizer steps")
    batch_size: int = option(64, doc="sequences per step over all dp ranks (a multiple of dp)")
    seed: int = option(0, doc="seed of the model init, data order and every RNG")
    device: Literal["auto", "cpu", "cuda"] = option("auto", doc="auto: CUDA when available")
    model: SFTModelConfig = option(SFTModelConfig(), doc="the model")
    data: SFTDataConfig = option(SFTDataConfig(), doc="the data")
    optim: OptimConfig = option(OptimConfig(lr=3e-3, warmup_steps=20), doc="optimizer and LR schedule")
    parallel: ParallelConfig = option(ParallelConfig(), doc="parallel layout")
    eval: EvalConfig = option(EvalConfig(), doc="held-out evaluation at the end")
    save_every: int = option(100, doc="checkpoint every N steps (and always after the last); 0: only after the last")
    keep_last: int = option(2, doc="completed checkpoints to keep")
    resume: str = option("auto", doc="'auto' (latest checkpoint in run_dir, if any), 'none', a step number or a checkpoint folder")
    export_hf: bool = option(True, doc="write the final model in HF format to run_dir/hf")
    log_every: int = option(1, doc="write metrics every N steps")
    tensorboard: bool = option(True, doc="also write TensorBoard scalars")

    def __post_init__(self):
        for name in ("steps", "batch_size", "keep_last", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.save_every < 0 or self.seed < 0:
            raise ValueError(f"save_every and seed must be >= 0, got {self.save_every}, {self.seed}")


@dataclasses.dataclass
class SFTResult:
    """What a run reports back: where it ended and how it did."""

    step: int
    """Steps completed (cfg.steps at the end)."""
    accuracy: Optional[float]
    """Held-out accuracy in [0, 1], or None when no evaluation ran."""
    metrics: list[dict[str, float]]
    """This invocation's logged metrics per step (a resumed run holds only the steps it ran)."""
    hf_path: Optional[str]
    """Folder of the HF export, or None."""


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _scratch_model(cfg: SFTModelConfig, tokenizer: Tokenizer, layout: ParallelLayout, seed: int) -> CausalLM:
    """A from-scratch `CausalLM` for `tokenizer`, initialised identically for every tp (module doc)."""
    config = ModelConfig(
        model_type=cfg.model_type, vocab_size=tokenizer.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads, tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=cfg.max_position_embeddings, pad_token_id=tokenizer.pad_id,
        extra_hf={"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id},
    )
    config = tensor_parallel_config(config, layout.tp)
    generator = torch.Generator().manual_seed(seed)
    dense = CausalLM(config)
    with torch.no_grad():
        for p in dense.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, cfg.init_std, generator=generator)
    if layout.tp == 1:
        return dense.to(layout.device)
    model = CausalLM(config, TensorParallelFactory(layout))
    shard_dims = {id(p): dim for p, dim in tp_sharded_parameters(model).items()}
    full = dict(dense.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            src = full[name]
            if id(p) in shard_dims:
                src = src.chunk(layout.tp, dim=shard_dims[id(p)])[layout.tp_rank]
            p.copy_(src)
    return model.to(layout.device)


def build_model(cfg: SFTConfig, tokenizer: Tokenizer, layout: ParallelLayout) -> CausalLM:
    """This rank's (tp shard of the) model: loaded from `cfg.model.path`, or built from scratch."""
    if cfg.model.path is None:
        return _scratch_model(cfg.model, tokenizer, layout, cfg.seed)
    model = from_pretrained(cfg.model.path, layout=layout)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"model.path {cfg.model.path!r} has vocab_size {model.config.vocab_size} but the tokenizer "
                         f"has {tokenizer.vocab_size} ids")
    return model


def build_data(cfg: SFTDataConfig, tokenizer: Tokenizer, max_prompt_length: int) -> tuple[list[SFTExample], list[PromptExample]]:
    """(training pairs, held-out prompts with answers) as the config says."""
    if cfg.path is not None:
        train, _ = load_sft_jsonl(cfg.path, tokenizer, cfg.max_length, cfg.skip_invalid, cfg.template_prompts)
        held_out = [] if cfg.eval_path is None else list(
            load_prompts(cfg.eval_path, tokenizer, max_prompt_length, cfg.skip_invalid, cfg.template_prompts))
        return train, held_out
    train_problems, held_problems = make_splits(cfg.arith)
    train = [encode_sft(p.prompt, p.response, tokenizer, cfg.template_prompts) for p in train_problems]
    too_long = sum(len(e.prompt_ids) + len(e.response_ids) > cfg.max_length for e in train)
    if too_long:
        raise ValueError(f"data.max_length={cfg.max_length} is shorter than {too_long} arithmetic examples; raise it")
    if cfg.eval_path is not None:
        held_out = list(load_prompts(cfg.eval_path, tokenizer, max_prompt_length, cfg.skip_invalid, cfg.template_prompts))
    else:
        held_out = [PromptExample(encode_sft(p.prompt, p.response, tokenizer, cfg.template_prompts).prompt_ids,
                                  p.prompt, p.answer, {}, f"arith held-out {i}") for i, p in enumerate(held_problems)]
    return train, held_out


def sft_loss(model: CausalLM, batch: dict[str, torch.Tensor], tp_group: Optional[dist.ProcessGroup],
             global_tokens: torch.Tensor) -> torch.Tensor:
    """This rank's share of the global-batch mean NLL per response token (0-dim fp32; module doc).

    batch: `collate_sft` tensors on the model's device; `global_tokens`: the number of response
    tokens over all dp ranks (0-dim). Summed over dp ranks the returned values give the mean.
    """
    logits = model(batch["input_ids"], batch["attention_mask"])  # [B, T, V_local]
    logp = vocab_parallel_token_logprob(logits, batch["targets"], tp_group, model.lm_head.vocab_start,
                                        vocab_size=model.config.vocab_size)  # [B, T], 0 where ignored
    return -logp.sum() / global_tokens.clamp(min=1)


@torch.no_grad()
def evaluate(model: CausalLM, examples: list[PromptExample], tokenizer: Tokenizer, cfg: EvalConfig,
             layout: ParallelLayout) -> tuple[float, list[tuple[str, str, Any]]]:
    """(held-out accuracy, a few (prompt, response, answer) samples) by greedy decoding.

    The examples are split over dp ranks (rank d takes d, d + dp, ...); tp ranks of a dp rank decode
    the same prompts together. Counts are summed over dp, so every rank returns the same accuracy.
    """
    n = len(examples) if cfg.max_samples is None else min(cfg.max_samples, len(examples))
    mine = examples[layout.dp_rank:n:layout.dp]
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=0.0, eos_token_id=tokenizer.eos_id,
                            pad_token_id=tokenizer.pad_id)
    correct, samples = 0, []
    was_training = model.training
    model.eval()
    for start in range(0, len(mine), cfg.batch_size):
        chunk = mine[start:start + cfg.batch_size]
        width = max(len(e.prompt_ids) for e in chunk)
        ids = torch.full((len(chunk), width), tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, e in enumerate(chunk):  # left padding: every row's next token lands in the same column
            ids[i, width - len(e.prompt_ids):] = torch.tensor(e.prompt_ids)
            mask[i, width - len(e.prompt_ids):] = 1
        out = generate(model, ids.to(layout.device), mask.to(layout.device), params)
        for e, row in zip(chunk, out.sequences[:, width:].tolist()):
            response = tokenizer.decode(row)
            correct += int(math_accuracy(response, e.answer))
            if len(samples) < 5:
                samples.append((e.prompt_text, response, e.answer))
    model.train(was_training)
    counts = all_reduce(torch.tensor([correct, len(mine)], dtype=torch.float64, device=layout.device), layout.dp_group)
    return float(counts[0] / counts[1].clamp(min=1)), samples


def train_sft(cfg: SFTConfig) -> SFTResult:
    """Run SFT as configured (module doc); every rank calls it after `init_distributed`."""
    device_type = "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"
    layout = ParallelLayout.build(tp=cfg.parallel.tp, device_type=device_type)
    if cfg.batch_size % layout.dp:
        raise ValueError(f"batch_size={cfg.batch_size} must be a multiple of dp={layout.dp}")
    rank = layout.rank
    if rank == 0:
        os.makedirs(cfg.run_dir, exist_ok=True)
        save_config(cfg, os.path.join(cfg.run_dir, "config.yaml"))
    _seed_everything(cfg.seed)
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    train, held_out = build_data(cfg.data, tokenizer, cfg.data.max_length)
    model = build_model(cfg, tokenizer, layout)
    model.train()
    optimizer = build_optimizer(model, cfg.optim, layout)
    sampler = PromptSampler(len(train), seed=cfg.seed, shuffle=cfg.data.shuffle, rank=layout.dp_rank,
                            world_size=layout.dp)
    progress = {"step": 0, "nan_skips": 0}
    checkpoints = CheckpointManager(cfg.run_dir, keep_last=cfg.keep_last)
    state = {"model": ModelState(model, layout), "optim": OptimizerState(model, optimizer, layout),
             "rng": RNGState(), "sampler": sampler, "progress": progress}
    resume = checkpoints.resolve_resume(cfg.resume)
    if resume is not None:
        checkpoints.load(resume, state)
        logger.info("resumed from %s at step %d", resume, progress["step"])
    logger.info("SFT: %d training pairs, %d held-out prompts, %d parameters per rank, layout tp=%d dp=%d",
                len(train), len(held_out), sum(p.numel() for p in model.parameters()), layout.tp, layout.dp)

    tp_group = layout.tp_group if layout.tp > 1 else None
    params = list(model.parameters())
    per_rank = cfg.batch_size // layout.dp
    timer = PhaseTimer()
    history: list[dict[str, float]] = []
    metrics_log = MetricsLogger(cfg.run_dir, rank=rank, tensorboard=cfg.tensorboard, progress_total=cfg.steps,
                                initial_step=progress["step"])
    try:
        while progress["step"] < cfg.steps:
            step = progress["step"]
            timer.reset()
            start = time.perf_counter()
            lr = lr_at(cfg.optim, step, cfg.steps)
            set_lr(optimizer, lr)
            with timer("data"):
                batch = collate_sft([train[i] for i in sampler.next_indices(per_rank)], tokenizer.pad_id)
                batch = {k: v.to(layout.device) for k, v in batch.items()}
                tokens = all_reduce((batch["targets"] != -100).sum(), layout.dp_group)
            with timer("forward_backward"):
                loss = sft_loss(model, batch, tp_group, tokens)
                loss.backward()
            with timer("update"):
                allreduce_gradients(params, layout.dp_group, average=False)
                grad_norm = clip_grad_norm_(model, cfg.optim.grad_clip or math.inf, layout)
                global_loss = all_reduce(loss.detach(), layout.dp_group)
                if all_finite([global_loss, grad_norm]):
                    optimizer.step()
                else:
                    progress["nan_skips"] += 1
                    logger.warning("step %d: non-finite loss (%s) or gradient norm (%s); skipping the update",
                                   step, float(global_loss), float(grad_norm))
                optimizer.zero_grad(set_to_none=True)
            progress["step"] = step + 1
            elapsed = time.perf_counter() - start
            if progress["step"] % cfg.log_every == 0 or progress["step"] == cfg.steps:
                row = {"loss": float(global_loss), "lr": lr, "grad_norm": float(grad_norm), "tokens": float(tokens),
                       "tokens_per_s": float(tokens) / elapsed, "nan_skips": float(progress["nan_skips"]),
                       "epoch": float(sampler.epoch), **timer.metrics(), **memory_report()}
                metrics_log.log(progress["step"], row)
                history.append({"step": progress["step"], **row})
            if progress["step"] == cfg.steps or (cfg.save_every and progress["step"] % cfg.save_every == 0):
                checkpoints.save(progress["step"], state)

        hf_path = export_hf(model, os.path.join(cfg.run_dir, "hf"), layout) if cfg.export_hf else None
        accuracy = None
        if held_out and cfg.eval.max_samples != 0:
            accuracy, samples = evaluate(model, held_out, tokenizer, cfg.eval, layout)
            metrics_log.log(progress["step"], {"eval/accuracy": accuracy})
            if rank == 0:
                for prompt, response, answer in samples:
                    logger.info("held-out sample: %r -> %r (answer %s)", prompt, response, answer)
                n = len(held_out) if cfg.eval.max_samples is None else min(cfg.eval.max_samples, len(held_out))
                print(f"SFT held-out accuracy after {progress['step']} steps: {accuracy:.1%} of {n} prompts", flush=True)
    finally:
        metrics_log.close()
    return SFTResult(progress["step"], accuracy, history, hf_path)
