"""Suite-wide settings. Tiny models run fastest single-threaded; with several test processes (the
distributed tests) on two cores, more threads only contend."""

from __future__ import annotations

import os

import torch
from hypothesis import settings

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)

# CI gates on the suite, so its fuzzing is reproducible: the same examples on every machine and run.
# Search for new cases with `pytest --hypothesis-profile=explore`: fresh random examples on each run.
settings.register_profile("reproducible", derandomize=True, deadline=None, database=None)
settings.register_profile("explore", deadline=None)
settings.load_profile("reproducible")
