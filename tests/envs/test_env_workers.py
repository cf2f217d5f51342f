"""Environments in worker processes (`envs.remote`): the same trees as in-process, the step timeout kept
in the worker, and every way environment code fails reported as one `EnvFailure` while the trainer's
process goes on."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from support.env_fixtures import END, FixedTurnsEnv, NoisyEnv, encode, tiny_model, tokenizer

from envs import EpisodeLimits, Message, TokenEnv, WrapperConfig, format_tool_call, make_env
from envs.remote import EnvFailure, RemoteEnv, WorkerEnvFactory
from envs.wire import MAX_ITEMS, WireError, messages_from_wire, result_from_wire, tools_from_wire
from treetrain.rollout import FanOut, RolloutConfig, SamplerConfig, Sampling, rollout_trees
from treetrain.rollout.engines.hf_engine import HFEngine

torch.set_num_threads(1)
MODEL = tiny_model(init=0.5)
ASSETS = str(Path(__file__).resolve().parents[1] / "assets" / "misbehaving")
SHORT = WrapperConfig(EpisodeLimits(max_turns=4, max_turn_tokens=6, max_episode_tokens=1024))


@pytest.fixture
def misbehaving(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(ASSETS)  # the worker starts with the trainer's sys.path


@pytest.mark.parametrize(
    ("name", "kwargs", "local", "fanout"),
    [
        (
            "calculator",
            {"max_operands": 2},
            lambda: make_env("calculator", max_operands=2),
            FanOut(3, 2, 1, 3),
        ),
        ("support.scripted_envs:FixedTurnsEnv", {}, FixedTurnsEnv, FanOut(2, 2, 1, 3)),
        (
            "support.scripted_envs:NoisyEnv",
            {},
            NoisyEnv,
            FanOut(2, 1, 2, 2),
        ),  # forks reseed: environment branches
    ],
)
@pytest.mark.parametrize(
    "sampling", [SamplerConfig(Sampling(temperature=0.0)), SamplerConfig(Sampling(temperature=1.0), seed=5)]
)
def test_worker_trees_equal_in_process_trees(
    tmp_path: Path, name: str, kwargs: dict, local: object, fanout: FanOut, sampling: SamplerConfig
) -> None:
    config = RolloutConfig(fanout=fanout, sampler=sampling, wrapper=SHORT)
    factory = WorkerEnvFactory(name, kwargs, timeout=30.0)
    try:
        remote = rollout_trees(
            MODEL,
            tokenizer(),
            factory,
            [0, 1, 2],
            tmp_path / "w",
            config,
            env_name=name,
            engine=HFEngine(MODEL),
        )
    finally:
        factory.close()
    inproc = rollout_trees(
        MODEL, tokenizer(), local, [0, 1, 2], tmp_path / "p", config, env_name=name, engine=HFEngine(MODEL)
    )  # type: ignore[arg-type]
    assert remote.failures == ()
    assert [t.id for t in remote.trees] == [t.id for t in inproc.trees]
    assert [t.trajectories() for t in remote.trees] == [t.trajectories() for t in inproc.trees]
    assert [p.name for p in remote.paths] == [p.name for p in inproc.paths]
    if not sampling.sampling.greedy:  # control: the comparison sees a difference when there is one
        other = RolloutConfig(
            fanout=fanout, sampler=SamplerConfig(Sampling(temperature=1.0), seed=6), wrapper=SHORT
        )
        moved = rollout_trees(
            MODEL, tokenizer(), local, [0, 1, 2], tmp_path / "o", other, env_name=name, engine=HFEngine(MODEL)
        )  # type: ignore[arg-type]
        assert [t.id for t in moved.trees] != [t.id for t in inproc.trees]


def _remote_episode(timeout: float | None) -> tuple[WorkerEnvFactory, TokenEnv]:
    factory = WorkerEnvFactory("support.scripted_envs:FlakyToolsEnv", {}, timeout)
    env = TokenEnv(factory(), tokenizer(), WrapperConfig(EpisodeLimits(max_turns=10, step_timeout_s=timeout)))
    env.reset(0)
    return factory, env


def test_a_slow_step_in_a_worker_is_a_timeout_observation_and_keeps_the_state() -> None:
    factory, env = _remote_episode(timeout=0.2)
    try:
        before = env.env
        result = env.step(encode(format_tool_call("slow", {"seconds": 2.0}) + END))
        assert [m.content for m in result.messages] == ["Error: tool 'slow' timed out after 0.2s."]
        assert env.env is before
        # The same episode goes on in the same worker: tool errors stay observations, a good call answers.
        boom = env.step(encode(format_tool_call("boom", {}) + END)).messages[0].content
        assert "tool 'boom' raised RuntimeError: the tool exploded" in boom
        assert env.step(encode(format_tool_call("ok", {"x": 21}) + END)).messages[0].content == "42"
        assert env.step(encode("done" + END)).done
        assert env.trajectory("t").reward == pytest.approx(0.4)
    finally:
        factory.close()


def test_fork_gives_an_independent_remote_copy() -> None:
    factory = WorkerEnvFactory("support.scripted_envs:FixedTurnsEnv", {"turns": 2}, 30.0)
    try:
        env = TokenEnv(factory(), tokenizer(), SHORT)
        env.reset(0)
        twin = env.fork(1)
        assert isinstance(twin.env, RemoteEnv) and twin.env.handle != env.env.handle
        assert not twin.step(encode("a" + END)).done and twin.step(encode("b" + END)).done
        assert not env.step(encode("a" + END)).done  # the original did not move with its fork
    finally:
        factory.close()


@pytest.mark.parametrize(
    ("fault", "method", "exception"),
    [
        ("step", "step", "RuntimeError: step fault"),
        ("step_dict", "step", "returned {'done': True}, not a StepResult"),
        ("exit", "step", "WorkerExited: the worker process exited with status 0"),
        ("reset_none", "reset", "returned None, not a non-empty sequence of Message"),
        ("reset", "reset", "RuntimeError: reset fault"),
        ("nan", "rubric 'length' (Length.score)", "reward is nan; rewards must be finite"),
    ],
)
def test_environment_faults_are_one_failure_and_the_next_environment_works(
    misbehaving: None, fault: str, method: str, exception: str
) -> None:
    factory = WorkerEnvFactory("misbehaving_env:Misbehaving", {"fault": fault, "seeds": "odd"}, 30.0)
    try:
        with pytest.raises(EnvFailure) as caught:
            env = TokenEnv(factory(), tokenizer(), SHORT)
            env.reset(1)
            env.step(encode("hi" + END))
            env.trajectory("t")
        error = caught.value.error
        assert (error.env, error.method) == ("misbehaving_env:Misbehaving", method)
        assert exception in error.exception
        if fault in ("step", "reset"):
            assert "misbehaving_env.py" in error.where and f"{fault} fault" in error.traceback
        # Control: the same factory serves the next task (a fresh worker after one died), which works.
        ok = TokenEnv(factory(), tokenizer(), SHORT)
        ok.reset(2)
        assert ok.step(encode("hi" + END)).done and ok.trajectory("t").reward >= 0.0
    finally:
        factory.close()


def test_a_closed_stdout_in_the_worker_leaves_the_trainer_its_own(misbehaving: None, capfd) -> None:
    factory = WorkerEnvFactory("misbehaving_env:Misbehaving", {"fault": "close_stdout"}, 30.0)
    try:
        env = TokenEnv(factory(), tokenizer(), SHORT)
        env.reset(0)
        assert env.step(encode("hi" + END)).done
        assert env.trajectory("t").reward >= 0.0
    finally:
        factory.close()
    os.write(1, b"trainer stdout still open\n")
    print("and sys.stdout too", flush=True)
    out = capfd.readouterr().out
    assert "trainer stdout still open" in out and "and sys.stdout too" in out
    assert not sys.stdout.closed


def test_a_failed_task_loses_its_tree_and_the_others_are_written(misbehaving: None, tmp_path: Path) -> None:
    """Tasks grow concurrently, so a worker that dies takes every task it hosts: each task gets its own
    worker here, as the trainer gives them (`rollout.env_workers`)."""
    factory = WorkerEnvFactory(
        "misbehaving_env:Misbehaving", {"fault": "exit", "seeds": "odd"}, 30.0, workers=4
    )
    config = RolloutConfig(fanout=FanOut(root=2), wrapper=SHORT)
    try:
        result = rollout_trees(
            MODEL, tokenizer(), factory, [0, 1, 2, 3], tmp_path, config, env_name="m", engine=HFEngine(MODEL)
        )
    finally:
        factory.close()
    assert [seed for seed, _ in result.failures] == [1, 3]
    assert all("status 0" in e.exception for _, e in result.failures)
    assert sorted(p.name.split("-")[1] for p in (tmp_path / "trees").iterdir()) == ["s0", "s2"]
    assert len(result.trees) == 2 and all(len(t.trajectories()) == 2 for t in result.trees)


def test_a_call_past_its_deadline_fails_alone_and_the_worker_serves_its_other_tasks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import envs.remote

    monkeypatch.setattr(envs.remote, "GRACE_S", 0.3)
    monkeypatch.setenv("BLOCKING_ENV_MARKER", "BLOCKING-ENV: blocked")  # the worker's step blocks for good
    factory = WorkerEnvFactory("support.blocking_env:BlockingStepEnv", {}, 0.2)
    try:
        hung, other = factory(), factory()
        hung.reset(0)
        other.reset(1)
        with pytest.raises(
            EnvFailure,
            match=r"step raised Timeout: no answer within 0.5s \(the worker still answers; only this",
        ):
            hung.step_within(
                Message("assistant", "hi"), None
            )  # no deadline in the worker: only the trainer's
        assert hung.worker is other.worker and other.worker.alive and other.worker.overdue == 1
        assert other.reset(2)[0].content == "Say anything (2)."  # the same worker serves its other task
        assert other.fork(1).reset(3)[0].content == "Say anything (3)."
    finally:
        factory.close()


def test_a_worker_that_answers_nothing_is_stopped_past_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control for the test above: a stuck worker (here a stopped process: not even its main loop
    answers the ping) is stopped, and a fresh one takes the next environment."""
    import envs.remote

    monkeypatch.setattr(envs.remote, "GRACE_S", 0.3)
    factory = WorkerEnvFactory("support.blocking_env:BlockingStepEnv", {}, 0.2)
    try:
        env = factory()
        env.reset(0)
        os.kill(env.worker._proc.pid or 0, signal.SIGSTOP)
        with pytest.raises(
            EnvFailure, match=r"reset raised Timeout: no answer within 0.5s, nor to a ping; the worker"
        ):
            env.reset(1)
        assert not env.worker.alive
        fresh = factory()  # control: a new worker answers
        assert fresh.reset(1)[0].content == "Say anything (1)."
    finally:
        factory.close()


