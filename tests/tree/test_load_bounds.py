"""Loading is bounded by the file: time and memory at most a measured constant times the file size, or
the file is refused naming the limit, on constructed worst cases (a deep comb of one-token nodes, a very
wide node, thousands of calls through one long prefix)."""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable

import pytest
from support.tree_worst import comb, shared_calls, wide

from treetrain.tree.format import Limits, TreeFormatError, trees_from_bytes

#: Measured on a busy 2-core machine (pytest -s prints them), with slack: tracemalloc peak bytes per file
#: byte (130 for the comb at the limit, 22 for the wide node, 8 for the shared calls) and load seconds
#: per file byte (3e-6 at worst).
MEMORY_PER_BYTE = 200
SECONDS_PER_BYTE = 5e-5

# Largest loadable comb under the defaults, and one just past it (visits grow as depth**2 / 2).
COMB_OK = 370
COMB_TOO_DEEP = 800

CASES: dict[str, Callable[[], bytes]] = {
    "deep comb at the limit": lambda: comb(COMB_OK),
    "very wide node": lambda: wide(500),
    # T is just under max_total_tokens (2**28): loading used to rebuild every call, now it never does.
    "calls sharing a long prefix": lambda: shared_calls(100_000, (1 << 28) // 100_000),
}


def _measure(blob: bytes) -> tuple[float, int]:
    start = time.perf_counter()
    trees_from_bytes(blob)
    seconds = time.perf_counter() - start
    tracemalloc.start()
    try:
        trees_from_bytes(blob)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return seconds, peak


@pytest.mark.parametrize("name", sorted(CASES))
def test_load_time_and_memory_are_a_constant_times_the_file(name: str) -> None:
    blob = CASES[name]()
    seconds, peak = _measure(blob)
    print(f"{name}: {len(blob)} bytes, {seconds / len(blob):.2e} s/byte, peak {peak / len(blob):.1f} x file")
    assert peak <= MEMORY_PER_BYTE * len(blob)
    assert seconds <= SECONDS_PER_BYTE * len(blob) + 0.5


def test_a_deep_comb_is_refused_naming_the_limit_before_the_work_is_done() -> None:
    blob = comb(COMB_TOO_DEEP)
    start = time.perf_counter()
    with pytest.raises(TreeFormatError, match=r"node_visits_per_byte x the file size") as info:
        trees_from_bytes(blob)
    seconds = time.perf_counter() - start
    assert "trajectories[" in str(info.value) and "\n" not in str(info.value)
    assert seconds <= SECONDS_PER_BYTE * len(blob) + 0.5
    # A reader allowed more pairs per byte loads it: the limit, not the structure, refused it.
    assert trees_from_bytes(blob, Limits(node_visits_per_byte=4))


def test_the_comb_limit_sits_where_the_constants_say() -> None:
    trees_from_bytes(comb(COMB_OK))
    with pytest.raises(TreeFormatError, match="node_visits_per_byte"):
        trees_from_bytes(comb(COMB_OK + 5))


def test_total_tokens_past_the_limit_are_refused_without_rebuilding_calls() -> None:
    blob = shared_calls(100_000, (1 << 28) // 100_000 + 1)
    start = time.perf_counter()
    with pytest.raises(TreeFormatError, match=r"over the limit of 268435456"):
        trees_from_bytes(blob)
    assert time.perf_counter() - start < 5.0
