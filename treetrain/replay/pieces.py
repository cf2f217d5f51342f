"""Running a batch of sibling units through the model, and turning their targets into loss inputs.

The scoring pass, the lazy recompute of evicted KV and the autograd replay all run sibling units the
same way: right-padded to one length, positions continuing their parent's path, against that path's KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel

from treetrain.loss.objective import Contributions
from treetrain.loss.targets import TargetTable
from treetrain.models.decoder import (
    DecoderOutput,
    LayerEntry,
    SharedPast,
    decoder_forward,
    output_head,
)
from treetrain.models.logprobs import target_logprobs
from treetrain.replay.units import Unit


@dataclass(frozen=True)
class PieceBatch:
    """Right-padded rows of sibling pieces (units, or whole calls in the flat reference)."""

    input_ids: torch.Tensor  # [B, S]
    positions: torch.Tensor  # [B, S]
    lengths: tuple[int, ...]


def pad_pieces(
    token_rows: Sequence[Sequence[int]], offsets: Sequence[int], device: torch.device, pad_id: int = 0
) -> PieceBatch:
    width = max(len(r) for r in token_rows)
    ids = torch.full((len(token_rows), width), pad_id, dtype=torch.long)
    for b, row in enumerate(token_rows):
        ids[b, : len(row)] = torch.as_tensor(row, dtype=torch.long)
    pos = torch.as_tensor(offsets, dtype=torch.long)[:, None] + torch.arange(width)[None, :]
    return PieceBatch(ids.to(device), pos.to(device), tuple(len(r) for r in token_rows))


def forward_units(
    model: PreTrainedModel,
    units: Sequence[Unit],
    past: SharedPast | None,
    device: torch.device,
    *,
    overlap: bool = True,
) -> tuple[PieceBatch, DecoderOutput]:
    """Run sibling units. With `overlap`, each row starts with the parent's last token and `past` must
    exclude that position; without it (KV recompute only) `past` is the parent's whole path."""
    if overlap:
        batch = pad_pieces([u.input_tokens for u in units], [u.input_offset for u in units], device)
    else:
        batch = pad_pieces([u.tokens for u in units], [u.offset for u in units], device)
    return batch, decoder_forward(model, batch.input_ids, batch.positions, past, lengths=batch.lengths)


def own_kv(unit: Unit, out: DecoderOutput, row: int, overlap: bool = True) -> list[LayerEntry]:
    """The unit's own resident state from a batched forward, graph kept (`DecoderOutput.own_entries`): the
    overlap token before the unit and the row's padding cut away."""
    return out.own_entries(row, 1 if overlap and unit.overlap is not None else 0, len(unit))


@dataclass(frozen=True)
class GatheredTargets:
    """Targets of several rows, flattened: `[M]` targets and `[C]` contributions."""

    flat_positions: torch.Tensor  # [M] index into the [B * S] flattened rows
    tokens: torch.Tensor  # [M]
    contributions: Contributions
    sampler_logprob: torch.Tensor  # [C]
    target_offsets: tuple[int, ...]
    """Start of each row's targets in the [M] arrays (length B + 1)."""


def gather_targets(tables: Sequence[TargetTable], width: int, device: torch.device) -> GatheredTargets:
    """Concatenate per-row target tables; row b's positions are shifted by b * width."""
    pos, tok, ct, coef, adv, lp = [], [], [], [], [], []
    offsets = [0]
    for b, t in enumerate(tables):
        pos.append(t.positions + b * width)
        tok.append(t.tokens)
        ct.append(t.contrib_target + offsets[-1])
        coef.append(t.coef)
        adv.append(t.advantage)
        lp.append(t.sampler_logprob)
        offsets.append(offsets[-1] + t.num_targets)

    def cat(parts: list[np.ndarray], dtype: torch.dtype) -> torch.Tensor:
        arr = np.concatenate(parts) if parts else np.zeros(0)
        return torch.as_tensor(arr, dtype=dtype, device=device)

    sampler = cat(lp, torch.float64)
    contrib = Contributions(cat(ct, torch.long), cat(coef, torch.float64), cat(adv, torch.float64), sampler)
    return GatheredTargets(cat(pos, torch.long), cat(tok, torch.long), contrib, sampler, tuple(offsets))


def target_stats(
    model: PreTrainedModel,
    hidden: torch.Tensor,  # [B, S, H]
    gathered: GatheredTargets,
    *,
    with_entropy: bool,
    max_logit_elements: int,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob (and entropy) of every gathered target, `[M]` float32, at the loss's `temperature`
    (`LossConfig.logit_temperature`)."""
    flat = hidden.reshape(-1, hidden.shape[-1])  # [B * S, H]
    selected = flat.index_select(0, gathered.flat_positions)  # [M, H]
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    return target_logprobs(
        output_head(model),
        selected,
        gathered.tokens,
        vocab_size=vocab,
        with_entropy=with_entropy,
        max_logit_elements=max_logit_elements,
        temperature=temperature,
    )
