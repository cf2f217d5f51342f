"""A stand-in for `envs.worker.serve` that breaks the protocol, for tests/envs/test_env_concurrency.py.

It reads `name`'s count of requests (so that several calls are waiting), then sends one bad reply: the mode
is the part of `name` before the colon."""

from __future__ import annotations

import json
from multiprocessing.connection import Connection

BAD = {
    "unknown_id": lambda first: json.dumps({"id": 999_999, "ok": {}}).encode(),
    "no_id": lambda first: json.dumps({"ok": {}}).encode(),
    "no_ok": lambda first: json.dumps({"id": first}).encode(),
    "not_json": lambda first: b"\xff{not json",
    "not_object": lambda first: b"[1, 2]",
    "oversized": lambda first: json.dumps({"id": first, "ok": "x" * 4096}).encode(),
}


def serve(conn: Connection, name: str, kwargs_json: str, max_concurrent: int) -> None:
    mode, count = name.split(":")
    first = None
    for _ in range(int(count)):
        req = json.loads(conn.recv_bytes())
        first = req["id"] if first is None else first
    conn.send_bytes(BAD[mode](first))
    try:
        while True:
            conn.recv_bytes()
    except EOFError:
        pass
