"""Peak memory by lifetime class: measured with the tracker, predicted with the ledger.

Measured: one update under a `MemoryTracker` (live tensor bytes, deterministic on the CPU). Predicted:
`predict_ledger` for the tree modes. The ledger models tree replay only, so flat is predicted from the
same calibrated memory model (`treetrain.memory.calibrate`): a flat microbatch is a forward and backward
of whole sequences with no past, which is the shape of a first-level replay step, and its peak is that
step's peak above the run-persistent and update-boundary bytes. That model is fitted on short probe
sequences, so for flat's long sequences it is an extrapolation; the report shows its error.

Example:
    >>> peak = measure_peak(model, batch, "exact", FULL)                                  # doctest: +SKIP
    >>> predict_peak(model, batch, "exact", FULL).total - peak.total                      # doctest: +SKIP
"""

from __future__ import annotations

from transformers import PreTrainedModel

from treetrain.benchmark.bench_config import BenchConfig, Mode
from treetrain.benchmark.workload import LOSS, make_engine, replay_config, zero_grads
from treetrain.lifetime import ClassBytes
from treetrain.memory.calibrate import calibrate
from treetrain.memory.events import Shape, forward_shape, plan_tree
from treetrain.memory.ledger import predict_ledger
from treetrain.memory.persistent import model_persistent_bytes
from treetrain.memory.tracker import MemoryTracker
from treetrain.replay.batch import ReplayConfig, UpdateBatch
from treetrain.replay.flat_reference import FlatReference


def measure_peak(model: PreTrainedModel, batch: UpdateBatch, mode: Mode, cfg: BenchConfig) -> ClassBytes:
    """Live bytes by class at the peak of one update in `mode` (gradients allocated from the start)."""
    zero_grads(model)
    tracker = MemoryTracker(next(model.parameters()).device)
    try:
        if mode == "flat":
            tracker.attach_model(model)
            with tracker:
                make_engine(model, mode, cfg).accumulate(batch)
        else:
            make_engine(model, mode, cfg, tracker=tracker).accumulate(batch)
    finally:
        tracker.detach()
    return tracker.peak


def _fixed(model: PreTrainedModel) -> ClassBytes:
    pers = model_persistent_bytes(model)
    return ClassBytes(persistent=pers.run_persistent, boundary=pers.update_boundary)


def predict_flat_peak(model: PreTrainedModel, batch: UpdateBatch, cfg: BenchConfig) -> ClassBytes:
    """Flat's predicted peak: the largest microbatch's forward-and-backward peak, as a no-past step."""
    mm = calibrate(model, "response_only")  # a flat backward has no <KV, G> term
    calls = FlatReference(model, LOSS, ReplayConfig(microbatch=cfg.flat_microbatch)).call_sizes(batch)
    worst = 0
    for i in range(0, len(calls), cfg.flat_microbatch):
        group = calls[i : i + cfg.flat_microbatch]
        shape = Shape(
            rows=len(group),
            width=max(c.tokens for c in group),
            past=0,
            pieces=0,
            targets=sum(c.targets for c in group),
        )
        worst = max(worst, mm.step_peak(shape))
    return _fixed(model) + ClassBytes(temporary=worst)


def predict_peak(model: PreTrainedModel, batch: UpdateBatch, mode: Mode, cfg: BenchConfig) -> ClassBytes:
    """Predicted peak by class of one update in `mode`."""
    if mode == "flat":
        return predict_flat_peak(model, batch, cfg)
    return predict_ledger(batch, model, replay_config(mode, cfg), LOSS).peak


def response_graph_bytes(model: PreTrainedModel, batch: UpdateBatch, mode: Mode, cfg: BenchConfig) -> int:
    """Predicted bytes of the largest single leaf branch's graph (one live response graph) in `mode`."""
    if mode == "flat":
        raise ValueError("flat has no response graphs apart from whole sequences")
    mm = calibrate(model, mode)
    plan = plan_tree(
        batch.work[0], replay_config(mode, cfg), LOSS, kv_bytes_per_token=mm.kv_bytes_per_token,
        state_bytes_per_unit=mm.state_bytes_per_unit,
    )  # fmt: skip
    units = plan.units
    leaves = [u for u in units.units[1:] if u.is_leaf and u.targets.num_targets]
    return max(
        (mm.graph_bytes(forward_shape(units, u.parent if u.parent is not None else 0, [u])) for u in leaves),
        default=0,
    )
