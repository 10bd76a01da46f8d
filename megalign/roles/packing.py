"""The hidden states that predict each response token, from a padded or a packed trunk forward.

The online trainers hold responses as `[B, P + R]` rows: a left-padded prompt then a right-padded
response (`megalign.trainers.online.RolloutBatch`). Response token t of a row (column P + t) is
predicted by the trunk's output at the previous real token. Both layouts here give those hidden
states `[N, H]` for the N response tokens that have a predictor, with their (row, column) in the
`[B, R]` response grid, so a head runs only on those N positions and `scatter_response` puts its
outputs back (other positions get 0, which callers mask out).

- Padded: one `[B, P + R]` forward; the predictor of column P + t is column P + t - 1.
- Packed: each row's real tokens (prompt without its left padding, response without its right
  padding) are laid back to back as documents of a `[1, total]` batch with `cu_seqlens`
  (`megalign.models.decoder`: positions restart per document and attention stops at its
  boundaries), so a short response costs its own tokens, not R. Position ids equal the padded
  path's running count of real tokens, so the two layouts compute the same function. On the CPU
  (and wherever attention is SDPA with a document mask, `megalign.models.attention`) attention over
  a pack costs total^2, so rows go into packs of at most `pack_tokens` tokens (default: one padded
  row, P + R), one trunk forward per pack; flash-attn's variable-length kernel costs the sum of
  the documents' squares whatever the pack, and there a large `pack_tokens` (one pack) is best.
  Packing needs each row's real tokens to be one contiguous run (checked).
- Packed on a pipeline (pp > 1, `pipeline_packs`): the same packs, each one micro-batch of the pipeline
  schedule, padded to one length L (a stage's receive buffers have one shape) with the padding as a
  last document; at least pp packs (empty ones added), and on the last stage `PipelinePacks.unpack`
  lays a pack's outputs back into its rows' padded `[k, P + R, H]` layout (0 at padding), so the
  losses and heads written for padded rows run unchanged.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

Trunk = Callable[..., torch.Tensor]


def _packs(lengths: list[int], pack_tokens: int) -> list[tuple[int, int]]:
    """Row ranges [start, end) packed greedily in order, each at most `pack_tokens` tokens (or one longer row)."""
    packs, start, used = [], 0, 0
    for row, n in enumerate(lengths):
        if row > start and used + n > pack_tokens:
            packs.append((start, row))
            start, used = row, 0
        used += n
    packs.append((start, len(lengths)))
    return packs


def response_positions(attention_mask: torch.Tensor, response_len: int) -> torch.Tensor:
    """bool [B, R]: the response tokens that have a predictor (the token and the column before it are real),
    i.e. the positions a head scores; every other position of a [B, R] result is 0."""
    real = attention_mask.bool()
    return real[:, -response_len:] & real[:, -response_len - 1:-1]


def _check_runs(real: torch.Tensor) -> None:
    runs = (real & ~torch.nn.functional.pad(real, (1, 0))[:, :-1]).sum(1)
    if bool((runs > 1).any()):
        raise ValueError("packing needs each row's real tokens to be one run (left-padded prompt, right-padded "
                         "response); attention_mask has rows with gaps")


def response_hidden(trunk: Trunk, sequences: torch.Tensor, attention_mask: torch.Tensor, response_len: int,
                    pack: bool, pack_tokens: Optional[int] = None, pack_max_fill: float = 1.0):
    """(hidden [N, H], rows [N], cols [N]): the trunk's outputs predicting the response tokens (module doc).

    Args:
        trunk: the model's decoder (`model.model`), called as trunk(ids, mask) or trunk(ids, cu_seqlens=...).
        sequences / attention_mask: [B, P + R] left-padded prompts then right-padded responses.
        response_len: R, the response columns at the end of `sequences` (1 <= R < P + R).
        pack: the packed layout instead of the padded one.
        pack_tokens: tokens per packed forward at most (None: P + R).
        pack_max_fill: pack only when the real tokens fill at most this fraction of the padded [B, P + R]
            (1.0: always). Packing runs one trunk forward per pack, so on nearly full rows it saves few
            tokens and costs many more, smaller forwards; those rows run padded.
    (rows, cols) index the [B, R] response grid: the real response tokens whose previous column is real.
    """
    b, width = sequences.shape
    if attention_mask.shape != sequences.shape:
        raise ValueError(f"attention_mask must have the shape of sequences {tuple(sequences.shape)}, "
                         f"got {tuple(attention_mask.shape)}")
    if not 1 <= response_len < width:
        raise ValueError(f"response_len must be in [1, {width - 1}] (a prompt column must precede it), got {response_len}")
    real = attention_mask.bool()
    rows, cols = response_positions(attention_mask, response_len).nonzero(as_tuple=True)
    if not pack or float(real.sum()) > pack_max_fill * real.numel():
        hidden = trunk(sequences, attention_mask)
        return hidden[:, -response_len - 1:-1][rows, cols], rows, cols
    _check_runs(real)
    lengths = real.sum(1)
    starts = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))  # [B + 1] each row's offset in the pack
    first = real.int().argmax(1)  # the row's first real column
    ids = sequences[real]  # [total] the real tokens, row after row
    outputs = []
    for s, e in _packs(lengths.tolist(), pack_tokens or width):
        bounds = starts[s:e + 1] - starts[s]
        outputs.append(trunk(ids[starts[s]:starts[e]][None], cu_seqlens=bounds)[0])
    hidden = torch.cat(outputs) if len(outputs) > 1 else outputs[0]  # [total, H]
    source = starts[rows] + (width - response_len - 1 + cols - first[rows])
    return hidden[source], rows, cols


@dataclasses.dataclass
class PipelinePacks:
    """A `[B, W]` batch's rows as n pipeline micro-batches of one pack each (module doc; `pipeline_packs`)."""

    input_ids: torch.Tensor
    """[n, L] each pack's rows' real tokens back to back, then padding."""
    cu_seqlens: torch.Tensor
    """[n, D + 1] document boundaries: one document a row, the padding as the last one, L repeated after it."""
    rows: list[torch.Tensor]
    """The batch rows of each pack (consecutive; empty for the packs added to reach the minimum count)."""
    scatter: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    """Per pack (row in the pack, column in the padded row, position in the pack) of each real token."""
    width: int
    """W, the padded rows' width."""

    def unpack(self, pack: int, hidden: torch.Tensor) -> torch.Tensor:
        """[k, W, H] padded-layout outputs of pack `pack`'s k rows from its `[1, L, H]` output (0 at padding;
        differentiable in `hidden`)."""
        row, col, src = self.scatter[pack]
        out = hidden.new_zeros(len(self.rows[pack]), self.width, hidden.shape[-1])
        return out.index_put((row, col), hidden[0, src])


