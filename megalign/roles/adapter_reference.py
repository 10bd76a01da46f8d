"""The reference of a LoRA run: the trained model itself with its adapters switched off.

With LoRA (`megalign.models.lora`) the base weights never change, so the frozen reference of DPO / KTO (and
of the online trainers' KL term) is the trained model computing without its adapters: no second copy of
the weights, as TRL's and verl's LoRA references. `AdapterOffReference` is a `PolicyRole` over the trained
model whose scoring methods run under `adapters_disabled`; it never freezes or offloads the model (the
trained role owns it), and it scores in the trained role's precision and layout. It owns no offloadable part
(`parts` is empty, so its resident bytes are 0: the weights are counted once, under the trained role), so a
trainer that offloads the trained role must keep that role's weights in whenever the reference scores (the online
trainers' `place`, `megalign.trainers.online_lora`).
"""
from __future__ import annotations

import torch

from megalign.models import CausalLM
from megalign.models.lora import adapters_disabled, lora_modules
from megalign.parallel import MixedPrecision, ParallelLayout
from megalign.roles.actor import PolicyRole


class AdapterOffReference(PolicyRole):
    """`PolicyRole` named "reference" over a LoRA model, scoring with the adapters off (module doc)."""

    def __init__(self, model: CausalLM, layout: ParallelLayout, precision: MixedPrecision, **packing):
        """`packing`: `pack`, `pack_tokens`, `pack_max_fill`, `head_chunk_tokens` of `PolicyRole`."""
        if not lora_modules(model):
            raise ValueError("AdapterOffReference: the model has no LoRA adapters; use a Reference with its own weights")
        super().__init__("reference", model, layout, precision, False, **packing)

    def parts(self):
        """None: the weights are the trained role's (module doc)."""
        return {}

    def logprobs(self, *args, **kwargs) -> torch.Tensor:
        with adapters_disabled(self.model):
            return super().logprobs(*args, **kwargs)

    def pipeline_scores(self, *args, **kwargs) -> torch.Tensor:
        with adapters_disabled(self.model):
            return super().pipeline_scores(*args, **kwargs)
