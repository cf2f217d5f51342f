"""The ledger and token cost of the flat mode (`FlatReference`): every call forward and backward in full.

Each microbatch of calls is one forward without a past, so the calibrated no-past regime of the same model
prices it (`MemoryModel`, `treetrain.memory.calibrate`): a no-grad scoring forward when the ratio uses
the current policy, a reference forward when KL is on, then the forward and backward under autograd.
Nothing is resident between microbatches.

Example:
    >>> ledger, cost = predict_flat(batch, model, LossConfig(), microbatch=2)     # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedModel

from treetrain.lifetime import ClassBytes
from treetrain.loss.loss_config import LossConfig
from treetrain.memory.calibrate import calibrate
from treetrain.memory.events import Shape
from treetrain.memory.ledger import Ledger, LedgerRow, manifest_host_bytes
from treetrain.memory.memory_model import MemoryModel
from treetrain.memory.persistent import PersistentBytes, model_persistent_bytes
from treetrain.models.logprobs import DEFAULT_MAX_LOGIT_ELEMENTS
from treetrain.models.lora import Reference
from treetrain.replay.batch import ReplayConfig, UpdateBatch
from treetrain.replay.flat_reference import FlatCallSize, FlatReference


def predict_flat(
    batch: UpdateBatch,
    model: PreTrainedModel,
    loss: LossConfig,
    *,
    microbatch: int = 1,
    ref_model: Reference | None = None,
    persistent: PersistentBytes | None = None,
    memory_model: MemoryModel | None = None,
    max_logit_elements: int = DEFAULT_MAX_LOGIT_ELEMENTS,
    sizes: Sequence[FlatCallSize] | None = None,
) -> tuple[Ledger, int]:
    """The predicted timeline of `FlatReference(model, loss, ReplayConfig(microbatch=...)).accumulate(batch)` and its
    token cost (forward 1, backward 2 per token, as `ReplayReport.token_cost` counts). `sizes` are
    `FlatReference.call_sizes(batch)` when the caller prices several microbatch sizes."""
    mm = memory_model or calibrate(
        model, "response_only", with_entropy=loss.needs_entropy, max_logit_elements=max_logit_elements
    )
    pers = persistent or model_persistent_bytes(model, ref_model=ref_model)
    fixed = ClassBytes(persistent=pers.run_persistent, boundary=pers.update_boundary)
    lp_size = max(4, next(model.parameters()).element_size())
    if sizes is None:
        sizes = FlatReference(
            model, loss, ReplayConfig(microbatch=microbatch), ref_model=ref_model
        ).call_sizes(batch)
    calls = sizes
    rows: list[LedgerRow] = []
    cost = 0
    for i in range(0, len(calls), microbatch):
        group = calls[i : i + microbatch]
        tokens = sum(c.tokens for c in group)
        targets = sum(c.targets for c in group)
        shape = Shape(rows=len(group), width=max(c.tokens for c in group), past=0, pieces=0, targets=targets)
        held = 0
        if loss.ratio_source == "scoring":
            rows.append(
                _row(len(rows), f"flat score {i}", "score", fixed, mm.nograd_peak(shape), shape, tokens)
            )
            held += targets * lp_size
            cost += tokens
        if loss.needs_reference:
            temporary = held + mm.nograd_peak(shape)
            rows.append(_row(len(rows), f"flat reference {i}", "reference", fixed, temporary, shape, tokens))
            held += targets * lp_size
            cost += tokens
        rows.append(
            _row(len(rows), f"flat step {i}", "step", fixed, held + mm.step_peak(shape), shape, tokens)
        )
        cost += 3 * tokens
    if not rows:
        rows.append(LedgerRow(0, -1, "idle", "idle", fixed))
    peak = max(rows, key=lambda r: r.bytes.total)
    cause = f"{peak.label}: {microbatch} call(s) forward and backward in full, no resident state"
    ledger = Ledger(
        tuple(rows), peak.bytes, peak.index, cause, pers, None, 0, 0, manifest_host_bytes(batch.manifest)
    )
    return ledger, cost


def _row(
    index: int, label: str, kind: str, fixed: ClassBytes, temporary: int, shape: Shape, tokens: int
) -> LedgerRow:
    return LedgerRow(index, -1, label, kind, fixed + ClassBytes(temporary=temporary), shape, tokens)
