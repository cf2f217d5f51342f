"""The environment registry: built-ins, `module:Class`, and the `treetrain.envs` entry-point group
(through a small package that this test installs from tests/assets/envpkg)."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.env_fixtures import END, FixedTurnsEnv, encode, tokenizer

from envs import (
    BUILTINS,
    Environment,
    TokenEnv,
    UnknownEnvironmentError,
    available,
    check_environment,
    make_env,
    resolve,
)
from envs.calculator import CalculatorEnv
from envs.registry import ENTRY_POINT_GROUP, EnvironmentLoadError

PACKAGE = Path(__file__).parents[1] / "assets" / "envpkg"


@pytest.fixture(scope="module")
def installed_envpkg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """pip-install the test package (offline, no deps) into a temporary site dir on sys.path."""
    root = tmp_path_factory.mktemp("envpkg")
    source, site = root / "src", root / "site"
    shutil.copytree(PACKAGE, source)  # build artefacts land in the copy, not in the repository
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    subprocess.run([*cmd, "--target", str(site), str(source)], check=True, timeout=300, capture_output=True)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    try:
        yield site
    finally:
        sys.path.remove(str(site))
        sys.modules.pop("treetrain_test_envpkg", None)
        importlib.invalidate_caches()


REQUIRED = {"dataset": {"path": str(Path(__file__).resolve().parents[1] / "assets" / "tasks.jsonl")}}
"""Arguments a built-in cannot do without (the dataset environment's task file)."""


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_builtins_resolve(name: str) -> None:
    cls = resolve(name)
    assert issubclass(cls, Environment) and available()[name].origin == "builtin"
    assert isinstance(make_env(name, **REQUIRED.get(name, {})), cls)


def test_make_env_passes_arguments() -> None:
    env = make_env("calculator", min_operands=2, max_operands=2)
    assert isinstance(env, CalculatorEnv) and env.max_operands == 2


def test_importing_the_registry_imports_no_environment() -> None:
    code = (
        "import sys, envs, envs.registry; "
        "loaded = [m for m in sys.modules if m.startswith(('envs.calculator', 'envs.lookup'))]; "
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_unknown_name_lists_what_is_available() -> None:
    with pytest.raises(UnknownEnvironmentError) as info:
        resolve("calculater")
    message = str(info.value)
    assert "'calculater'" in message and "calculator (builtin)" in message and "lookup (builtin)" in message
    assert "module:Class" in message


def test_module_class_strings() -> None:
    assert resolve("envs.calculator:CalculatorEnv") is CalculatorEnv
    assert resolve("support.env_fixtures:FixedTurnsEnv") is FixedTurnsEnv


@pytest.mark.parametrize(
    ("target", "problem"),
    [
        ("envs.calculator:Nope", "has no attribute 'Nope'"),
        ("no_such_module_xyz:Env", "No module named 'no_such_module_xyz'"),
        ("json:JSONDecoder", "not a subclass of envs.Environment"),
        ("envs.calculator:", "not of the form 'module:Class'"),
    ],
)
def test_bad_module_class_strings(target: str, problem: str) -> None:
    with pytest.raises(EnvironmentLoadError, match=problem):
        resolve(target)


def test_entry_point_environment_is_found_and_conforms(installed_envpkg: Path) -> None:
    sources = available()
    assert sources["echo"].origin.startswith("entry point of treetrain")
    assert sources["echo"].target == "treetrain_test_envpkg:EchoEnv"
    cls = resolve("echo")
    assert cls.__module__ == "treetrain_test_envpkg"
    assert Path(sys.modules[cls.__module__].__file__ or "").is_relative_to(installed_envpkg)
    check_environment(lambda: make_env("echo"), reward_range=(0.0, 1.0), tokenizer=tokenizer())


def test_entry_point_environment_runs_an_episode(installed_envpkg: Path) -> None:
    env = TokenEnv(make_env("echo"), tokenizer(), env_name="echo")
    env.reset(seed=4)
    word = env.env.state()
    assert isinstance(word, str)
    env.step(encode(word + END))
    assert env.trajectory("e", env.env.rubrics()["echoed"]).reward == 1.0
    assert env.trajectory("s", env.env.rubrics()["shouted"]).reward == 0.0


def test_unknown_name_lists_entry_points(installed_envpkg: Path) -> None:
    with pytest.raises(UnknownEnvironmentError, match=r"echo \(entry point of treetrain"):
        resolve("ech")


def test_builtin_wins_over_an_entry_point_of_the_same_name(installed_envpkg: Path) -> None:
    assert resolve("calculator") is CalculatorEnv


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("broken-missing", "has no attribute 'Missing'"),
        ("broken-not-env", "not a subclass of envs.Environment"),
    ],
)
def test_broken_entry_points_name_their_distribution(installed_envpkg: Path, name: str, problem: str) -> None:
    with pytest.raises(EnvironmentLoadError, match=problem) as info:
        resolve(name)
    assert "entry point of treetrain" in str(info.value)


def test_entry_points_are_not_visible_without_the_package() -> None:
    """Control: the test package is not installed in the environment, only on the fixture's path."""
    code = (
        "from importlib.metadata import entry_points; "
        f"names = {{ep.name for ep in entry_points(group={ENTRY_POINT_GROUP!r})}}; "
        "assert 'echo' not in names, names"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
