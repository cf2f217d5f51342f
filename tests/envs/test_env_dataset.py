"""The dataset environment: real task files (JSONL, Parquet, CSV, a saved dataset), refused rows, draws and
the held-out split, the `answer` reward, user rewards and tools, and the worker processes."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from envs import Episode, Message, ToolCall, check_environment
from envs.dataset import DatasetEnv, Split, TaskFileError, final_answer, normalize, read_rows
from envs.dataset.answers import AnswerMatch
from envs.dataset.draws import draw
from envs.remote import WorkerEnvFactory
from treetrain.errors import ConfigError
from treetrain.rollout.env_check import check_environment_config

ASSET = Path(__file__).resolve().parents[1] / "assets" / "tasks.jsonl"


def _write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _episode(row: Any, reply: str, finish: str = "done") -> Episode:
    return Episode((Message("user", "q"), Message("assistant", reply)), row, finish)


ROWS = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i), "id": f"r{i}"} for i in range(6)]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same six rows as JSONL, Parquet, CSV and a `save_to_disk` directory, written by `datasets`."""
    datasets = pytest.importorskip("datasets")
    root = tmp_path_factory.mktemp("tasks")
    table = datasets.Dataset.from_list(ROWS)
    table.to_parquet(str(root / "tasks.parquet"))
    table.to_csv(str(root / "tasks.csv"), index=False)
    table.save_to_disk(str(root / "saved"))
    return {
        "jsonl": _write_jsonl(root / "tasks.jsonl", ROWS),
        "parquet": root / "tasks.parquet",
        "csv": root / "tasks.csv",
        "saved": root / "saved",
    }


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "csv", "saved"])
def test_every_format_reads_the_same_rows(files: dict[str, Path], kind: str) -> None:
    rows = read_rows(files[kind], needs=("answer",))
    as_text = {**ROWS[0], "answer": 0} if kind == "csv" else ROWS[0]  # CSV has no types: pandas reads 0
    assert dict(rows[0].fields) == as_text
    assert [{**r.fields, "answer": str(r.fields["answer"])} for r in rows] == ROWS
    assert [r.number for r in rows] == list(range(1, 7))
    assert rows[2].opening("Be brief.") == (Message("system", "Be brief."), Message("user", "What is 2 + 2?"))


def test_the_shipped_task_file_is_conformant() -> None:
    check_environment(
        lambda: DatasetEnv(str(ASSET), eval_fraction=0.25), seeds=(0, 5, 11), reward_range=(0, 1)
    )
    check_environment(lambda: DatasetEnv(str(ASSET), eval_fraction=0.25, split="eval"), seeds=(0, 1))


BAD_ROWS = [
    ({"prompt": 7, "answer": "1"}, "prompt"),
    ({"answer": "1"}, "neither 'prompt'"),
    ({"prompt": "x"}, "answer: missing"),
    ({"prompt": "x", "answer": [1]}, "answer: must be text or a number"),
    ({"prompt": "x", "answer": True}, "answer: must be text or a number"),
    ({"messages": [{"role": "user"}], "answer": "1"}, "messages[0].content"),
    ({"messages": [{"role": "tool", "content": "x"}], "answer": "1"}, "messages[0].role"),
    (
        {"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "y"}], "answer": 1},
        "messages[1]",
    ),
    ({"messages": "hello", "answer": "1"}, "messages: must be a non-empty list"),
    ({"messages": [], "answer": "1"}, "messages: must be a non-empty list"),
    ({"prompt": "x", "messages": [{"role": "user", "content": "x"}], "answer": "1"}, "both"),
    ([1, 2], "not an object"),
]


@pytest.mark.parametrize(("bad", "field"), BAD_ROWS)
def test_a_bad_row_is_refused_naming_its_number_and_field(tmp_path: Path, bad: Any, field: str) -> None:
    path = _write_jsonl(tmp_path / "t.jsonl", [ROWS[0], ROWS[1], bad, ROWS[2]])
    with pytest.raises(TaskFileError) as caught:
        read_rows(path, needs=("answer",))
    line = str(caught.value)
    assert "\n" not in line and "row 3:" in line and field in line, line


def test_rows_are_checked_whole_and_mixed_types_are_the_authors_choice(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "t.jsonl", [{"prompt": "a", "answer": 4}, {"prompt": "b", "answer": "four"}]
    )
    assert [r.fields["answer"] for r in read_rows(path, ("answer",))] == [4, "four"]
    (tmp_path / "cut.jsonl").write_text(json.dumps(ROWS[0]) + "\n" + '{"prompt": "x"')
    with pytest.raises(TaskFileError, match="row 2: not JSON"):
        read_rows(tmp_path / "cut.jsonl")
    (tmp_path / "gap.jsonl").write_text(json.dumps(ROWS[0]) + "\n\n")
    with pytest.raises(TaskFileError, match="row 2: an empty line"):
        read_rows(tmp_path / "gap.jsonl")


def test_a_hub_name_and_a_missing_datasets_library_are_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: dict[str, Path]
) -> None:
    with pytest.raises(TaskFileError, match="'openai/gsm8k' is not a local file or directory"):
        read_rows("openai/gsm8k")
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(TaskFileError, match="pip install datasets"):
        read_rows(files["parquet"])
    assert len(read_rows(files["jsonl"])) == 6  # JSONL does not need it


def test_draws_are_deterministic_shuffled_by_epoch_and_cover_each_epoch() -> None:
    rows = tuple(range(100, 110))
    first = [draw(rows, s) for s in range(10)]
    assert sorted(first) == list(rows) and first == [draw(rows, s) for s in range(10)]
    second = [draw(rows, s) for s in range(10, 20)]
    assert sorted(second) == list(rows) and second != first  # a new permutation for the next epoch
    assert first != list(rows)  # shuffled (negative control: the identity order)


