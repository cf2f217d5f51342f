"""Suite-wide settings. Tiny models run fastest single-threaded; with several test processes (the
distributed tests) on two cores, more threads only contend."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import settings

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)

# CI gates on the suite, so its fuzzing is reproducible: the same examples on every machine and run.
# Search for new cases with `pytest --hypothesis-profile=explore`: fresh random examples on each run.
settings.register_profile("reproducible", derandomize=True, deadline=None, database=None)
settings.register_profile("explore", deadline=None)
settings.load_profile("reproducible")


@pytest.fixture(scope="session", autouse=True)
def calibration_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One memory-calibration store for the whole run (`treetrain.memory.calibration_store`), shared by the
    xdist workers and every process a test starts: a model is calibrated once per run, as a user's machine
    does across runs, and nothing is read from or left in the user's own cache."""
    base = tmp_path_factory.getbasetemp()
    where = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "calibrations"
    os.environ.setdefault("TREETRAIN_CACHE_DIR", str(where))
    return Path(os.environ["TREETRAIN_CACHE_DIR"])


@pytest.fixture(scope="session")
def vllm_engine() -> Iterator[Any]:
    """One real vLLM engine (the CPU build in `make test`) on the wide demo model, for the whole session:
    starting one costs about half a minute. Tests that change its weights put the originals back."""
    from treetrain.rollout.engines.engine_settings import VLLMSettings
    from treetrain.rollout.engines.vllm_engine import VLLMEngine
    from treetrain.train.models import WIDE_DEMO_MODEL

    engine = VLLMEngine(str(WIDE_DEMO_MODEL), VLLMSettings(), dtype="float32", max_model_len=1024, seed=0)
    yield engine
    engine.close()


SERVED = pytest.StashKey[Any]()
SECOND = pytest.StashKey[Any]()


ENGINE_FIXTURES = frozenset({"vllm_engine", "vllm_server", "second_vllm_server"})
"""Fixtures that start an inference engine or a server: their tests are `launch` tests."""


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Cases listed in tests/slow_cases.txt are `slow`. Tests that start vLLM (the shared fixtures, or an engine of their own in a `*vllm*`/`*served*` file) are
    `launch` tests and share one xdist group, so under `pytest -n 2 --dist loadgroup` (`make test`) one
    worker runs them all: the session's engine and server start once, and two vLLM engines never compete
    for the machine. The `distributed` launches share a group of their own for the same reason."""
    slow = _slow_cases()
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)
        name = item.path.name
        if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())) or "vllm" in name or "served" in name:
            item.add_marker(pytest.mark.launch)
            _group(config, item, "vllm")
        elif item.get_closest_marker("distributed") is not None:
            _group(config, item, "torchrun")


def _slow_cases() -> frozenset[str]:
    """The test ids in tests/slow_cases.txt: cases measured slow, which `make test-fast` leaves out."""
    text = Path(__file__).with_name("slow_cases.txt").read_text()
    return frozenset(line for line in text.splitlines() if line and not line.startswith("#"))


def _group(config: pytest.Config, item: pytest.Item, group: str) -> None:
    """Put `item` in xdist group `group`. xdist tells the scheduler an item's group by appending `@group` to
    its test id, through the `_nodeid` field pytest before 9.2 kept; on pytest 9.2, which keeps the id as a
    structured `NodeId`, that write is lost and `--dist loadgroup` silently spreads a group over all workers
    (pytest-xdist issue 1386), so there the id is extended here."""
    item.add_marker(pytest.mark.xdist_group(group))
    if getattr(config.option, "loadgroup", False) and not hasattr(item, "_nodeid"):
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(f"{item.nodeid}@{group}")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the real `vllm serve` now when a collected test needs it (and the second one beside it when a
    test needs that): its start-up overlaps the tests that run before. Under xdist every worker collects
    every test, so there the first fixture used starts them, together, in the one worker that runs the
    vLLM group."""
    if session.config.option.collectonly or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    _start_servers(session.config, session.items)


def _start_servers(config: pytest.Config, items: list[pytest.Item], key: Any = None) -> Any:
    """Start each session server (`vllm_server`, `second_vllm_server`) that a test of `items` needs, and the
    one `key` names, unless started already: together, so their start-ups overlap. The one of `key`."""
    from support.vllm_serve import Served

    for each, name in ((SERVED, "vllm_server"), (SECOND, "second_vllm_server")):
        needed = each is key or any(name in getattr(i, "fixturenames", ()) for i in items)
        if needed and each not in config.stash:
            config.stash[each] = Served(Path(tempfile.mkdtemp(prefix="vllm-serve-")) / "server.log")
    return config.stash[key] if key is not None else None


def pytest_sessionfinish(session: pytest.Session) -> None:
    for key in (SERVED, SECOND):
        served = session.config.stash.get(key, None)
        if served is not None:
            served.stop()


@pytest.fixture(scope="session")
def vllm_server(request: pytest.FixtureRequest) -> str:
    """The base URL of one real `vllm serve` (the docs' command, the CPU build in `make test`) on the wide
    demo model, started once for the session as collection ends (`tests/support/vllm_serve.py`). Every use
    starts with a reload, so what an earlier test reloaded into it does not matter."""
    # started here under xdist, or when collected through a path that skipped the hook
    return str(_start_servers(request.config, request.session.items, SERVED).url())


@pytest.fixture(scope="session")
def vllm_server_log(vllm_server: str, request: pytest.FixtureRequest) -> Path:
    """The log file of the session's `vllm serve`, its engine core's lines included (what vLLM warns)."""
    return Path(request.config.stash[SERVED].log)


@pytest.fixture
def second_vllm_server(request: pytest.FixtureRequest) -> Any:
    """A second `vllm serve` like `vllm_server`'s (a `support.vllm_serve.Served`, up), for tests that route
    across servers and may kill it: started beside the first as collection ends, and started again (on
    another port) for the next test that needs it when a test killed it."""
    from support.vllm_serve import Served

    served = _start_servers(request.config, request.session.items, SECOND)
    if served.proc.poll() is not None:  # killed by an earlier test
        served.stop()  # what is left below it (vLLM's engine core)
        served = Served(Path(tempfile.mkdtemp(prefix="vllm-serve-")) / "server.log")
        request.config.stash[SECOND] = served
    served.url()
    return served
