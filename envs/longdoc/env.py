"""Longdoc: find a vault's access code in a long document, with a `read` tool that quotes a span of lines.

The prompt holds the whole document (`num_tokens` long, `envs.longdoc.document`) and asks for the access
code of one vault; other vaults' codes are decoys. `read(first, last)` returns up to `MAX_SPAN` numbered
lines verbatim, so an agent can check the line it found before answering. This is the long-context
geometry a context group is for (docs/long-context.md): G samples share a prompt of N tokens and differ in a
few short turns. Rubrics: `exact` (the final answer holds the right code and no other vault's) and `cited`
(`exact`, and a `read` covered the line that states it).

The length is counted with the tokenizer in `tokenizer` (a local directory, read with `local_files_only`)
when given, else in UTF-8 bytes, which bounds the tokens of any byte-level tokenizer from above.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from envs.longdoc.document import Document, make_document
from envs.protocol import Episode, Immutable, Message, Rubric
from envs.tools import Tool, ToolEnv

SYSTEM_PROMPT = (
    "You answer a question about the numbered document below. The read tool quotes lines first to last of "
    "it. Reply with the four-digit code only."
)
MAX_SPAN = 20
"""Most lines one `read` returns."""
MAX_TOKENS = 1 << 21
"""Largest document (2M tokens); `num_tokens` is user input and sizes the prompt."""
_CODE = re.compile(r"\b\d{4}\b")


@dataclass(frozen=True)
class LongDocTask(Immutable):
    """One task: the document, the vault asked about, and its code and line."""

    document: Document
    vault: str
    code: str
    line: int


def _task(episode: Episode) -> LongDocTask:
    if not isinstance(episode.state, LongDocTask):
        raise TypeError(f"longdoc rubric got state {episode.state!r}")
    return episode.state


class ExactCode(Rubric):
    """1.0 when the final answer holds the asked vault's code and no other vault's code, else 0.0."""

    def score(self, episode: Episode) -> float:
        task = _task(episode)
        answers = [m.content for m in episode.messages if m.role == "assistant" and not m.tool_calls]
        if episode.finish != "done" or not answers:
            return 0.0
        known = {f.code for f in task.document.facts}
        return float(set(_CODE.findall(answers[-1])) & known == {task.code})


class CitedCode(Rubric):
    """`ExactCode`, counted only when some `read` call's span covered the line that states the code."""

    def score(self, episode: Episode) -> float:
        task = _task(episode)
        covered = False
        for m in episode.messages:
            for c in m.tool_calls if m.role == "assistant" else ():
                first, last = c.arguments.get("first"), c.arguments.get("last")
                if c.name == "read" and isinstance(first, int) and isinstance(last, int):
                    covered |= first <= task.line <= last and last - first < MAX_SPAN
        return ExactCode().score(episode) if covered else 0.0


def _counter(tokenizer: str | None) -> Callable[[str], int] | None:
    if tokenizer is None:
        return None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    return lambda text: len(tok.encode(text, add_special_tokens=False))


class LongDocEnv(ToolEnv):
    """Find a fact in a document of `num_tokens` tokens, with `vaults` codes in it (one asked, the rest decoys)."""

    def __init__(self, num_tokens: int = 4096, vaults: int = 4, tokenizer: str | None = None) -> None:
        if (
            isinstance(num_tokens, bool)
            or not isinstance(num_tokens, int)
            or not 256 <= num_tokens <= MAX_TOKENS
        ):
            raise ValueError(f"num_tokens must be a whole number in [256, {MAX_TOKENS}], got {num_tokens!r}")
        self.num_tokens, self.vaults = num_tokens, vaults
        self.count = _counter(tokenizer)
        self.task: LongDocTask | None = None

    def reset(self, seed: int) -> Sequence[Message]:
        document = make_document(seed, self.num_tokens, self.vaults, self.count)
        fact = random.Random(seed).choice(document.facts)
        self.task = LongDocTask(document, fact.vault, fact.code, fact.line)
        question = f"What is the access code of the {fact.vault} vault?"
        return (Message("system", f"{SYSTEM_PROMPT}\n\n{document.text()}"), Message("user", question))

    def read(self, first: int, last: int) -> str:
        """Quote lines first to last of the document (inclusive, numbered from 1, at most 20 lines).

        Args:
            first: the first line to quote.
            last: the last line to quote.
        """
        if self.task is None:
            raise RuntimeError("read called before reset")
        size = len(self.task.document.lines)
        if not 1 <= first <= last <= size or last - first >= MAX_SPAN:
            raise ValueError(
                f"need 1 <= first <= last <= {size} and at most {MAX_SPAN} lines, got {first}..{last}"
            )
        return self.task.document.numbered(first, last)

    def tools(self) -> Sequence[Tool]:
        return (Tool.from_function(self.read),)

    def state(self) -> LongDocTask | None:
        return self.task

    def rubrics(self) -> Mapping[str, Rubric]:
        return {"exact": ExactCode(), "cited": CitedCode()}
