"""Calibrations kept on disk: a later process gets the same fitted costs without measuring again, and a file
that is not exactly a calibration of its key is measured again, never trusted.

The store is checked against a fresh calibration of the same model (the negative control is a model of
another width, whose costs differ); the misses are a truncated file, a file whose costs have the wrong
length, another key's file copied under this key's name, and the store turned off.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.replay_cases import VOCAB

import treetrain.memory.calibrate as calibrate_module
from treetrain.memory import calibration_store
from treetrain.memory.calibrate import calibrate, calibration_key
from treetrain.models.presets import TinySize, tiny_model


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(calibration_store.ENV, str(tmp_path))
    monkeypatch.setattr(calibrate_module, "_CACHE", {})  # as a new process: only the disk remembers
    return tmp_path


def _measured(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the probe measurements `calibrate` runs from here on."""
    runs: list[int] = []
    measure = calibrate_module.measure

    def counted(*args, **kwargs):
        runs.append(1)
        return measure(*args, **kwargs)

    monkeypatch.setattr(calibrate_module, "measure", counted)
    return runs


def test_a_later_process_reads_the_calibration_instead_of_measuring(store: Path, monkeypatch) -> None:
    model = tiny_model("llama", VOCAB)
    first = calibrate(model, "exact")
    assert [p.name for p in store.iterdir()] == [f"{first.key}.json"]
    monkeypatch.setattr(calibrate_module, "_CACHE", {})
    runs = _measured(monkeypatch)
    again = calibrate(tiny_model("llama", VOCAB), "exact")
    assert runs == [] and again == first
    other = calibrate(
        tiny_model("llama", VOCAB, size=TinySize(hidden_size=64)), "exact"
    )  # negative control: another model
    assert runs == [1] and other.key != first.key and other.past != first.past


def test_what_is_not_a_calibration_of_its_key_is_measured_again(store: Path, monkeypatch) -> None:
    model = tiny_model("llama", VOCAB)
    fresh = calibrate(model, "response_only")
    path = store / f"{fresh.key}.json"
    good = json.loads(path.read_text())
    wrong_length = {**good, "past": {**good["past"], "graph": good["past"]["graph"][:-1]}}
    other_key = {**good, "key": "0" * 16}
    cases = {
        "truncated": path.read_text()[:50],
        "costs of another length": json.dumps(wrong_length),
        "another key's file": json.dumps(other_key),
        "not an object": "[]",
    }
    runs = _measured(monkeypatch)
    for what, text in cases.items():
        path.write_text(text)
        monkeypatch.setattr(calibrate_module, "_CACHE", {})
        assert calibrate(model, "response_only") == fresh, what
        assert json.loads(path.read_text()) == good, what  # measured, and written whole again
    assert len(runs) == len(cases)


def test_the_key_covers_the_code(monkeypatch) -> None:
    model = tiny_model("llama", VOCAB)
    key = calibration_key(model, "exact", False, 1 << 20)
    assert calibration_key(tiny_model("llama", VOCAB), "exact", False, 1 << 20) == key
    monkeypatch.setattr(calibration_store, "code_digest", lambda: "another engine")
    assert calibration_key(model, "exact", False, 1 << 20) != key


def test_an_empty_setting_turns_the_store_off(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(calibration_store.ENV, "")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(calibrate_module, "_CACHE", {})
    assert calibration_store.store_dir() is None
    calibrate(tiny_model("llama", VOCAB), "exact")
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_store_does_not_stop_the_calibration(tmp_path: Path, monkeypatch) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv(calibration_store.ENV, str(blocked / "calibration"))
    monkeypatch.setattr(calibrate_module, "_CACHE", {})
    assert calibrate(tiny_model("llama", VOCAB), "exact").samples > 0
