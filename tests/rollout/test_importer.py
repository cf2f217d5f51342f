"""Importing JSONL rollouts: a sample file round-trips into trees; broken files are rejected with the
line number and field, and nothing is written."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from treetrain.cli.main import main
from treetrain.rollout.import_records import RecordError
from treetrain.rollout.importer import GroupBy, import_jsonl
from treetrain.trajectory import Call, Role, Segment, Trajectory
from treetrain.tree.format import load_tree
from treetrain.tree.stats import tree_stats

SAMPLE = Path(__file__).parents[1] / "assets" / "import_sample.jsonl"


def _rows() -> list[dict[str, Any]]:
    return [json.loads(line) for line in SAMPLE.read_text().splitlines()]


def _segments(row: dict[str, Any]) -> tuple[Segment, ...]:
    if "segments" in row:
        return tuple(Segment(Role(s["role"]), s["token_ids"], s.get("logprobs")) for s in row["segments"])
    return (
        Segment(Role.PROMPT, row["prompt_token_ids"]),
        Segment(Role.POLICY, row["response_token_ids"], row.get("response_logprobs")),
    )


def _expected() -> dict[str, Trajectory]:
    """The sample's trajectories, built independently of the importer."""
    by_id: dict[str, list[dict[str, Any]]] = {}
    for row in _rows():
        by_id.setdefault(row["trajectory_id"], []).append(row)
    out = {}
    for tid, rows in by_id.items():
        rows.sort(key=lambda r: r.get("call_index", 0))
        reward = next(r["reward"] for r in rows if "reward" in r)
        steps = tuple(x for r in rows for x in r.get("step_rewards", ()))
        out[tid] = Trajectory(tid, tuple(Call(_segments(r)) for r in rows), reward, steps)
    return out


def _imported(paths: tuple[Path, ...]) -> dict[str, Trajectory]:
    return {t.id: t for p in paths for t in load_tree(p).trajectories()}


def test_sample_round_trips(tmp_path: Path) -> None:
    result = import_jsonl(SAMPLE, tmp_path / "trees")
    got, want = _imported(result.paths), _expected()
    assert set(got) == set(want)
    for tid, traj in want.items():
        assert got[tid].calls == traj.calls
        assert (got[tid].reward, got[tid].step_rewards) == (traj.reward, traj.step_rewards)
    a0, a2, m0 = got["a0"].meta, got["a2"].meta, got["m0"].meta
    assert (a0.env, a0.seed, a0.model_version, a0.extra["group_id"]) == ("calculator", 7, 3, "g1")
    assert dict(a2.extra) == {"sampler": "vllm", "temperature": "0.7", "group_id": "g2"}
    assert json.loads(m0.extra["messages"])[-1] == {"role": "assistant", "content": "final"}


def test_grouping_by_prompt_and_by_group_id(tmp_path: Path) -> None:
    by_prompt = import_jsonl(SAMPLE, tmp_path / "p")
    members = sorted(sorted(r.id for r in t.records) for t in by_prompt.trees)
    assert members == [["a0", "a1", "a2", "s0"], ["m0"]]
    shared = by_prompt.trees[0]
    assert len(shared.divergence_points()) >= 1 and tree_stats(shared).num_trajectories == 4

    by_group = import_jsonl(SAMPLE, tmp_path / "g", GroupBy.GROUP_ID)
    assert by_group.groups == ("g1", "g2")
    assert [sorted(r.id for r in t.records) for t in by_group.trees] == [["a0", "a1", "s0"], ["a2", "m0"]]
    assert all(p.name.startswith(g) for g, p in zip(by_group.groups, by_group.paths))


def test_cli_imports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["import", str(SAMPLE), "--out", str(tmp_path / "out"), "--group-by", "group_id"]) == 0
    assert "imported 5 trajectories into 2 trees" in capsys.readouterr().out
    assert len(list((tmp_path / "out").glob("*.msgpack"))) == 2


def _replace(line: int, text: str) -> list[str]:
    lines = SAMPLE.read_text().splitlines()
    lines[line - 1] = text
    return lines


def _edit(line: int, **changes: Any) -> list[str]:
    row = _rows()[line - 1]
    for key, value in changes.items():
        if value is _DROP:
            row.pop(key)
        else:
            row[key] = value
    return _replace(line, json.dumps(row))


_DROP = object()
_SEG_OBS = {"role": "observation", "token_ids": [5], "logprobs": [-1.0]}

