"""bench/gpu_check.py runs end to end on CPU in its dry-run mode (the GPU run itself needs a device)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("bench_gpu_check", REPO / "bench" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    ):
        assert heading in text
    rows = [line for line in text.splitlines() if line.startswith("| llama")]
    assert len(rows) == 2 and all(line.endswith("| yes |") for line in rows), text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_refuses_without_a_device(capsys: pytest.CaptureFixture[str]) -> None:
    assert _script().main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err
