"""TRL's GRPOTrainer and DPOTrainer on megalign's kernels, in one call (like Liger-Kernel's
`apply_liger_kernel_to_*`, which swaps names in a library's modules before the model is built).

    from megalign.integrations import apply_megalign_kernels_to_trl, unpatch_trl
    apply_megalign_kernels_to_trl()          # before the trainers are constructed
    trainer = trl.GRPOTrainer(...)           # or trl.DPOTrainer(...)
    ...
    unpatch_trl()                            # or: with megalign_kernels_in_trl(): ...

Where TRL 1.16 computes log-probs (read from its source):

- `GRPOTrainer` and `DPOTrainer` never build the [B, T, V] logits: their `__init__` calls
  `trl.trainer.utils.add_fused_lm_head(model, temperature, cast_lm_head_to_fp32, outputs)`, which
  replaces `model.forward` so that `model(..., labels=labels, fused_lm_head=True)` runs the backbone
  and TRL's `ChunkedLogProbFunction` (the head projected in [4096 tokens, 32768 ids] tiles, each
  folded into online-logsumexp statistics; on a CPU the fold is several fp32 torch temporaries of
  the tile, and every position is scored, masked or not). GRPO asks for (log_probs, entropy),
  DPO for (log_probs, entropy, mean_logits, is_top1), plus log_sum_sq_probs with WPO weighting.
- `selective_log_softmax(logits, index, temperature, row_mask)` (trl.trainer.utils) is the
  logits-level op; in 1.16 only the experimental trainers (CPO, ORPO, SDPO, SDFT, A2PO) import
  it by name, and `selective_log_softmax_and_entropy` (TPO).
- `GRPOTrainer._compute_loss` computes the policy loss from the per-token log-probs.

What the patch replaces (each is a name swap, undone by `unpatch_trl`):

1. `add_fused_lm_head` as imported by `trl.trainer.grpo_trainer` and `trl.trainer.dpo_trainer`:
   TRL's own head is installed first and kept, then wrapped by a forward that scores only the
   labelled positions with `megalign.parallel.logprob.fused_linear_token_logprob` (the
   token_logprob kernels over [chunk, V] logits chunks, recomputed in backward and overwritten by
   their gradient). mean_logits is h . mean_j(W_j) / T (the head is linear, so this is the mean
   logit without a pass over the vocabulary); is_top1 (DPO's token-accuracy metric) needs the
   argmax, which costs one extra no-grad pass over the head. The wrapper calls TRL's forward when
   the patch is off (so unpatching also reverts trainers built while it was on) and for what it
   does not cover: WPO's log_sum_sq_probs, final-logit soft-capping or a logit scale (Gemma,
   Granite, Falcon-H1, ...), an LM-head bias, MoE router outputs, vision-language models and
   FSDP2's DTensor heads. Trainers constructed before the patch keep TRL's head.
2. `GRPOTrainer._compute_loss`: routed to `megalign.ops.policy_loss` only where TRL's formula is
   the fused op's: loss_type in {grpo, bnpo, dr_grpo, dapo, luspo} (the clipped surrogate
   -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), with TRL's own aggregation of each type) at
   importance_sampling_level="token", plus beta * k3 when beta != 0. TRL's two-sided clip `delta`
   caps r at delta for every token; for A >= 0 the cap never binds and for A < 0
   max(min(r, d), clip(r)) = min(max(r, clip(r)), d) when d > 1 + eps_high, which is the fused op's
   dual clip c = delta; a delta <= 1 + eps_high falls back. One difference remains: the fused op
   clamps log r to [-20, 20] (verl's guard), TRL does not; they agree for |log r| <= 20
   (r in [2e-9, 4.9e8]). Everything else runs TRL's own `_compute_loss`: loss types cispo, sapo
   and vespo (other formulas), sequence-level importance sampling, the off-policy mask, the
   high-entropy token mask, vLLM importance-sampling correction, use_bias_correction_kl, the
   entropy bonus and MoE aux loss (they reweight the per-token loss or add terms around it).
3. `selective_log_softmax` and `selective_log_softmax_and_entropy` in every loaded `trl.*` module
   that holds TRL's function by name (and in trl.trainer.utils, so later imports get the patched
   one): `token_logprob`, with row_mask == 0 rows as ignored targets. Outputs are fp32 (fp64 for
   fp64 logits), as TRL's own Triton path returns, where TRL's eager path returns the logits dtype.
   A [..., K] index (top-K gathers) and non-float logits go to TRL's function.

TRL is imported inside `apply_megalign_kernels_to_trl`, never when megalign is imported.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import warnings
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from megalign.ops import policy_loss, token_logprob
from megalign.ops._backend import FLOAT_DTYPES
from megalign.parallel.logprob import fused_linear_token_logprob

__all__ = ["apply_megalign_kernels_to_trl", "unpatch_trl", "megalign_kernels_in_trl"]

SUPPORTED_TRL = "1.16"
# outputs of TRL's FusedCausalLMOutput that the megalign head computes
_HEAD_OUTPUTS = frozenset({"log_probs", "entropy", "mean_logits", "is_top1"})
# logit multipliers TRL's add_fused_lm_head reads from the text config (any of them != 1 falls back)
_LOGIT_SCALES = ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")
# GRPO loss types whose per-token loss is the clipped surrogate of megalign.ops.policy_loss
_CLIPPED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# multimodal inputs GRPOTrainer._compute_loss forwards to _get_per_token_logps_and_entropies
_GRPO_MODEL_INPUTS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                      "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")
_LOGITS_CHUNK_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class _Options:
    lm_head: bool
    policy_loss: bool
    chunk_size: Optional[int]


_ACTIVE: Optional[_Options] = None
_SAVED: list[tuple[object, str, object]] = []  # (owner, attribute, TRL's value), in patch order


def _import_trl():
    try:
        import trl
        import trl.trainer.dpo_trainer as dpo_module
        import trl.trainer.grpo_trainer as grpo_module
        import trl.trainer.utils as utils_module
    except ImportError as exc:
        raise ImportError("apply_megalign_kernels_to_trl needs TRL (pip install 'trl>=1.16,<1.17'); "
                          f"importing it failed: {exc}") from exc
    if not trl.__version__.startswith(SUPPORTED_TRL + "."):
        raise ImportError(f"apply_megalign_kernels_to_trl patches TRL {SUPPORTED_TRL}.x internals "
                          f"(add_fused_lm_head, GRPOTrainer._compute_loss), found trl {trl.__version__}")
    return utils_module, grpo_module, dpo_module


def _swap(owner: object, name: str, value: object) -> None:
    _SAVED.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def apply_megalign_kernels_to_trl(lm_head: bool = True, policy_loss: bool = True, logprob: bool = True,
                                  chunk_size: Optional[int] = None) -> None:
    """Patch TRL so GRPOTrainer and DPOTrainer run on megalign's kernels (module docstring).

    Args:
        lm_head: replace the fused LM head of GRPOTrainer / DPOTrainer models (log-probs, entropy).
        policy_loss: route GRPOTrainer's clipped-surrogate losses to megalign.ops.policy_loss.
        logprob: replace trl's `selective_log_softmax` and `selective_log_softmax_and_entropy`.
        chunk_size: tokens per logits chunk of the LM head, the only [tokens, vocab] temporary
            ([chunk_size, V] in the compute dtype); None sizes it to about 64 MiB.

    Call it before constructing the trainers: they install the LM head in `__init__`. Calling it
    again replaces the previous patch.
    """
    global _ACTIVE
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"apply_megalign_kernels_to_trl: chunk_size must be a positive int or None, "
                         f"got {chunk_size!r}")
    utils_module, grpo_module, dpo_module = _import_trl()
    unpatch_trl()
    if lm_head:
        trl_add = utils_module.add_fused_lm_head
        for module in (grpo_module, dpo_module):
            _swap(module, "add_fused_lm_head", functools.partial(_add_megalign_head, trl_add))
    if policy_loss:
        trainer = grpo_module.GRPOTrainer
        _swap(trainer, "_compute_loss", functools.partialmethod(_grpo_compute_loss, trainer._compute_loss))
    if logprob:
        originals = {"selective_log_softmax": utils_module.selective_log_softmax,
                     "selective_log_softmax_and_entropy": utils_module.selective_log_softmax_and_entropy}
        replacements = {"selective_log_softmax": functools.partial(_selective_log_softmax, originals),
                        "selective_log_softmax_and_entropy": functools.partial(_selective_log_softmax_and_entropy,
                                                                               originals)}
        for module_name, module in list(sys.modules.items()):
            if module is None or not (module_name == "trl" or module_name.startswith("trl.")):
                continue
            for name, original in originals.items():
                if getattr(module, name, None) is original:
                    _swap(module, name, replacements[name])
    _ACTIVE = _Options(lm_head, policy_loss, chunk_size)


def unpatch_trl() -> None:
    """Restore every TRL name the patch replaced; models built under the patch go back to TRL's head."""
    global _ACTIVE
    while _SAVED:
        owner, name, value = _SAVED.pop()
        setattr(owner, name, value)
    _ACTIVE = None


