"""The document of the longdoc task: numbered lines of filler prose, with a few vault codes among them.

Why: a long-context workload needs a prompt whose length is a parameter and whose answer sits at one place
in it. Lines are drawn from a seeded generator until the document reaches `num_tokens`, counted with a
tokenizer when one is given and in UTF-8 bytes otherwise (a byte-level tokenizer never makes more tokens
than bytes, so the byte count bounds the token count from above). A few lines state the access code of a
vault; the question asks for one of them, and the others are decoys.

Example:
    >>> doc = make_document(seed=3, num_tokens=600, vaults=3)
    >>> len(doc.facts), doc.text().count("access code") == 3
    (3, True)
    >>> doc == make_document(seed=3, num_tokens=600, vaults=3)
    True
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from envs.protocol import Immutable

PLACES = (
    "north archive",
    "river office",
    "old mill",
    "harbor depot",
    "east tower",
    "stone hall",
    "west gate",
)
KEEPERS = ("the keeper", "a clerk", "the night guard", "an auditor", "the porter", "a courier", "the steward")
ACTS = ("logged", "moved", "sealed", "counted", "checked", "copied", "stamped", "sorted")
GOODS = (
    "crates of lamp oil",
    "bolts of wool",
    "sacks of grain",
    "boxes of ledgers",
    "barrels of tar",
    "coils of rope",
)
TIMES = (
    "at dawn",
    "before noon",
    "after the bell",
    "at dusk",
    "during the rain",
    "on the last day of the month",
)
VAULTS = (
    "Amber",
    "Birch",
    "Cedar",
    "Dune",
    "Ember",
    "Fjord",
    "Garnet",
    "Heath",
    "Iris",
    "Juniper",
    "Kestrel",
)


@dataclass(frozen=True)
class Fact(Immutable):
    """One vault's access code and the line that states it."""

    vault: str
    code: str
    line: int


@dataclass(frozen=True)
class Document(Immutable):
    """The numbered lines and the facts among them."""

    lines: tuple[str, ...]
    facts: tuple[Fact, ...]

    def numbered(self, first: int, last: int) -> str:
        """Lines `first` to `last` (inclusive, 1-based) as the prompt shows them."""
        return "\n".join(f"{i:04d}. {self.lines[i - 1]}" for i in range(first, last + 1))

    def text(self) -> str:
        """The whole document as the prompt shows it."""
        return self.numbered(1, len(self.lines))


def _filler(rng: random.Random) -> str:
    return (
        f"In the {rng.choice(PLACES)}, {rng.choice(KEEPERS)} {rng.choice(ACTS)} "
        f"{rng.randint(2, 99)} {rng.choice(GOODS)} {rng.choice(TIMES)}."
    )


def _bytes(text: str) -> int:
    return len(text.encode("utf-8"))


def _fill(lines: list[str], rng: random.Random, count: Callable[[str], int], limit: int) -> None:
    """Append filler lines while the numbered document stays within `limit` by `count`."""
    used = sum(count(f"{i:04d}. {line}\n") for i, line in enumerate(lines, 1))
    while True:
        line = _filler(rng)
        cost = count(f"{len(lines) + 1:04d}. {line}\n")
        if used + cost > limit:
            return
        lines.append(line)
        used += cost


def make_document(
    seed: int, num_tokens: int, vaults: int = 4, count: Callable[[str], int] | None = None
) -> Document:
    """A document of at most `num_tokens` tokens by `count` (default: UTF-8 bytes, see the module docstring),
    with `vaults` facts at seeded lines; the same arguments always give the same document."""
    if not 1 <= vaults <= len(VAULTS):
        raise ValueError(f"vaults must be in [1, {len(VAULTS)}], got {vaults}")
    count = count or _bytes
    rng = random.Random(seed)
    names = rng.sample(VAULTS, vaults)
    codes = rng.sample(range(1000, 10000), vaults)
    statements = [f"The access code of the {n} vault is {c}." for n, c in zip(names, codes)]
    lines: list[str] = []
    _fill(lines, rng, count, num_tokens)
    if len(lines) < vaults:
        raise ValueError(
            f"num_tokens={num_tokens} is too short for {vaults} facts: make it at least {100 * vaults}"
        )
    at = sorted(rng.sample(range(len(lines)), vaults))
    order = rng.sample(range(vaults), vaults)
    facts = []
    for slot, k in zip(at, order):
        lines[slot] = statements[k]
        facts.append(Fact(names[k], str(codes[k]), slot + 1))
    _fill(lines, rng, count, num_tokens)  # a fact is shorter than the filler line it replaced
    return Document(tuple(lines), tuple(facts))
