"""Reading a task file into validated rows: every row is checked once, when the environment is made.

JSONL is read line by line with the standard library, so a row keeps the types its author wrote (a column
that is a number in one row and text in another is the author's choice, not a parse error) and a bad row is
named by its line. Parquet, CSV and anything else `datasets.load_dataset` reads from a local path go through
`datasets`; a name that is not a local file or directory is refused (no hub downloads inside a run).

A row is `prompt` (text) or `messages` (system and user chat messages ending on a user turn), plus any other
fields, which the reward sees. Every limit here is a constant, never a number read from the file.

Example:
    >>> import json, tempfile
    >>> path = tempfile.mktemp(suffix=".jsonl")
    >>> _ = open(path, "w").write(json.dumps({"prompt": "2+2?", "answer": 4}) + "\\n")
    >>> rows = read_rows(path, needs=("answer",))
    >>> rows[0].opening()[0].content, rows[0].fields["answer"]
    ('2+2?', 4)
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from envs.protocol import Immutable, Message
from treetrain.errors import TreetrainError
from treetrain.io import open_regular

MAX_ROWS = 1 << 22
"""Most rows one task file may hold (about 4 million)."""
MAX_LINE_BYTES = 1 << 24
"""Longest JSONL line (16 MiB): a row, however long its prompt, is read whole and kept in memory."""
MAX_MESSAGES = 256
"""Most opening messages of one row."""
DATASETS_SUFFIXES: Mapping[str, str] = MappingProxyType(
    {".parquet": "parquet", ".csv": "csv", ".tsv": "csv", ".json": "json", ".arrow": "arrow"}
)
"""File suffixes read through `datasets` and the builder that reads each."""


class TaskFileError(TreetrainError, ValueError):
    """A task file that cannot be used; the message names the file, and for a bad row its number and field."""


@dataclass(frozen=True)
class TaskRow(Immutable):
    """One validated row: its 1-based number in the file, and every field as the file had it (read-only).

    It is the environment's state, so rubrics score against it; `Immutable` makes forks share it."""

    number: int
    fields: Mapping[str, Any]

    def opening(self, system_prompt: str | None = None) -> tuple[Message, ...]:
        """The task's opening messages: the row's `messages`, or `system_prompt` (when given) and `prompt`."""
        if "messages" in self.fields and self.fields["messages"] is not None:
            return tuple(Message(m["role"], m["content"]) for m in self.fields["messages"])
        system = (Message("system", system_prompt),) if system_prompt else ()
        return (*system, Message("user", self.fields["prompt"]))


def _frozen(value: Any) -> Any:
    if isinstance(value, Mapping):
        return MappingProxyType({str(k): _frozen(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    return value


def row_problem(row: object, needs: Sequence[str] = ()) -> str | None:
    """What is wrong with one decoded row (naming the field), or None.

    >>> row_problem({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]})
    "has both 'prompt' and 'messages'; give one"
    >>> row_problem({"messages": [{"role": "assistant", "content": "hi"}]})
    "messages[0].role: 'assistant' is not 'system' or 'user' (a task opens with system and user messages)"
    """
    if not isinstance(row, Mapping):
        return f"is a JSON {type(row).__name__}, not an object"
    prompt, messages = row.get("prompt"), row.get("messages")
    if prompt is not None and messages is not None:
        return "has both 'prompt' and 'messages'; give one"
    if prompt is None and messages is None:
        return "has neither 'prompt' (text) nor 'messages' (chat messages)"
    if prompt is not None and (not isinstance(prompt, str) or not prompt.strip()):
        return f"prompt: must be non-empty text, got {_shown(prompt)}"
    if messages is not None:
        problem = _messages_problem(messages)
        if problem is not None:
            return problem
    for name in needs:
        value = row.get(name)
        if value is None:
            return f"{name}: missing (the reward compares the answer against it)"
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            return f"{name}: must be text or a number, got {_shown(value)}"
    return _non_finite(row)


def _non_finite(row: Mapping[Any, Any]) -> str | None:
    """The first field (nested ones by path) holding NaN or an infinity, in words, or None.

    JSON's `NaN`, `Infinity` and `1e999` (which overflows to infinity) parse as floats, and Parquet holds
    them natively; an answer of NaN equals nothing, so every task would score 0 in silence.

    >>> _non_finite({"prompt": "x", "answer": float("nan")})
    'answer: nan is not a finite number (NaN and infinities are refused)'
    """
    stack: list[tuple[str, Any]] = [(str(k), v) for k, v in row.items()]
    while stack:
        where, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return f"{where}: {value} is not a finite number (NaN and infinities are refused)"
        if isinstance(value, Mapping):
            stack.extend((f"{where}.{k}", v) for k, v in value.items())
        elif isinstance(value, list | tuple):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(value))
    return None


def special_file(path: Path, limit: int = 100_000) -> Path | None:
    """`path`, or the first entry below it when it is a directory, that is not a regular file or a directory
    (a FIFO, a device, a socket, links followed), or None. Opening a FIFO blocks until a writer comes and a
    device may never end, so they are refused before any reader opens them; at most `limit` entries of a
    directory are looked at, and more are refused."""
    stack, seen = [path], 0
    while stack:
        current = stack.pop()
        seen += 1
        if seen > limit:
            raise TaskFileError(f"{path}: more than {limit} entries below it; give the task files themselves")
        try:
            mode = os.stat(current).st_mode
        except OSError:
            continue  # a dangling link: the reader says what it makes of it
        if stat.S_ISDIR(mode):
            stack.extend(sorted(Path(current).iterdir(), reverse=True))
        elif not stat.S_ISREG(mode):
            return Path(current)
    return None


def _messages_problem(messages: object) -> str | None:
    if not isinstance(messages, list | tuple) or not messages:
        return f"messages: must be a non-empty list of chat messages, got {_shown(messages)}"
    if len(messages) > MAX_MESSAGES:
        return f"messages: {len(messages)} messages, more than {MAX_MESSAGES}"
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            return f"messages[{i}]: must be an object with 'role' and 'content', got {_shown(m)}"
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "user"):
            return (
                f"messages[{i}].role: {role!r:.40} is not 'system' or 'user' "
                "(a task opens with system and user messages)"
            )
        if not isinstance(content, str):
            return f"messages[{i}].content: must be text, got {_shown(content)}"
    if messages[-1].get("role") != "user":
        return f"messages[{len(messages) - 1}]: the last opening message must be the user's"
    return None


def _shown(value: object) -> str:
    text = json.dumps(value, default=repr) if not isinstance(value, str) else repr(value)
    kind = type(value).__name__ if value is not None else "null"
    return f"{kind} {text[:60]}{'...' if len(text) > 60 else ''}"


def read_rows(
    path: str | os.PathLike[str], needs: Sequence[str] = (), field: str = "path"
) -> tuple[TaskRow, ...]:
    """Every row of the task file at `path`, validated; `needs` names fields each row must carry.

    `field` is the environment argument that named the file (`path` or `eval_path`), for the errors."""
    where = Path(path)
    if not where.exists():
        raise TaskFileError(
            f"{field}: {str(path)!r} is not a local file or directory; the dataset environment reads local "
            "files only (save a hub dataset first, e.g. datasets.load_dataset(NAME, split=...).to_json(FILE))"
        )
    special = special_file(where)
    if special is not None:
        raise TaskFileError(
            f"{field}: {str(special)!r} is not a regular file (a FIFO, device or socket); give a task file "
            "or a directory of them"
        )
    raw = _read_jsonl(where) if where.suffix == ".jsonl" else _read_datasets(where, field)
    rows = []
    for number, row in enumerate(raw, start=1):
        problem = row_problem(row, needs)
        if problem is not None:
            raise TaskFileError(f"{path}: row {number}: {problem}")
        rows.append(TaskRow(number, _frozen(row)))
    if not rows:
        raise TaskFileError(f"{path}: no rows")
    return tuple(rows)


def _read_jsonl(path: Path) -> list[object]:
    rows: list[object] = []
    with open_regular(path) as f:
        for number, line in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=1):
            if len(line) > MAX_LINE_BYTES:
                raise TaskFileError(f"{path}: row {number}: longer than {MAX_LINE_BYTES} bytes")
            if not line.strip():
                raise TaskFileError(f"{path}: row {number}: an empty line (one JSON object per line)")
            if len(rows) >= MAX_ROWS:
                raise TaskFileError(f"{path}: more than {MAX_ROWS} rows")
            try:
                rows.append(json.loads(line))
            except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError
                raise TaskFileError(
                    f"{path}: row {number}: not JSON ({' '.join(str(exc).split())[:120]})"
                ) from None
    return rows


