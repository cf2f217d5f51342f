"""The message-level environment protocol: what an environment sees and returns.

An environment works on chat messages, never on tokens. `reset(seed)` returns the opening messages
(system and user) of a task drawn from `seed`; `tool_specs()` lists the tools the agent may call;
`step(assistant_message)` answers one assistant turn with tool results or other messages and says
whether the episode is over. Tokenization, the chat template, budgets and timeouts belong to the
token-level wrapper (`envs.wrapper.TokenEnv`), so an environment never needs to know about them.

Rewards are kept apart from dynamics: a `Rubric` scores a finished `Episode` (its messages plus the
environment's task state), so one environment can be scored several ways (`Environment.rubrics()`).

Tool calls are OpenAI-style: an assistant `Message` carries `ToolCall(id, name, arguments)` and each result
comes back as a `tool` message whose `tool_call_id` names the call. `envs.tools.ToolEnv` implements the
usual dispatch, so most environments only write `reset`, their tools and a rubric.
"""

from __future__ import annotations

import copy
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, TypeVar

from treetrain.errors import TreetrainError
from treetrain.trajectory import TrajectoryError, check_reward

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")

_E = TypeVar("_E", bound="Environment")
_T = TypeVar("_T")


class ProtocolError(TreetrainError, ValueError):
    """A value that breaks the protocol (bad role, non-JSON arguments, ...); the message names it."""


class Immutable:
    """Mixin for frozen value types: copies share the value (read-only mappings cannot be deep-copied,
    and forking an episode should not copy long documents)."""

    def __copy__(self: _T) -> _T:
        return self

    def __deepcopy__(self: _T, memo: dict[int, object]) -> _T:
        return self


@dataclass(frozen=True)
class ToolCall(Immutable):
    """One OpenAI-style function call. `arguments` is the decoded JSON object, not a string."""

    id: str
    name: str
    arguments: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ProtocolError(f"tool call {self.id!r}: name {self.name!r} must be a non-empty string")
        if not isinstance(self.arguments, Mapping):
            raise ProtocolError(f"tool call {self.id!r}: arguments must be a JSON object")
        try:
            json.dumps(dict(self.arguments))
        except (TypeError, ValueError) as exc:
            raise ProtocolError(
                f"tool call {self.id!r}: arguments are not JSON-serialisable: {exc}"
            ) from None
        object.__setattr__(self, "arguments", MappingProxyType(dict(self.arguments)))

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI chat format (arguments as an object, which HF chat templates expect)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": dict(self.arguments)},
        }


