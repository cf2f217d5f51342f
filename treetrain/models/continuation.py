"""How the engine continues resident state: one function, shared by the engine's recompute and the support
probe, so that a family the engine continues wrongly is refused by the probe instead of trained on.

A unit runs against the resident pieces of its ancestors. Where any layer's state is taken before a
unit's last token (a recurrent layer, or the recurrent half of a hybrid layer:
`treetrain.models.recurrent_state.continues_with_overlap`), the parent's last token is fed again (the
*overlap*) and its KV left out of the past; otherwise the unit's tokens continue the whole past. The probe
chains three pieces this way, as the engine does when it recomputes an evicted or never-scored unit
(`ratio_source='sampler'`, a retention budget): whole against first + recomputed middle + continued rest.

Example:
    >>> import torch
    >>> from treetrain.models.decoder import decoder_forward
    >>> from treetrain.models.presets import tiny_model
    >>> model = tiny_model("falcon_h1", 64, dtype=torch.float64).eval()
    >>> ids = torch.arange(1, 13)[None]; pos = torch.arange(12)[None]
    >>> first = decoder_forward(model, ids[:, :5], pos[:, :5], None)
    >>> rest = continue_pieces(model, ids, pos, 5, 12, [first.entries()])
    >>> whole = decoder_forward(model, ids, pos, None).hidden
    >>> bool(torch.allclose(torch.cat([first.hidden, rest.hidden], 1), whole))
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from treetrain.models.decoder import LayerEntry, SharedPast, decoder_forward
from treetrain.models.lora import unwrap
from treetrain.models.recurrent_state import continues_with_overlap, unkeyed_layers


@dataclass(frozen=True)
class Continued:
    """A span's forward continuing resident pieces."""

    hidden: torch.Tensor  # [1, T, H] of the span's own positions
    entries: list[LayerEntry]
    """The span's own resident state (graph kept), as the engine stores a unit's."""


def continue_pieces(
    model: PreTrainedModel,
    ids: torch.Tensor,  # [1, L]
    pos: torch.Tensor,  # [1, L]
    start: int,
    stop: int,
    pieces: Sequence[Sequence[LayerEntry]],
    *,
    concatenate: bool = False,
) -> Continued:
    """Positions `start .. stop - 1` of `ids` continuing `pieces` (the resident state of positions
    `0 .. start - 1`, root side first), as the engine continues a unit."""
    overlap = 1 if start > 0 and continues_with_overlap(unwrap(model)) else 0
    past = SharedPast.of(pieces, recurrent=unkeyed_layers(unwrap(model))) if pieces else None
    if past is not None and overlap:
        past = past.without_last_position()
    a = start - overlap
    out = decoder_forward(model, ids[:, a:stop], pos[:, a:stop], past, concatenate=concatenate)
    return Continued(out.hidden[:, overlap:], out.own_entries(0, overlap, stop - start))


def split_error(whole: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> float:
    """Relative max error of a split forward's hidden states `[1, T, H]` against the whole one's."""
    joined = torch.cat([first, second], dim=1)
    return float(((joined - whole).abs().max() / whole.abs().max().clamp_min(1.0)).item())


@torch.no_grad()
def recompute_error(
    model: PreTrainedModel,
    ids: torch.Tensor,  # [1, L]
    pos: torch.Tensor,  # [1, L]
    split: int,
    whole: torch.Tensor,  # [1, L, H]
) -> float:
    """`split_error` of three spans: `0 .. split - 1` alone, a middle span recomputed from its resident
    state (as the engine recomputes a unit it never scored or evicted), and the rest continued from both."""
    mid = split + (ids.shape[1] - split) // 2
    first = decoder_forward(model, ids[:, :split], pos[:, :split], None)
    middle = continue_pieces(model, ids, pos, split, mid, [first.entries()])
    rest = continue_pieces(model, ids, pos, mid, ids.shape[1], [first.entries(), middle.entries])
    return split_error(whole, first.hidden, torch.cat([middle.hidden, rest.hidden], dim=1))