def _thread_lock_for_progress() -> None:
    """Keep tqdm from making its multiprocessing lock in this process.

    `datasets` resolves data files through tqdm's `thread_map`, whose first use makes tqdm's write lock,
    and with it a `multiprocessing.RLock`: a named POSIX semaphore registered with the resource tracker that
    the trainer and its spawned environment workers share. A worker ends with `os._exit` (threads of
    abandoned steps must not keep it alive), which never unregisters the semaphore, so the tracker would warn
    of a leaked semaphore when the trainer exits, after a refusal and after a successful run alike. The rows
    are read by threads of one process, for which tqdm's thread lock is enough."""
    try:
        from tqdm.std import TqdmDefaultWriteLock  # type: ignore[attr-defined]
    except ImportError:  # pragma: no cover (datasets depends on tqdm)
        return
    if not hasattr(TqdmDefaultWriteLock, "mp_lock"):
        TqdmDefaultWriteLock.mp_lock = None


def _read_datasets(path: Path, field: str) -> list[object]:
    try:
        import datasets
    except ImportError:
        raise TaskFileError(
            f"{field}: reading {path.name} needs the datasets library: pip install datasets "
            "(or pip install 'treetrain[data]'); JSONL files are read without it"
        ) from None
    datasets.disable_progress_bars()
    _thread_lock_for_progress()
    try:
        if path.is_dir() and (path / "dataset_info.json").is_file():  # written by Dataset.save_to_disk
            table: Any = datasets.load_from_disk(str(path))
        elif path.is_dir():
            table = datasets.load_dataset(str(path), split="train")
        elif path.suffix in DATASETS_SUFFIXES:
            builder = DATASETS_SUFFIXES[path.suffix]
            extra = {"sep": "\t"} if path.suffix == ".tsv" else {}
            table = datasets.load_dataset(builder, data_files=str(path), split="train", **extra)
        else:
            raise TaskFileError(
                f"{field}: {path.name}: unknown kind of file; give .jsonl, "
                f"{', '.join(DATASETS_SUFFIXES)} or a directory datasets can load"
            )
    except TaskFileError:
        raise
    except Exception as exc:  # datasets and pyarrow raise many types for a file they cannot read
        raise TaskFileError(f"{path}: datasets cannot read it: {' '.join(str(exc).split())[:200]}") from None
    if isinstance(table, datasets.DatasetDict):
        raise TaskFileError(f"{path}: holds several splits ({', '.join(table)}); give one split's files")
    if len(table) > MAX_ROWS:
        raise TaskFileError(f"{path}: {len(table)} rows, more than {MAX_ROWS}")
    return list(table.to_list())
