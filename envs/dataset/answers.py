"""The dataset environment's rewards: the built-in `answer` comparison and a user's `module:function`.

`answer` takes the final assistant message (the last one without tool calls, of an episode the environment
ended) and the row's `answer` field, passes both through `final_answer` and `normalize`, and gives 1.0 when
they are equal, else 0.0. Extraction, in this order, takes:

1. the contents of the last `\\boxed{...}` (braces balanced), when there is one;
2. else the text after the last `####` (GSM8K's marker);
3. else the text after the last "the answer is" (any case), up to the end of its line;
4. else the whole text.

`normalize` then strips surrounding whitespace, lower-cases (Unicode case folding), turns every run of
whitespace into one space, and drops one trailing period. A number in the row (`"answer": 42`) is compared
as its text (`42`, `2.5`), so `42.0` does not match `42`.

Example:
    >>> final_answer("Adding them gives 7, so the answer is 7."), normalize("7.")
    ('7.', '7')
    >>> final_answer(r"so $x = \\boxed{\\frac{1}{2}}$"), final_answer("work...\\n#### 1,200")
    ('\\\\frac{1}{2}', '1,200')
    >>> normalize("  The  Eiffel Tower. ")
    'the eiffel tower'
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

from envs.dataset.rows import TaskRow
from envs.protocol import Episode, ProtocolError, Rubric
from envs.registry import _import_module

_ANSWER_IS = re.compile(r"the answer is:?", re.IGNORECASE)
_SPACE = re.compile(r"\s+")


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def final_answer(text: str) -> str:
    """The answer part of `text` (see the module docstring for the order of the rules)."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    found = list(_ANSWER_IS.finditer(text))
    if found:
        return text[found[-1].end() :].split("\n", 1)[0].strip()
    return text.strip()


def normalize(text: str) -> str:
    """Whitespace stripped and collapsed, case folded, one trailing period dropped."""
    text = _SPACE.sub(" ", text.strip()).casefold()
    return text[:-1].rstrip() if text.endswith(".") else text


def reply(episode: Episode) -> str | None:
    """The final assistant message's text, or None when the episode did not end on one."""
    if episode.finish != "done":
        return None
    finals = [m for m in episode.messages if m.role == "assistant" and not m.tool_calls]
    return finals[-1].content if finals else None


def _row(episode: Episode) -> TaskRow:
    if not isinstance(episode.state, TaskRow):
        raise ProtocolError(f"the dataset rubric got state {type(episode.state).__name__}, not a TaskRow")
    return episode.state


class AnswerMatch(Rubric):
    """1.0 when the final answer equals the row's `field` after extraction and normalisation, else 0.0."""

    def __init__(self, field: str = "answer") -> None:
        self.field = field

    def score(self, episode: Episode) -> float:
        text = reply(episode)
        if text is None:
            return 0.0
        expected = _row(episode).fields[self.field]
        return float(normalize(final_answer(text)) == normalize(final_answer(str(expected))))


class FunctionReward(Rubric):
    """A user's `fn(episode, row) -> float`; `row` is the row's fields, read-only."""

    def __init__(self, fn: Callable[[Episode, Mapping[str, Any]], float], name: str) -> None:
        self.fn, self.name = fn, name

    def score(self, episode: Episode) -> float:
        value = self.fn(episode, _row(episode).fields)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ProtocolError(f"reward {self.name!r} returned {type(value).__name__}, not a number")
        return float(value)


def load_callable(target: str, field: str) -> Any:
    """The object `module:attr` names (`module` importable, `attr` possibly dotted), or a one-line error."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{field}: {target!r} is not of the form 'module:name'")
    try:  # like an environment's `module:Class`: a module in the current directory is found too
        obj: Any = _import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{field}: cannot load {target!r}: {exc}") from None
    return obj


def make_reward(name: str) -> Rubric:
    """`answer`, or the function `module:function` names."""
    if name == "answer":
        return AnswerMatch()
    if ":" not in name:
        raise ValueError(f"reward: {name!r} is neither 'answer' nor 'module:function'")
    fn = load_callable(name, "reward")
    if not callable(fn):
        raise ValueError(f"reward: {name!r} is a {type(fn).__name__}, not a function")
    problem = call_problem(fn, 2)
    if problem is not None:
        raise ValueError(f"reward: {name!r} cannot be called as fn(episode, row): {problem}")
    return FunctionReward(fn, name)


def call_problem(fn: Callable[..., Any], positional: int) -> str | None:
    """Why `fn` cannot take `positional` arguments, or None (also when Python cannot tell its signature,
    as for some built-ins): a wrong function is refused when the environment is made, before any model
    loads, not at the first rubric call after the first rollout.

    >>> import json
    >>> call_problem(json.loads, 2)
    'json.loads(s, *, cls=None, object_hook=None, ...): too many positional arguments'
    >>> call_problem(lambda episode, row: 1.0, 2) is None
    True
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*range(positional))
    except TypeError as exc:
        shown = str(signature)
        shown = shown if len(shown) <= 40 else shown[:36].rsplit(",", 1)[0] + ", ...)"
        name = f"{getattr(fn, '__module__', '') or ''}.{getattr(fn, '__qualname__', fn)}".lstrip(".")
        return f"{name}{shown}: {exc}"
    return None
