"""Weight versions per policy token range: `Segment.version` through the trajectory, the tree (metadata that
never changes a node's identity), the file (format version 2, a call's `versions`), `treetrain inspect`, and
the `hf` engine's completions through `rollout_trees` into the saved tree."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgpack
import pytest
from support.env_fixtures import encode, tiny_model, tokenizer
from support.scripted_envs import FixedTurnsEnv
from support.tree_samples import (
    TINY_BYTES,
    expect_error,
    first_tree,
    tiny_tree,
    versioned_doc,
    versioned_tree,
)

from envs import EpisodeLimits, TokenEnv, WrapperConfig
from treetrain.cli.main import main
from treetrain.rollout import FanOut, RolloutConfig, rollout_trees
from treetrain.rollout.engines.hf_engine import HFEngine
from treetrain.trajectory import Call, Role, Segment, Trajectory, TrajectoryError
from treetrain.tree import SamplingRecord, TrajectoryTree
from treetrain.tree.build import build_tree
from treetrain.tree.format import load_tree, save_tree, trees_from_bytes, trees_to_bytes

ASSETS = Path(__file__).parents[1] / "assets"
PROMPT = Segment(Role.PROMPT, (1, 2, 3))


def _policy_versions(traj: Trajectory) -> list[int | None]:
    return [s.version for c in traj.calls for s in c.segments if s.role is Role.POLICY]


def test_only_policy_segments_carry_a_version_and_it_is_a_non_negative_int() -> None:
    assert Segment(Role.POLICY, (4,), version=0).version == 0
    assert Segment(Role.POLICY, (4,)).version is None
    for role, version, message in (
        (Role.PROMPT, 1, "prompt segment has a weight version; only policy segments may"),
        (Role.OBSERVATION, 0, "observation segment has a weight version; only policy segments may"),
        (Role.POLICY, -1, "policy segment version -1 is not an int in [0, 2**63)"),
        (Role.POLICY, True, "policy segment version True is not an int in [0, 2**63)"),
        (Role.POLICY, 1.0, "policy segment version 1.0 is not an int in [0, 2**63)"),
        (Role.POLICY, 1 << 63, f"policy segment version {1 << 63} is not an int in [0, 2**63)"),
    ):
        with pytest.raises(TrajectoryError) as info:
            Segment(role, (4,), version=version)  # type: ignore[arg-type]
        assert str(info.value) == message


def test_a_tree_of_several_versions_round_trips_through_a_file(tmp_path: Path) -> None:
    tree = TrajectoryTree(versioned_tree().nodes, versioned_tree().records, SamplingRecord(0.7))
    path = tmp_path / "v.msgpack"
    save_tree(tree, path)
    assert msgpack.unpackb(path.read_bytes())["version"] == 2
    loaded = load_tree(path)
    assert loaded.records == tree.records and loaded.trajectories() == tree.trajectories()
    # An episode whose turns span versions keeps each turn's version; an unknown one stays unknown.
    assert {t.id: _policy_versions(t) for t in loaded.trajectories()} == {
        "a": [4, 5],
        "b": [5],
        "c": [4, None],
    }
    assert loaded.trajectory(0).versions == (4, 5)
    # The shared first turn (node 1) was sampled by 4 ("a", "c") and 5 ("b"); node 4 holds only c's unknown.
    assert loaded.node_versions == ((), (4, 5), (4,), (5,), (), (5,))
    # Versions are metadata: the nodes and the tree id are those of the same tokens without versions.
    assert loaded.nodes == tiny_tree().nodes and loaded.id == tiny_tree().id
    assert trees_to_bytes([loaded]) == path.read_bytes()


def test_the_same_tokens_sampled_by_two_versions_are_one_node_recording_both() -> None:
    def traj(tid: str, answer: int, version: int) -> Trajectory:
        return Trajectory(tid, (Call((PROMPT, Segment(Role.POLICY, (7, answer), version=version))),), 1.0)

    same = build_tree([traj("x", 8, 1), traj("y", 8, 2)])
    assert len(same.nodes) == 2 and same.node_versions == ((), (1, 2))
    assert [t.calls[0].segments[1].version for t in same.trajectories()] == [1, 2]
    apart = build_tree([traj("x", 8, 1), traj("y", 9, 2)])  # negative control: different tokens part ways
    assert len(apart.nodes) == 4 and apart.node_versions == ((), (1, 2), (1,), (2,))


def test_an_unversioned_tree_is_written_as_before_and_version_1_files_read_with_no_versions() -> None:
    assert trees_to_bytes([tiny_tree()]) == TINY_BYTES == (ASSETS / "tree_tiny.msgpack").read_bytes()
    (old,) = trees_from_bytes((ASSETS / "tree_tiny.msgpack").read_bytes())
    assert msgpack.unpackb(TINY_BYTES)["version"] == 1
    assert all(v is None for t in old.trajectories() for v in _policy_versions(t))
    assert all(not c.versions for r in old.records for c in r.calls)
    assert old.node_versions == ((),) * len(old.nodes)


def _set_versions(value: Any, trajectory: int = 0) -> Any:
    def mutate(doc: dict[str, Any]) -> None:
        first_tree(doc)["trajectories"][trajectory]["calls"][0]["versions"] = value

    return mutate


WHERE = "trees[0].trajectories[0].calls[0].versions"
CASES = {
    "not an array": (_set_versions(4), f"{WHERE}: expected an array, got int"),
    "too few": (_set_versions([4]), f"{WHERE}: 1 entries but the call has 2 policy segments"),
    "too many": (_set_versions([4, 5, 6]), f"{WHERE}: 3 entries but the call has 2 policy segments"),
    "negative": (_set_versions([4, -1]), f"{WHERE}[1]: -1 is out of range [0, {(1 << 63) - 1}]"),
    "too large": (_set_versions([1 << 63, 5]), f"{WHERE}[0]: {1 << 63} is out of range"),
    "a bool": (_set_versions([True, 5]), f"{WHERE}[0]: expected an int, got bool"),
    "a float": (_set_versions([4, 5.0]), f"{WHERE}[1]: expected an int, got float"),
    "a str": (_set_versions(["4", 5]), f"{WHERE}[0]: expected an int, got str"),
    "all nil": (
        _set_versions([None, None]),
        f"{WHERE}: holds no version (every entry nil); leave the field out",
    ),
    "empty on a second call": (
        lambda d: first_tree(d)["trajectories"][0]["calls"].append(
            {"end": 1, "segment_lengths": [3, 1], "logprobs": [None], "versions": []}
        ),
        "trees[0].trajectories[0].calls[1].versions: 0 entries but the call has 1 policy segments",
    ),
    "in a version 1 file": (
        lambda d: d.update(version=1),
        f"{WHERE}: a version 1 file has no such field (version 2 added it)",
    ),
}


def test_the_unmutated_versioned_document_loads() -> None:
    """Negative control: each case's error comes from its mutation."""
    (tree,) = trees_from_bytes(msgpack.packb(versioned_doc()))
    assert tree.records == versioned_tree().records


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_versions_are_refused_in_one_line_naming_the_field(name: str) -> None:
    mutate, fragment = CASES[name]
    doc = versioned_doc()
    mutate(doc)
    message = expect_error(msgpack.packb(doc), fragment)
    assert "\n" not in message


