"""Environment workers under concurrent calls (`envs.remote`, `envs.channel`, `envs.lanes`): a step held at
a gate holds up only its own handle, one handle's requests run in order, and every way a worker fails
reaches every caller that waits on it.

Overlap is shown with gates (files the worker's environment waits on, `support.gated_env`), not with
timing thresholds: a fast step that returns while a gated one is still held proves they overlapped,
however loaded the machine is."""

from __future__ import annotations

import functools
import re
import signal
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from support.gated_env import GatedEnv, touch, wait_for

import envs.channel
import envs.remote
from envs import Message
from envs.remote import EnvFailure, EnvWorker, RemoteEnv, WorkerEnvFactory
from treetrain.errors import ConfigError

GATED = "support.gated_env:GatedEnv"


class Call(threading.Thread):
    """`fn()` in a thread, keeping what it returned or raised."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.fn, self.value, self.error = fn, None, None
        self.start()

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as exc:
            self.error = exc

    def result(self) -> Any:
        self.join(30)
        assert not self.is_alive(), "the call did not return"
        if self.error is not None:
            raise self.error
        return self.value

    def failure(self) -> EnvFailure:
        """The `EnvFailure` the call raised (it must have raised one)."""
        with pytest.raises(EnvFailure) as caught:
            self.result()
        return caught.value


def step(env: RemoteEnv, text: str, timeout: float | None = None) -> str:
    result = env.step_within(Message("assistant", text), timeout)
    assert result is not None
    return result.messages[0].content


def started(gates: Path, name: str) -> None:
    assert wait_for((gates / f"{name}.started").exists), f"step {name!r} never started"


@pytest.fixture
def gates(tmp_path: Path) -> Path:
    return tmp_path


def opened(factory: WorkerEnvFactory, seed: int) -> RemoteEnv:
    env = factory()
    env.reset(seed)
    return env


def test_a_held_step_delays_only_its_own_handle(gates: Path) -> None:
    factory = WorkerEnvFactory(GATED, {"gates": str(gates)}, timeout=30.0)
    try:
        a, b = opened(factory, 0), opened(factory, 1)
        held = Call(lambda: step(a, "wait:a", 30.0))
        started(gates, "a")
        assert step(b, "fast", 30.0) == "seed1|fast"  # under a deadline: the worker steps a copy in a thread
        twin = b.fork(1)
        assert step(twin, "twin") == "seed1|fast|twin"
        assert b.score("length", _episode(b)) == pytest.approx(0.02)
        fresh = opened(factory, 2)  # building a new environment does not wait either
        assert held.is_alive()  # all of the above ran while a's step was held
        touch(gates / "a.go")
        assert held.result() == "seed0|a-start|a-end"
        assert step(fresh, "after") == "seed2|after"
    finally:
        factory.close()


def test_control_one_request_at_a_time_makes_the_fast_step_wait(gates: Path) -> None:
    factory = WorkerEnvFactory(GATED, {"gates": str(gates)}, timeout=30.0, max_concurrent=1)
    try:
        a, b = opened(factory, 0), opened(factory, 1)
        held = Call(lambda: step(a, "wait:a"))
        started(gates, "a")
        fast = Call(lambda: step(b, "fast"))
        assert not wait_for((gates / "fast.started").exists, 0.5)  # the test above could have failed
        touch(gates / "a.go")
        assert held.result() == "seed0|a-start|a-end" and fast.result() == "seed1|fast"
    finally:
        factory.close()


def test_requests_on_one_handle_run_in_the_order_sent(gates: Path) -> None:
    worker = EnvWorker(GATED, {"gates": str(gates)}, 30.0, max_concurrent=4)
    try:
        handle = worker.build()["handle"]
        worker.call("reset", {"op": "reset", "handle": handle, "seed": 0})

        def raw(text: str) -> Callable[[], Any]:  # past RemoteEnv, whose own lock would order them anyway
            message = {"role": "assistant", "content": text, "tool_calls": []}
            return lambda: worker.call("step", {"op": "step", "handle": handle, "message": message})

        first = Call(raw("wait:a"))
        started(gates, "a")
        second = Call(raw("b"))
        assert wait_for(lambda: worker.waiting == 2)
        assert not wait_for((gates / "b.started").exists, 0.5)  # queued behind a, not run beside it
        touch(gates / "a.go")
        assert first.result()["result"]["messages"][0]["content"] == "seed0|a-start|a-end"
        assert second.result()["result"]["messages"][0]["content"] == "seed0|a-start|a-end|b"
    finally:
        worker.close()


def test_one_callers_deadline_fails_that_call_alone_and_the_others_go_on(
    gates: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that answers a ping is not stuck: the call past its deadline fails, and the worker keeps
    serving every other call, before and after (tests/envs/test_env_workers.py stops one that answers
    nothing)."""
    monkeypatch.setattr(envs.remote, "GRACE_S", 3.0)
    factory = WorkerEnvFactory(GATED, {"gates": str(gates)}, timeout=0.2)
    try:
        a, b, c = opened(factory, 0), opened(factory, 1), opened(factory, 2)
        stuck = Call(lambda: step(a, "block", None))  # no deadline in the worker: only the trainer's 3.2 s
        done = 0
        while stuck.is_alive() and done < 3:
            assert step(b, f"b{done}").endswith(f"b{done}")
            done += 1
        assert done == 3  # the others went on while it waited
        assert re.search(
            r"step raised Timeout: no answer within 3.2s \(the worker still answers; only this call failed\)",
            str(stuck.failure()),
        )
        assert a.worker.alive and a.worker.overdue == 1
        held = Call(
            lambda: step(c, "wait:c", None)
        )  # the worker still runs calls that wait, beside the stuck one
        started(gates, "c")
        touch(gates / "c.go")
        assert held.result() == "seed2|c-start|c-end"
        assert step(b, "late", 0.2).endswith("late")
    finally:
        factory.close()