BROKEN: list[tuple[str, list[str], int, str]] = [
    ("invalid json", _replace(2, '{"trajectory_id": "a1", '), 2, "<json>"),
    ("not an object", _replace(3, "[1, 2]"), 3, "<record>"),
    ("missing id", _edit(1, trajectory_id=_DROP), 1, "trajectory_id"),
    ("negative token", _edit(2, prompt_token_ids=[1, -4]), 2, "prompt_token_ids[1]"),
    ("bool token", _edit(2, response_token_ids=[True, 2]), 2, "response_token_ids[0]"),
    ("token over uint32", _edit(2, prompt_token_ids=[1, 2**32]), 2, "prompt_token_ids[1]"),
    ("seed over int64", _edit(1, seed=10**23), 1, "seed"),
    ("policy first", _edit(4, segments=[{"role": "policy", "token_ids": [1]}]), 4, "segments"),
    ("logprob count", _edit(1, response_logprobs=[-0.5]), 1, "response_logprobs"),
    ("positive logprob", _edit(1, response_logprobs=[-0.5, 0.5, -1.0]), 1, "response_logprobs"),
    ("bad role", _edit(4, segments=[{"role": "tool", "token_ids": [1]}]), 4, "segments[0].role"),
    ("prompt logprobs", _edit(4, segments=[_SEG_OBS]), 4, "segments[0].logprobs"),
    (
        "nan reward",
        _replace(3, SAMPLE.read_text().splitlines()[2].replace('"reward": 0.5', '"reward": NaN')),
        3,
        "reward",
    ),
    ("unknown field", _edit(2, rewrd=1.0), 2, "rewrd"),
    ("two formats", _edit(5, prompt_token_ids=[1]), 5, "segments"),
    ("step reward count", _edit(6, step_rewards=[0.0]), 6, "step_rewards"),
    ("duplicate call", _edit(6, call_index=1), 6, "call_index"),
    ("gap in calls", _edit(6, call_index=2), 4, "call_index"),
    ("gap at zero", _edit(4, call_index=3), 4, "call_index"),
    ("conflicting reward", _edit(6, reward=0.5), 6, "reward"),
    ("no reward", _edit(4, reward=_DROP), 4, "reward"),
    (
        "no policy tokens",
        _edit(
            2,
            response_token_ids=_DROP,
            response_logprobs=_DROP,
            prompt_token_ids=_DROP,
            segments=[{"role": "prompt", "token_ids": [1, 2]}],
        ),
        2,
        "trajectory_id",
    ),
]


@pytest.mark.parametrize(("lines", "line", "field"), [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_broken_records_are_rejected_and_nothing_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], lines: list[str], line: int, field: str
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    out = tmp_path / "trees"
    with pytest.raises(RecordError) as info:
        import_jsonl(bad, out)
    assert (info.value.line, info.value.field) == (line, field)
    assert str(info.value).startswith(f"{bad}:{line}: field {field!r}: ")
    assert not out.exists()
    assert main(["import", str(bad), "--out", str(out)]) == 2
    assert f":{line}: field {field!r}" in capsys.readouterr().err
    assert not out.exists()


def test_missing_group_id_is_rejected(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(_edit(3, group_id=_DROP)) + "\n")
    with pytest.raises(RecordError) as info:
        import_jsonl(bad, tmp_path / "trees", GroupBy.GROUP_ID)
    assert (info.value.line, info.value.field) == (3, "group_id")
    import_jsonl(bad, tmp_path / "trees")  # control: grouping by prompt does not need it


def test_existing_output_is_untouched_on_failure(tmp_path: Path) -> None:
    out = tmp_path / "trees"
    import_jsonl(SAMPLE, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(_edit(6, call_index=1)) + "\n")
    with pytest.raises(RecordError):
        import_jsonl(bad, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def _snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"", p.stat().st_mode)
        for p in sorted(root.rglob("*"))
    }


def _fail_on_replace(monkeypatch: pytest.MonkeyPatch, nth: int) -> list[str]:
    """Make the `nth` os.replace of the import fail like a full disk; the earlier ones happen for real."""
    real = os.replace
    calls: list[str] = []

    def flaky(src: Any, dst: Any) -> None:
        calls.append(str(dst))
        if len(calls) == nth:
            raise OSError("disk full")
        real(src, dst)

    monkeypatch.setattr(os, "replace", flaky)
    return calls


def test_a_failure_part_way_restores_the_directory_overwritten_files_included(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "trees"
    names = [p.name for p in import_jsonl(SAMPLE, out).paths]
    assert len(names) >= 2
    for k, name in enumerate(names):  # files the next import overwrites, with other content and modes
        (out / name).write_bytes(b"the user's own bytes %d" % k)
    (out / names[0]).chmod(0o600)
    (out / "notes.txt").write_text("not treetrain's")
    before = _snapshot(tmp_path)
    calls = _fail_on_replace(monkeypatch, nth=len(names))  # every file but the last is already in place
    with pytest.raises(OSError, match="disk full"):
        import_jsonl(SAMPLE, out)
    assert len(calls) >= len(names)
    assert _snapshot(tmp_path) == before
    monkeypatch.undo()
    import_jsonl(SAMPLE, out)  # control: without the failure the files are replaced
    assert (out / names[0]).read_bytes() != before[f"trees/{names[0]}"][0]


def test_a_failure_part_way_leaves_no_new_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fail_on_replace(monkeypatch, nth=2)
    with pytest.raises(OSError, match="disk full"):
        import_jsonl(SAMPLE, tmp_path / "a" / "b")
    assert list(tmp_path.iterdir()) == []


def test_blank_lines_are_skipped_and_empty_files_rejected(tmp_path: Path) -> None:
    spaced = tmp_path / "spaced.jsonl"
    spaced.write_text("\n\n".join(SAMPLE.read_text().splitlines()) + "\n\n")
    assert sum(len(t.records) for t in import_jsonl(spaced, tmp_path / "a").trees) == 5
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(RecordError, match="no records"):
        import_jsonl(empty, tmp_path / "b")


def test_bytes_that_are_not_utf8_name_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    lines = SAMPLE.read_bytes().splitlines()
    bad.write_bytes(b"\n".join([lines[0], b'{"trajectory_id": "\xff"}', *lines[2:]]) + b"\n")
    with pytest.raises(RecordError) as info:
        import_jsonl(bad, tmp_path / "trees")
    assert (info.value.line, info.value.field) == (2, "<encoding>")
