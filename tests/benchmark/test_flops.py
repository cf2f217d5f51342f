"""The benchmark's FLOP ceiling: the token ceiling with attention priced in, and the reduced grids."""

from __future__ import annotations

import pytest

from treetrain.benchmark.bench_config import MODES, REAL_LAYER, TARGETS
from treetrain.benchmark.flops import FlopModel, flop_ceiling
from treetrain.benchmark.workload import bench_model
from treetrain.tree.stats import tree_stats
from treetrain.tree.synthetic import synthetic_group


@pytest.mark.parametrize("depth", [1, 3])
def test_without_attention_the_flop_ceiling_is_the_token_ceiling(depth: int) -> None:
    tree = synthetic_group(prefix=100, branches=4, suffix=12, depth=depth, vocab=64, seed=0)
    stats = tree_stats(tree)
    tokens = {
        "flat": stats.cost_flat(),
        "exact": stats.cost_exact(),
        "response_only": stats.cost_response_only(),
    }
    for mode in MODES:
        assert flop_ceiling(tree, mode, FlopModel(1.0, 0.0)) == tokens[mode]


def test_attention_lowers_the_ceiling_speedup_where_the_past_is_long() -> None:
    """Flat pays each branch's attention over the prompt too, but the tree modes keep paying the prompt's
    own quadratic attention: with attention priced in, the ceiling speedup of response_only drops."""
    tree = synthetic_group(prefix=4096, branches=8, suffix=64, depth=1, vocab=64, seed=0)
    linear_only, with_attention = FlopModel(1e6, 0.0), FlopModel(1e6, 2e3)

    def speedup(fm: FlopModel) -> float:
        return flop_ceiling(tree, "flat", fm) / flop_ceiling(tree, "response_only", fm)

    assert speedup(with_attention) < speedup(linear_only)
    # Hand count for one token at position 9: linear + 10 keys.
    assert FlopModel(5.0, 1.0).forward(length=1, start=9) == 15.0


def test_flop_model_of_a_real_size_layer() -> None:
    spec = REAL_LAYER.model
    assert (spec.hidden_size, spec.num_heads, spec.num_kv_heads) == (2048, 16, 2)
    fm = FlopModel.of(bench_model(TARGETS.model))  # the benchmark model: 4 heads of 64, 2 layers
    assert fm.attention_per_key == 4 * 4 * 64 * 2
    assert fm.linear_per_token > 0
    assert TARGETS.shapes() == ((8, 64, 1),) and REAL_LAYER.shapes() == ()
