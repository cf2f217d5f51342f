"""`treetrain plan --context-parallel C`: one rank's ledger, its peak and the bytes it sends per update; a
tree one device cannot hold is refused in one line naming the group that holds it, and that group fits."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support.replay_cases import VOCAB

from treetrain.cli.main import main
from treetrain.tree.format import save_trees
from treetrain.tree.synthetic import synthetic_group

MODEL = ["--model", "tiny-llama", "--vocab", str(VOCAB)]


@pytest.fixture(scope="module")
def long_prefix(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("context") / "long.msgpack"
    tree = synthetic_group(
        prefix=3072, branches=2, suffix=8, depth=1, vocab=VOCAB, seed=5, rewards=[1.0, 0.0]
    )
    save_trees([tree], path)
    return path


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow  # three plans of a 3072-token prefix, one over four ranks
def test_prints_the_per_rank_peak_and_the_bytes_sent(
    long_prefix: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _plan(capsys, str(long_prefix), *MODEL, "--budget", "1GiB", "--context-parallel", "4")
    assert code == 0
    line = next(x for x in out.splitlines() if x.startswith("context group of 4"))
    assert re.search(r"per-rank peak [\d.]+ \wi?B \(rank \d\); each rank sends [\d.]+ \wi?B per update", line)
    code, out, _ = _plan(
        capsys, str(long_prefix), *MODEL, "--budget", "1GiB", "--context-parallel", "4", "--json"
    )
    context = json.loads(out)["ledger"]["context"]
    assert context["size"] == 4 and len(context["rank_peaks"]) == 4 and context["sent_bytes"] > 0
    code, out, _ = _plan(capsys, str(long_prefix), *MODEL, "--budget", "1GiB", "--json")
    assert json.loads(out)["ledger"]["context"] is None  # no group: no share, nothing sent


def test_a_tree_one_device_cannot_hold_names_the_group_that_can(
    long_prefix: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _plan(capsys, str(long_prefix), *MODEL, "--budget", "1GiB", "--json", "--chunk-size", "64")
    peak = json.loads(out)["ledger"]["peak"]
    resident = max(r["prompt_group"] for r in json.loads(out)["ledger"]["rows"])
    budget = str(peak["persistent"] + peak["boundary"] + resident // 2)
    code, _, err = _plan(capsys, str(long_prefix), *MODEL, "--budget", budget)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    found = re.search(
        r"needs distributed\.context_parallel >= (\d+) \(treetrain plan --context-parallel \1\)", err
    )
    assert found, err
    code, out, _ = _plan(capsys, str(long_prefix), *MODEL, "--budget", budget, "--context-parallel", found[1])
    assert code == 0 and f"context group of {found[1]}: per-rank peak" in out


@pytest.mark.parametrize("bad", ["0", "-2", "1.5", "two", "nan", str(2**63), "1025"])
def test_bad_group_sizes_are_one_line(
    long_prefix: Path, capsys: pytest.CaptureFixture[str], bad: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["plan", str(long_prefix), *MODEL, "--budget", "1GiB", f"--context-parallel={bad}"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("treetrain plan: error: argument --context-parallel")
