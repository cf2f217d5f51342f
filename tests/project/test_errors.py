"""Every error a user can hit is a `TreetrainError`, so one `except` tells bad input from a bug.

The check imports every module of `treetrain/` and `envs/` and looks at each exception class defined there.
Private classes (a leading underscore) and the few listed in `INTERNAL` never reach a user as bad input.
"""

from __future__ import annotations

import ast
import functools
import importlib
import types
from pathlib import Path

import pytest

from treetrain.errors import ConfigError, TreetrainError

ROOT = Path(__file__).resolve().parents[2]

INTERNAL = {
    "treetrain.replay.tree_replay.BackwardFailed": "control flow: a failed backward, judged by its cause and retried",
    "treetrain.replay.resident.StaleResidentStateError": "an invariant of the engine: reading it is a bug",
    "treetrain.train.config_docs.MissingDocstring": "a developer's tool: a config field without a docstring",
    "envs.tools.StepAbandoned": "control flow: injected into a timed-out tool thread to stop it",
    "treetrain.models.attention.PastLayoutError": "control flow: the layer takes the concatenated past instead",
    "treetrain.rollout.engines.cascade.CascadeError": "control flow: the hf engine's probe keeps each row's full KV",
    "envs.wire.WireError": "control flow: a malformed worker reply, reported as the episode's EnvFailure",
    "treetrain.cli.termination.Terminated": "control flow: SIGTERM, taken as an interrupt (a KeyboardInterrupt)",
}
"""Public exception classes that are not bad input, and why."""


@functools.cache
def _modules() -> list[types.ModuleType]:
    """Every module of both packages, found from the files (`treetrain/train` is a namespace package)."""
    paths = sorted([*(ROOT / "treetrain").rglob("*.py"), *(ROOT / "envs").rglob("*.py")])
    names = [".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__") for p in paths]
    return [importlib.import_module(n) for n in names if not n.endswith("__main__")]  # running it is the CLI


def exception_classes(modules: list[types.ModuleType]) -> dict[str, type[BaseException]]:
    """`module.Name` -> every exception class a module defines (not the ones it imports)."""
    return {
        f"{m.__name__}.{name}": value
        for m in modules
        for name, value in vars(m).items()
        if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == m.__name__
    }


def outside_the_base(classes: dict[str, type[BaseException]]) -> list[str]:
    """The public classes that are neither `TreetrainError`s nor listed as internal."""
    return sorted(
        where
        for where, cls in classes.items()
        if not where.rsplit(".", 1)[1].startswith("_")
        and where not in INTERNAL
        and not issubclass(cls, TreetrainError)
    )


def test_every_user_facing_error_derives_from_treetrain_error() -> None:
    classes = exception_classes(_modules())
    assert len(classes) >= 20  # the walk found the modules (TreeFormatError, ConfigError, envs' errors, ...)
    assert outside_the_base(classes) == []


def test_the_internal_list_names_real_classes_outside_the_base() -> None:
    classes = exception_classes(_modules())
    for where in INTERNAL:
        assert where in classes, f"{where} is listed as internal but does not exist"
        assert not issubclass(classes[where], TreetrainError), f"{where} is a TreetrainError: unlist it"


def test_the_check_catches_an_error_outside_the_base() -> None:
    probe = types.ModuleType("treetrain.probe")
    exec(
        "class BadInputError(ValueError): ...\nclass _Private(ValueError): ...\n"
        "from treetrain.errors import TreetrainError\nclass GoodError(TreetrainError, ValueError): ...\n",
        probe.__dict__,
    )
    classes = exception_classes([probe])
    assert sorted(classes) == [
        "treetrain.probe.BadInputError",
        "treetrain.probe.GoodError",
        "treetrain.probe._Private",
    ]
    assert outside_the_base(classes) == ["treetrain.probe.BadInputError"]


def test_errors_keep_their_builtin_base() -> None:
    from envs.registry import UnknownEnvironmentError
    from treetrain.train.rundir import RunDirError
    from treetrain.tree.schema import TreeFormatError

    assert issubclass(ConfigError, ValueError) and issubclass(TreeFormatError, ValueError)
    assert issubclass(RunDirError, RuntimeError) and issubclass(UnknownEnvironmentError, LookupError)


def test_config_error_is_imported_from_one_home() -> None:
    """`treetrain.errors` is the only module `ConfigError` is imported from (no copy, no re-export)."""
    wrong = []
    for path in sorted(
        [*(ROOT / "treetrain").rglob("*.py"), *(ROOT / "envs").rglob("*.py"), *(ROOT / "tests").glob("*.py")]
    ):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module not in ("treetrain.errors", "treetrain")
                and any(alias.name == "ConfigError" for alias in node.names)
            ):
                wrong.append(f"{path.relative_to(ROOT)}: from {node.module}")
    assert wrong == []
    defined = [where for where in exception_classes(_modules()) if where.endswith(".ConfigError")]
    assert defined == ["treetrain.errors.ConfigError"]


def test_the_cli_turns_a_treetrain_error_a_verb_lets_through_into_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import treetrain.cli.inspect as verb
    from treetrain.cli.main import main

    def refuse(args: object) -> int:
        raise ConfigError("must be >= 1, got 0", field="x")

    monkeypatch.setattr(verb, "run", refuse)
    assert main(["inspect", "some.msgpack"]) == 2
    assert capsys.readouterr().err == "treetrain inspect: x: must be >= 1, got 0\n"

    def bug(args: object) -> int:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(verb, "run", bug)  # the control: a bug is not bad input, and is not hidden
    with pytest.raises(ZeroDivisionError):
        main(["inspect", "some.msgpack"])