@pytest.mark.parametrize("rubric_timeout", [0.5, 30.0])
def test_a_rubric_past_its_deadline_ends_its_task_alone_on_a_shared_worker(
    misbehaving: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rubric_timeout: float
) -> None:
    """Four tasks on one worker; the rubric of the odd ones takes 1.5 s. Under a 0.5 s rubric deadline
    those two tasks fail and the even ones are written; under 30 s (the control) all four are."""
    monkeypatch.setenv("MISBEHAVING_SLEEP_S", "1.5")
    factory = WorkerEnvFactory(
        "misbehaving_env:Misbehaving",
        {"fault": "slow_rubric", "seeds": "odd"},
        30.0,
        rubric_timeout=rubric_timeout,
    )
    config = RolloutConfig(fanout=FanOut(root=2), wrapper=SHORT)
    try:
        result = rollout_trees(
            MODEL, tokenizer(), factory, [0, 1, 2, 3], tmp_path, config, env_name="m", engine=HFEngine(MODEL)
        )
    finally:
        factory.close()
    if rubric_timeout > 1.5:
        assert result.failures == () and len(result.trees) == 4
        return
    assert [seed for seed, _ in result.failures] == [1, 3]
    for _, error in result.failures:
        assert error.method == "rubric 'length'" and error.exception.startswith(
            "Timeout: no answer within 0.5s"
        )
    assert sorted(p.name.split("-")[1] for p in (tmp_path / "trees").iterdir()) == ["s0", "s2"]
    assert all(len(t.trajectories()) == 2 for t in result.trees)


