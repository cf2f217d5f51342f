"""`bench/profile_point.py`: one point profiled in one mode; the smoke run and a clear refusal of bad input."""

from __future__ import annotations

from types import ModuleType

import pytest
from support.scripts import load_script


def _script() -> ModuleType:
    return load_script("bench/profile_point.py", "profile_point")


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
