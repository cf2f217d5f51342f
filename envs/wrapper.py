"""`TokenEnv`: the single token-level wrapper around a message-level environment.

It owns everything between token ids and messages: the model's own chat template
(`envs.template.ChatTemplate`), its tool-call format (`envs.formats`), the turn and token budgets, the
size of tool results and the step timeout. It builds the episode's `Trajectory` directly from token ids:
the prompt segment is the templated opening, each policy segment is exactly the sampled ids (with the
sampler's logprobs), each observation segment is the token difference the template adds after a turn.
Nothing is re-tokenized, so the trajectory is what the model saw. When the template rewrites earlier
turns, the episode continues as a new call of the same trajectory (`TurnResult.new_call`).

Failures in the agent's output never crash an episode. A malformed tool call, an unknown tool, bad
arguments, a tool that raises and a step that exceeds `step_timeout_s` all become `tool` observations.
An exception raised by the environment's own `step` (not by a tool) is a bug in the environment and
propagates as `EnvStepError`. An environment hosted in a worker process (`envs.remote.RemoteEnv`, what the
trainer uses) keeps the step deadline in the worker, and its failures arrive as `envs.remote.EnvFailure`.

Threads: a `TokenEnv` is one episode, used by one thread at a time. Different episodes may be stepped and
forked from different threads at once, as the rollout scheduler does, and so may the forks of one episode
while it is not being stepped: episodes share only what they read (the tokenizer and the chat template),
and each owns its environment (a fork is the environment's own `fork`; an in-process step runs on a copy,
in its own thread, `envs.step_thread`). State that an in-process environment shares between its objects
(a module or class attribute) is the environment's to guard; a worker (`envs.remote`) runs the requests of
one environment in order. `tests/envs/test_wrapper_threads.py` compares threaded episodes with a
sequential run.

`EpisodeLimits` (turns, tokens, step timeout, `envs.episode_limits`) is also the trainer's `rollout.episode`
config section, as it is: its defaults are the demo's and its field names are the config's keys
(`--set rollout.episode.max_turns=6`).

Example (a scripted "policy"; a real one samples from a model):
    >>> from transformers import AutoTokenizer
    >>> from treetrain.assets import tokenizer_path
    >>> from envs.calculator import CalculatorEnv
    >>> env = TokenEnv(CalculatorEnv(), AutoTokenizer.from_pretrained(tokenizer_path()), env_name="calculator")
    >>> prompt = env.reset(seed=0)
    >>> answer = env.template.encode(f"{env.env.state().answer}{env.template.end_of_turn}")
    >>> env.step(answer).done, env.trajectory("ep0").reward
    (True, 1.0)
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from envs.episode_limits import EpisodeLimits
from envs.protocol import Environment, Episode, Message, Rubric, StepResult, ToolSpec, default_rubric
from envs.step_thread import DeadlineEnvironment, step_within
from envs.template import ChatTemplate, RenderError, Rewrite
from treetrain.errors import ConfigError, TreetrainError
from treetrain.trajectory import Call, Role, Segment, Trajectory, TrajectoryMeta


class PromptTooLongError(TreetrainError, ValueError):
    """A task's opening does not fit the episode's token budget (the message names both numbers)."""


class EnvStepError(TreetrainError, RuntimeError):
    """The environment's `step` raised (a bug in the environment, not in the agent's output)."""


log = logging.getLogger(__name__)


def _encodable(text: str) -> str:
    """`text` with lone surrogates replaced, so that it encodes as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "".join("\ufffd" if "\ud800" <= ch <= "\udfff" else ch for ch in text)
    return text


class Finish(str, Enum):
    """Why an episode ended."""

    DONE = "done"
    MAX_TURNS = "max_turns"
    MAX_TOKENS = "max_tokens"
    TEMPLATE_ERROR = "template_error"
    """The chat template refused to render the conversation (e.g. Mistral's, after a turn whose only tool
    call was malformed); the episode ends here instead of crashing the rollout."""