def test_a_worker_that_dies_fails_every_waiting_call(gates: Path) -> None:
    factory = WorkerEnvFactory(GATED, {"gates": str(gates)}, timeout=30.0)
    try:
        a, b, c = (opened(factory, seed) for seed in range(3))
        waiting = [Call(lambda: step(a, "wait:a")), Call(lambda: step(b, "wait:b"))]
        started(gates, "a")
        started(gates, "b")
        with pytest.raises(EnvFailure) as caught:
            step(c, "exit")
        for failure in [caught.value, *(w.failure() for w in waiting)]:
            assert failure.error.method == "step"
            assert "WorkerExited: the worker process exited with status 0" in failure.error.exception
        assert step(opened(factory, 4), "x") == "seed4|x"
    finally:
        factory.close()


@pytest.mark.parametrize("timeout", [None, 30.0])
def test_sys_exit_in_a_step_fails_that_call_alone(gates: Path, timeout: float | None) -> None:
    factory = WorkerEnvFactory(GATED, {"gates": str(gates)}, timeout=30.0)
    try:
        a, b = opened(factory, 0), opened(factory, 1)
        held = Call(lambda: step(a, "wait:a", timeout))
        started(gates, "a")
        with pytest.raises(EnvFailure) as caught:
            step(b, "sys.exit", timeout)
        assert (caught.value.error.method, caught.value.error.exception) == ("step", "SystemExit: 3")
        assert "gated_env.py" in caught.value.error.where
        assert b.worker.alive and held.is_alive()  # the worker, and the call waiting on it, go on
        touch(gates / "a.go")
        assert held.result() == "seed0|a-start|a-end"
        assert step(b, "again", timeout) == "seed1|again"  # b kept its state from before the failed step
    finally:
        factory.close()


