"""Protocol conformance: the checks every environment must pass, usable from any package's tests.

    from envs.conformance import check_environment
    check_environment(lambda: MyEnv(), seeds=(0, 1, 2))

It checks that `reset` is deterministic per seed and returns system/user messages; that tool specs are
well-formed and uniquely named; that a call to an unknown tool is answered, not raised; that `fork`
gives an independent copy (stepping a copy leaves the original unchanged, so a later fork with the same
branch number answers as an earlier one did); that repeated final answers
end the episode; and that every rubric returns a finite reward (within `reward_range` when given) on
the finished episode. With a tokenizer it also runs one episode through `TokenEnv`. Failures raise
`ConformanceError` listing every problem found.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import Any

from envs.protocol import Environment, Episode, Message, Rubric, StepResult, ToolCall, ToolSpec
from treetrain.errors import TreetrainError


class ConformanceError(TreetrainError, AssertionError):
    """The environment breaks the protocol; the message lists each problem."""


def _run_to_done(env: Environment, max_steps: int) -> tuple[list[Message], bool]:
    messages: list[Message] = []
    for i in range(max_steps):
        answer = Message("assistant", f"final answer {i}")
        result = env.step(answer)
        messages += [answer, *result.messages]
        if result.done:
            return messages, True
    return messages, False


def _check_one(
    factory: Callable[[], Environment], seed: int, max_steps: int, reward_range: tuple[float, float] | None
) -> list[str]:
    problems: list[str] = []
    env = factory()
    if not isinstance(env, Environment):
        return [f"factory returned {type(env).__name__}, not an Environment"]
    opening = tuple(env.reset(seed))
    if not opening or any(not isinstance(m, Message) or m.role not in ("system", "user") for m in opening):
        problems.append(f"seed {seed}: reset must return a non-empty sequence of system/user Messages")
    if tuple(factory().reset(seed)) != opening:
        problems.append(
            f"seed {seed}: reset is not deterministic (two fresh instances gave different messages)"
        )
    specs = env.tool_specs()
    if not all(isinstance(s, ToolSpec) for s in specs):
        problems.append("tool_specs must return ToolSpec objects")
    elif len({s.name for s in specs}) != len(specs):
        problems.append(f"tool names are not unique: {[s.name for s in specs]}")
    else:
        try:
            json.dumps([s.to_openai() for s in specs])
        except (TypeError, ValueError) as exc:
            problems.append(f"tool specs are not JSON-serialisable: {exc}")
    rubrics = env.rubrics()
    if not rubrics or not all(isinstance(r, Rubric) for r in rubrics.values()):
        problems.append("rubrics() must return at least one Rubric")

    probe = Message("assistant", "", (ToolCall("conformance_0", "__no_such_tool__", {}),))
    try:
        answered = env.fork().step(probe)
        if not isinstance(answered, StepResult):
            problems.append(f"step returned {type(answered).__name__}, not StepResult")
    except Exception as exc:
        problems.append(f"a call to an unknown tool raised {exc!r} instead of returning an observation")

    final = Message("assistant", "final answer 0")
    before = env.fork().step(final)
    twin = env.fork()
    _run_to_done(twin, max_steps)
    if env.fork().step(final) != before:
        problems.append("fork is not independent: stepping a copy changed what the original answers")
    env = factory()
    env.reset(seed)
    messages, done = _run_to_done(env, max_steps)
    if not done:
        problems.append(f"seed {seed}: {max_steps} final answers did not end the episode")
    episode = Episode((*opening, *messages), env.state(), "done" if done else "max_turns")
    for name, rubric in rubrics.items():
        try:
            value = rubric(episode)
        except Exception as exc:
            problems.append(f"rubric {name!r} raised {exc!r}")
            continue
        if reward_range is not None and not reward_range[0] <= value <= reward_range[1]:
            problems.append(f"rubric {name!r} gave {value}, outside {reward_range}")
        if not math.isfinite(value):
            problems.append(f"rubric {name!r} gave a non-finite reward")
    return problems


def _check_tokens(factory: Callable[[], Environment], seed: int, tokenizer: Any) -> list[str]:
    from envs.wrapper import EpisodeLimits, TokenEnv, WrapperConfig

    limits = EpisodeLimits(max_turns=4, max_turn_tokens=512, max_episode_tokens=1 << 20)
    episode = TokenEnv(factory(), tokenizer, WrapperConfig(limits))
    prompt = episode.reset(seed)
    answer = episode.template.encode("final answer" + episode.template.end_of_turn)
    while not episode.done:
        episode.step(answer)
    traj = episode.trajectory("conformance")
    if traj.calls[0].tokens[: len(prompt)] != prompt or traj.calls[-1].tokens != episode.context:
        return [f"seed {seed}: the trajectory's tokens differ from the tokens the wrapper fed"]
    return []


def check_environment(
    factory: Callable[[], Environment],
    seeds: Sequence[int] = (0, 1, 2),
    max_steps: int = 50,
    reward_range: tuple[float, float] | None = None,
    tokenizer: Any = None,
) -> None:
    """Run every conformance check for each seed; raise `ConformanceError` listing all problems."""
    problems: list[str] = []
    for seed in seeds:
        try:
            problems += _check_one(factory, seed, max_steps, reward_range)
            if tokenizer is not None:
                problems += _check_tokens(factory, seed, tokenizer)
        except Exception as exc:
            problems.append(f"seed {seed}: raised {exc!r}")
    if problems:
        raise ConformanceError("environment is not conformant:\n  " + "\n  ".join(dict.fromkeys(problems)))
