"""What a recurrent layer's forward costs per row beyond its per-token terms: whole chunks.

Why: the chunked kernels of Gated DeltaNet (`torch_chunk_gated_delta_rule`) and Mamba-2
(`mamba2_chunk_scan`) pad every row to a whole number of chunks of C tokens and keep per-chunk
intermediates for the backward: the `[B, H, n_chunks, C, C]` intra-chunk attention and decay masks, and
`[B, H, n_chunks, C, D]` keys, values and states. Their bytes grow with `rows x ceil(width / C)`, a step
function of the width that no per-token feature follows: a 12-token suffix costs what a 64-token one
does. Mamba's selective scan has no chunks; its per-row cost (the state of every row, the captured step at
the cut) is one "chunk" per row. The calibration (`treetrain.memory.calibrate`) fits a cost per such row
chunk like any other feature, so these layers are measured, never modelled by hand.

Example:
    >>> from treetrain.models.presets import tiny_model
    >>> recurrent_chunk(tiny_model("qwen3_5_text", 64)), recurrent_chunk(tiny_model("llama", 64))
    (64, None)
    >>> row_chunks(rows=2, width=65, chunk=64), row_chunks(rows=2, width=65, chunk=0)
    (4.0, 2.0)
"""

from __future__ import annotations

import inspect
import math
import sys

from transformers import PreTrainedModel

from treetrain.models.lora import unwrap
from treetrain.models.recurrent_state import mixers


def _layer_chunk(module: object, sequence_form: str) -> int:
    """The chunk a layer's sequence form runs with: the layer's own `chunk_size` (Mamba-2), else the
    function's default (Gated DeltaNet: transformers' layers do not pass one), else 0 (no chunks)."""
    own = getattr(module, "chunk_size", None)
    if isinstance(own, int) and own > 0:
        return own
    fn = getattr(sys.modules.get(type(module).__module__), sequence_form, None)
    param = inspect.signature(fn).parameters.get("chunk_size") if callable(fn) else None
    default = None if param is None else param.default
    return default if isinstance(default, int) and default > 0 else 0


def recurrent_chunk(model: PreTrainedModel) -> int | None:
    """The chunk of `model`'s recurrent layers (the smallest, if they differ); 0 for a scan without chunks;
    None for a model without recurrent layers."""
    found = [_layer_chunk(module, kind.functions[0]) for module, kind in mixers(unwrap(model)).values()]
    if not found:
        return None
    chunked = [c for c in found if c > 0]
    return min(chunked) if chunked else 0


def row_chunks(rows: int, width: int, chunk: int | None) -> float:
    """The feature a recurrent forward's per-chunk bytes are linear in: `rows x ceil(width / chunk)`,
    `rows` without chunks, 0 without recurrent layers."""
    if chunk is None or width <= 0:
        return 0.0
    return float(rows * (math.ceil(width / chunk) if chunk > 0 else 1))
