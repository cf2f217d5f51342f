"""`bench/keep_sync.py` against the session's real `vllm serve`: one weight sync in the middle of streamed
samples, by interrupt-and-resubmit and by vLLM's `/pause?mode=keep`. What the benchmark reports is checked
here on a short round of each: the resubmitted contexts are encoded again and the kept stream's are not
(the server preempts the paused requests instead); the tokens after the sync are the new weights' own at
float32 rounding either way; the negative control (the same tokens scored under the old weights) is far
off, so the sync did change the weights they were drawn with."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from support.scripts import load_script

bench = load_script("bench/keep_sync.py", "bench_keep_sync")

GAP = 1e-4
"""|vLLM - trainer| logprob of a sampled token on the same float32 weights (measured 4e-6 to 2e-5)."""
CHANGED = 1e-2
"""Smallest gap the control must show: one AdamW step at lr 1e-3 (measured 1.8 to 5.5)."""


@pytest.mark.slow
@pytest.mark.parametrize("method", ["interrupt", "keep"])
def test_a_sync_mid_sample_gives_the_new_weights_tokens(
    vllm_server: str, method: str, tmp_path: Path
) -> None:
    served = bench.call_server(vllm_server, "/v1/models", None, 30)["data"][0]["id"]
    # a budget the server cannot finish before the client, reading the stream on a loaded machine, pauses it
    args = argparse.Namespace(samples=2, drawn=8, tokens=240)
    done = bench.one_round(vllm_server, served, method, args, 7, tmp_path)
    assert done.after > 0 and done.gap_after < GAP and done.gap_before < GAP, done
    assert done.gap_control > CHANGED, done
    if method == "interrupt":  # each sample's context and drawn tokens, after the prefix cache was reset
        assert done.reencoded > 2 * 8 and done.preempted == 0, done
    else:  # nothing sent again; the server preempted both samples and computed their KV anew
        assert done.reencoded == 0 and done.preempted == 2, done


def test_the_report_has_one_row_per_method() -> None:
    rounds = [
        bench.Round("interrupt", 200, 0.08, 5e-6, 4e-6, 2.0, 500, 0),
        bench.Round("keep", 0, 0.1, 5e-6, 4e-6, 5.0, 500, 4),
    ]
    lines = bench.report(rounds, "python bench/keep_sync.py").splitlines()
    assert lines[2].count("|") == lines[3].count("|") == lines[4].count("|") == lines[5].count("|")
    assert lines[4].startswith("| interrupt | 200 | 0.080 | 5e-06 | 4e-06 | 2 | 500 | 0 |")
    assert lines[5].startswith("| keep | 0 | 0.100 | 5e-06 | 4e-06 | 5 | 500 | 4 |")
