"""Every `treetrain train` command the README and docs/ show passes the checks a run makes at start.

A page's Python blocks run in tests/project/test_docs.py; its shell commands are read here. Each command is
parsed with the CLI's own parser and its settings go through `check_model` (the environment, the template,
the tokenizer against the vocabulary, the episode budget against the context, the engine's support probes:
everything `treetrain train` refuses before its first rollout), so an example a reader copies is not
refused at once. Commands that name something only a reader has (their config file, checkpoint, task
file, package, server or run directory) are skipped by that name, and the test checks that most are run.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from support.pages import FENCE

from treetrain.cli.main import build_parser
from treetrain.train.config import load_config
from treetrain.train.model_check import check_model

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
LAUNCH = re.compile(r"(?:^|\s)(?:treetrain|-m treetrain|--module treetrain) train(?:\s|$)")
READERS_OWN = (
    "/path/to/", "tasks.jsonl", "my_pkg", "bank_env", "http://", "runs/lora/final", "--resume",
    "--trees", "/shared/",
)  # fmt: skip
"""What only a reader has; the docs/models.md commands run in tests/project/test_models_page.py. `my.yaml` is
not among them: the pages make it with `treetrain train --print-config > my.yaml`, the defaults."""


def _commands() -> list[tuple[str, str]]:
    """(page, the arguments after `train`) for every `treetrain train` line of a shell block."""
    found = []
    for page in PAGES:
        if page.name == "models.md":
            continue
        for lang, body in FENCE.findall(page.read_text()):
            if lang not in ("bash", "sh", "shell", "console"):
                continue
            for line in body.replace("\\\n", " ").splitlines():
                line = re.sub(r"\s#.*$", "", line).strip()
                match = LAUNCH.search(line)
                if match and not line.startswith("make"):
                    args = re.split(r"\s[>|]\s", line[match.end() :])[0]  # a redirection or a pipe ends it
                    found.append((page.name, args.strip()))
    return found


COMMANDS = _commands()
CHECKED = [c for c in COMMANDS if not any(own in c[1] for own in (*READERS_OWN, "--print-config"))]
"""The commands checked: not those naming what only a reader has, nor `--print-config` (the defaults)."""


def test_most_commands_are_checked() -> None:
    assert len(COMMANDS) >= 40 and len(CHECKED) >= 22, (len(COMMANDS), len(CHECKED))


@pytest.mark.parametrize(("page", "args"), CHECKED, ids=[f"{p}:{a[:60]}" for p, a in CHECKED])
def test_a_documented_train_command_passes_the_start_checks(page: str, args: str) -> None:
    parsed = build_parser().parse_args(["train", *shlex.split(args)])
    overrides = list(parsed.overrides) + ([f"updates={parsed.updates}"] if parsed.updates else [])
    check_model(load_config(None if parsed.config == "my.yaml" else parsed.config, overrides))


def test_the_check_refuses_a_command_past_the_models_context() -> None:
    """The control: the demo model's 1024-token context against an 8192-token episode budget."""
    from treetrain.errors import ConfigError

    with pytest.raises(ConfigError, match="longer than the model's context"):
        check_model(load_config(None, ["rollout.episode.max_episode_tokens=8192"]))
