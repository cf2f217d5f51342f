"""The trainer's current weights as a safetensors directory that a `vllm serve` process reloads.

`write_weights(model, root)` writes `root/current/` atomically (a complete new directory replaces the
complete old one): one `model-NNNNN.safetensors` file per bucket of `treetrain.rollout.engines.weight_buckets`, so a
ZeRO-3 model is never gathered whole. The servers read it during the reload call, before the next write,
and may run as another user: the files are made 0644 and the directories 0755 whatever the umask (the
safetensors writer creates its files 0600).

Example:
    >>> import tempfile, torch
    >>> path = write_weights(torch.nn.Linear(2, 2), tempfile.mkdtemp())
    >>> sorted(p.name for p in path.iterdir())
    ['model-00000.safetensors']
    >>> oct(next(path.iterdir()).stat().st_mode & 0o777), oct(path.stat().st_mode & 0o777)
    ('0o644', '0o755')
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from treetrain.io import atomic_directory
from treetrain.rollout.engines.weight_buckets import weight_buckets


def write_weights(model: Any, root: str | Path, name: str = "current") -> Path:
    """Write the weights under `root/name/` (`name` may have folders of its own) and return that
    directory."""
    final = Path(root) / name
    final.parent.mkdir(parents=True, exist_ok=True)
    for folder in {Path(root), final.parent}:  # the servers may run as another user
        folder.chmod(0o755)
    with atomic_directory(final) as tmp:
        tmp.chmod(0o755)
        for i, bucket in enumerate(weight_buckets(model)):
            tensors = {key: t.detach().cpu().clone() for key, t in bucket}  # tied weights share storage
            file = Path(tmp) / f"model-{i:05d}.safetensors"
            save_file(tensors, str(file), metadata={"format": "pt"})
            file.chmod(0o644)
    return final
