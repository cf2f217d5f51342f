"""`bench/profile_point.py`: one point profiled in one mode; the smoke run and a clear refusal of bad input."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "profile_point.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("profile_point", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_profile_names_the_shared_past_kernel(capsys: pytest.CaptureFixture[str]) -> None:
    assert _script().main(["--quick", "--mode", "exact", "--reps", "0", "--top", "40"]) == 0
    out = capsys.readouterr().out
    assert "exact at P=64 G=2 S=8 d=1" in out and "cProfile run" in out
    assert "attention against resident KV: shared-past" in out


def test_bad_point_is_one_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        _script().main(["--suffix", "2", "--depth", "3"])
    assert stop.value.code == 2
    assert "suffix 2 is shorter than depth 3" in capsys.readouterr().err
