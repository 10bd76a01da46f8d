"""Each sampled sequence's MoE routing, recorded by the rollout engine: what routing replay reuses in training.

`rollout(..., routing=RoutingRecorder())` (`megalign.rollout.engine`) runs the rollout's forwards inside
`moe_routing(model, record=True)` and hands each forward's chosen experts (`Routing.chosen`, global layer ->
`[n, k]`) to the recorder, which files them per sample and position in small integer buffers on the device,
without a host sync (so the CUDA-graph decode step captures the writes too):

- a prefill of a chunk of c prompts, right-aligned from column 0 and padded to the chunk's longest w:
  `[c * w, k]` -> those prompts' rows of `prompts` `[U, P, L, k]`;
- a decode step over slot rows: row r feeds sample `sample[r]`'s response token `counts[r] - 1` (the token
  drawn last), so its experts go to that sample's column of `responses` `[U G + 1, max_new + 1, L, k]`; a
  finished row riding along writes to the trash column max_new, a harvested one (pointing at the trash row
  U G) to the trash row.

A response's last token is never fed (it ends the sample) and padding is never routed: those positions keep -1,
which routing replay reads as "the router's own choice" (`megalign.models.moe`); neither changes a response
log-prob (the last token predicts nothing that is scored). `assemble` lays the record out as the engine's output
rows, `sequences` `[U G, P + N, L, k]` (left-padded prompt then response, `L` the MoE layers in `layers` order),
int16 (E <= 32767; 2 bytes per (token, layer, expert slot)).
"""
from __future__ import annotations

from typing import Optional

import torch

NONE = -1
"""Expert id of a position without a record."""


class RoutingRecorder:
    """The MoE routing of one `rollout` call, per sample and position (module doc); `sequences` after it returns."""

    def __init__(self):
        self.routing = None  # the `megalign.models.moe.Routing` the engine attached (`begin`)
        self.layers: list[int] = []
        """Global indices of the MoE layers, the order of dim 2 of the buffers."""
        self.prompts: Optional[torch.Tensor] = None
        self.responses: Optional[torch.Tensor] = None
        self.sequences: Optional[torch.Tensor] = None
        """`[U G, P + N, L, k]` int16 expert ids of the rollout's output rows (-1: none), set by `assemble`."""

    def begin(self, routing, n_prompts: int, prompt_width: int, n_samples: int, max_new: int,
              device: torch.device) -> None:
        """A new rollout of `n_prompts` prompts (at most `prompt_width` tokens), `n_samples` samples of at most
        `max_new` tokens; `routing` records each forward's experts (`moe_routing(model, record=True)`)."""
        self.routing, self.sequences = routing, None
        self.shape = (n_prompts, prompt_width, n_samples, max_new)
        self.device = device
        self.prompts = self.responses = None

    def _latest(self) -> torch.Tensor:
        """`[n, L, k]` int16: the experts of the latest forward; the buffers are made on the first call."""
        chosen = self.routing.chosen
        self.routing.steps.clear()  # the record lives in the buffers, not in one dict per forward
        if not chosen:
            raise ValueError("RoutingRecorder: the forward recorded no MoE layer (a dense model?)")
        if self.prompts is None:
            self.layers = sorted(chosen)
            k = chosen[self.layers[0]].shape[1]
            u, p, n, m = self.shape
            self.prompts = torch.full((u, p, len(self.layers), k), NONE, dtype=torch.int16, device=self.device)
            self.responses = torch.full((n + 1, m + 1, len(self.layers), k), NONE, dtype=torch.int16,
                                        device=self.device)
        return torch.stack([chosen[layer] for layer in self.layers], 1).to(torch.int16)

    def prefill(self, prompts: torch.Tensor, width: int) -> None:
        """After the prefill of prompts `prompts` `[c]` (indices), right-aligned from column 0, `width` columns."""
        ids = self._latest()
        self.prompts[prompts, :width] = ids.view(len(prompts), width, *ids.shape[1:])

    def decode(self, sample: torch.Tensor, counts: torch.Tensor, done: torch.Tensor) -> None:
        """After a decode step of slot rows with output rows `sample`, response tokens so far `counts` and finished
        flags `done` (`[b]` each, read before the step's token is recorded)."""
        cols = torch.where(done, self.shape[3], counts - 1)
        self.responses[sample, cols] = self._latest()

    def assemble(self, attention_mask: torch.Tensor, group: int, columns: int) -> torch.Tensor:
        """`sequences` for left-padded prompts with `attention_mask` `[U, P]`, `group` samples a prompt and `columns`
        response columns (the output's N); -1 everywhere when the model routed nothing (no forward ran)."""
        u, p = attention_mask.shape
        n = self.shape[2]
        if self.prompts is None:
            return torch.full((n, p + columns, 0, 0), NONE, dtype=torch.int16, device=attention_mask.device)
        lengths = attention_mask.sum(-1)
        col = torch.arange(p, device=lengths.device)[None] - (p - lengths)[:, None]  # column in the right-aligned row
        index = col.clamp(min=0)[:, :, None, None].expand(-1, -1, *self.prompts.shape[2:])
        prompt = self.prompts[:, :p].gather(1, index).masked_fill((col < 0)[:, :, None, None], NONE)
        self.sequences = torch.cat([prompt.repeat_interleave(group, 0), self.responses[:n, :columns]], 1)
        self.prompts = self.responses = None
        return self.sequences
