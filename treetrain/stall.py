"""A test hook that stops the process at a named point, so tests can kill it exactly there.

Interruption tests (`kill -9` during a checkpoint write, SIGINT mid-run) need the process to be at a known
point when the signal arrives. With `TREETRAIN_TEST_STALL=POINT@UPDATE` set, `stall("POINT", UPDATE)` writes
the process id to the file `TREETRAIN_TEST_STALL_FILE` (so the test knows it arrived) and then sleeps until
killed. Without the variable it does nothing; it is not a user-facing setting.

Example:
    >>> stall("checkpoint-write", 3)  # no TREETRAIN_TEST_STALL: returns at once
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ENV = "TREETRAIN_TEST_STALL"
ENV_FILE = "TREETRAIN_TEST_STALL_FILE"


def stall(point: str, update: int | None = None) -> None:
    """Sleep forever here when `TREETRAIN_TEST_STALL` is `point` or `point@update`."""
    wanted = os.environ.get(ENV)
    if not wanted:
        return
    name, _, at = wanted.partition("@")
    if name != point or (at and str(update) != at):
        return
    signal_file = os.environ.get(ENV_FILE)
    if signal_file:
        Path(signal_file).write_text(str(os.getpid()))
    while True:
        time.sleep(0.05)
