"""The `hf` sampler's process, started before there is a policy to give it.

An asynchronous run's `hf` engine decodes in a process of its own (`treetrain.rollout.engines.hf_process`).
Most of that process's start-up is its imports (torch, transformers, the engine: 3-6 s on the 2-core
machine), none of which needs the policy. `SamplerProcess()` spawns it at once, from a module that imports
nothing heavy itself: the child sets up its lifetime, imports the engine's modules, and then waits for the
policy (`hf_child.Start`, sent by the `HFProcessEngine` that adopts it). The trainer starts it before it
loads its model and backend (`treetrain.rollout.sources.sampler_start`), so the two start-ups overlap
instead of adding up before the first rollout. A process that has imported torch and transformers and computed
nothing yet (`treetrain train`, right after its imports) forks it instead where that is safe
(`fork_is_safe`: no CUDA): the copy has every module already, and the 5 s of CPU those imports take are
not spent twice, which counts on a machine whose cores are all busy.

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
    """A sampler process waiting for its policy; see the module docstring.

    `commands` and `replies` are the parent's ends of the two pipes, `proc` the process, and `started` the
    `time.time()` of the spawn (the engine reports its start-up from there)."""

    def __init__(self, method: str = "spawn") -> None:
        """`method`: "spawn" (a fresh interpreter, which imports the engine's modules itself), or "fork" (a
        copy of this process, which has them already) where a fork is safe (`fork_is_safe`)."""
        if method not in ("spawn", "fork"):
            raise ValueError(f"SamplerProcess: method must be 'spawn' or 'fork', got {method!r}")
        ctx: Any = multiprocessing.get_context(method)  # a spawn or a fork context, each with its Process
        commands_in, self.commands = ctx.Pipe(duplex=False)
        self.replies, replies_out = ctx.Pipe(duplex=False)
        self.method = method
        self.started = time.time()
        self.adopted = False
        ours = (self.commands, self.replies) if method == "fork" else ()  # a fork inherits them; closes them
        self.proc = ctx.Process(
            target=_entry, args=(os.getpid(), commands_in, replies_out, ours), name=PROCESS_NAME, daemon=True
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


def fork_is_safe() -> bool:
    """Whether this process may fork its sampler instead of spawning it: torch is loaded (the modules the
    copy saves importing), CUDA is not available (a CUDA context does not survive a fork, and a GPU run's
    shadow travels by CUDA IPC, which needs a spawned child), and only the main Python thread runs. Only a
    process that has not computed yet should ask (`treetrain train`, right after its imports): OpenMP's
    threads of earlier work do not carry over into a fork."""
    import threading

    torch = sys.modules.get("torch")
    return torch is not None and not torch.cuda.is_available() and threading.active_count() == 1


def _entry(parent_pid: int, commands: Any, replies: Any, parents: tuple[Any, ...] = ()) -> None:
    """The child: die with the parent's thread, name itself, then import the engine and serve it.
    `parents`: the parent's ends of the pipes, inherited by a fork and closed here, so that the command pipe
    reports end of file once the parent closes its end."""
    for end in parents:
        end.close()
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
