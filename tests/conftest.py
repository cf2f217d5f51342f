"""Suite-wide settings. Tiny models run fastest single-threaded; with several test processes (the
distributed tests) on two cores, more threads only contend."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
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


@pytest.fixture(scope="session")
def vllm_engine() -> Iterator[Any]:
    """One real vLLM engine (the CPU build in `make test`) on the wide demo model, for the whole session:
    starting one costs about half a minute. Tests that change its weights put the originals back."""
    from treetrain.rollout.engines.engine_settings import VLLMSettings
    from treetrain.rollout.engines.vllm_engine import VLLMEngine
    from treetrain.train.models import WIDE_DEMO_MODEL

    engine = VLLMEngine(str(WIDE_DEMO_MODEL), VLLMSettings(), dtype="float32", max_model_len=1024, seed=0)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One real `vllm serve` (the docs' command, the CPU build in `make test`) on the wide demo model, for
    the whole session: it takes about a minute to start. Yields its base URL; what the tests reload into it
    is whatever a later test reloads next (every use starts with a reload)."""
    from support.vllm_serve import served

    with served(tmp_path_factory.mktemp("vllm-serve") / "server.log") as url:
        yield url
