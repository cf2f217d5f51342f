"""The one base of every error treetrain raises for bad input, and the configuration error.

A user can hand treetrain a bad config, a corrupt tree file, an invalid trajectory or JSONL record, a model
it does not support, a budget too small, a run directory that is not its own, an environment that breaks the
protocol, a checkpoint that does not load. Each of those errors derives from `TreetrainError`, so a caller
(every CLI verb among them) tells "your input is wrong" from "treetrain has a bug" with one `except`, and
prints the message as it is: one line that names the problem. Each error keeps its builtin base too
(`ConfigError` is a `ValueError`), so code that catches the builtin keeps working.

Errors that mean a bug in treetrain, and exceptions used for control flow, are not `TreetrainError`s.

Example:
    >>> try:
    ...     raise ConfigError("must be >= 1, got 0", field="root")
    ... except TreetrainError as exc:
    ...     print(exc, "|", exc.within("rollout.fanout"))
    root: must be >= 1, got 0 | rollout.fanout.root: must be >= 1, got 0
"""

from __future__ import annotations


class TreetrainError(Exception):
    """Bad input: the message is one line that names what is wrong (the CLI prints it and exits with 2)."""


class ConfigError(TreetrainError, ValueError):
    """A setting is invalid; the message starts with the setting's name (`rollout.fanout.root: ...`).

    A library dataclass that doubles as a config section (`FanOut` is `rollout.fanout`) does not know where
    it sits in the config: it names only its own `field`, and the config loader puts the section in front
    (`within`). Sections of the trainer's config name the full key in the message itself.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        """The field the message is about, relative to the dataclass that raised it (None: named in it)."""
        self.reason = message
        """The message without the field's name."""

    def within(self, section: str) -> ConfigError:
        """This error with its field named from the top of the config (itself when the field is unknown)."""
        if not self.field or not section:
            return self
        return ConfigError(self.reason, field=f"{section}.{self.field}")
