"""Heads on the decoder trunk, and the three models RLHF needs: policy (LM), critic (value), reward.

- `LMHead`: hidden -> logits over this rank's slice of the padded vocabulary, built by the same
  `LayerFactory` as the trunk (column-parallel under TP), optionally tied to the embedding. Padded
  vocabulary rows get logit -inf, so softmax gives them exactly zero probability; loss code must
  therefore use `torch.xlogy`-style entropy (0 * -inf = nan otherwise).
- `ValueHead`: hidden -> one scalar per token (PPO critic). Its weight is named `score`, like HF's
  `...ForSequenceClassification`, so a critic can start from a reward-model checkpoint.
- `RewardHead`: the same projection, read at the last real token of each sequence (HF's pooling: the
  rightmost non-padding position; with packing, the last token of each document).
The scalar heads are replicated across tensor-parallel ranks: the final hidden states they read are
whole on every rank.

Every model takes `layer_range=(start, end)` to build one pipeline stage (see `Decoder`): the head
exists only on the stage that ends at the last layer, and a stage without it returns the trunk's hidden
states `[B, T, H]` for the next stage. Tied word embeddings split into stages follow Megatron: the first
stage's embedding and the last stage's LM head are two Parameters holding the same (vocab-parallel,
padded) matrix, both loaded from the checkpoint's embedding tensor (`hf_adapter`), and marked `pp_tied`
so that `megalign.parallel.clip_grad_norm_` sums their gradients over the embedding group (first and
last stage) and counts the matrix once in the norm; identical updates then keep the copies equal. A
stage built without loading a checkpoint initialises its copy independently, so load one. Unsplit
(pp=1), the head shares the embedding's Parameter.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megalign.parallel.logprob import fused_linear_token_logprob

from . import batch_invariant
from .config import ModelConfig
from .decoder import Decoder, LayerFactory


class LMHead(nn.Module):
    """hidden `[..., H]` -> logits `[..., V_local]` over vocab rows `[vocab_start, vocab_end)` of the padded vocabulary.

    Under tensor parallelism the logits stay sharded over the vocabulary (V_local = V_pad / tp): the
    vocab-parallel log-prob (`megalign.parallel.logprob.vocab_parallel_token_logprob(logits, targets,
    group, vocab_start, vocab_size)`) consumes them without ever forming `[tokens, V]`. `gather_logits`
    assembles the full vocabulary where it is really needed (sampling, parity tests).
    Rows at or past `config.vocab_size` (vocab padding) are set to -inf.
    """

    def __init__(self, config: ModelConfig, factory: LayerFactory, tied_embedding: Optional[nn.Module] = None):
        super().__init__()
        self.factory = factory
        self.vocab_size = config.vocab_size
        self.proj = factory.column_linear(config.hidden_size, config.padded_vocab_size, bias=False)
        if tied_embedding is not None:
            # Same [V_local, H] rows on every tp layout: the vocab-parallel embedding and the
            # column-parallel head split the vocabulary identically.
            self.proj.weight = tied_embedding.weight
        self.vocab_start, self.vocab_end = factory.vocab_range(config.padded_vocab_size)
        pad = torch.arange(self.vocab_start, self.vocab_end) >= config.vocab_size
        self.register_buffer("vocab_pad", pad if bool(pad.any()) else None, persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.proj(hidden)
        if self.vocab_pad is not None:
            logits = logits.masked_fill(self.vocab_pad, float("-inf"))
        return logits

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """This rank's `[..., V_local]` logits -> the full `[..., vocab_size]` (padding dropped), the same on every tp rank.

        One all-gather over the tp group (autograd-aware: the backward keeps this rank's slice of
        the gradient). It materialises `[..., V]` on every rank, so use it for the few positions that
        need the whole distribution (the last position while decoding), not for training log-probs.
        """
        return self.factory.gather_vocab(logits)[..., : self.vocab_size]

    def token_logprob(self, hidden: torch.Tensor, targets: torch.Tensor, group, temperature: float = 1.0,
                      return_entropy: bool = False, chunk_size: int = 1024):
        """log p(target) (and the entropy) of softmax(head(hidden) / temperature) without the `[N, V]` logits.

        Args:
            hidden: `[..., H]` final hidden states (replicated over the tp group).
            targets: `[...]` int64 global token ids.
            group: the tensor-parallel group of this head's vocabulary shards (None at tp = 1).
        Returns fp32 `[...]` (and the entropy `[...]`), both differentiable, the same on every tp rank.
        `megalign.parallel.fused_linear_token_logprob` in chunks of `chunk_size` tokens (Liger-Kernel's
        fused linear cross entropy, vocab-parallel): neither the logits nor their gradient exist whole.
        Under autocast the head runs in the autocast dtype, as `forward`'s `F.linear` would; otherwise
        in the hidden states' dtype.
        """
        if batch_invariant.enabled():  # the engine's own head and log-softmax, in a fixed order (tp = 1 only)
            if group is not None:
                raise NotImplementedError("the batch-invariant mode runs at tensor-parallel size 1 only")
            return batch_invariant.head_token_logprob(self, hidden, targets, temperature, return_entropy)
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        return fused_linear_token_logprob(hidden.to(dtype), self.proj.weight.to(dtype), targets, group,
                                          self.vocab_start, chunk_size, temperature, return_entropy=return_entropy,
                                          vocab_size=self.vocab_size)


class ValueHead(nn.Module):
    """hidden `[B, T, H]` -> per-token values `[B, T]` (a bias-free linear map, HF's `score`)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.score = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.score(hidden).squeeze(-1)


def last_token_index(attention_mask: Optional[torch.Tensor], batch: int, seq: int, device) -> torch.Tensor:
    """`[B]` index of the rightmost real token: argmax(t * mask_t), HF's sequence-classification pooling."""
    if attention_mask is None:
        return torch.full((batch,), seq - 1, device=device)
    return (torch.arange(seq, device=device) * attention_mask.long()).argmax(-1)


class RewardHead(ValueHead):
    """hidden `[B, T, H]` -> one reward per sequence `[B]` (or per packed document `[n_docs]`)."""

    def forward(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        values = super().forward(hidden)
        if cu_seqlens is not None:
            return values[0, cu_seqlens[1:] - 1]
        idx = last_token_index(attention_mask, values.shape[0], values.shape[1], values.device)
        return values[torch.arange(values.shape[0], device=values.device), idx]


class _WithTrunk(nn.Module):
    """A `Decoder` trunk under `self.model` (the HF `model.` prefix), shared by the three models below."""

    def __init__(self, config: ModelConfig, factory: Optional[LayerFactory] = None,
                 activation_checkpointing: bool = False, layer_range: Optional[tuple[int, int]] = None):
        super().__init__()
        self.config = config
        self.model = Decoder(config, factory, activation_checkpointing, layer_range)

    @property
    def has_head(self) -> bool:
        """Whether this module ends at the last layer (holds the final norm and the head)."""
        return self.model.norm is not None


class CausalLM(_WithTrunk):
    """Policy / reference model: `forward(input_ids, ...)` -> logits `[B, T, V_local]` (see `Decoder.forward`)."""

    def __init__(self, config: ModelConfig, factory: Optional[LayerFactory] = None,
                 activation_checkpointing: bool = False, layer_range: Optional[tuple[int, int]] = None):
        super().__init__(config, factory, activation_checkpointing, layer_range)
        whole = self.model.layer_range == (0, config.num_hidden_layers)
        tied = self.model.embed if config.tie_word_embeddings and whole else None
        self.lm_head = LMHead(config, self.model.factory, tied) if self.has_head else None
        if config.tie_word_embeddings and not whole:  # a pipeline stage, see the module notes; {name: is_copy}
            if self.model.embed is not None:
                self.model.embed.pp_tied = {"weight": False}
            if self.lm_head is not None:
                self.lm_head.proj.pp_tied = {"weight": True}

    def forward(self, input_ids, attention_mask=None, position_ids=None, cu_seqlens=None, kv_cache=None):
        hidden = self.model(input_ids, attention_mask, position_ids, cu_seqlens, kv_cache)
        return self.lm_head(hidden) if self.has_head else hidden


class ValueModel(_WithTrunk):
    """Critic: `forward(input_ids, ...)` -> per-token values `[B, T]`."""

    head_cls = ValueHead

    def __init__(self, config: ModelConfig, factory: Optional[LayerFactory] = None,
                 activation_checkpointing: bool = False, layer_range: Optional[tuple[int, int]] = None):
        super().__init__(config, factory, activation_checkpointing, layer_range)
        self.head = self.head_cls(config.hidden_size) if self.has_head else None

    def forward(self, input_ids, attention_mask=None, position_ids=None, cu_seqlens=None):
        hidden = self.model(input_ids, attention_mask, position_ids, cu_seqlens)
        return self.head(hidden) if self.has_head else hidden


class RewardModel(ValueModel):
    """Reward model: `forward(input_ids, ...)` -> `[B]` rewards (`[n_docs]` when packed with cu_seqlens).

    A critic whose head reads only the last real token of each sequence.
    """

    head_cls = RewardHead

    def forward(self, input_ids, attention_mask=None, position_ids=None, cu_seqlens=None):
        hidden = self.model(input_ids, attention_mask, position_ids, cu_seqlens)
        return self.head(hidden, attention_mask, cu_seqlens) if self.has_head else hidden