def pipeline_packs(sequences: torch.Tensor, attention_mask: torch.Tensor, pack_tokens: Optional[int],
                   min_packs: int) -> PipelinePacks:
    """The rows of `sequences` / `attention_mask` [B, W] (each row's real tokens one run) packed greedily in order
    into packs of at most `pack_tokens` tokens (None: W; a longer row alone), all padded to the longest allowed
    pack L, at least `min_packs` of them (module doc)."""
    b, width = sequences.shape
    real = attention_mask.bool()
    _check_runs(real)
    lengths = real.sum(1)
    limit = max(pack_tokens or width, int(lengths.max()) if b else 1)
    starts = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    first = real.int().argmax(1)
    ids = sequences[real]
    ranges = _packs(lengths.tolist(), limit) if b else []
    ranges += [(b, b)] * (min_packs - len(ranges))
    docs = max(e - s for s, e in ranges) + 1  # rows of the fullest pack, and its padding document
    input_ids = sequences.new_zeros(len(ranges), limit)
    cu_seqlens = torch.full((len(ranges), docs + 1), limit, dtype=torch.long, device=sequences.device)
    rows, scatter = [], []
    for i, (s, e) in enumerate(ranges):
        bounds = starts[s:e + 1] - starts[s]
        input_ids[i, :bounds[-1]] = ids[starts[s]:starts[e]]
        cu_seqlens[i, :e - s + 1] = bounds
        row, col = real[s:e].nonzero(as_tuple=True)
        rows.append(torch.arange(s, e, device=sequences.device))
        scatter.append((row, col, bounds[row] + col - first[s:e][row]))
    return PipelinePacks(input_ids, cu_seqlens, rows, scatter, width)


def scatter_response(values: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, batch: int,
                     response_len: int) -> torch.Tensor:
    """[N] per-token values at (rows, cols) -> [B, R], 0 elsewhere (differentiable in `values`)."""
    out = values.new_zeros(batch, response_len)
    return out.index_put((rows, cols), values)


__all__ = ["PipelinePacks", "pipeline_packs", "response_hidden", "response_positions", "scatter_response"]
