"""The start's wait for servers still loading (`rollout.vllm.startup_wait_s`): a run started beside its
servers waits for each to answer `GET /v1/models`, saying so in one warning line; one that never answers is
refused in one line naming it and the wait, and with no wait (the default) at once, as a mistyped URL must
be."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from support.ports import free_port
from support.vllm_standin import Standin, standins

from treetrain.errors import ConfigError
from treetrain.rollout.engines import server_calls
from treetrain.rollout.engines.generation import EngineError
from treetrain.train.config import load_config


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_calls, "STARTUP_POLL_S", 0.2)


def test_a_server_that_comes_up_during_the_wait_is_taken(caplog: pytest.LogCaptureFixture) -> None:
    with standins() as start:
        up, loading = start(), Standin(dead=True)
        late = start(loading)
        with pytest.raises(EngineError, match=rf"^rollout.vllm.urls: no vllm serve answers at {late} \(GET"):
            server_calls.check_reachable((up, late))  # no wait: refused at once (the negative control)
        threading.Timer(0.6, lambda: setattr(loading, "dead", False)).start()
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger=server_calls.__name__):
            server_calls.check_reachable((up, late), wait_s=30.0)
        assert 0.5 < time.monotonic() - started < 10
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("waiting up to 30 s for 1 of 2 servers to answer GET /v1/models") and late in line


def test_a_server_that_never_answers_is_refused_after_the_wait_naming_it() -> None:
    gone = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(EngineError) as caught:
        server_calls.check_reachable((gone,), wait_s=1.0)
    assert 1.0 <= time.monotonic() - started < 10
    line = str(caught.value)
    assert "\n" not in line and line.startswith(
        f"rollout.vllm.urls: no vllm serve answers at {gone} after waiting 1 s (rollout.vllm.startup_wait_s)"
    )


@pytest.mark.parametrize("bad", ["-1", "86401", "true", "soon"])
def test_the_wait_is_a_bounded_number_of_seconds(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"^rollout.vllm.startup_wait_s: (must be|expected) a number"):
        load_config(None, [f"rollout.vllm.startup_wait_s={bad}"])
