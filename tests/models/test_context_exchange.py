"""Shared-past attention with the past sharded over a context group equals it in one process.

One 4-rank torchrun launch (gloo, CPU) runs tests/support/context_cases.py: groups of 2 and of 4, each
rank holding only the pieces it owns, the output gradient split over the ranks at random. The output must
be the one-process output and the same on every rank, bit for bit; the summed query and own-key gradients
and every piece's G (where it lives) must be the one-process gradients. Negative controls: leaving the
remote pieces out of the merge, or giving a piece's G only this rank's share of the output gradient, is
caught by the same comparison.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from support.context_cases import CASES
from support.ports import free_port
from support.ports import run as launch

pytestmark = pytest.mark.distributed
CASES_FILE = Path(__file__).parents[1] / "support" / "context_cases.py"
TOL = {"f64": 1e-12, "f32": 1e-5}
"""Relative error of float64 (the reference kernel or torch's fused one) and float32 (fused) against the
same attention in one process: a different merge order only."""


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, float]:
    out = tmp_path_factory.mktemp("context")
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(CASES_FILE.parents[1]), *sys.path])
    )
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4", "--master_addr=127.0.0.1",
        f"--master_port={free_port()}", str(CASES_FILE), str(out),
    ]  # fmt: skip
    done = launch(cmd, env, 600)
    if done.returncode != 0:
        pytest.fail(f"torchrun failed ({done.returncode}):\n{done.output[-6000:]}")
    loaded: dict[str, float] = json.loads((out / "results.json").read_text())
    return loaded


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", sorted(CASES))
def test_sharded_attention_equals_one_process(results: dict[str, float], size: int, name: str) -> None:
    tol = TOL[name.rsplit("_", 1)[1]]
    key = f"C{size}/{name}"
    assert results[f"{key}/out_differs_across_ranks"] == 0.0, "ranks of a group must hold the same output"
    for what in ("out", "dq", "dk", "dv", "G", *(["dsinks"] if "sinks" in name else [])):
        assert results[f"{key}/{what}"] <= tol, (what, results[f"{key}/{what}"])
    assert results[f"{key}/bytes"] > 0  # the exchange counted what crossed ranks


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", sorted(CASES))
def test_negative_controls_are_caught(results: dict[str, float], size: int, name: str) -> None:
    """Remote pieces left out change the output; a G from this rank's share of dO alone is wrong."""
    tol = TOL[name.rsplit("_", 1)[1]]
    assert results[f"C{size}/{name}/drop_remote/out"] > 100 * tol
    assert results[f"C{size}/{name}/no_reduce/G"] > 100 * tol


@pytest.mark.parametrize("size", [2, 4])
def test_a_group_whose_ranks_disagree_refuses_on_every_rank(results: dict[str, float], size: int) -> None:
    """`ContextExchange.agree`: ranks passing the same values go on; one rank a version behind makes every
    rank of the group raise, in one line (the lowest result over the ranks is kept)."""
    assert results[f"C{size}/mismatch_caught"] == 1.0