@dataclass(frozen=True)
class WrapperConfig:
    """Budgets and limits of one episode, and how its turns are rendered and parsed."""

    episode: EpisodeLimits = field(default_factory=EpisodeLimits)
    """Turn and token budgets and the step timeout."""
    end_of_turn: str | None = None
    """The text that ends an assistant turn, any number of tokens (None: what the chat template writes
    after an assistant message, up to its first special token, e.g. `<|im_end|>` or `<|eot_id|>`)."""
    tool_format: str = "auto"
    """Tool-call syntax, a name in `envs.formats.FORMATS` ('auto': detected from the chat template)."""
    stop_token_ids: tuple[int, ...] = ()
    """More token ids that end a turn besides the end-of-turn marker and the tokenizer's EOS (the trainer
    adds the model's `generation_config.eos_token_id`)."""
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Extra chat-template variables (`{"enable_thinking": False}` for Qwen3 and GLM), on every rendering."""
    max_tool_result_chars: int = 8000
    """Longest tool message shown to the agent, in characters; a longer one is cut there and ends with
    a `[... N more characters truncated]` marker, so a tool that dumps megabytes cannot fill the context."""

    def __post_init__(self) -> None:
        value = self.max_tool_result_chars
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"must be a positive integer, got {value!r}", field="max_tool_result_chars")


@dataclass(frozen=True)
class TurnResult:
    """The wrapper's answer to one policy turn.

    `observation` holds the tokens to feed before the next turn (empty when `done`); `messages` are the
    observation messages the agent sees (or, when done, the environment's closing messages).
    """

    observation: tuple[int, ...]
    done: bool
    finish: Finish | None
    messages: tuple[Message, ...]
    new_call: bool = False
    """The template rewrote earlier turns: `observation` is the whole context of a new call of the same
    trajectory (the sampler must encode it from scratch), not a continuation."""


class TokenEnv:
    """Runs one episode of a message-level environment at the token level. See the module docstring."""

    def __init__(
        self, env: Environment, tokenizer: Any, config: WrapperConfig | None = None, env_name: str = ""
    ) -> None:
        self.env = env
        self.config = config or WrapperConfig()
        self.template = ChatTemplate(
            tokenizer,
            self.config.end_of_turn,
            self.config.tool_format,
            self.config.stop_token_ids,
            self.config.template_kwargs,
        )
        self.env_name = env_name or type(env).__name__
        self._seed: int | None = None
        self._tools: tuple[ToolSpec, ...] = ()
        self._messages: list[Message] = []
        self._calls: list[Call] = []
        self._segments: list[Segment] = []
        self._context: list[int] = []
        self._rendered = ""
        self._turns = 0
        self._finish: Finish | None = None
        self.timed_out = False
        """Whether the last `step`'s environment call missed its deadline (`step_timeout_s`)."""

    # ----- state ------------------------------------------------------------------------------------
    @property
    def context(self) -> tuple[int, ...]:
        """Every token of the current call so far, in order: exactly what the model has been fed."""
        return tuple(self._context)

    @property
    def messages(self) -> tuple[Message, ...]:
        return tuple(self._messages)

    @property
    def done(self) -> bool:
        return self._finish is not None

    @property
    def finish(self) -> Finish | None:
        return self._finish

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Single token ids that end a turn."""
        return self.template.stop_token_ids

    @property
    def stop_sequences(self) -> tuple[tuple[int, ...], ...]:
        """Token sequences that end a turn (the end-of-turn marker, EOS, ...); pass them to the sampler."""
        return self.template.stop_sequences

    @property
    def episode_tokens(self) -> int:
        """Most tokens in one call's context (`EpisodeLimits.episode_tokens`: the trainer resolves a null
        `max_episode_tokens` against the model's context before the wrapper sees it)."""
        return self.config.episode.episode_tokens()

    def turn_budget(self) -> int:
        """Most tokens the next turn may sample (turn and episode budgets together)."""
        return min(self.config.episode.max_turn_tokens, self.episode_tokens - len(self._context))

    # ----- episode ----------------------------------------------------------------------------------
    def reset(self, seed: int) -> tuple[int, ...]:
        """Start an episode; returns the prompt tokens (which end with the generation prompt)."""
        opening = tuple(self.env.reset(seed))
        if not opening or any(
            not isinstance(m, Message) or m.role not in ("system", "user") for m in opening
        ):
            raise EnvStepError(f"{self.env_name}.reset must return system/user messages, got {opening!r}")
        opening = tuple(self._truncate(m) for m in opening)
        self._seed, self._tools = seed, tuple(self.env.tool_specs())
        self.template.check_tools(self._tools)
        self._messages = list(opening)
        rendered = self.template.render(opening, self._tools, generation_prompt=True)
        prompt = self.template.encode(rendered)
        if len(prompt) >= self.episode_tokens:
            raise PromptTooLongError(
                f"{self.env_name} seed {seed}: prompt has {len(prompt)} tokens, which leaves no room under "
                f"max_episode_tokens={self.episode_tokens} (treetrain train: rollout.episode.max_episode_tokens)"
            )
        self._calls, self._segments = [], [Segment(Role.PROMPT, prompt)]
        self._context, self._rendered = list(prompt), rendered
        self._turns, self._finish = 0, None
        return prompt

    def step(
        self,
        tokens: Sequence[int],
        logprobs: Sequence[float] | None = None,
        version: int | None = None,
        runs: Sequence[tuple[int, int]] = (),
    ) -> TurnResult:
        """Feed one sampled assistant turn (its token ids, ending with the stop token when it stopped), and
        the weight version that sampled it when known (kept on the turn's policy segment). A turn whose
        tokens several versions drew (its request was interrupted for new weights) gives `runs`, the
        `(tokens, version)` runs in order, and becomes one policy segment per run."""
        if self._seed is None or self.done:
            raise RuntimeError(
                f"{self.env_name}: step called {'before reset' if self._seed is None else 'after done'}"
            )
        if not tokens or len(tokens) > self.turn_budget():
            raise ValueError(
                f"{self.env_name}: a turn must have 1..{self.turn_budget()} tokens, got {len(tokens)}"
            )
        self.timed_out = False
        if runs and (any(n < 1 for n, _ in runs) or sum(n for n, _ in runs) != len(tokens)):
            raise ValueError(f"{self.env_name}: version runs {tuple(runs)} do not cover {len(tokens)} tokens")
        start = 0
        for n, v in runs or ((len(tokens), version),):
            lps = None if logprobs is None else tuple(logprobs[start : start + n])
            self._segments.append(Segment(Role.POLICY, tuple(tokens[start : start + n]), lps, v))
            start += n
        self._context.extend(tokens)
        text, closed = self.template.turn_text(tokens)
        stop = tuple(tokens[len(tokens) - self.template.stop_length(tokens) :]) if closed else ()
        parsed = self.template.format.read(text, self._turns, self._tools)
        self._turns += 1
        self._messages.append(parsed.message)
        errors = tuple(e.to_message() for e in parsed.errors)
        if errors and not parsed.message.tool_calls:
            result = StepResult(errors)
        else:
            result = self._run_step(parsed.message)
            result = StepResult(errors + result.messages, result.done, result.info)
        result = StepResult(tuple(self._truncate(m) for m in result.messages), result.done, result.info)
        self._messages.extend(result.messages)
        if result.done:
            return self._end(Finish.DONE, result.messages)
        if self._turns >= self.config.episode.max_turns:
            return self._end(Finish.MAX_TURNS, result.messages)
        history = self._messages[: len(self._messages) - len(result.messages)]
        try:
            nxt = self.template.observation(
                history, result.messages, self._tools, closed, self._rendered, stop
            )
        except RenderError as exc:
            log.warning("%s: episode ended: %s", self.env_name, exc)
            return self._end(Finish.TEMPLATE_ERROR, result.messages)
        if isinstance(nxt, Rewrite):  # the template changed earlier turns: a new call of this trajectory
            if len(nxt.tokens) >= self.episode_tokens:
                return self._end(Finish.MAX_TOKENS, result.messages)
            self._calls.append(Call(tuple(self._segments)))
            self._segments, self._context, self._rendered = (
                [Segment(Role.PROMPT, nxt.tokens)],
                [*nxt.tokens],
                nxt.rendered,
            )
            return TurnResult(nxt.tokens, False, None, result.messages, new_call=True)
        obs = nxt.tokens
        if len(self._context) + len(obs) >= self.episode_tokens:
            return self._end(Finish.MAX_TOKENS, result.messages)
        self._segments.append(Segment(Role.OBSERVATION, obs))
        self._context.extend(obs)
        self._rendered = nxt.rendered
        return TurnResult(obs, False, None, result.messages)

    def _end(self, finish: Finish, messages: tuple[Message, ...]) -> TurnResult:
        self._finish = finish
        return TurnResult((), True, finish, messages)

    def _truncate(self, message: Message) -> Message:
        """A tool message cut at `max_tool_result_chars`; any message's text made encodable (a lone
        surrogate, which a tool can return in a `str`, becomes U+FFFD instead of crashing the tokenizer)."""
        limit, text = self.config.max_tool_result_chars, _encodable(message.content)
        if message.role == "tool" and len(text) > limit:
            text = f"{text[:limit]}\n[... {len(text) - limit} more characters truncated]"
        if text == message.content:
            return message
        return Message(message.role, text, tool_call_id=message.tool_call_id, name=message.name)

    def _run_step(self, message: Message) -> StepResult:
        timeout = self.config.episode.step_timeout_s
        if isinstance(self.env, DeadlineEnvironment):  # hosted elsewhere: it keeps the deadline itself
            answered = self.env.step_within(message, timeout)
        elif timeout is None:
            return self._call_env(self.env, message)
        else:
            try:
                stepped = step_within(self.env, message, timeout, self._call_env, self.env_name)
            except EnvStepError:
                raise
            except Exception as exc:
                raise EnvStepError(
                    f"{self.env_name}: a step timeout steps a deep copy of the environment, and this one cannot "
                    f"be copied ({exc!r}); make its state deep-copyable (see Environment) or set step_timeout_s=None"
                ) from exc
            answered = None if stepped is None else stepped[1]
            if stepped is not None:
                self.env = stepped[0]
        if answered is None:
            assert timeout is not None
            self.timed_out = True
            return StepResult(self._timeout_messages(message, timeout))
        return answered

    def _call_env(self, env: Environment, message: Message) -> StepResult:
        try:
            result = env.step(message)
        except Exception as exc:
            raise EnvStepError(f"{self.env_name}.step raised on turn {self._turns}: {exc!r}") from exc
        if not isinstance(result, StepResult):
            raise EnvStepError(f"{self.env_name}.step returned {type(result).__name__}, not StepResult")
        return result

    @staticmethod
    def _timeout_messages(message: Message, timeout: float) -> tuple[Message, ...]:
        if not message.tool_calls:
            return (Message("user", f"Error: the environment did not answer within {timeout:g}s."),)
        return tuple(
            Message(
                "tool",
                f"Error: tool {c.name!r} timed out after {timeout:g}s.",
                tool_call_id=c.id,
                name=c.name,
            )
            for c in message.tool_calls
        )

    def fork(self, branch: int = 0) -> TokenEnv:
        """An independent copy of this episode (the environment forked with `branch`)."""
        twin = copy.copy(self)
        twin.env = self.env.fork(branch)
        twin._messages = list(self._messages)
        twin._calls = list(self._calls)
        twin._segments = list(self._segments)
        twin._context = list(self._context)
        return twin

    def release(self) -> None:
        """Free this episode's environment (`Environment.release`) once nothing will step or fork it."""
        self.env.release()

    # ----- results ----------------------------------------------------------------------------------
    def episode(self) -> Episode:
        """The finished episode, as rubrics see it."""
        if self._finish is None:
            raise RuntimeError(f"{self.env_name}: the episode is not finished")
        return Episode(tuple(self._messages), self.env.state(), self._finish.value)

    def trajectory(
        self,
        trajectory_id: str,
        rubric: Rubric | None = None,
        model_version: int | None = None,
        extra: Mapping[str, str] | None = None,
    ) -> Trajectory:
        """The finished episode as a `Trajectory`, rewarded by `rubric` (default: the env's first)."""
        scorer = rubric or default_rubric(self.env)
        meta = TrajectoryMeta(
            env=self.env_name,
            seed=self._seed,
            model_version=model_version,
            extra={"finish": self.episode().finish, "turns": str(self._turns), **(extra or {})},
        )
        calls = (*self._calls, Call(tuple(self._segments)))
        return Trajectory(trajectory_id, calls, scorer(self.episode()), meta=meta)
