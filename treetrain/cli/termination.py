"""SIGTERM as an interrupt: `treetrain train` stops on it as on Ctrl-C (the same cleanup, one line, the
way to `--resume`), instead of dying where it stands.

SIGTERM is how a run is usually stopped from outside: a scheduler preempting the job, a container
stopping, and `torchrun` stopping the other ranks when one of them fails. Python's default for it ends the
process at once, with no line from treetrain and its environment workers and sampler left to the reaper.
Inside `sigterm_interrupts()` the first SIGTERM raises `Terminated` (a `KeyboardInterrupt`) in the main
thread, so every `except KeyboardInterrupt`/`finally` that tidies up after Ctrl-C runs for it too; a
second one while that runs is ignored (a launcher that cannot wait sends SIGKILL). A caller that is
already stopping for another reason (another rank's failed collective, which torchrun follows with
SIGTERM a moment later) calls `Stops.ignore()` first, so that its one line is not cut short.

Example:
    >>> import os, signal
    >>> with sigterm_interrupts() as stops:
    ...     try:
    ...         os.kill(os.getpid(), signal.SIGTERM)
    ...     except Terminated:
    ...         stops.ignore()
    ...         print("stopped")
    stopped
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

EXIT_CODE = 128 + signal.SIGTERM
"""What a process ended by SIGTERM reports, by the shell's convention."""


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived."""


class Stops:
    """The handle `sigterm_interrupts` yields."""

    def __init__(self, installed: bool) -> None:
        self.installed = installed

    def ignore(self) -> None:
        """SIGTERM is ignored from now until the region ends: the caller is stopping already."""
        if self.installed:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)


@contextmanager
def sigterm_interrupts() -> Iterator[Stops]:
    """Within: the first SIGTERM raises `Terminated` in the main thread, later ones are ignored. Outside the
    main thread (where Python cannot install a handler) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield Stops(installed=False)
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield Stops(installed=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
