"""Where tree mode stops helping: token-ceiling speedup over prefix length x G x suffix length.

Each cell is a synthetic group (`synthetic_group`: one P-token prompt, G trajectories, S tokens after the
prompt spread over `depth` turns) and its `TreeStats` costs (docs/design.md, token-ceiling cost model): flat's
cost over the contract's. The ceiling ignores attention's quadratic term and every overhead, so it is an
upper bound on the measured speedup; the benchmark (`bench/geometry.py`) reports measured over ceiling.
Tree mode helps where the prompt is long against the responses and G is large; as S grows past P/G
the speedup falls towards 1 (`exact`) or towards 3·(P+S)/(3·S) per trajectory (`response_only`).

Example:
    >>> grid = ceiling_grid(prefixes=(512, 2048), branches=(8,), suffixes=(64,), depth=1)
    >>> grid.speedup("exact").round(2).tolist(), grid.speedup("response_only").round(2).tolist()
    ([[[3.86], [5.21]]], [[[6.75], [14.15]]])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from treetrain.replay.schedule import Contract
from treetrain.tree.stats import tree_stats
from treetrain.tree.synthetic import synthetic_group

CONTRACTS: tuple[Contract, ...] = ("exact", "response_only")


@dataclass(frozen=True)
class CeilingGrid:
    """Token-ceiling speedups against flat, indexed `[G, prefix, suffix]`."""

    prefixes: tuple[int, ...]
    branches: tuple[int, ...]
    suffixes: tuple[int, ...]
    depth: int
    scoring: bool
    """Whether a scoring pass is counted (T for flat, U for the tree modes)."""
    exact: np.ndarray  # [G, P, S]
    response_only: np.ndarray  # [G, P, S]

    def speedup(self, contract: Contract) -> np.ndarray:
        if contract == "exact":
            return self.exact
        if contract == "response_only":
            return self.response_only
        raise ValueError(f"contract must be one of {CONTRACTS}, got {contract!r}")


def ceiling_grid(
    prefixes: Sequence[int],
    branches: Sequence[int],
    suffixes: Sequence[int],
    *,
    depth: int = 1,
    scoring: bool = False,
) -> CeilingGrid:
    """Build one synthetic tree per cell and take its token-ceiling speedups."""
    shape = (len(branches), len(prefixes), len(suffixes))
    exact, ro = np.zeros(shape), np.zeros(shape)
    for gi, g in enumerate(branches):
        for pi, p in enumerate(prefixes):
            for si, s in enumerate(suffixes):
                tree = synthetic_group(
                    prefix=p, branches=g, suffix=s, depth=depth, seed=0, with_logprobs=False
                )
                st = tree_stats(tree)
                flat = st.cost_flat(scoring)
                exact[gi, pi, si] = flat / max(1, st.cost_exact(scoring))
                ro[gi, pi, si] = flat / max(1, st.cost_response_only(scoring))
    return CeilingGrid(tuple(prefixes), tuple(branches), tuple(suffixes), depth, scoring, exact, ro)


@dataclass(frozen=True)
class MeasuredPoint:
    """A benchmarked speedup against flat, drawn over the matching heatmap cell."""

    prefix: int
    branches: int
    suffix: int
    depth: int
    contract: Contract
    speedup: float


def plot_ceiling_heatmaps(
    grid: CeilingGrid,
    *,
    measured: Sequence[MeasuredPoint] = (),
    levels: Sequence[float] = (1.25, 2.0, 4.0),
    fig: Any = None,
) -> Any:
    """One heatmap per (contract, G): prefix down, suffix across, colour = ceiling speedup (log scale).

    Contour lines mark `levels` (below the first, tree mode barely pays for its bookkeeping). A measured
    point at a cell's exact geometry is printed under the ceiling as `m=...`. Returns the figure.
    """
    from matplotlib.colors import LogNorm

    from treetrain.viz._mpl import pyplot

    plt = pyplot()
    rows, cols = len(CONTRACTS), len(grid.branches)
    if fig is None:
        fig = plt.figure(figsize=(3.4 * cols + 1.2, 3.0 * rows + 0.6))
    axes = fig.subplots(rows, cols, squeeze=False)
    top = max(float(grid.exact.max()), float(grid.response_only.max()), 1.01)
    norm = LogNorm(vmin=1.0, vmax=top)
    image = None
    lookup = {
        (m.contract, m.branches, m.prefix, m.suffix): m.speedup for m in measured if m.depth == grid.depth
    }
    for r, contract in enumerate(CONTRACTS):
        values = grid.speedup(contract)
        for c, g in enumerate(grid.branches):
            ax = axes[r][c]
            cell = values[c]  # [P, S]
            image = ax.imshow(cell, cmap="viridis", norm=norm, origin="lower", aspect="auto")
            if len(grid.prefixes) > 1 and len(grid.suffixes) > 1:
                cs = ax.contour(cell, levels=sorted(levels), colors="white", linewidths=0.8)
                ax.clabel(cs, fmt=lambda v: f"{v:g}×", fontsize=7)
            for pi, p in enumerate(grid.prefixes):
                for si, s in enumerate(grid.suffixes):
                    text = f"{cell[pi, si]:.1f}"
                    m = lookup.get((contract, g, p, s))
                    if m is not None:
                        text += f"\nm={m:.1f}"
                    shade = "black" if norm(cell[pi, si]) > 0.6 else "white"
                    ax.text(si, pi, text, ha="center", va="center", fontsize=6.5, color=shade)
            ax.set_xticks(range(len(grid.suffixes)), [str(s) for s in grid.suffixes], fontsize=7)
            ax.set_yticks(range(len(grid.prefixes)), [str(p) for p in grid.prefixes], fontsize=7)
            ax.set_title(f"{contract}, G={g}", fontsize=9)
            if r == rows - 1:
                ax.set_xlabel("suffix tokens S")
            if c == 0:
                ax.set_ylabel("prefix tokens P")
    what = "with a scoring pass" if grid.scoring else "no scoring pass"
    fig.suptitle(f"token-ceiling speedup against flat (depth {grid.depth}, {what})", fontsize=10)
    fig.colorbar(image, ax=axes, shrink=0.85, label="speedup ×")
    return fig


@dataclass(frozen=True)
class HelpfulSuffixes:
    """For each (prefix, G) of a grid, the longest suffix on the grid whose ceiling reaches `threshold`."""

    contract: Contract
    threshold: float
    prefixes: tuple[int, ...]
    branches: tuple[int, ...]
    suffix: np.ndarray  # [P, G] int, 0 where no suffix on the grid reaches the threshold

    def markdown(self) -> str:
        head = "| P | " + " | ".join(f"G={g}" for g in self.branches) + " |"
        lines = [head, "|" + "---|" * (len(self.branches) + 1)]
        for pi, p in enumerate(self.prefixes):
            cells = [str(int(s)) if s else "none" for s in self.suffix[pi]]
            lines.append(f"| {p} | " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def _repr_markdown_(self) -> str:
        return self.markdown()


def largest_helpful_suffix(grid: CeilingGrid, contract: Contract, threshold: float = 1.25) -> HelpfulSuffixes:
    """The longest grid suffix at which `contract`'s ceiling speedup is still >= `threshold`.

    Example:
        >>> grid = ceiling_grid(prefixes=(1024,), branches=(2, 8), suffixes=(64, 512, 4096))
        >>> print(largest_helpful_suffix(grid, "exact", 1.25).markdown())
        | P | G=2 | G=8 |
        |---|---|---|
        | 1024 | 512 | 512 |
    """
    values = grid.speedup(contract)  # [G, P, S]
    out = np.zeros((len(grid.prefixes), len(grid.branches)), dtype=np.int64)
    for gi in range(len(grid.branches)):
        for pi in range(len(grid.prefixes)):
            ok = [s for si, s in enumerate(grid.suffixes) if values[gi, pi, si] >= threshold]
            out[pi, gi] = max(ok, default=0)
    return HelpfulSuffixes(contract, threshold, grid.prefixes, grid.branches, out)
