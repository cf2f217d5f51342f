"""The ledger of a model with recurrent layers (Qwen3.5: Gated DeltaNet beside attention) within the usual +-10% of the peak.

As tests/memory/test_ledger.py, on the dynamic bytes (everything but parameters), with its tolerance. The
chunked delta rule pads every row to whole 64-token chunks and keeps per-chunk intermediates, a step
function of the width that the per-token features do not follow; the calibration fits a cost per row and
chunk (`treetrain.memory.recurrent_cost`). Negative control: the same model calibrated without that
feature misses the measured peak by more than the tolerance.
"""

from __future__ import annotations

import pytest
from support.ledger_cases import error, ledger_batch, measured_flat, measured_tree
from support.replay_cases import VOCAB

import treetrain.memory.calibrate as calibrate_module
from treetrain.loss.loss_config import LossConfig
from treetrain.memory.calibrate import calibrate
from treetrain.memory.flat_cost import predict_flat
from treetrain.memory.ledger import predict_ledger
from treetrain.memory.recurrent_cost import recurrent_chunk
from treetrain.models.presets import tiny_model
from treetrain.replay import ReplayConfig, UpdateBatch

TOLERANCE = 0.10
LOSS = LossConfig()
FAMILY = "qwen3_5_text"


def make_batch(prefix: int, branches: int, suffix: int, depth: int) -> UpdateBatch:
    return ledger_batch(prefix, branches, suffix, depth=depth, vocab=VOCAB, loss=LOSS)


@pytest.fixture(scope="module")
def model():
    return tiny_model(FAMILY, VOCAB)


def test_the_recurrent_layers_chunk_is_found(model) -> None:
    assert recurrent_chunk(model) == 64  # transformers' torch_chunk_gated_delta_rule default
    assert recurrent_chunk(tiny_model("nemotron_h", VOCAB)) == 16  # the tiny preset's Mamba-2 chunk_size
    assert recurrent_chunk(tiny_model("mamba", VOCAB, attn="eager")) == 0  # a scan without chunks
    assert recurrent_chunk(tiny_model("llama", VOCAB)) is None


@pytest.mark.parametrize(
    ("prefix", "branches", "suffix", "depth", "k", "contract"),
    [
        (48, 4, 12, 1, 2, "exact"),
        (24, 6, 40, 2, 0, "exact"),
        (96, 8, 16, 2, 2, "response_only"),
        (512, 4, 32, 1, 2, "response_only"),
    ],
)
def test_tree_contracts_within_the_tolerance(model, prefix, branches, suffix, depth, k, contract) -> None:
    batch = make_batch(prefix, branches, suffix, depth)
    replay = ReplayConfig(contract=contract, microbatch=k)
    ledger = predict_ledger(batch, model, replay, LOSS)
    measured = measured_tree(model, batch, replay, LOSS)
    err = error(ledger.peak.dynamic, measured.dynamic)
    assert abs(err) <= TOLERANCE, f"predicted {ledger.peak} vs measured {measured}: {err:+.1%}"
    assert ledger.peak.persistent == measured.persistent


def test_flat_within_the_tolerance_and_not_without_the_chunk_feature(model, monkeypatch) -> None:
    batch = make_batch(24, 6, 40, 2)
    measured = measured_flat(model, batch, LOSS)
    ledger, _ = predict_flat(batch, model, LOSS)
    err = error(ledger.peak.dynamic, measured)
    assert abs(err) <= TOLERANCE, f"flat: predicted {ledger.peak} vs {measured}: {err:+.1%}"
    # negative control: the calibration as if the model had no recurrent layers' chunks to price
    monkeypatch.setattr(calibrate_module, "recurrent_chunk", lambda model: None)
    blind = calibrate(model, "response_only", cache=False)
    assert blind.recurrent_chunk is None
    wrong, _ = predict_flat(batch, model, LOSS, memory_model=blind)
    assert abs(error(wrong.peak.dynamic, measured)) > TOLERANCE, error(wrong.peak.dynamic, measured)