def test_training_never_draws_held_out_rows() -> None:
    train = DatasetEnv(str(ASSET), eval_fraction=0.25)
    held = DatasetEnv(str(ASSET), eval_fraction=0.25, split="eval")
    assert train.held_out_count() == 3
    drawn = set()
    for seed in range(0, 3000, 7):
        train.reset(seed)
        assert train.row is not None
        drawn.add(train.row.number)
    scored = set()
    for seed in range(3):
        held.reset(seed)
        assert held.row is not None
        scored.add(held.row.number)
    assert len(drawn) == 9 and len(scored) == 3 and not drawn & scored
    # the held-out rows are the same whatever the environment's other settings
    assert Split.of(range(12), 0.25) == Split.of(range(12), 0.25)


def test_eval_path_holds_out_a_second_file(tmp_path: Path) -> None:
    extra = _write_jsonl(tmp_path / "held.jsonl", [{"prompt": "held?", "answer": "yes"}])
    env = DatasetEnv(str(ASSET), eval_path=str(extra), split="eval")
    assert env.reset(0)[-1].content == "held?" and env.held_out_count() == 1
    with pytest.raises(ValueError, match="give one way"):
        DatasetEnv(str(ASSET), eval_path=str(extra), eval_fraction=0.1)
    with pytest.raises(ValueError, match="leaves none to train on"):
        DatasetEnv(str(ASSET), eval_fraction=0.99)


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("42", "42"),
        ("  42. ", "42"),
        ("The answer is 42.", "42"),
        ("so THE ANSWER IS: Paris.\nThanks", "paris"),
        (r"Hence $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
        ("7 apples...\n#### 1,200", "1,200"),
        ("New   York", "new york"),
    ],
)
def test_answer_extraction_and_normalisation(reply: str, expected: str) -> None:
    assert normalize(final_answer(reply)) == expected


def test_the_answer_reward_scores_right_and_wrong_answers() -> None:
    env = DatasetEnv(str(ASSET))
    env.reset(0)
    row = env.state()
    assert row is not None
    answer = str(row.fields["answer"])
    rubric = env.rubrics()["answer"]
    assert rubric(_episode(row, f"The answer is {answer}.")) == 1.0
    assert rubric(_episode(row, f"The answer is {answer}1.")) == 0.0  # negative control
    assert rubric(_episode(row, answer, finish="max_tokens")) == 0.0  # cut by a budget: no final answer
    assert isinstance(rubric, AnswerMatch)


def test_a_reward_function_sees_the_row(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "t.jsonl", [{"prompt": "a"}, {"prompt": "b", "skip": True}])
    env = DatasetEnv(str(path), reward="support.dataset_plugins:shorter_is_better")
    rubric = env.rubrics()["support.dataset_plugins:shorter_is_better"]
    rows = read_rows(path)
    assert rubric(_episode(rows[0], "abc")) == pytest.approx(0.25)
    assert rubric(_episode(rows[1], "abc")) == 0.0
    bad = DatasetEnv(str(path), reward="support.dataset_plugins:not_a_number").rubrics()
    with pytest.raises(Exception, match="not a number"):
        next(iter(bad.values()))(_episode(rows[0], "abc"))
    for reward, message in (("nope", "neither 'answer'"), ("support.dataset_plugins:missing", "cannot load")):
        with pytest.raises(ValueError, match=message):
            DatasetEnv(str(path), reward=reward)


def test_tools_by_class_and_by_function_list() -> None:
    by_class = DatasetEnv(str(ASSET), tools="envs.calculator:CalculatorEnv")
    by_class.reset(0)
    assert [t.name for t in by_class.tool_specs()] == ["calculate"]
    call = ToolCall("c0", "calculate", {"expression": "6 * 7"})
    assert by_class.step(Message("assistant", "", (call,))).messages[0].content == "42"
    listed = DatasetEnv(str(ASSET), tools=["support.dataset_plugins:add", "support.dataset_plugins:negate"])
    assert [t.name for t in listed.tool_specs()] == ["add", "negate"]
    call = ToolCall("c1", "add", {"a": 2, "b": 3})
    assert listed.step(Message("assistant", "", (call,))).messages[0].content == "5"
    assert DatasetEnv(str(ASSET)).tool_specs() == ()
    for tools in ("envs.protocol:Message", ["envs.calculator:CalculatorEnv"], [3]):
        with pytest.raises(ValueError, match="tools"):
            DatasetEnv(str(ASSET), tools=tools)  # type: ignore[arg-type]


def test_it_runs_in_worker_processes_and_refuses_bad_settings_in_one_line(tmp_path: Path) -> None:
    kwargs = {"path": str(ASSET), "eval_fraction": 0.25, "tools": ["support.dataset_plugins:add"]}
    check_environment_config("dataset", kwargs, seed=12345)
    factory = WorkerEnvFactory("dataset", kwargs)
    try:
        env = factory()
        local = DatasetEnv(**kwargs)  # type: ignore[arg-type]
        assert env.reset(77) == local.reset(77)
        assert [t.name for t in env.tool_specs()] == ["add"]
    finally:
        factory.close()
    bad = _write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], {"prompt": ""}])
    with pytest.raises(ConfigError) as caught:
        check_environment_config("dataset", {"path": str(bad)})
    line = str(caught.value)
    assert line.startswith("env.kwargs:") and "row 2: prompt" in line and "\n" not in line
