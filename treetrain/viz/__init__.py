"""Views of trees, geometry and memory for notebooks and benchmark reports.

Nothing here imports matplotlib at module import time (it is only in the `viz` and `dev` extras); the
plotting functions import it when called and raise a clear error if it is missing. The table and layout
helpers need no plotting library at all.

- `treetrain.viz.tree_files`: load trees from a tree file, a directory of them, or a run directory;
- `treetrain.viz.layout`: a tidy top-down layout of a tree, computed here (no graphviz);
- `treetrain.viz.draw`: draw a tree (node size by tokens, colour by role or advantage, divergence marks);
- `treetrain.viz.tables`: a per-node table, as markdown or HTML;
- `treetrain.viz.geometry`: token-ceiling speedup grids over prefix x G x suffix, as heatmaps;
- `treetrain.viz.ledger_plot`: a predicted memory timeline by lifetime class, with measured peaks on top.

Example:
    >>> from treetrain.viz.tree_files import load_tree_sources
    >>> [t.name for t in load_tree_sources("trees/tool_use.msgpack")]      # doctest: +SKIP
    ['tool_use']
"""
