"""The `hf` sampler's process, started before there is a policy to give it.

An asynchronous run's `hf` engine decodes in a process of its own (`treetrain.rollout.engines.hf_process`).
Most of that process's start-up is its imports (torch, transformers, the engine: 3-6 s on the 2-core
machine), none of which needs the policy. `SamplerProcess()` spawns it at once, from a module that imports
nothing heavy itself: the child sets up its lifetime, imports the engine's modules, and then waits for the
policy (`hf_child.Start`, sent by the `HFProcessEngine` that adopts it). The trainer starts it before it
loads its own modules, model and backend (`treetrain.cli.train`, or `Trainer` itself), so the two start-ups
overlap instead of adding up before the first rollout.

A process nobody adopted is closed by whoever started it (`close`, a no-op once adopted: the engine owns it
then); one left behind exits when its command pipe closes, and dies with the thread that started it
(`PR_SET_PDEATHSIG`), so start it on a thread that lives as long as the run.

Example:
    >>> started = SamplerProcess()
    >>> started.proc.is_alive()
    True
    >>> started.close()
    >>> started.proc.is_alive()
    False
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import time
from typing import Any

from treetrain.rollout.engines.generation import EngineError

PROCESS_NAME = "treetrain-hf"
"""The child's name in /proc/<pid>/comm (at most 15 characters)."""
CLOSE_WAIT_S = 5.0
"""How long `close` waits for the child to exit before it kills it."""


class SamplerProcess:
    """A spawned sampler process waiting for its policy; see the module docstring.

    `commands` and `replies` are the parent's ends of the two pipes, `proc` the process, and `started` the
    `time.time()` of the spawn (the engine reports its start-up from there)."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        commands_in, self.commands = ctx.Pipe(duplex=False)
        self.replies, replies_out = ctx.Pipe(duplex=False)
        self.started = time.time()
        self.adopted = False
        self.proc = ctx.Process(
            target=_entry, args=(os.getpid(), commands_in, replies_out), name=PROCESS_NAME, daemon=True
        )
        try:
            self.proc.start()
        except Exception as exc:  # the process cannot start (no memory, no process slots)
            self.commands.close()
            self.replies.close()
            raise EngineError(f"rollout.engine=hf: the sampler process did not start: {exc}") from None
        finally:
            commands_in.close()
            replies_out.close()

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def adopt(self) -> None:
        """Hand the process to an engine, which closes it from now on (once only)."""
        if self.adopted or not self.proc.is_alive():
            raise EngineError(
                "rollout.engine=hf: the sampler process was already taken or has ended "
                f"(exit status {self.proc.exitcode})"
            )
        self.adopted = True

    def close(self) -> None:
        """End a process no engine adopted (a no-op once one did). It holds nothing yet and may still be in
        its imports, far from reading its pipe: it is killed rather than waited for."""
        if self.adopted:
            return
        self.adopted = True  # closed: no engine may take it any more
        if self.proc.is_alive():
            self.proc.kill()
        self.stop()

    def stop(self) -> None:
        """Close the pipes (the child reads end of file and exits), then make sure it has."""
        self.commands.close()
        self.proc.join(CLOSE_WAIT_S)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(CLOSE_WAIT_S)
        self.replies.close()


def _entry(parent_pid: int, commands: Any, replies: Any) -> None:
    """The child: die with the parent's thread, name itself, then import the engine and serve it."""
    if sys.platform == "linux":
        libc = ctypes.CDLL(None)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        libc.prctl(15, PROCESS_NAME.encode())  # PR_SET_NAME
    if os.getppid() != parent_pid:  # the parent died before the request above took hold
        os._exit(0)
    from treetrain.rollout.engines.hf_child import child_main

    child_main(commands, replies)  # returns once its last reply is sent
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # nothing left to save: skip the interpreter's teardown of torch (1-2 s the parent waits)
