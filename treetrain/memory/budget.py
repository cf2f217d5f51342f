"""How many bytes a run may plan for on one process: `memory_budget`, or the device's memory.

The planner sizes each update against this budget (`treetrain.update.planning`), and the `hf` rollout
engine's KV cache takes a share of it between updates (`treetrain.rollout.sources.engine_config`); both
read it here, so the two never disagree about what the machine holds.

Example:
    >>> import torch
    >>> memory_budget_bytes("2GiB", torch.device("cpu"))
    2147483648
    >>> memory_budget_bytes(None, torch.device("cpu")) == device_memory(torch.device("cpu"))
    True
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from treetrain.bytesize import parse_bytes


def device_memory(device: torch.device) -> int:
    """Bytes of memory on `device` (CUDA: the card's total; CPU: physical RAM)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def free_memory(device: torch.device) -> int:
    """Bytes `device` has free now (CUDA: the driver's free memory; CPU: available pages, and no more than a
    cgroup's memory limit when the process runs under one)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    free = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            free = min(free, int(text))
    return free


def memory_budget_bytes(setting: str | None, device: torch.device) -> int:
    """`setting` (the config's `memory_budget`, e.g. '8GiB') in bytes; null: all of `device`'s memory."""
    return parse_bytes(setting) if setting else device_memory(device)
