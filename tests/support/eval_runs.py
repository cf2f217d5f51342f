"""Many `treetrain eval` argument lists answered in one fresh interpreter: each one's exit code and seconds,
whether torch was imported by the end, and stderr with a `--- NAME` line after each case's output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import json, sys, time
from treetrain.cli.main import main
results = {}
for name, argv in json.loads(sys.argv[1]).items():
    start = time.perf_counter()
    try:
        code = main(["eval", *argv])
    except SystemExit as exc:
        code = exc.code
    print(f"--- {name}", file=sys.stderr, flush=True)
    results[name] = [code, time.perf_counter() - start]
print(json.dumps({"results": results, "torch": "torch" in sys.modules}))
"""


@dataclass(frozen=True)
class EvalRuns:
    codes: dict[str, int]
    seconds: dict[str, float]
    torch: bool
    """torch was imported by the time the last case was answered."""
    stderr: str


def eval_in_one_process(argvs: dict[str, list[str]], cwd: Path) -> EvalRuns:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argvs)], capture_output=True, text=True, timeout=280, env=env,
        cwd=cwd,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    results = report["results"]
    return EvalRuns(
        {k: v[0] for k, v in results.items()},
        {k: v[1] for k, v in results.items()},
        report["torch"],
        done.stderr,
    )
