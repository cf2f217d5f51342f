"""A real `vllm serve` for the suite, started with the command `docs/rollout-engines.md` gives.

The command is read from the page (its ```bash block that runs `vllm.entrypoints.openai.api_server`), so
the docs' command is the tested one; only the port is changed, to a free loopback port. The server runs
in a session of its own and everything below it is killed at the end, however the tests ended. The
suite's conftest starts it as soon as collection shows a test that needs it, so its minute of start-up
overlaps the tests that run before.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from support.ports import free_port, kill_tree

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "rollout-engines.md"
START_TIMEOUT_S = 300.0
"""Longest the server may take to answer `/v1/models` (about a minute on two cores)."""


def docs_command(port: int) -> tuple[dict[str, str], list[str]]:
    """The environment variables and argv of the docs' server command, serving on `port`."""
    text = PAGE.read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    (block,) = [b for b in blocks if "vllm.entrypoints.openai.api_server" in b]
    words = shlex.split(block.replace("\\\n", " "), comments=True)
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    assert words[0] == "python", words
    words[0] = sys.executable
    words[words.index("--port") + 1] = str(port)
    return env, words


def _die_with_parent() -> None:
    """In the child before exec: a SIGKILL when the test process dies, even by SIGKILL (Linux). Only the
    server itself gets it: after a SIGKILL of the test process, vLLM's engine core process (a child of the
    server) is left running and must be killed by hand; every other ending stops both (`Served.stop`)."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=2) as resp:
            return bool(json.loads(resp.read())["data"])
    except (OSError, ValueError, KeyError):
        return False


class Served:
    """The docs' server, started at once in its own session; `url()` waits until it answers."""

    def __init__(self, log: Path) -> None:
        port = free_port()
        extra, argv = docs_command(port)
        self.log = log
        self.base = f"http://127.0.0.1:{port}"
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                argv, cwd=ROOT, env={**os.environ, **extra, "OMP_NUM_THREADS": "1"}, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent,
            )  # fmt: skip

    def url(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _up(self.base):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text()[-4000:]
                raise RuntimeError(f"vllm serve did not come up (exit {self.proc.poll()}):\n{tail}")
            time.sleep(1.0)
        return self.base

    def stop(self) -> None:
        kill_tree(self.proc.pid)
        self.proc.wait()
