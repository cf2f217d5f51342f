"""bench/gpu_check.py runs end to end on CPU in its dry-run mode (the GPU run itself needs a device)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.scripts import load_script


def _script():  # type: ignore[no-untyped-def]
    return load_script("bench/gpu_check.py", "bench_gpu_check")


def test_dry_run_writes_every_table(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.md"
    assert _script().main(["--dry-run", "--out", str(out)]) == 0
    text = out.read_text()
    for heading in (
        "exact vs flat",
        "## speed",
        "peak memory against the ledger",
        "## rollout engines",
        "## asynchronous",
        "## context groups",
    ):
        assert heading in text
    rows = [line for line in text.splitlines() if line.startswith("| llama")]
    assert len(rows) == 2 and all(line.endswith("| yes |") for line in rows), text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_refuses_without_a_device(capsys: pytest.CaptureFixture[str]) -> None:
    assert _script().main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_the_context_group_table_says_when_the_machine_has_one_gpu() -> None:
    """A group's ranks take a GPU each, so on one GPU the step is a line that says why it did not run."""
    (line,) = _script().context_groups(dry=False, devices=1)
    assert line.startswith("not run: a context group of 2 needs 2 GPUs") and "has 1" in line
