"""The geometry benchmark's smoke run (`bench/geometry.py --quick`) and the logic of its targets."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest
from support.scripts import load_script

from treetrain.benchmark.bench_config import MODES, QUICK, BenchConfig, GridPoint, Mode
from treetrain.benchmark.longest_prefix import PrefixFit
from treetrain.benchmark.report import check_lines
from treetrain.benchmark.results import (
    BenchResults,
    Machine,
    ModeResult,
    PointResult,
    all_checks,
    budget_checks,
    from_json,
    growth_checks,
    memory_checks,
    resident_per_token,
    speed_checks,
    to_json,
)
from treetrain.benchmark.timing import rotation
from treetrain.benchmark.workload import bench_batch
from treetrain.lifetime import ClassBytes
from treetrain.replay.units import UnitTree
from treetrain.tree.stats import tree_stats

PNG = b"\x89PNG\r\n\x1a\n"


def _script() -> ModuleType:
    return load_script("bench/geometry.py", "bench_geometry")


@pytest.mark.parametrize(
    "name",
    [
        "treetrain.benchmark.bench_config",
        "treetrain.benchmark.timing",
        "treetrain.benchmark.results",
        "treetrain.benchmark.longest_prefix",
    ],
)
def test_doctests(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_rotation_puts_every_mode_in_every_position() -> None:
    orders = [rotation(rep, 0) for rep in range(3)]
    for position in range(3):
        assert {o[position] for o in orders} == set(MODES)
    assert rotation(0, 1) == rotation(1, 0)  # the next point starts where the next repetition would


def test_quick_run_writes_well_formed_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _script().main(["--quick", "--out", str(tmp_path)]) == 0
    assert "wrote" in capsys.readouterr().out
    results = from_json((tmp_path / "geometry.json").read_text())
    assert results.config == QUICK
    assert results.machine.command == f"python bench/geometry.py --quick --out {tmp_path}"
    points = QUICK.points()
    assert [r.point for r in results.points] == list(points)
    for r in results.points:
        for m in r.modes:
            assert len(m.seconds) == QUICK.reps and all(s > 0 for s in m.seconds)
            # the engines ran the token-ceiling work the cost model counts. Beyond it, a tree unit below the
            # first level re-reads its parent's last token under autograd (the overlap, 3 per unit), and an
            # internal unit's KV is first computed without a graph (at most U_int more)
            extra = m.token_cost - m.ceiling_cost
            work = bench_batch(r.point, QUICK).work[0]
            units = len(UnitTree.build(work.tree, work.targets, QUICK.chunk_size)) - 1
            bound = 0 if m.mode == "flat" else 3 * units + tree_stats(work.tree).internal_tokens
            assert 0 <= extra <= bound, (r.point, m)
            assert m.measured.persistent > 0 and m.measured.boundary == m.measured.persistent
            assert m.predicted.total > 0
        assert r.ceiling("flat") == 1.0
    assert len(results.fits) == len(QUICK.shapes()) * len(MODES)
    for f in results.fits:
        assert f.prefix % QUICK.search_step == 0 and f.prefix > 0
        assert 1 <= f.microbatch <= QUICK.microbatch
        if f.mode == "flat":
            assert f.judged == "measured" and f.measured is not None
        elif (f.branches, f.suffix, f.depth) in QUICK.confirm:
            assert f.judged in ("confirmed", "corrected") and f.measured is not None
            assert f.prefix <= f.predicted_prefix
        else:
            assert f.judged == "predicted" and f.measured is None
        if f.measured is not None:  # every measured answer really fits
            assert f.measured.total <= QUICK.memory_limit
    md = (tmp_path / "geometry.md").read_text()
    for heading in ("## Speed", "## Peak memory by lifetime class", "## Longest prefix", "## Targets"):
        assert heading in md
    speed = md.split("## Speed")[1].split("Every repetition")[0]
    speed_rows = [line for line in speed.splitlines() if line.startswith("| ")]
    assert len(speed_rows) == 1 + len(points)  # header + one row per point
    for name in ("speedup.png", "memory.png", "longest_prefix.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG
    assert to_json(from_json(to_json(results))) == to_json(results)


# ----- targets on hand-made results ---------------------------------------------------------------------------
CFG = BenchConfig(prefixes=(2048,), branches=(2, 8), suffixes=(64,), depths=(1,), microbatch=4)
MIB = 1 << 20


def _mode(mode: Mode, seconds: float, cost: int, total: int, graph: int = 0) -> ModeResult:
    peak = ClassBytes(temporary=total)
    return ModeResult(mode, (seconds,), cost, cost, peak, peak, graph)


def _results(exact_seconds: float, g8_exact_bytes: int, exact_longest: int) -> BenchResults:
    points = []
    for g in (2, 8):
        exact_bytes = g8_exact_bytes if g == 8 else 10 * MIB
        points.append(
            PointResult(
                GridPoint(2048, g, 64, 1),
                (
                    _mode("flat", 8.0, 800, 100 * MIB),
                    _mode("exact", exact_seconds, 200, exact_bytes, graph=MIB),
                    _mode("response_only", 1.0, 100, 10 * MIB, graph=MIB),
                ),
            )
        )
    fits = []
    for g in (2, 8):
        fits.append(PrefixFit(g, 64, 1, "flat", 1, 1000, False, "measured", 1000, ClassBytes()))
        fits.append(
            PrefixFit(g, 64, 1, "exact", 4, exact_longest, False, "predicted", exact_longest, ClassBytes())
        )
        fits.append(
            PrefixFit(g, 64, 1, "response_only", 4, 100_000, True, "predicted", 100_000, ClassBytes())
        )
    machine = Machine("cmd", "2026-01-01", "test", "0", 1, 1.0)
    return BenchResults(CFG, machine, tuple(points), tuple(fits))


def test_targets_pass_on_good_results() -> None:
    good = _results(exact_seconds=2.0, g8_exact_bytes=12 * MIB, exact_longest=9000)
    checks = all_checks(good)
    assert checks and all(c.met for c in checks)
    assert [c.value for c in speed_checks(good)] == pytest.approx([1.0, 1.0])  # 8/2 = 4 = ceiling 800/200


def test_targets_catch_each_kind_of_miss() -> None:
    slow = _results(exact_seconds=4.0, g8_exact_bytes=12 * MIB, exact_longest=9000)
    missed = [c for c in speed_checks(slow) if not c.met]
    assert [c.where for c in missed] == ["P=2048 G=8 S=64 d=1 exact"]
    assert missed[0].value == pytest.approx(0.5)
    fat = _results(exact_seconds=2.0, g8_exact_bytes=15 * MIB, exact_longest=9000)  # +5 MiB > K=4 graphs
    assert [c.met for c in memory_checks(fat)] == [False, True]
    short = _results(exact_seconds=2.0, g8_exact_bytes=12 * MIB, exact_longest=4000)  # 4000 < 8 x 1000
    by_where = {c.where: c.met for c in budget_checks(short)}
    assert by_where == {
        "G=2 S=64 d=1 exact": True,
        "G=2 S=64 d=1 response_only": True,
        "G=8 S=64 d=1 exact": False,
        "G=8 S=64 d=1 response_only": True,
    }


def test_result_file_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="not a geometry benchmark result file"):
        from_json('{"config": {}}')
    good = _results(exact_seconds=2.0, g8_exact_bytes=12 * MIB, exact_longest=9000)
    assert from_json(to_json(good)) == replace(good)


def test_growth_target_compares_peak_growth_with_resident_bytes_per_token() -> None:
    cfg = BenchConfig(prefixes=(2048, 8192), branches=(8,), suffixes=(64,), depths=(1,))
    kv = resident_per_token(cfg, "response_only")
    assert resident_per_token(cfg, "exact") == 2 * kv  # G doubles the resident bytes
    grow = {"flat": 50 * 1024, "exact": int(1.2 * 2 * kv), "response_only": 2 * kv}  # bytes per token
    points = []
    for prefix in (2048, 8192):
        modes = tuple(
            _mode(m, 1.0, 100, 10 * MIB + (prefix - 2048) * grow[m])
            for m in ("flat", "exact", "response_only")
        )
        points.append(PointResult(GridPoint(prefix, 8, 64, 1), modes))
    machine = Machine("cmd", "2026-01-01", "test", "0", 1, 1.0)
    checks = {c.where: c for c in growth_checks(BenchResults(cfg, machine, tuple(points), ()))}
    assert (
        checks["G=8 S=64 d=1 exact"].value == pytest.approx(1.2, rel=1e-3)
        and checks["G=8 S=64 d=1 exact"].met
    )
    assert checks["G=8 S=64 d=1 response_only"].value == pytest.approx(2.0)
    assert not checks["G=8 S=64 d=1 response_only"].met  # 2x its KV per token: missed
    assert checks["G=8 S=64 d=1 flat"].met  # flat has nothing resident: shown, never graded
    lines = check_lines(tuple(checks.values()))
    assert lines[0] == "- **growth**: 1 of 2 met."
    assert any("response_only" in line and "2.00x" in line for line in lines)
