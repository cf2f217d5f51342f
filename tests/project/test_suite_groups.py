"""`make test` runs on two xdist workers and relies on its groups: every vLLM test on one worker (the
session's engine and `vllm serve` start once there, and two engines never compete for the machine), the
torchrun launches on one. A group that silently stops taking effect spreads them over both workers, where
the suite still passes most of the time, so this runs a small grouped selection and reads where each test
ran."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.launch  # runs pytest with two workers in a subprocess

REPO = Path(__file__).resolve().parents[2]


def test_the_vllm_group_runs_on_one_worker_under_loadgroup() -> None:
    files = ["tests/models/test_vllm_column.py", "tests/foundations/test_jsonfile.py"]
    args = [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*args, *files], cwd=REPO, env={**os.environ, "DS_ACCELERATOR": "cpu"},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    ran = re.findall(r"^\[(gw\d)\] \[ *\d+%\] PASSED (\S+)", done.stdout, re.M)
    grouped = {(worker, test) for worker, test in ran if "test_vllm_column" in test}
    others = [test for _, test in ran if "test_jsonfile" in test]
    assert len(grouped) == 2 and all(test.endswith("@vllm") for _, test in grouped), done.stdout[-3000:]
    assert len({worker for worker, _ in grouped}) == 1, grouped
    assert others and not any("@" in test for test in others)  # control: ungrouped tests keep their ids
