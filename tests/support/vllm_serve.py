"""A real `vllm serve` for the suite, started with the command `docs/rollout-engines.md` gives.

The command is read from the page (its ```bash block that runs `vllm.entrypoints.openai.api_server`), so
the docs' command is the tested one; only the port is changed, to a free loopback port. The server runs
in a session of its own and everything below it is killed at the end, however the tests ended.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
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


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=2) as resp:
            return bool(json.loads(resp.read())["data"])
    except (OSError, ValueError, KeyError):
        return False


@contextlib.contextmanager
def served(log: Path) -> Iterator[str]:
    """Start the docs' server, wait until it answers, yield its base URL; stop it at the end."""
    port = free_port()
    extra, argv = docs_command(port)
    env = {**os.environ, **extra, "OMP_NUM_THREADS": "1"}
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _up(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text()[-4000:]
                raise RuntimeError(f"vllm serve did not come up (exit {proc.poll()}):\n{tail}")
            time.sleep(1.0)
        yield url
    finally:
        kill_tree(proc.pid)
        proc.wait()
