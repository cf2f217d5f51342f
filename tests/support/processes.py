"""Which processes a test's process started, and whether they still run (a zombie counts as ended)."""

from __future__ import annotations

import os
from pathlib import Path


def descendants(pid: int) -> set[int]:
    """Every descendant process of `pid` (environment workers, the sampler process, what they started)."""
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            kids = (task / "children").read_text().split() if (task / "children").exists() else []
            for kid in map(int, kids):
                if kid not in found:
                    found.add(kid)
                    todo.append(kid)
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ")[-1][:1] != "Z"


def name(pid: int) -> str:
    """The process's name (`/proc/<pid>/comm`), "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
