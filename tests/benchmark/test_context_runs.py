"""The measured context-group benchmark (`bench/context_runs.py`): each case's settings, and the table that sets a rank's
measured peak beside its ledger and a refusal on a row of its own (the runs themselves are
`tests/train/test_train_context.py`'s)."""

from __future__ import annotations

from support.scripts import load_script

bench = load_script("bench/context_runs.py", "bench_context_runs")
Case, Row, table = bench.Case, bench.Row, bench.table


def test_a_case_sets_the_group_only_under_torchrun() -> None:
    assert Case("one process", budget="32MiB").settings() == ["memory_budget=32MiB"]
    assert Case("c2", ranks=4, context=2, zero=3).settings() == [
        "distributed.backend=deepspeed",
        "distributed.zero_stage=3",
        "distributed.context_parallel=2",
    ]


def test_a_gpu_case_takes_one_gpu_per_rank_and_leaves_deepspeed_its_accelerator() -> None:
    """On a GPU the one-process case names the device and a launch leaves DeepSpeed to find CUDA; on the
    CPU both stay there (`DS_ACCELERATOR=cpu`), also on a machine that has a GPU."""
    one, group = Case("one process", device="cuda"), Case("c2", ranks=2, context=2, device="cuda")
    assert one.settings() == ["device=cuda"]
    assert "device=cuda" not in group.settings()  # DeepSpeed places each rank on cuda:LOCAL_RANK
    assert "DS_ACCELERATOR" not in group.env()
    assert Case("c2", ranks=2, context=2).env()["DS_ACCELERATOR"] == "cpu"
    cases = bench.gpu_cases(4)
    assert [c.device for c in cases] == ["cuda"] * len(cases)
    assert {c.context for c in cases if c.ranks > 1} == {1, 2} and max(c.ranks for c in cases) == 4
    assert all(c.zero == 0 for c in cases if c.dtype == "float64")  # float64 reduces exactly at ZeRO 0 only
    assert [c.dtype for c in cases if c.ranks == 1] == ["float32", "float64"]  # each dtype's reference first
    assert max(c.ranks for c in bench.gpu_cases(2)) == 2 and bench.gpu_cases(1) == []


def test_the_table_gives_ratios_to_the_first_row_and_a_refusal_its_own_line() -> None:
    rows = [
        Row(Case("one process"), None, 4.0, 3 << 20, 2 << 20),
        Row(Case("c2", ranks=2, context=2), None, 6.0, 1 << 20, 1 << 20, 5 << 10, 5 << 10, 2.5e-7),
        Row(Case("refused", ranks=2, budget="1MiB"), "nothing fits the 1.0 MiB budget"),
    ]
    head, rule, one, two, refused = table(rows)
    assert head.count("|") == rule.count("|") == one.count("|") == two.count("|")
    assert "| 4.0 | 1.00x | 3.0 MiB | 2.0 MiB | 1.50 | 0 B | 0 B | 0.0e+00 |" in one
    assert "| 6.0 | 1.50x | 1.0 MiB | 1.0 MiB | 1.00 | 5.0 KiB | 5.0 KiB | 2.5e-07 |" in two
    assert "| 1MiB | refused: nothing fits the 1.0 MiB budget |" in refused


def test_a_familys_row_sets_the_groups_step_beside_the_one_process_floor() -> None:
    one = Row(Case("one process", dtype="float64"), None, 1.0)
    flat = Row(Case("flat", dtype="float64", mode="flat"), None, 1.0, step_error=4e-9)
    group = Row(Case("c2", ranks=2, context=2, dtype="float64"), None, 1.0, 0, 0, 3 << 10, 3 << 10, 6e-9)
    assert Case("flat", mode="flat").settings() == ["mode=flat"]
    assert (
        bench.family_line("qwen3", [one, flat, group])
        == "| qwen3 | 6.0e-09 | 4.0e-09 | 1.50 | 3.0 KiB | yes |"
    )
    off = Row(group.case, None, 1.0, 0, 0, 3 << 10, 2 << 10, 6e-9)  # the control: bytes off the ledger's
    assert bench.family_line("qwen3", [one, flat, off]).endswith("| no |")
    refused = Row(group.case, "nothing fits")
    assert "refused: nothing fits" in bench.family_line("gpt2", [one, flat, refused])
    no_reference = Row(one.case, "no room")  # a refused reference never lets another row stand in for it
    assert "refused: no room" in bench.family_line("gpt2", [no_reference, flat, group])
