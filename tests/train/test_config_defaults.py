"""Every section's defaults are the documented ones, whichever of its fields a config sets.

A section built from a file or `--set` gets the section class's own defaults for the fields left out, while
`TrainConfig()` (and so docs/configuration.md) may construct the section with other values
(`field(default_factory=lambda: Section(lr=...))`). Then one override silently moves every other field of
the section. This test reads the documented defaults from docs/configuration.md, sets each field alone to
its documented value, and checks every field of its section against the page. The negative control is a
small config with exactly that split, rendered by the same generator.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from treetrain.train.config import TrainConfig, load_config
from treetrain.train.config_docs import _sections, renamed_keys, render, section_table
from treetrain.train.typed import apply_override, from_dict, to_dict

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\| `(?P<key>[^`]+)` \| (?:[^|`\\]|\\\|)* \| `(?P<default>[^`]*)` \|", re.MULTILINE)


def documented_defaults(page: str) -> dict[str, Any]:
    """Key -> default value (JSON) of every row of the page's field tables."""
    return {m["key"]: json.loads(m["default"]) for m in ROW.finditer(page)}


def _at(tree: Any, key: str) -> Any:
    for part in key.split("."):
        tree = tree[part]
    return tree


def drift(documented: Mapping[str, Any], load: Callable[[str], Any]) -> list[str]:
    """For every documented key set alone to its documented value, the fields of its section that then
    differ from the page ('optim.grad_clip set alone: optim.lr is 1e-06, documented 3e-05')."""
    problems = []
    for key, value in documented.items():
        section = key.rpartition(".")[0]
        resolved = to_dict(load(f"{key}={json.dumps(value)}"))
        for other, want in documented.items():
            if other.rpartition(".")[0] == section and _at(resolved, other) != want:
                problems.append(f"{key} set alone: {other} is {_at(resolved, other)!r}, documented {want!r}")
    return problems


def test_the_page_lists_every_section() -> None:
    """The parser reads the page: every section of the config has rows, optional ones (model.lora) too."""
    page = (ROOT / "docs" / "configuration.md").read_text()
    documented = documented_defaults(page)
    sections = {key.rpartition(".")[0] for key in documented}
    assert {"", "optim", "model", "model.lora", "rollout.fanout", "replay", "loss", "eval"} <= sections
    assert documented["optim.lr"] == 3e-05 and documented["optim.betas"] == [0.9, 0.99]
    assert len(documented) == page.count("\n| `") - len(renamed_keys(TrainConfig))  # every field row read


def test_one_override_keeps_every_other_default_of_its_section() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == render()  # the page is the typed config's (tests/project/test_docs.py says so too)
    assert drift(documented_defaults(page), lambda o: load_config(None, [o])) == []


def test_a_config_file_that_sets_one_optim_field(tmp_path: Path) -> None:
    """The case that was reported: a file setting only optim.weight_decay keeps the documented rate."""
    path = tmp_path / "wd.yaml"
    path.write_text("optim:\n  weight_decay: 0.1\n")
    cfg = load_config(path)
    assert (cfg.optim.lr, cfg.optim.betas, cfg.optim.weight_decay) == (3e-05, (0.9, 0.99), 0.1)
    assert cfg.optim == load_config(None, ["optim.weight_decay=0.1"]).optim
    assert cfg.optim.lr == TrainConfig().optim.lr


@dataclass(frozen=True)
class _Inner:
    lr: float = 1e-6
    """Learning rate."""
    clip: float = 1.0
    """Clip."""


@dataclass(frozen=True)
class _Outer:
    steps: int = 1
    """Steps."""
    inner: _Inner = field(default_factory=lambda: _Inner(lr=3e-5))
    """The split: the outer default is not the section class's."""


def test_negative_control_a_split_default_is_caught() -> None:
    page = "\n".join([section_table(_Outer, _Outer(), ""), *_sections(_Outer, _Outer(), "")])
    documented = documented_defaults(page)
    assert documented == {"steps": 1, "inner.lr": 3e-5, "inner.clip": 1.0}

    def load(override: str) -> Any:
        data: dict[str, Any] = {}
        apply_override(data, override)
        return from_dict(_Outer, data)

    problems = drift(documented, load)
    assert problems == ["inner.clip set alone: inner.lr is 1e-06, documented 3e-05"]


@pytest.mark.parametrize("override", ["optim.grad_clip=1.0", "optim.weight_decay=0.0", "optim.name=adamw"])
def test_print_config_is_unchanged_by_an_override_to_the_default(override: str) -> None:
    assert to_dict(load_config(None, [override])) == to_dict(load_config(None))
