"""The sampler gap of an update window is over every rank's tokens: ranks simulated by threads
(tests/support/fake_world.py) report the same gap as one process, though each replays only its share."""

from __future__ import annotations

import pytest
from support.dist_cases import OPTIMIZER, groups, make_model, settings, update
from support.fake_world import ThreadRankBackend, ThreadWorld

from treetrain.distributed import TorchBackend, round_robin
from treetrain.memory.overrides import Mode
from treetrain.update.learner import Learner
from treetrain.update.window_types import WindowReport


@pytest.mark.parametrize("mode", ["tree", "flat"])
def test_ranks_report_the_gap_of_the_whole_update(mode: Mode) -> None:
    cfg = settings(mode, None if mode == "flat" else 0)
    one = update(Learner(TorchBackend(make_model(), OPTIMIZER)), groups(), cfg)
    assert one.sampler_gap.tokens > 0 and one.sampler_gap == one.local.sampler_gap

    world = ThreadWorld(2)
    trees = [t for g in groups() for t in g.trees]

    backends = [
        ThreadRankBackend(world, r, make_model(), OPTIMIZER) for r in range(world.size)
    ]  # seeded: not in threads

    def rank(r: int):
        def fn() -> WindowReport:
            return update(Learner(backends[r]), groups(), cfg, placement=round_robin(trees, world.size))

        return fn

    reports = world.run([rank(r) for r in range(world.size)])
    for report in reports:
        assert isinstance(report, WindowReport), report
        total = report.sampler_gap
        assert total.tokens == one.sampler_gap.tokens
        assert total.mean == pytest.approx(one.sampler_gap.mean, rel=1e-9)
        assert total.max == pytest.approx(one.sampler_gap.max, rel=1e-9)
        # negative control: each rank alone saw only part of the tokens
        assert 0 < report.local.sampler_gap.tokens < total.tokens
    assert sum(r.local.sampler_gap.tokens for r in reports) == one.sampler_gap.tokens  # type: ignore[union-attr]
