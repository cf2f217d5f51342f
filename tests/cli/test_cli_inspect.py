"""`treetrain inspect`: outline, --json, --dot, --tokenizer, and a clean exit 2 on bad files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from treetrain.cli.main import main
from treetrain.tree.build import build_tree
from treetrain.tree.format import load_tree
from treetrain.tree.stats import tree_stats

REPO = Path(__file__).parents[2]
TOOL_USE = REPO / "trees" / "tool_use.msgpack"
ASSETS = Path(__file__).parents[1] / "assets"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["inspect", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_outline_shows_divergence_points_leaves_and_rewards(capsys: pytest.CaptureFixture[str]) -> None:
    tree = load_tree(TOOL_USE)
    code, out, _ = run(capsys, str(TOOL_USE))
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == 1 + len(tree.nodes)  # a summary line, then one line per node
    node_lines = {int(m.group(1)): line for line in lines if (m := re.search(r"#(\d+) ", line))}
    assert set(node_lines) == set(range(1, len(tree.nodes)))
    for node in tree.nodes[1:]:
        line = node_lines[node.index]
        assert ("◆" in line) == node.is_divergence
        assert f"{len(node.trajectories)} traj" in line
    for rec in tree.records:
        assert f"{rec.id} reward={rec.reward:g}" in out
    assert "…" in out  # long token runs are collapsed


def test_max_tokens_controls_the_snippet(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(capsys, str(TOOL_USE), "--max-tokens", "3")
    first = next(line for line in out.splitlines() if "#1 " in line)
    ids = load_tree(TOOL_USE).nodes[1].tokens
    assert f"[{ids[0]} {ids[1]} … {ids[-1]}]" in first
    with pytest.raises(SystemExit):
        main(["inspect", str(TOOL_USE), "--max-tokens", "1"])


def test_json_matches_tree_stats(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, str(TOOL_USE), "--json")
    assert code == 0
    doc = json.loads(out)
    tree = load_tree(TOOL_USE)
    assert [t["id"] for t in doc["trees"]] == [tree.id]
    assert doc["trees"][0]["stats"] == json.loads(json.dumps(tree_stats(tree).as_dict()))


def test_dot_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dot = tmp_path / "tree.dot"
    code, _, _ = run(capsys, str(TOOL_USE), "--dot", str(dot))
    assert code == 0
    text = dot.read_text()
    tree = load_tree(TOOL_USE)
    assert text.startswith("digraph") and text.rstrip().endswith("}")
    assert len(re.findall(r"^\s*t0n\d+ \[label=", text, re.M)) == len(tree.nodes)
    assert len(re.findall(r"^\s*t0n\d+ -> t0n\d+;", text, re.M)) == len(tree.nodes) - 1
    assert text.count("peripheries=2") == len(tree.divergence_points())
    assert "#9be9a8" in text and "#ffd59e" in text  # policy and observation colours


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("tree_bad_parent.msgpack", "nodes[2].parent: 7 is not a valid parent index (must be < 2)"),
        ("missing.msgpack", "missing.msgpack' does not exist"),
    ],
)
def test_bad_file_exits_2_with_the_message(
    capsys: pytest.CaptureFixture[str], name: str, message: str
) -> None:
    code, out, err = run(capsys, str(ASSETS / name))
    assert code == 2
    assert message in err
    assert "Traceback" not in err and out == ""


def test_truncated_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "cut.msgpack"
    bad.write_bytes(TOOL_USE.read_bytes()[:500])
    code, _, err = run(capsys, str(bad))
    assert code == 2 and "ends early" in err


def test_tokenizer_shows_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = ["<unk>", "hello", "world", "search", "result", "yes", "no"]
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.decoder = tokenizers.decoders.WordPiece()  # joins tokens with spaces
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(
        tmp_path / "tok"
    )

    from treetrain.trajectory import Call, Role, Segment, Trajectory
    from treetrain.tree.format import save_tree

    prompt = Segment(Role.PROMPT, (1, 2, 3))
    trajs = [Trajectory(f"t{i}", (Call((prompt, Segment(Role.POLICY, (4, 5 + i)))),), 1.0) for i in range(2)]
    save_tree(build_tree(trajs), tmp_path / "t.msgpack")
    code, out, _ = run(capsys, str(tmp_path / "t.msgpack"), "--tokenizer", str(tmp_path / "tok"))
    assert code == 0
    assert '"hello world search result"' in out and '"yes"' in out and '"no"' in out
    code, _, err = run(capsys, str(tmp_path / "t.msgpack"), "--tokenizer", str(tmp_path / "nothing"))
    assert code == 2 and err == f"treetrain inspect: --tokenizer: '{tmp_path / 'nothing'}' does not exist\n"
