"""The long document of the lookup task: an inventory table, and a directory hidden behind a tool.

Each row maps an item (a unique two-word name) to a warehouse code. The cities of the warehouses are not
in the document; only the `lookup` tool knows them. So the agent must read a long context (find the row)
and then use a tool (resolve the code): the long-shared-prefix geometry, where G samples share a prompt
of thousands of tokens.

Example:
    >>> t = make_table(seed=3, num_rows=4, num_warehouses=2)
    >>> len(t.rows), t.city_of(t.rows[0].warehouse) in CITIES
    (4, True)
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from envs.protocol import Immutable

ADJECTIVES = [
    "amber",
    "azure",
    "brass",
    "cobalt",
    "copper",
    "coral",
    "crimson",
    "dusty",
    "emerald",
    "frosted",
    "golden",
    "granite",
    "hollow",
    "ivory",
    "jade",
    "lunar",
    "maple",
    "misty",
    "navy",
    "olive",
    "onyx",
    "pearl",
    "quartz",
    "rusty",
    "sable",
    "silver",
    "slate",
    "smoky",
    "tawny",
    "velvet",
]
NOUNS = [
    "anchor",
    "barrel",
    "beacon",
    "bell",
    "bracket",
    "cable",
    "candle",
    "clamp",
    "compass",
    "crate",
    "drum",
    "easel",
    "funnel",
    "gasket",
    "hinge",
    "kettle",
    "ladder",
    "lantern",
    "lever",
    "mallet",
    "nozzle",
    "pulley",
    "ratchet",
    "rivet",
    "spindle",
    "spring",
    "tripod",
    "valve",
    "whistle",
    "winch",
]
CITIES = [
    "Lisbon",
    "Oslo",
    "Quito",
    "Accra",
    "Hanoi",
    "Lima",
    "Perth",
    "Riga",
    "Turin",
    "Bergen",
    "Cairo",
    "Dakar",
    "Essen",
    "Fargo",
    "Graz",
    "Hobart",
    "Izmir",
    "Kyoto",
    "Leeds",
    "Malmo",
    "Nantes",
    "Osaka",
    "Porto",
    "Reno",
    "Split",
    "Tartu",
    "Utrecht",
    "Vigo",
    "Windhoek",
    "Zagreb",
]


@dataclass(frozen=True)
class Row(Immutable):
    """One inventory row."""

    item: str
    name: str
    warehouse: str


@dataclass(frozen=True)
class Table(Immutable):
    """The document rows and the code -> city directory behind the tool."""

    rows: tuple[Row, ...]
    directory: Mapping[str, str]

    def city_of(self, code: str) -> str:
        """The city of warehouse `code`; a KeyError names an unknown code."""
        try:
            return self.directory[code]
        except KeyError:
            raise KeyError(f"unknown warehouse code {code!r}") from None

    def render(self) -> str:
        """The document text shown in the prompt."""
        lines = ["| item | name | warehouse |", "|---|---|---|"]
        lines += [f"| {r.item} | {r.name} | {r.warehouse} |" for r in self.rows]
        return "\n".join(lines)


def make_table(seed: int, num_rows: int, num_warehouses: int) -> Table:
    """A random table; the same arguments always give the same table."""
    if num_rows > len(ADJECTIVES) * len(NOUNS):
        raise ValueError(
            f"num_rows={num_rows} exceeds the {len(ADJECTIVES) * len(NOUNS)} distinct item names"
        )
    if not 1 <= num_warehouses <= 900:
        raise ValueError(f"num_warehouses must be in [1, 900], got {num_warehouses}")
    rng = random.Random(seed)
    codes = [f"W{c}" for c in rng.sample(range(100, 1000), num_warehouses)]
    directory = {code: rng.choice(CITIES) for code in codes}
    names = rng.sample([f"{a} {n}" for a in ADJECTIVES for n in NOUNS], num_rows)
    items = rng.sample(range(1000, 10000), num_rows)
    rows = tuple(Row(f"item-{i}", name, rng.choice(codes)) for i, name in zip(items, names))
    return Table(rows, MappingProxyType(directory))
