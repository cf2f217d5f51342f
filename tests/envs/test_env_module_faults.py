"""Environment modules that fail at import, as a class: they raise, have a syntax error, exit (`sys.exit(0)`,
`sys.exit(3)`, `raise SystemExit`), or import a missing package. Each ends `treetrain train` and `treetrain
plan --model` with a non-zero status and one line naming the module and the error, and the traceback in the
file that line names; no traceback on the console. A module that imports cleanly trains (the negative
control), and a misspelled built-in name is offered its closest match."""

from __future__ import annotations

import itertools
import re
import sys
from pathlib import Path

import pytest

from envs.registry import EnvironmentLoadError, UnknownEnvironmentError, resolve
from treetrain.cli.main import main

GOOD = """
from envs.calculator import CalculatorEnv as Env
"""
FAULTS = {
    "exits 0": ("import sys\nsys.exit(0)\n", "called sys.exit(0)"),
    "exits 3": ("import sys\nsys.exit(3)\n", "called sys.exit(3)"),
    "raises SystemExit": ("raise SystemExit('bye')\n", "called sys.exit('bye')"),
    "raises": ("x = 1\nraise RuntimeError('no database at import')\n", "RuntimeError: no database at import"),
    "divides by zero": ("RATE = 1 / 0\n", "ZeroDivisionError: division by zero"),
    "syntax error": ("def broken(:\n    pass\n", "SyntaxError"),
    "indentation error": ("if True:\nreturn 1\n", "IndentationError"),
    "missing dependency": ("import no_such_dependency_xyz\n", "ModuleNotFoundError: No module named"),
    "bad attribute of a package": ("import os\nos.no_such_thing\n", "AttributeError"),
}
_counter = itertools.count()


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str) -> str:
    name = f"faulty_env_{next(_counter)}_{tmp_path.name[-8:]}".replace("-", "_")
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _one_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # what an exiting module did before: the whole process ended
        code = -1 if exc.code in (0, None) else exc.code  # type: ignore[assignment]
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    return code, lines[-1] if lines else ""


@pytest.mark.timeout(240)
def test_a_module_that_fails_at_import_is_one_line_with_its_traceback_in_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for case, (source, said) in FAULTS.items():
        name = _module(tmp_path, monkeypatch, source)
        for verb, argv in [
            ("train", ["train", "--no-progress", "--run-dir", str(tmp_path / f"run-{name}"),
                       "--set", f"env.name={name}:Env", "--set", "model.path=tiny-llama", "--set", "updates=1"]),
            ("plan", ["plan", "--model", "tiny-llama", "--set", f"env.name={name}:Env"]),
        ]:  # fmt: skip
            code, line = _one_line(capsys, argv)
            assert code == 2, f"{case}: {verb} exited {code}: {line}"
            assert line.startswith(f"treetrain {verb}: "), f"{case}: {line}"
            assert f"environment module {name!r}" in line and said in line, f"{case}: {line}"
            log = Path(re.search(r"traceback in (\S+\.log)", line).group(1))  # type: ignore[union-attr]
            text = log.read_text()
            assert "Traceback (most recent call last)" in text and f"{name}.py" in text, f"{case}: {text}"
            log.unlink()
            assert not (tmp_path / f"run-{name}").exists(), f"{case}: train left a run directory"
        sys.modules.pop(name, None)


def test_a_module_that_imports_cleanly_resolves_and_a_missing_one_names_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = _module(tmp_path, monkeypatch, GOOD)
    assert resolve(f"{name}:Env").__name__ == "CalculatorEnv"  # negative control
    with pytest.raises(EnvironmentLoadError, match=r"cannot load 'no_such_env_module:Env'.*No module named"):
        resolve("no_such_env_module:Env")


def test_a_misspelled_name_is_offered_the_closest_one() -> None:
    for typo, meant in [("calculater", "calculator"), ("lokup", "lookup"), ("Calculator", "calculator")]:
        with pytest.raises(UnknownEnvironmentError, match=f"did you mean {meant!r}"):
            resolve(typo)
    with pytest.raises(UnknownEnvironmentError) as info:
        resolve("zzzzzz")
    assert "did you mean" not in str(info.value) and "Available: calculator" in str(info.value)