@contextlib.contextmanager
def megalign_kernels_in_trl(**options):
    """`apply_megalign_kernels_to_trl(**options)` for the duration of a `with` block."""
    apply_megalign_kernels_to_trl(**options)
    try:
        yield
    finally:
        unpatch_trl()


# ----- the LM head (GRPOTrainer, DPOTrainer)

def _head_fallback_reason(model, outputs) -> Optional[str]:
    text_config = model.config.get_text_config()
    unsupported = set(outputs) - _HEAD_OUTPUTS
    if unsupported:
        return f"outputs {sorted(unsupported)}"
    if text_config is not model.config:
        return "a vision-language model"
    if getattr(text_config, "final_logit_softcapping", None) is not None:
        return "final_logit_softcapping"
    for name in _LOGIT_SCALES:
        if getattr(text_config, name, None) not in (None, 1, 1.0):
            return f"config.{name} = {getattr(text_config, name)}"
    if getattr(text_config, "output_router_logits", False):
        return "MoE router outputs"
    if getattr(model.get_output_embeddings(), "bias", None) is not None:
        return "an LM-head bias"
    return None


def _add_megalign_head(trl_add: Callable, model, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False,
                       outputs: tuple[str, ...] = ("log_probs",)) -> None:
    """TRL's `add_fused_lm_head` signature: install TRL's head, then megalign's in front of it."""
    trl_add(model, temperature=temperature, cast_lm_head_to_fp32=cast_lm_head_to_fp32, outputs=outputs)
    reason = _head_fallback_reason(model, outputs)
    if reason is not None:
        warnings.warn(f"megalign.integrations.trl: {type(model).__name__} keeps TRL's LM head ({reason})", stacklevel=3)
        return
    from trl.trainer.utils import FusedCausalLMOutput

    trl_forward = model.forward

    @functools.wraps(trl_forward)
    def forward(*args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        weight = model.get_output_embeddings().weight
        if (not fused_lm_head or _ACTIVE is None or not _ACTIVE.lm_head
                or isinstance(weight, DTensor) or kwargs.get("output_router_logits")):
            return trl_forward(*args, fused_lm_head=fused_lm_head, labels=labels, shift_labels=shift_labels,
                               num_items_in_batch=num_items_in_batch, **kwargs)
        kwargs["use_cache"] = False
        hidden = model.base_model(*args, **kwargs).last_hidden_state
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        per_token = _megalign_head(hidden.to(weight.device), weight, labels.to(weight.device), temperature,
                                   cast_lm_head_to_fp32, outputs, _ACTIVE.chunk_size)
        mask = per_token.pop("label_mask")
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedCausalLMOutput(loss=-per_token["log_probs"].sum() / count, label_mask=mask, **per_token)

    model.forward = forward


def _megalign_head(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float,
                   cast_fp32: bool, outputs, chunk_size: Optional[int]) -> dict:
    """TRL's FusedCausalLMOutput fields of `hidden @ weight^T / temperature` at the labelled positions.

    hidden [B, T, H], weight [V, H], labels [B, T] (-100 = not scored). Returns log_probs and
    entropy (fp32, differentiable, 0 where unlabelled), mean_logits / is_top1 when in `outputs`
    (no grad), None for the others, and label_mask [B, T] bool. The compute dtype is TRL's: fp32
    with cast_lm_head_to_fp32, else autocast's dtype when autocast is on, else hidden's.
    """
    device = hidden.device.type
    if cast_fp32:
        dtype = torch.float32
    elif torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = hidden.dtype
    mask = labels != -100
    vocab = weight.shape[0]
    if chunk_size is None:
        chunk_size = max(1, _LOGITS_CHUNK_BYTES // (vocab * torch.finfo(dtype).bits // 8))
    with torch.autocast(device, enabled=False):
        h, w, targets = hidden[mask].to(dtype), weight.to(dtype), labels[mask]
        with_entropy = "entropy" in outputs
        result = fused_linear_token_logprob(h, w, targets, chunk_size=chunk_size, temperature=temperature,
                                            return_entropy=with_entropy)
        logp, entropy = result if with_entropy else (result, None)
        fields = {"log_probs": logp, "entropy": entropy, "log_sum_sq_probs": None, "mean_logits": None,
                  "is_top1": None}
        with torch.no_grad():
            if "mean_logits" in outputs:
                fields["mean_logits"] = h.float() @ w.mean(0, dtype=torch.float32) / temperature
            if "is_top1" in outputs:
                # torch.argmax returns the first maximum: a tie with an earlier id is not top-1, as in TRL
                top1 = [F.linear(h[s:s + chunk_size], w).argmax(-1) == targets[s:s + chunk_size]
                        for s in range(0, h.shape[0], chunk_size)]
                fields["is_top1"] = torch.cat(top1) if top1 else targets.new_zeros(0, dtype=torch.bool)
    # masked_scatter keeps an all-unlabelled batch connected to the graph (a zero loss that backpropagates)
    out = {k: None if v is None else v.new_zeros(mask.shape).masked_scatter(mask, v) for k, v in fields.items()}
    out["label_mask"] = mask
    return out


# ----- GRPOTrainer's policy loss

def _grpo_fallback_reason(trainer) -> Optional[str]:
    """Why TRL's own _compute_loss must run for this trainer's configuration (None: it need not)."""
    args = trainer.args
    checks = (
        (trainer.loss_type not in _CLIPPED_LOSSES, f"loss_type={trainer.loss_type!r}"),
        (trainer.importance_sampling_level != "token", "importance_sampling_level='sequence'"),
        (trainer.off_policy_mask_threshold is not None, "off_policy_mask_threshold"),
        (trainer.top_entropy_quantile < 1.0, "top_entropy_quantile < 1"),
        (trainer.use_vllm and trainer.vllm_importance_sampling_correction, "vllm_importance_sampling_correction"),
        (trainer.beta != 0.0 and args.use_bias_correction_kl, "use_bias_correction_kl"),
        (args.delta is not None and not args.delta > 1 + trainer.epsilon_high, "delta <= 1 + epsilon_high"),
        (trainer._entropy_bonus_enabled, "the entropy bonus"),
        (trainer.aux_loss_enabled, "the MoE aux loss"),
    )
    return next((why for failed, why in checks if failed), None)


def _grpo_compute_loss(trainer, trl_compute_loss: Callable, model, inputs):
    """GRPOTrainer._compute_loss with the per-token loss from megalign.ops.policy_loss.

    Same inputs, aggregation, gradient-accumulation scaling and metrics as TRL 1.16's
    `_compute_loss` for the configurations `_grpo_fallback_reason` accepts; TRL's otherwise.
    """
    if _ACTIVE is None or not _ACTIVE.policy_loss:
        return trl_compute_loss(trainer, model, inputs)
    reason = _grpo_fallback_reason(trainer)
    if reason is not None:  # the default warning filter shows each distinct message once
        warnings.warn(f"megalign.integrations.trl: GRPOTrainer runs TRL's own loss ({reason})", stacklevel=2)
        return trl_compute_loss(trainer, model, inputs)
    from trl.trainer.utils import nanmax, nanmin

    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    logp, entropies, _ = trainer._get_per_token_logps_and_entropies(
        model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True, compute_aux_loss=False,
        **{name: inputs.get(name) for name in _GRPO_MODEL_INPUTS})
    advantages = inputs["advantages"]
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    advantages = advantages.to(logp.dtype).expand_as(logp)
    old_logp = inputs.get("old_per_token_logps")
    old_logp = logp.detach() if old_logp is None else old_logp.to(logp.dtype)
    ref_logp = inputs["ref_per_token_logps"].to(logp.dtype) if trainer.beta != 0.0 else None
    per_token_loss, stats = policy_loss(logp, old_logp, advantages, mask, eps_low=trainer.epsilon_low,
                                        eps_high=trainer.epsilon_high, dual_clip=trainer.args.delta,
                                        beta=trainer.beta, ref_logp=ref_logp)  # 0 at masked tokens

    mode = "train" if trainer.model.training else "eval"
    accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
    loss_type = trainer.loss_type
    if loss_type == "grpo":
        loss = (per_token_loss.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
    elif loss_type == "bnpo":
        loss = per_token_loss.sum() / mask.sum().clamp(min=1.0) / accumulation
    elif loss_type == "dr_grpo":
        loss = per_token_loss.sum() / (per_token_loss.size(0) * trainer.max_completion_length) / accumulation
    elif loss_type == "dapo":
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
        if mode == "train":
            normalizer = normalizer * accumulation / trainer.args.steps_per_generation
        loss = per_token_loss.sum() / normalizer
    else:  # luspo
        loss = per_token_loss.sum(-1).mean() / accumulation

    metrics = trainer._metrics[mode]
    maskf = mask.float()

    def global_mean(local_sum: torch.Tensor, local_count: torch.Tensor) -> float:
        totals = trainer.accelerator.reduce(torch.stack([local_sum, local_count]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    if trainer.beta != 0.0:
        metrics["kl"].append(global_mean(stats.kl_mean * stats.count, stats.count))
    metrics["entropy"].append(global_mean((entropies * maskf).sum(), maskf.sum()))
    ratio = torch.exp(logp.detach() - old_logp)
    low = ((ratio < 1 - trainer.epsilon_low) & (advantages < 0)).float()
    high = ((ratio > 1 + trainer.epsilon_high) & (advantages > 0)).float()
    for name, clipped in (("low", low), ("high", high), ("region", torch.maximum(low, high))):
        metrics[f"clip_ratio/{name}_mean"].append(global_mean((clipped * maskf).sum(), maskf.sum()))

    def seq_means(x: torch.Tensor) -> torch.Tensor:  # per-sequence masked means, from every process
        return trainer.accelerator.gather((x * maskf).sum(-1) / maskf.sum(-1))

    metrics["clip_ratio/low_min"].append(nanmin(seq_means(low)).item())
    metrics["clip_ratio/high_max"].append(nanmax(seq_means(high)).item())
    return loss


# ----- selective_log_softmax

def _selective_log_softmax(originals: dict, logits: torch.Tensor, index: torch.Tensor, temperature: float = 1.0,
                           row_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """trl.trainer.utils.selective_log_softmax on megalign's token_logprob (same arguments).

    logits [..., V], index [...] ids, row_mask [...] (0 = the row gives 0 and no gradient).
    Returns [...] fp32 (fp64 for fp64 logits). A [..., K] index goes to TRL's function.
    """
    if temperature <= 0:
        raise ValueError("temperature must be positive")
    if index.ndim != logits.ndim - 1 or logits.dtype not in FLOAT_DTYPES:
        return originals["selective_log_softmax"](logits, index, temperature=temperature, row_mask=row_mask)
    return token_logprob(logits, _targets(index, row_mask), temperature=temperature)


def _selective_log_softmax_and_entropy(originals: dict, logits: torch.Tensor, index: torch.Tensor,
                                       entropy_requires_grad: bool = True, temperature: float = 1.0,
                                       row_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """trl.trainer.utils.selective_log_softmax_and_entropy on token_logprob: (logp, entropy) [...] fp32."""
    if temperature <= 0:
        raise ValueError("temperature must be positive")
    if index.ndim != logits.ndim - 1 or logits.dtype not in FLOAT_DTYPES:
        return originals["selective_log_softmax_and_entropy"](
            logits, index, entropy_requires_grad=entropy_requires_grad, temperature=temperature, row_mask=row_mask)
    logp, entropy = token_logprob(logits, _targets(index, row_mask), temperature=temperature, return_entropy=True)
    return logp, entropy if entropy_requires_grad else entropy.detach()


def _targets(index: torch.Tensor, row_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """int64 ids with masked rows (row_mask == 0) set to token_logprob's ignore_index (-100)."""
    targets = index.long()
    return targets if row_mask is None else targets.masked_fill(row_mask == 0, -100)