@pytest.mark.parametrize("fault", ["slow_step", "none"])
def test_step_timeouts_are_counted(
    misbehaving: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    monkeypatch.setenv("MISBEHAVING_SLEEP_S", "1")
    wrapper = WrapperConfig(
        EpisodeLimits(max_turns=2, max_turn_tokens=6, max_episode_tokens=1024, step_timeout_s=0.2)
    )
    factory = WorkerEnvFactory("misbehaving_env:Misbehaving", {"fault": fault, "seeds": "odd"}, 0.2)
    config = RolloutConfig(fanout=FanOut(root=2), wrapper=wrapper)
    try:
        result = rollout_trees(
            MODEL, tokenizer(), factory, [0, 1], tmp_path, config, env_name="m", engine=HFEngine(MODEL)
        )
    finally:
        factory.close()
    assert result.failures == ()
    texts = {
        t.id: tokenizer().decode(t.calls[0].tokens) for tree in result.trees for t in tree.trajectories()
    }
    timed_out = sum(text.count("did not answer within 0.2s") for text in texts.values())
    hit = fault == "slow_step"  # seed 1: 2 branches x 2 turns; the last turn's observation is never rendered
    assert (result.step_timeouts, timed_out) == ((4, 2) if hit else (0, 0))
    assert all("did not answer" not in text for tid, text in texts.items() if tid.startswith("m-s0"))


@pytest.mark.parametrize(
    ("decode", "value", "problem"),
    [
        (messages_from_wire, [{"role": "user", "content": "x"}] * (MAX_ITEMS + 1), "more than"),
        (messages_from_wire, [{"role": "robot", "content": "x"}], "role 'robot'"),
        (messages_from_wire, [{"role": "user", "content": 3}], "expected a string"),
        (messages_from_wire, {"role": "user"}, "expected a list"),
        (result_from_wire, {"messages": [], "done": "yes"}, "boolean 'done'"),
        (
            result_from_wire,
            {"messages": [{"role": "assistant", "content": "x"}], "done": False},
            "only user and tool",
        ),
        (
            tools_from_wire,
            [["t", "d", {"type": "object", "properties": {"a": {"type": "float"}}}]],
            "tool 't'",
        ),
    ],
)
def test_replies_outside_the_protocol_are_refused(decode: object, value: object, problem: str) -> None:
    with pytest.raises(WireError, match=problem):
        decode(value)  # type: ignore[operator]
    assert messages_from_wire([{"role": "user", "content": "x"}])[0].content == "x"  # control


def test_the_demo_writes_the_recorded_trees(tmp_path: Path) -> None:
    """The demo's first two updates grow the trees recorded in tests/assets/demo_rollouts.txt: the same
    tree ids (content hashes of every token and role) on every machine and run. The sampler's logprobs in
    the files are left out: the engine batches whatever is ready, so their float32 rounding moves with
    timing (tests/rollout/test_scheduler.py checks that tokens do not)."""
    from support.train_cases import train_in_process

    fixture = Path(__file__).resolve().parents[1] / "assets" / "demo_rollouts.txt"
    expected = [line.split() for line in fixture.read_text().splitlines() if not line.startswith("#")]
    run = tmp_path / "run"
    settings = ["updates=2", "rollout.groups_per_update=2", "measure_memory_every=0", "threads=1"]
    assert train_in_process(run, settings) == 0
    rollouts = run / "rollouts"
    written = sorted(p for p in rollouts.rglob("*.msgpack"))
    got = [[str(p.relative_to(rollouts))] for p in written]
    assert len(expected) == 4 and got == expected
