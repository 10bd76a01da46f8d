"""The PPO critic: a decoder with a scalar value per token, trained beside the actor on the same ranks.

Design choices:

- The critic is a `ValueModel` (`megalign.models.heads`: the decoder trunk and a bias-free
  `score` head) on its own `ParallelLayout`, dtype, optimizer, learning rate, gradient clip and
  offload switches (`megalign.trainers.ppo.CriticConfig`: the actor's section plus its own `optim`). It
  is a `TrainableRole`, so gradient sync over dp, global-norm clipping, skipped non-finite updates
  and the "weights" / "optimizer" offload parts are the actor's.
- Initialisation: from a reward-model export (`*ForSequenceClassification`, OpenRLHF's default)
  its head is read; from a policy (SFT) export the head starts fresh, small and identical on every
  rank (`megalign.models.scalar_head_from_pretrained`).
- Which positions: V(s_t) for the state before response token t, i.e. the hidden state of the
  position that predicts token t (`hidden[:, P-1 : P+R-1]`), the same slice the actor's log-probs use
  (verl's `values[:, -response_length - 1:-1]`), so values, log-probs and rewards line up [B, R].
  With packing (`rollout.pack`, `megalign.roles.packing`) the same states come from the rows'
  real tokens packed back to back, and only the real response tokens go through the head.
- Pipeline stages (`layout.pp > 1`; `scalar_head_from_pretrained` builds this rank's stage, the head on
  the last stage only, read from an RM export or drawn fresh as at pp = 1): old values come from the
  forward-only schedule with the head on the last stage, broadcast over the pp group
  (`pipeline_values`, the actor's `PolicyRole.pipeline_scores` with the value head); the value loss
  runs inside 1F1B (`megalign.trainers.online.OnlineTrainer.train_role`), where `values_with_grad`
  gets the last stage's hidden states. The critic's layout is its own: at pp = 1 beside a pp = 2
  actor its dp replicas inside one actor replica train on the same batch (`batch_copies`,
  `TrainableRole`). Pipelined forwards run on padded rows (no packing).
- Export (`TOKEN_CLASSIFICATION` names the architecture; the trainer writes it with
  `megalign.checkpoint.export_hf`): HF `*ForTokenClassification` with one label and no bias
  (`token_classification_bias: false`), which is what verl's critic loads; transformers' logits
  `[B, T, 1]` are this model's values at every position.
"""
from __future__ import annotations

from typing import Optional

import torch

from megalign.models import ValueModel, hf_architecture
from megalign.models.config import SUPPORTED_MODEL_TYPES
from megalign.parallel import MixedPrecision, ParallelLayout
from megalign.roles.actor import TrainableRole
from megalign.roles.packing import response_hidden, scatter_response

TOKEN_CLASSIFICATION = {family: hf_architecture(family, "TokenClassification") for family in SUPPORTED_MODEL_TYPES}


def response_values(model: ValueModel, sequences: torch.Tensor, attention_mask: torch.Tensor,
                    response_len: int, pack: bool = False, pack_tokens: Optional[int] = None,
                    pack_max_fill: float = 1.0) -> torch.Tensor:
    """Values V(s_t) [B, R] fp32 of the states before each response token (module doc).

    Args:
        sequences / attention_mask: [B, P + R] left-padded prompts then right-padded responses.
        response_len: R, the response columns at the end of `sequences`.
        pack / pack_tokens / pack_max_fill: the trunk runs on the rows' real tokens packed (`megalign.roles.packing`).
    Only real response tokens go through the head; other positions are 0, which the caller masks out.
    """
    hidden, rows, cols = response_hidden(model.model, sequences, attention_mask, response_len, pack, pack_tokens,
                                          pack_max_fill)
    return scatter_response(model.head(hidden).float(), rows, cols, sequences.shape[0], response_len)


class Critic(TrainableRole):
    """The value model of PPO (module doc): `values` for GAE, `values_with_grad` for the value loss."""

    def __init__(self, model: ValueModel, layout: ParallelLayout, precision: MixedPrecision, offload_weights: bool,
                 offload_optimizer: bool, optimizer: torch.optim.Optimizer, grad_clip: Optional[float],
                 batch_copies: int = 1, **packing):
        """`batch_copies` as in `TrainableRole`; `packing`: `pack`, `pack_tokens`, `pack_max_fill` of
        `megalign.roles.actor.PolicyRole`."""
        if not isinstance(model, ValueModel) or type(model).head_cls is not ValueModel.head_cls:
            raise TypeError(f"Critic needs a per-token ValueModel, got {type(model).__name__}")
        model.train()
        super().__init__("critic", model, layout, precision, offload_weights, offload_optimizer, optimizer, grad_clip,
                         batch_copies, **packing)

    @torch.no_grad()
    def values(self, sequences: torch.Tensor, attention_mask: torch.Tensor, response_len: int) -> torch.Tensor:
        """[B, R] fp32 values without gradient (the old values of GAE and the value clip)."""
        with self.precision.autocast(self.layout.device):
            return response_values(self.model, sequences, attention_mask, response_len, self.pack, self.pack_tokens,
                                   self.pack_max_fill)

    def pipeline_values(self, sequences: torch.Tensor, attention_mask: torch.Tensor, response_len: int,
                        micro_batch_size: int) -> torch.Tensor:
        """`values` of a pipeline stage (`layout.pp > 1`, module doc): the forward-only schedule over micro-batches
        of `micro_batch_size` rows, the head on the last stage, [B, R] broadcast over the pp group."""
        return self.pipeline_scores(sequences, attention_mask, response_len, micro_batch_size,
                                    lambda hidden, rows: self.model.head(hidden))

    def values_with_grad(self, sequences: torch.Tensor, attention_mask: torch.Tensor, response_len: int,
                         hidden: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[B, R] fp32 values with gradient, for the value loss.

        hidden: at pp > 1, the last stage's trunk output [B, P + R, H] for these rows (inside the 1F1B schedule,
        `OnlineTrainer.train_role`); the head then runs on it (already under the schedule's autocast).
        """
        if hidden is not None:
            return self.model.head(hidden[:, -response_len - 1:-1]).float()
        with self.precision.autocast(self.layout.device):
            return response_values(self.model, sequences, attention_mask, response_len, self.pack, self.pack_tokens,
                                   self.pack_max_fill)


__all__ = ["Critic", "TOKEN_CLASSIFICATION", "response_values"]
