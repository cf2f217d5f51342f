"""Hostile tokenizer directories, as a class, for every verb that takes one (`inspect --tokenizer`, `plan`,
`train`): each is refused in one line naming the file, before transformers reads it, never a traceback and
never a suggestion to pass `trust_remote_code`. The intact copy of each case loads (the negative control:
the check refuses what is hostile, not everything)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from support.tree_samples import TINY_BYTES

from treetrain.assets import tokenizer_path
from treetrain.cli.main import main
from treetrain.models.tokenizer_files import (
    MAX_JSON_DEPTH,
    MAX_TOKENIZER_FILE_BYTES,
    TokenizerFileError,
    check_tokenizer_dir,
    json_depth,
)


def _edit_json(name: str, change: Callable[[dict], object]) -> Callable[[Path], str]:
    def make(d: Path) -> str:
        path = d / name
        data = json.loads(path.read_text()) if path.exists() else {}
        change(data)
        path.write_text(json.dumps(data))
        return name

    return make


def _write(name: str, text: str) -> Callable[[Path], str]:
    def make(d: Path) -> str:
        (d / name).unlink(missing_ok=True)
        (d / name).write_text(text)
        return name

    return make


def _replace(name: str, how: Callable[[Path], None]) -> Callable[[Path], str]:
    def make(d: Path) -> str:
        (d / name).unlink(missing_ok=True)
        how(d / name)
        return name

    return make


def _sparse(path: Path) -> None:
    with open(path, "wb") as f:
        f.truncate(MAX_TOKENIZER_FILE_BYTES + 1)


def _nested(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


CASES: dict[str, Callable[[Path], str]] = {
    "unknown model type": _edit_json("tokenizer.json", lambda t: t["model"].update(type="Quantum")),
    "no model": _edit_json("tokenizer.json", lambda t: t.pop("model")),
    "no added_tokens": _edit_json("tokenizer.json", lambda t: t.pop("added_tokens")),
    "added_tokens not a list": _edit_json("tokenizer.json", lambda t: t.update(added_tokens={"a": 1})),
    "config nested 100k deep": _write("tokenizer_config.json", "[" * 100_000 + "]" * 100_000),
    "config nested past the limit": _write("tokenizer_config.json", _nested(MAX_JSON_DEPTH + 5)),
    "special tokens map nested": _write("special_tokens_map.json", _nested(500)),
    "config not an object": _write("tokenizer_config.json", "[1, 2]"),
    "config not UTF-8": _replace("tokenizer_config.json", lambda p: p.write_bytes(b'{"a": "\xff"}')),
    "config not JSON": _write("tokenizer_config.json", "{'single': quotes}"),
    "tokenizer.json a FIFO": _replace("tokenizer.json", lambda p: os.mkfifo(p)),
    "tokenizer.json is /dev/zero": _replace("tokenizer.json", lambda p: p.symlink_to("/dev/zero")),
    "tokenizer.json a directory": _replace("tokenizer.json", lambda p: p.mkdir()),
    "merges.txt a FIFO": _replace("merges.txt", lambda p: os.mkfifo(p)),
    "chat template a FIFO": _replace("chat_template.jinja", lambda p: os.mkfifo(p)),
    "tokenizer.json too large": _replace("tokenizer.json", _sparse),
    "auto_map in tokenizer_config": _edit_json(
        "tokenizer_config.json", lambda c: c.update(auto_map={"AutoTokenizer": ["evil.Tok", None]})
    ),
    "auto_map in config.json": _edit_json(
        "config.json", lambda c: c.update(auto_map={"AutoConfig": "evil.C"})
    ),
    "auto_map with a custom class": _edit_json(
        "tokenizer_config.json",
        lambda c: c.update(
            tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": ["evil.EvilTokenizer", None]}
        ),
    ),
}


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """case -> (tokenizer directory, the file that makes it hostile)."""
    root = tmp_path_factory.mktemp("tokenizers")
    out = {}
    for k, (case, make) in enumerate(sorted(CASES.items())):
        d = root / f"tok{k:02d}"
        shutil.copytree(tokenizer_path(), d)
        out[case] = (d, make(d))
    return out


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], verb: str, named: str, case: str) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    assert code == 2, f"{case}: {verb} exited {code}\n{err[-2000:]}"
    text = out + err
    assert "Traceback" not in text and "trust_remote_code" not in text, f"{case}: {text[-2000:]}"
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"treetrain {verb}: "), f"{case}: {err!r}"
    assert named in lines[0], f"{case}: does not name {named}: {lines[0]}"


def test_the_check_refuses_every_case_and_passes_the_shipped_tokenizer(
    hostile: dict[str, tuple[Path, str]],
) -> None:
    check_tokenizer_dir(tokenizer_path())  # negative control
    for case, (d, name) in hostile.items():
        with pytest.raises(TokenizerFileError) as info:
            check_tokenizer_dir(d)
        assert str(d / name) in str(info.value), f"{case}: {info.value}"
        assert "\n" not in str(info.value)


@pytest.mark.timeout(240)
def test_every_verb_refuses_every_hostile_tokenizer(
    hostile: dict[str, tuple[Path, str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree = tmp_path / "tiny.msgpack"
    tree.write_bytes(TINY_BYTES)
    for k, (case, (d, name)) in enumerate(sorted(hostile.items())):
        named = str(d / name)
        _refused(capsys, ["inspect", str(tree), "--tokenizer", str(d)], "inspect", named, case)
        tok = ["--set", "model.path=tiny-llama", "--set", f"model.tokenizer={d}"]
        _refused(capsys, ["plan", str(tree), *tok, "--budget", "64MiB"], "plan", named, case)
        _refused(capsys, ["plan", *tok], "plan", named, case)
        argv = ["train", "--no-progress", "--trees", str(tree), "--run-dir", str(tmp_path / f"r{k}"), *tok]
        _refused(capsys, [*argv, "--set", "updates=1"], "train", named, case)
        assert not (tmp_path / f"r{k}").exists(), f"{case}: train left its run directory"
    code = main(["inspect", str(tree), "--tokenizer", str(tokenizer_path())])  # the intact tokenizer loads
    assert code == 0 and "Traceback" not in capsys.readouterr().err


def test_json_depth_counts_without_recursion() -> None:
    assert json_depth(1) == 0 and json_depth([]) == 1 and json_depth({"a": [1, {"b": []}]}) == 4
    deep: list[object] = []
    for _ in range(10_000):
        deep = [deep]
    assert json_depth(deep) == 10_001