@dataclass(frozen=True)
class ToolSpec(Immutable):
    """A tool the agent may call. `parameters` is a JSON Schema object describing the arguments."""

    name: str
    description: str
    parameters: Mapping[str, Any] = field(
        default_factory=lambda: MappingProxyType({"type": "object", "properties": {}})
    )

    def __post_init__(self) -> None:
        from envs.tool_schema import parameters_problem

        if not isinstance(self.name, str) or not self.name:
            raise ProtocolError(f"tool name {self.name!r} must be a non-empty string")
        if not isinstance(self.parameters, Mapping):
            raise ProtocolError(f"tool {self.name!r}: parameters must be a JSON Schema object")
        problem = parameters_problem(self.parameters)
        if problem is not None:
            raise ProtocolError(f"tool {self.name!r}: {problem}")

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI `tools=[...]` entry, as passed to `apply_chat_template(tools=...)`."""
        params = json.loads(json.dumps(dict(self.parameters)))
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": params},
        }


@dataclass(frozen=True)
class Message(Immutable):
    """One chat message.

    `tool_calls` only on assistant messages; `tool_call_id` (and optionally `name`) only on tool messages.
    """

    role: Role
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ProtocolError(f"message role {self.role!r} is not one of {list(ROLES)}")
        if not isinstance(self.content, str):
            raise ProtocolError(
                f"{self.role} message content must be a string, got {type(self.content).__name__}"
            )
        object.__setattr__(self, "tool_calls", tuple(self.tool_calls))
        if self.tool_calls and self.role != "assistant":
            raise ProtocolError(f"{self.role} message has tool_calls; only assistant messages may")
        if self.tool_call_id is not None and self.role != "tool":
            raise ProtocolError(f"{self.role} message has tool_call_id; only tool messages may")

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI/HF chat dict for this message."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [c.to_openai() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


@dataclass(frozen=True)
class StepResult(Immutable):
    """What the environment answers to one assistant turn.

    `messages` (tool results, or a user reply) are shown to the agent unless `done`; `info` holds free-form
    diagnostics for logs, never anything a rubric or the trainer depends on.
    """

    messages: tuple[Message, ...] = ()
    done: bool = False
    info: Mapping[str, str | int | float | bool] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        object.__setattr__(self, "messages", tuple(self.messages))
        for m in self.messages:
            if not isinstance(m, Message) or m.role not in ("user", "tool"):
                raise ProtocolError(
                    f"step returned {m!r}; only user and tool messages may follow an assistant turn"
                )
        object.__setattr__(self, "info", MappingProxyType(dict(self.info)))


@dataclass(frozen=True)
class Episode(Immutable):
    """A finished episode as a rubric sees it.

    `state` is whatever `Environment.state()` returned at the end (typically the task with its answer);
    `finish` says why the episode stopped: "done" (the environment ended it), "max_turns" or
    "max_tokens" (a budget of the wrapper ran out).
    """

    messages: tuple[Message, ...]
    state: object
    finish: str = "done"


class Rubric(ABC):
    """Maps a finished episode to a scalar reward. Stateless; built-in rubrics return values in [0, 1]."""

    @abstractmethod
    def score(self, episode: Episode) -> float:
        """The reward of `episode`; must be finite."""

    def __call__(self, episode: Episode) -> float:
        try:
            return check_reward(self.score(episode), f"{type(self).__name__}'s reward")
        except TrajectoryError as exc:
            raise ProtocolError(str(exc)) from None


class Environment(ABC):
    """A message-level environment. Subclass it (or `envs.tools.ToolEnv`) and register it.

    The wrapper calls `reset(seed)` once, then `step` once per assistant turn until `done` or a budget
    runs out. To branch an episode (tree rollouts), the wrapper calls `fork(branch)` and steps the copies
    independently, so the state must live on the instance and survive `copy.deepcopy`.
    """

    @abstractmethod
    def reset(self, seed: int) -> Sequence[Message]:
        """Start a new task drawn deterministically from `seed`; return the opening system/user messages."""

    @abstractmethod
    def step(self, message: Message) -> StepResult:
        """Answer one assistant message (whose `tool_calls` are already parsed)."""

    def tool_specs(self) -> tuple[ToolSpec, ...]:
        """Tools offered to the agent for the current task (rendered into the prompt by the template)."""
        return ()

    def state(self) -> object:
        """What rubrics score against, typically a frozen dataclass holding the task and its answer."""
        return None

    def rubrics(self) -> Mapping[str, Rubric]:
        """Named ways to score this environment. The first entry is the default."""
        return {}

    def fork(self: _E, branch: int = 0) -> _E:
        """An independent copy to step separately. `branch` numbers the siblings, so a stochastic
        environment can reseed each copy; the default deep copy suits deterministic environments."""
        del branch
        return copy.deepcopy(self)

    def release(self) -> None:
        """Free what this environment holds once its episode needs it no more (one hosted in a worker
        frees its handle there); the default holds nothing beyond the object itself."""
        return None


def default_rubric(env: Environment, name: str | None = None) -> Rubric:
    """The rubric called `name`, or the environment's first one; errors list the known names."""
    rubrics = env.rubrics()
    if not rubrics:
        raise ProtocolError(f"{type(env).__name__} defines no rubrics; pass one explicitly")
    if name is None:
        return next(iter(rubrics.values()))
    try:
        return rubrics[name]
    except KeyError:
        raise ProtocolError(
            f"{type(env).__name__} has no rubric {name!r}; known: {sorted(rubrics)}"
        ) from None