@pytest.mark.parametrize(
    ("mode", "text"),
    [
        ("unknown_id", "a reply to request 999999, which no call is waiting for"),
        ("no_id", "a reply without a request id"),
        ("no_ok", "a reply without 'ok' or 'error'"),
        ("not_json", "a reply that is not JSON"),
        ("not_object", "a reply that is not an object"),
        ("oversized", "a reply over 1024 bytes"),
    ],
)
def test_a_reply_outside_the_protocol_fails_every_waiting_call(
    monkeypatch: pytest.MonkeyPatch, mode: str, text: str
) -> None:
    import support.fake_worker

    monkeypatch.setattr(envs.remote, "serve", support.fake_worker.serve)
    monkeypatch.setattr(envs.channel, "MAX_REPLY_BYTES", 1024)
    worker = EnvWorker(f"{mode}:2", {}, 30.0, max_concurrent=4)
    try:
        calls = [Call(functools.partial(worker.call, m, {"op": m, "handle": 1})) for m in ("step", "fork")]
        failures = [c.failure() for c in calls]
        assert sorted(f.error.method for f in failures) == ["fork", "step"]
        assert all(f"WireError: {text}" in f.error.exception for f in failures), failures
        assert not worker.alive and wait_for(lambda: not worker._proc.is_alive(), 10)
        with pytest.raises(EnvFailure, match="WorkerGone: the worker had already stopped"):
            worker.call("reset", {"op": "reset"})
    finally:
        worker.close()


def test_ctrl_c_while_waiting_stops_the_worker_and_fails_the_other_callers(gates: Path) -> None:
    factory = WorkerEnvFactory(GATED, {"gates": str(gates)}, timeout=30.0)
    try:
        a, b = opened(factory, 0), opened(factory, 1)
        other = Call(lambda: step(b, "wait:b"))
        started(gates, "b")
        main = threading.main_thread().ident
        assert main == threading.get_ident()
        # a's step has started in the worker only once its call was sent, so the caller is waiting by then
        interrupt = threading.Thread(
            target=lambda: wait_for((gates / "a.started").exists) and signal.pthread_kill(main, signal.SIGINT)
        )
        previous = signal.signal(
            signal.SIGINT, signal.default_int_handler
        )  # Ctrl-C raises, whatever ran before
        try:
            interrupt.start()
            with pytest.raises(KeyboardInterrupt):
                step(a, "wait:a")
        finally:
            signal.signal(signal.SIGINT, previous)
        interrupt.join()
        assert not a.worker.alive
        with pytest.raises(EnvFailure, match=r"WorkerStopped: interrupted \(KeyboardInterrupt\)"):
            other.result()
    finally:
        factory.close()


def _script(seed: int) -> list[str]:
    return [f"s{seed}-{i}" for i in range(3)]


def _episode_of(env: Any, seed: int) -> tuple[list[str], list[str], float]:
    """Reset, three steps, a fork stepped twice, a score, release: what each step answered."""
    env.reset(seed)
    said = [_say(env, text) for text in _script(seed)]
    twin = env.fork(seed)
    forked = [_say(twin, f"f{seed}-{i}") for i in range(2)]
    reward = env.rubrics()["length"](_episode(env))
    for e in (env, twin):
        if isinstance(e, RemoteEnv):
            e.release()
    return said, forked, reward


def _say(env: Any, text: str) -> str:
    return env.step(Message("assistant", text)).messages[0].content


def _episode(env: Any) -> Any:
    from envs import Episode

    return Episode((), env.state(), "done")


def test_many_threads_on_many_handles_match_a_sequential_run(gates: Path) -> None:
    seeds = list(range(24))
    expected = [_episode_of(GatedEnv(str(gates)), seed) for seed in seeds]
    assert len({tuple(e[0]) for e in expected}) == len(seeds)  # control: every episode's answers differ
    factory = WorkerEnvFactory(GATED, {"gates": str(gates)}, timeout=30.0, max_concurrent=4, workers=2)
    try:
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda seed: _episode_of(factory(), seed), seeds))
        assert got == expected
        assert len({id(w) for w in factory._workers}) == 2  # both workers served
    finally:
        factory.close()


@pytest.mark.parametrize(("field", "value"), [("max_concurrent", 0), ("workers", True), ("workers", 65)])
def test_pool_sizes_out_of_range_are_refused(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"{field}: must be an integer in \[1, "):
        WorkerEnvFactory(GATED, {}, **{field: value})  # type: ignore[arg-type]
