"""The trainer names no inference engine: `treetrain/train/` holds the loop, the config and the run directory,
and reaches the rollout only through its tree sources (`treetrain.rollout.sources`).

Read from the source, as `test_layers.py` reads imports: no module of `treetrain/train/` imports an engine
module (the engine-neutral `GenerationEngine` interface excepted), names vLLM, or reads an engine setting
(`rollout.engine`, `rollout.vllm`, `rollout.hf_kv_budget`) or the engine factory's `EngineSpec`. The negative
control plants each kind of mention in a module's text and checks that it is found.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALLOWED_ENGINE_MODULES = {"treetrain.rollout.engines.generation"}
"""The interface every engine implements, naming none of them (the evaluator samples on whichever it gets)."""
NAMES = re.compile(r"vllm|\.engine\b|hf_kv_budget|EngineSpec|make_engine|engine_spec|\bhf\b", re.IGNORECASE)
"""Words that name an engine or its settings: vLLM, `cfg.rollout.engine`, the `hf` engine, the factory."""


def mentions(source: str) -> list[str]:
    """Each import of an engine module and each line that names an engine or its settings."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = (
            [node.module]
            if isinstance(node, ast.ImportFrom) and node.module
            else [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else []
        )
        found += [
            f"imports {n}"
            for n in names
            if n.startswith("treetrain.rollout.engines") and n not in ALLOWED_ENGINE_MODULES
        ]
    found += [line.strip() for line in source.splitlines() if NAMES.search(line)]
    return found


def test_no_trainer_module_names_an_inference_engine() -> None:
    bad = {
        str(p.relative_to(ROOT)): hits
        for p in sorted((ROOT / "treetrain" / "train").rglob("*.py"))
        if (hits := mentions(p.read_text(encoding="utf-8")))
    }
    assert not bad, bad


def test_the_check_finds_each_kind_of_mention() -> None:
    """Negative control: each planted mention is found, and the engine-neutral interface is not one."""
    planted = (
        "from treetrain.rollout.engines.factory import make_engine",
        "import treetrain.rollout.engines.vllm_engine",
        "urls = cfg.rollout.vllm.urls",
        "if cfg.rollout.engine == 'x': pass",
        "budget = cfg.rollout.hf_kv_budget",
        "# the `hf` sampler's process",
    )
    for line in planted:
        assert mentions(line), line
    assert not mentions("from treetrain.rollout.engines.generation import GenerationEngine")
    assert not mentions("engine = None  # the replay engine")
