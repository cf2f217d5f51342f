"""Two trainer ranks on one fleet (`treetrain.rollout.engines.server_ranks`), on stand-in servers, each rank
an engine on a thread of its own with a gather between them: rank 0 writes and loads once per sync, the
follower takes its outcome (its version, the servers it lost, the line that stopped it) and never removes
rank 0's files. The real fleet under torchrun and ZeRO-3 is `tests/train/test_served_fleet_ranks.py`'s
(streamed weights at K = 0, files at K = 1)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.env_fixtures import tiny_model
from support.vllm_standin import EXPECTED, Standin, standins

from treetrain.rollout.engines.engine_settings import VLLMSettings
from treetrain.rollout.engines.generation import EngineError
from treetrain.rollout.engines.server_ranks import TrainerRanks
from treetrain.rollout.engines.vllm_server import VLLMServerEngine
from treetrain.rollout.sources.shared_trees import share_servers


@pytest.fixture
def server() -> Iterator[Callable[..., str]]:
    with standins() as start:
        yield start


class _Gather:
    """`TrainerRanks.gather` between threads: every rank's text, once all have posted."""

    def __init__(self, world: int) -> None:
        self.slots = [""] * world
        self.barrier = threading.Barrier(world, timeout=30)

    def of(self, rank: int) -> Callable[[str], list[str]]:
        def gather(text: str) -> list[str]:
            self.slots[rank] = text
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out

        return gather


def _pair(urls: list[str], tmp_path: Path) -> list[VLLMServerEngine]:
    gather, settings = _Gather(2), VLLMSettings(urls=tuple(urls), request_timeout_s=5.0)
    return [
        VLLMServerEngine(
            settings,
            weights_dir=tmp_path / "w",
            expected=EXPECTED,
            ranks=TrainerRanks(rank, 2, gather.of(rank)),
        )
        for rank in (0, 1)
    ]


def _sync_both(engines: list[VLLMServerEngine], model: object, version: int) -> list[BaseException | None]:
    """Each rank's sync on its own thread; what each raised (None: it synced)."""

    def one(engine: VLLMServerEngine) -> BaseException | None:
        try:
            engine.sync_weights(model, version)
        except EngineError as exc:
            return exc
        return None

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(one, engines))


def test_rank_zero_loads_once_and_the_follower_takes_its_version(
    server: Callable[..., str], tmp_path: Path
) -> None:
    standin = Standin(model=tiny_model())
    lead, follow = _pair([server(standin)], tmp_path)
    assert _sync_both([lead, follow], standin.model, 3) == [None, None]
    assert len(standin.reloads) == 1  # written and loaded once, by rank 0
    assert lead.version == follow.version == 3 and follow.label == lead.label == standin.version
    assert follow.weights.path == tmp_path / "w" / "current" and follow.weights.probe == lead.weights.probe
    assert follow.stats.sync_bytes == 0 < lead.stats.sync_bytes
    follow.close()  # rank 0's files stay for rank 0
    assert list((tmp_path / "w" / "current").glob("*.safetensors"))
    lead.close()
    assert not (tmp_path / "w").exists()


def test_a_sync_that_stops_rank_zero_stops_the_follower_with_its_line(
    server: Callable[..., str], tmp_path: Path
) -> None:
    standin = Standin(model=tiny_model(), posts={"/collective_rpc": lambda body: (200, b"")})
    lead, follow = _pair([server(standin)], tmp_path)
    stopped, followed = _sync_both([lead, follow], standin.model, 1)
    assert isinstance(stopped, EngineError) and "was not confirmed" in str(stopped)
    assert str(followed) == f"rank 0's weight sync stopped: {stopped}"
    assert follow.version == lead.version == 0  # neither took the version


def test_a_server_rank_zero_lost_at_its_sync_is_lost_for_the_follower(
    server: Callable[..., str], tmp_path: Path
) -> None:
    kept, dropped = Standin(model=tiny_model()), Standin(model=tiny_model())
    lead, follow = _pair([server(kept), server(dropped)], tmp_path)
    dropped.dead = True  # answers the follower's start, not rank 0's reload
    assert _sync_both([lead, follow], kept.model, 2) == [None, None]
    assert lead.fleet.alive == follow.fleet.alive == (0,)
    assert dropped.version == "default" and kept.version == follow.label
    lead.close()
    follow.close()


class _TwoRanks:
    """Rank 0's view of a gather where rank 1 posts `other`."""

    world_size, rank = 2, 0

    def __init__(self, other: str) -> None:
        self.other = other

    def gather(self, text: str) -> list[str]:
        return [text, self.other]


def test_every_ranks_requests_are_counted_per_server() -> None:
    mine = (("http://a", 3, 12, 0.5), ("http://b", 1, 4, 0.25))
    theirs = json.dumps([["http://b", 2, 8, 9.0], ["http://c", 1, 4, 1.0]])
    merged = share_servers(_TwoRanks(theirs), mine)  # type: ignore[arg-type]
    assert merged == (("http://a", 3, 12, 0.5), ("http://b", 3, 12, 0.25), ("http://c", 1, 4, 1.0))
