"""Notebook helpers: loading, layout, node tables, advantages per node, ceiling grids and the plots."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import matplotlib
import numpy as np
import pytest

from treetrain.loss.advantages import AdvantageConfig, compute_advantages
from treetrain.tree.format import save_trees
from treetrain.tree.stats import tree_stats
from treetrain.tree.synthetic import synthetic_group
from treetrain.tree.trajectory_tree import ROOT
from treetrain.viz.geometry import MeasuredPoint, ceiling_grid, plot_ceiling_heatmaps
from treetrain.viz.layout import tidy_layout
from treetrain.viz.nodes import node_advantages, node_mean_rewards
from treetrain.viz.tables import node_table, tree_table
from treetrain.viz.tree_files import load_tree_sources, tree_files, tree_groups

matplotlib.use("Agg")
import matplotlib.pyplot as plt

REPO = Path(__file__).resolve().parents[2]
TREES = REPO / "trees"


@pytest.mark.parametrize(
    "name",
    ["treetrain.viz.layout", "treetrain.viz.nodes", "treetrain.viz.tables", "treetrain.viz.geometry"],
)
def test_doctests(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_sources_find_checked_in_trees_and_run_directories(tmp_path: Path) -> None:
    names = [t.name for t in load_tree_sources(TREES)]
    assert names == sorted(p.stem for p in TREES.glob("*.msgpack"))
    # a run directory: trees nested under rollouts/update-XXXXX/trees, one file holding a group of two
    nested = tmp_path / "rollouts" / "update-00000" / "trees"
    nested.mkdir(parents=True)
    group = [synthetic_group(prefix=4, branches=2, suffix=2, seed=s) for s in (0, 1)]
    save_trees(group, nested / "g.msgpack")
    found = load_tree_sources(tmp_path)
    assert [t.name for t in found] == ["rollouts/update-00000/trees/g#0", "rollouts/update-00000/trees/g#1"]
    assert [t.tree.id for t in found] == [t.id for t in group]
    assert tree_files(nested / "g.msgpack") == (nested / "g.msgpack",)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no \*\.msgpack"):
        load_tree_sources(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="missing' does not exist"):
        load_tree_sources(tmp_path / "missing")
    groups = tree_groups(tmp_path)  # planning's view: one group per file
    assert [(name, [t.id for t in trees]) for name, trees in groups] == [
        (str(nested / "g.msgpack"), [t.id for t in group])
    ]
    with pytest.raises(FileNotFoundError, match=r"no \*\.msgpack"):
        tree_groups(tmp_path / "empty")


def test_tidy_layout_never_overlaps_and_centres_parents() -> None:
    tree = load_tree_sources(TREES / "tool_use.msgpack")[0].tree
    pos = tidy_layout(tree)
    leaves = sorted(pos[i][0] for i in tree.leaves())
    assert leaves == [float(i) for i in range(len(leaves))]  # one slot per leaf, in order
    for n in tree.nodes:
        if n.children:
            xs = [pos[c][0] for c in n.children]
            assert pos[n.index][0] == pytest.approx((xs[0] + xs[-1]) / 2)
            assert all(pos[c][1] == pos[n.index][1] - 1 for c in n.children)
        # siblings are ordered left to right and distinct
        assert len({pos[c][0] for c in n.children}) == len(n.children)
    by_tokens = tidy_layout(tree, vertical="tokens", include_root=False)
    assert ROOT not in by_tokens
    assert all(by_tokens[n.index][1] == -n.end for n in tree.nodes[1:])
    with pytest.raises(ValueError, match="vertical"):
        tidy_layout(tree, vertical="sideways")  # type: ignore[arg-type]


def test_node_advantages_average_over_trajectories_through_the_node() -> None:
    tree = synthetic_group(prefix=8, branches=4, suffix=6, depth=2, rewards=[1.0, 0.0, 1.0, 1.0])
    adv = compute_advantages([tree], AdvantageConfig()).trees[0]
    per_node = node_advantages(tree, adv)
    for n in tree.nodes:
        expected = np.mean([adv.at(j, n.index) for j in n.trajectories])
        assert per_node[n.index] == pytest.approx(expected)
    assert per_node[tree.nodes[1].index] == pytest.approx(0.0, abs=1e-9)  # shared by all: mean of GRPO is 0
    assert node_mean_rewards(tree)[1] == pytest.approx(0.75)
    other = synthetic_group(prefix=8, branches=4, suffix=6, depth=2, seed=5)
    with pytest.raises(ValueError, match="advantages are for tree"):
        node_advantages(other, adv)


def test_node_table_rows_match_the_tree() -> None:
    tree = load_tree_sources(TREES / "tool_use.msgpack")[0].tree
    adv = compute_advantages([tree], AdvantageConfig(mode="tree")).trees[0]
    table = node_table(tree, adv)
    assert len(table) == len(tree.nodes) - 1
    assert sum(r.tokens for r in table.rows) == tree_stats(tree).unique_tokens
    assert sum(r.divergence for r in table.rows) == tree_stats(tree).num_divergence_points
    assert all(r.advantage is not None for r in table.rows)
    md = table.markdown(columns=("node", "tokens", "divergence"))
    assert md.splitlines()[0] == "| node | tokens | divergence |"
    assert len(md.splitlines()) == len(tree.nodes) + 1
    html = table._repr_html_()
    assert html.count("<tr>") == len(tree.nodes) and "<th>advantage</th>" in html
    with pytest.raises(ValueError, match="unknown columns"):
        table.markdown(columns=("node", "colour"))
    summary = tree_table(load_tree_sources(TREES))
    long_prefix = next(r for r in summary.rows if r.name == "long_prefix")
    assert long_prefix.trajectories == 16 and long_prefix.ceiling_exact > 1


def test_ceiling_grid_matches_tree_stats_and_the_closed_form() -> None:
    grid = ceiling_grid(prefixes=(100, 400), branches=(2, 8), suffixes=(10, 50), depth=1)
    for gi, g in enumerate(grid.branches):
        for pi, p in enumerate(grid.prefixes):
            for si, s in enumerate(grid.suffixes):
                flat = 3 * g * (p + s)  # docs/design.md: one prompt of P, G responses of S
                assert grid.exact[gi, pi, si] == pytest.approx(flat / (4 * p + 3 * g * s))
                assert grid.response_only[gi, pi, si] == pytest.approx(flat / (p + 3 * g * s))
    assert grid.speedup("exact") is grid.exact
    with pytest.raises(ValueError, match="contract"):
        grid.speedup("flat")  # type: ignore[arg-type]


def test_plots_draw_without_error() -> None:
    tree = load_tree_sources(TREES / "tool_use.msgpack")[0].tree
    adv = compute_advantages([tree], AdvantageConfig()).trees[0]
    from treetrain.viz.draw import draw_tree

    ax = draw_tree(tree)
    assert len(ax.collections) >= 3  # edges, root, nodes
    ax = draw_tree(tree, color_by="advantage", advantages=adv, vertical="tokens")
    with pytest.raises(ValueError, match="needs the tree's advantages"):
        draw_tree(tree, color_by="advantage")
    grid = ceiling_grid(prefixes=(64, 128), branches=(2,), suffixes=(8, 16), depth=1)
    fig = plot_ceiling_heatmaps(grid, measured=[MeasuredPoint(64, 2, 8, 1, "exact", 1.2)])
    texts = [t.get_text() for a in fig.axes for t in a.texts]
    assert any("m=1.2" in t for t in texts)
    plt.close("all")


def test_ledger_plot_stacks_classes_and_marks_measured_peaks() -> None:
    import torch

    from treetrain.lifetime import ClassBytes
    from treetrain.loss.loss_config import LossConfig
    from treetrain.memory.ledger import predict_ledger
    from treetrain.memory.tracker import MeasuredSegment, MemoryTracker
    from treetrain.models.presets import tiny_model
    from treetrain.replay import ReplayConfig, TreeReplay, UpdateBatch
    from treetrain.replay.replay_schedule import ReplayHooks
    from treetrain.viz.ledger_plot import measured_peaks, plot_ledger

    segs = [
        MeasuredSegment("step 0", ClassBytes(), ClassBytes(temporary=5)),
        MeasuredSegment("step 0 backward", ClassBytes(), ClassBytes(temporary=9)),
        MeasuredSegment("step 1", ClassBytes(), ClassBytes(temporary=3)),
    ]
    assert measured_peaks(segs) == {"step 0": 9, "step 1": 3}

    tree = synthetic_group(prefix=24, branches=4, suffix=6, depth=2, vocab=64, rewards=[1.0, 0.0, 0.0, 1.0])
    model = tiny_model("llama", 64, seed=0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    loss, replay = LossConfig(), ReplayConfig(microbatch=2)
    adv = compute_advantages([tree], AdvantageConfig())
    batch = UpdateBatch.build([tree], adv.trees, loss)
    ledger = predict_ledger(batch, model, replay, loss)
    tracker = MemoryTracker()
    TreeReplay(model, loss, replay, hooks=ReplayHooks(tracker=tracker)).accumulate(batch)
    tracker.detach()
    ax = plot_ledger(ledger, measured=tracker.segments, limit=ledger.peak.total)
    bars = [p for p in ax.patches]
    assert len(bars) == 4 * len(ledger.rows)  # one bar per class per row
    top = max(b.get_y() + b.get_height() for b in bars)
    assert top == pytest.approx(ledger.peak.total / 2**20, rel=1e-6)
    dots = [line for line in ax.lines if line.get_marker() == "."]
    peaks = measured_peaks(tracker.segments)
    assert dots and len(dots[0].get_xdata()) == sum(r.label in peaks for r in ledger.rows)
    plt.close("all")


def _leaf_label_boxes(tree: object) -> tuple[list[str], list[object]]:
    from treetrain.viz.draw import draw_tree

    ax = draw_tree(tree)  # type: ignore[arg-type]
    ax.figure.canvas.draw()
    renderer = ax.figure.canvas.get_renderer()  # type: ignore[attr-defined]
    labels = [t for t in ax.texts if t.get_text().startswith("r=")]
    return [t.get_text() for t in labels], [t.get_window_extent(renderer) for t in labels]


def test_leaf_labels_are_rounded_and_never_overlap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rewards such as 0.123456789 print as 0.12, and no two leaves' labels overlap, on trees of many
    narrow leaves; the same check finds overlaps in the labels as they were (the control)."""
    import re

    import treetrain.viz.draw as draw

    rng = np.random.default_rng(0)
    trees = []
    for b, d in [(8, 1), (12, 1), (20, 1), (3, 2), (4, 2)]:
        shape = synthetic_group(prefix=16, branches=b, suffix=4, depth=d, vocab=64, seed=b)
        rewards = list(rng.random(len(shape.records)))
        trees.append(
            synthetic_group(prefix=16, branches=b, suffix=4, depth=d, vocab=64, seed=b, rewards=rewards)
        )

    def overlaps(boxes: list[object]) -> int:
        return sum(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])  # type: ignore[attr-defined]

    for tree in trees:
        texts, boxes = _leaf_label_boxes(tree)
        assert len(texts) == len(tree.leaves())
        assert not any(re.search(r"\d\.\d{3,}", t) for t in texts), texts
        assert overlaps(boxes) == 0, texts
    # the control: six significant digits on one line, as the labels were, overlap on the same trees
    monkeypatch.setattr(draw, "LABEL_LINE", 0.0)
    monkeypatch.setattr(draw, "reward_label", lambda rs: "r=" + ",".join(f"{v:g}" for v in sorted(set(rs))))
    assert sum(overlaps(_leaf_label_boxes(tree)[1]) for tree in trees) > 0
    plt.close("all")


