"""Suite-wide settings. Tiny models run fastest single-threaded; with several test processes (the
distributed tests) on two cores, more threads only contend."""

from __future__ import annotations

import os

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)
