"""A free TCP port for a torchrun launch: several launches (tests, or several people) run at once, so a
fixed port would collide. The port is free when returned; torchrun binds it a moment later."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
