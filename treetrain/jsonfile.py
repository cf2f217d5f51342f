"""One bounded reader for the JSON files a user can touch (adapter configs, checkpoint state, DeepSpeed
configs): the size is checked from `stat` before anything is read, the read itself is bounded, and every
way the bytes can be wrong (too large, not a regular file, not UTF-8, not JSON, nested past the parser's
recursion limit, an integer longer than Python converts, not an object) becomes one line naming the file,
raised as the caller's own error type.

Example:
    >>> import pathlib, tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "a.json"
    >>> _ = path.write_text('{"r": 8}')
    >>> read_json_object(path, max_bytes=1024)
    {'r': 8}
    >>> _ = path.write_text("[1, 2]")
    >>> read_json_object(path, max_bytes=1024)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: .../a.json: the top level must be an object, found a list
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from treetrain.io import open_regular

_KINDS = {list: "a list", str: "a string", int: "a number", float: "a number", bool: "a boolean"}


def read_json_object(
    path: str | os.PathLike[str], *, max_bytes: int, error: Callable[[str], Exception] = ValueError
) -> dict[str, Any]:
    """The JSON object in `path`, or `error(message)` raised with a one-line message naming the file."""
    p = Path(path)
    try:
        info = p.stat()
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{p}: not a regular file")
        if info.st_size > max_bytes:
            raise error(f"{p}: {info.st_size} bytes, larger than the limit of {max_bytes} bytes")
        with open_regular(p) as f:  # non-blocking open: a FIFO swapped in after the stat is refused too
            raw = f.read(max_bytes + 1)  # bounded even if the file grew after the stat
    except OSError as exc:
        raise error(f"{p}: cannot read it ({exc.strerror or type(exc).__name__})") from None
    if len(raw) > max_bytes:
        raise error(f"{p}: larger than the limit of {max_bytes} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{p}: not UTF-8 text (a bad byte at offset {exc.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{p}: invalid JSON at line {exc.lineno}: {exc.msg}") from None
    except RecursionError:
        raise error(f"{p}: not valid JSON: nested too deeply") from None
    except ValueError as exc:  # e.g. an integer longer than Python converts
        raise error(f"{p}: not valid JSON: {' '.join(str(exc).split())[:120]}") from None
    if not isinstance(data, dict):
        raise error(f"{p}: the top level must be an object, found {_KINDS.get(type(data), 'null')}")
    return data