def test_notebook_trees_come_from_the_variable_or_the_shipped_examples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import treetrain.viz.tree_files as tree_files_module
    from treetrain.viz.tree_files import notebook_trees

    assert notebook_trees({"TREETRAIN_TREES": str(tmp_path)}) == tmp_path
    assert notebook_trees({}) == TREES  # the shipped examples, wherever the notebook runs from
    monkeypatch.setattr(tree_files_module, "SHIPPED_TREES", tmp_path / "gone")  # installed without the repo
    with pytest.raises(
        FileNotFoundError, match=r"no trees to show: \$TREETRAIN_TREES is not set.*set TREETRAIN"
    ):
        notebook_trees({})


def test_a_relative_notebook_trees_path_is_read_from_where_jupyter_was_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`TREETRAIN_TREES=runs/demo jupyter lab` from the repository root: the kernel runs in notebooks/,
    and the server hands it the shell's `PWD`; the path is the shell's."""
    from treetrain.viz.tree_files import notebook_trees

    (tmp_path / "runs" / "demo").mkdir(parents=True)
    kernel_dir = tmp_path / "notebooks"
    kernel_dir.mkdir()
    monkeypatch.chdir(kernel_dir)
    env = {"TREETRAIN_TREES": "runs/demo", "PWD": str(tmp_path)}
    assert notebook_trees(env) == tmp_path / "runs" / "demo"
    assert notebook_trees({"TREETRAIN_TREES": "runs/demo"}) == Path(
        "runs/demo"
    )  # no shell directory: as typed
    (kernel_dir / "runs" / "demo").mkdir(parents=True)  # one beside the kernel wins: it is what cwd names
    assert notebook_trees(env) == Path("runs/demo")
    assert notebook_trees({"TREETRAIN_TREES": "elsewhere", "PWD": str(tmp_path)}) == Path("elsewhere")