def test_inspect_shows_versions_per_node_and_the_sampling_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "v.msgpack"
    save_tree(
        TrajectoryTree(versioned_tree().nodes, versioned_tree().records, SamplingRecord(0.7, 0.9)), path
    )
    assert main(["inspect", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("sampled at temperature 0.7, top_p 0.9")
    by_node = {line.split("#")[1].split()[0]: line for line in lines[2:]}
    assert "  v4,5  " in by_node["1"] and "  v4  " in by_node["2"] and "  v5  " in by_node["3"]
    assert " v" not in by_node["4"].split("traj")[1]  # c's unknown version shows nothing
    assert main(["inspect", "--json", str(path)]) == 0
    (doc,) = json.loads(capsys.readouterr().out)["trees"]
    assert doc["node_versions"] == [[], [4, 5], [4], [5], [], [5]]
    assert doc["sampling"] == {"temperature": 0.7, "top_p": 0.9}
    # Negative control: a tree that records neither shows neither.
    save_tree(tiny_tree(), path)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "sampled at" not in out and " v4" not in out
    assert main(["inspect", "--json", str(path)]) == 0
    (doc,) = json.loads(capsys.readouterr().out)["trees"]
    assert doc["sampling"] is None and doc["node_versions"] == [[]] * 6


def test_an_episode_keeps_the_version_of_each_turn() -> None:
    env = TokenEnv(FixedTurnsEnv(turns=3), tokenizer(), WrapperConfig(EpisodeLimits(max_turns=3)))
    env.reset(0)
    for version in (2, 2, 3):
        env.step(encode("hi<|im_end|>"), version=version)
    traj = env.trajectory("t", model_version=2)
    assert _policy_versions(traj) == [2, 2, 3] and traj.versions == (2, 3)
    assert traj.meta.model_version == 2  # what the rollout expected, not a summary of the tokens
    assert _policy_versions(build_tree([traj]).trajectory(0)) == [2, 2, 3]


MODEL = tiny_model(init=0.02)


@pytest.mark.parametrize("version", [3, 8])
def test_the_hf_engines_version_reaches_the_saved_tree(tmp_path: Path, version: int) -> None:
    """Each version differs, so the recorded one is the engine's, not a constant."""
    config = RolloutConfig(
        fanout=FanOut(root=2), wrapper=WrapperConfig(EpisodeLimits(max_turns=2, max_turn_tokens=4))
    )
    engine = HFEngine(MODEL, version=version)
    result = rollout_trees(
        MODEL, tokenizer(), lambda: FixedTurnsEnv(turns=2), [0], tmp_path, config, engine=engine
    )
    saved = load_tree(result.paths[0])
    trajs = saved.trajectories()
    assert len(trajs) >= 2 and all(_policy_versions(t) == [version, version] for t in trajs)
    assert {v for n, vs in zip(saved.nodes, saved.node_versions) for v in vs} == {version}
    assert all(vs == (version,) for n, vs in zip(saved.nodes, saved.node_versions) if Role.POLICY in n.roles)
    assert saved.records == result.trees[0].records


def test_replacing_a_version_changes_only_the_record() -> None:
    """The tree rebuilt with one turn's version changed has the same nodes and id, other records."""
    trajs = list(versioned_tree().trajectories())
    a = trajs[0]
    seg = a.calls[0].segments[1]
    trajs[0] = replace(
        a, calls=(Call((a.calls[0].segments[0], replace(seg, version=9), *a.calls[0].segments[2:])),)
    )
    other = build_tree(trajs)
    assert other.nodes == versioned_tree().nodes and other.id == versioned_tree().id
    assert other.records != versioned_tree().records and other.node_versions[1] == (4, 5, 9)
