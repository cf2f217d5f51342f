"""Lazy matplotlib import with a clear message when the plotting extra is not installed."""

from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """`matplotlib.pyplot`, imported on first use. Raises ImportError naming the extra to install."""
    try:
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "treetrain.viz plots need matplotlib; install the viz extra: pip install 'treetrain[viz]'"
        ) from exc
    return plt


def use_file_backend() -> None:
    """Switch to the non-interactive Agg backend (scripts that only write PNG files)."""
    import matplotlib

    matplotlib.use("Agg")
