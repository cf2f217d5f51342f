"""The trainer's current weights as a safetensors directory that a `vllm serve` process reloads.

`write_weights(model, root)` writes `root/current/` atomically (a complete new directory replaces the
complete old one): one `model-NNNNN.safetensors` file per bucket of `treetrain.rollout.engines.weight_buckets`, so a
ZeRO-3 model is never gathered whole. The servers read it during the reload call, before the next write.

Example:
    >>> import tempfile, torch
    >>> path = write_weights(torch.nn.Linear(2, 2), tempfile.mkdtemp())
    >>> sorted(p.name for p in path.iterdir())
    ['model-00000.safetensors']
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from treetrain.io import atomic_directory
from treetrain.rollout.engines.weight_buckets import weight_buckets


def write_weights(model: Any, root: str | Path) -> Path:
    """Write the weights under `root/current/` and return that directory."""
    final = Path(root) / "current"
    final.parent.mkdir(parents=True, exist_ok=True)
    with atomic_directory(final) as tmp:
        for i, bucket in enumerate(weight_buckets(model)):
            tensors = {name: t.detach().cpu().clone() for name, t in bucket}  # tied weights share storage
            save_file(tensors, str(Path(tmp) / f"model-{i:05d}.safetensors"), metadata={"format": "pt"})
    return final
