"""Every episode of a rollout in flight at once: branch points go to the engine as soon as they are ready.

`tree_rollout._grow_concurrently` grows the trees of many tasks together. A branch point becomes a
`GenerationRequest` the moment its context exists (the prompt after `reset`, or the observation after a tool call), so the engine
always holds every ready request of every tree and batches them. When a request's samples come back, each
sample is forked `env_factor` ways and every fork is stepped by the environment in a thread pool of
`max_concurrent_steps` threads: tool calls run concurrently with generation and with each other, and a slow
tool delays only its own branch.

The trees are the same as the sequential loop's (`treetrain.rollout.sequential`): the same fan-out, the same
trajectory ids, the same trajectories in the same order (each finished episode carries the depth-first key
the sequential loop would have produced it at), so under greedy decoding both give identical trees. Each
request's seed is a function of its task seed and its place in the tree, so sampled trees do not depend on
timing either.

One task ends alone. Any exception of one task's episode (environment code failing in its worker, a
rubric that raises or misses its deadline, the chat template refusing the conversation, any other error of
the token wrapper) ends that task's tree at once: the task's other branches are abandoned, its
environments released, and the failure kept on the task (`Task.failure`, an `EnvError` with the
traceback); the other tasks go on. Only what is not one task's (the engine failing, Ctrl-C) stops the
run, and then every request in flight is aborted, so the engine is idle for the next sync.

Weights may change in flight (`rollout.max_staleness` >= 1): given an `InFlightSync`, the scheduler asks it
before each engine step whether newer weights wait. If so, it interrupts the engine
(`GenerationEngine.interrupt`): every request in flight stops and says what each sample drew so far. The
engine takes the new weights at once, and each unfinished sample goes on as a request of its own whose
context is the branch point's plus the tokens drawn so far, under the new weights (abort and resubmit). The
sample's tokens then span versions, and its `Completion.runs` say which tokens each version drew; the
turn's policy tokens become one segment per version. An engine that cannot interrupt (`interrupt` returns
None: a server whose answers are not streamed) finishes what is in flight while new branch points are held
back, then syncs. Either way,
each token records the version that drew it, and an episode's later tokens are never older than its first.

The records it keeps (tasks, branch points, requests sent, forks) are `treetrain.rollout.branch_points`.

Steps whose environment call missed its deadline (`rollout.episode.step_timeout_s`; the episode goes on
with a timeout observation) are counted in `Scheduler.step_timeouts`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Protocol

from envs.env_error import EnvError
from envs.wrapper import TokenEnv, TurnResult
from treetrain.rollout.branch_points import Asked, BranchPoint, Fork, Sent, Task, release, request_seed
from treetrain.rollout.engines.generation import (
    Completion,
    Draft,
    GenerationEngine,
    GenerationRequest,
    GenerationResult,
    Interrupted,
    check_versions,
    continued,
    cut_at_stop,
    finished,
)
from treetrain.rollout.fanout import FanOut
from treetrain.rollout.sampling import Sampling
from treetrain.trajectory import Trajectory


class InFlightSync(Protocol):
    """Newer weights for an engine that is growing trees (`treetrain.rollout.weight_feed.WeightFeed`)."""

    def due(self, engine_version: int) -> bool:
        """Whether weights newer than `engine_version` wait (may raise to stop the rollout)."""
        ...

    def sync(self, engine: GenerationEngine) -> None:
        """Load them into `engine`, which has no request in flight."""
        ...


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler grows trees: the fan-out, the sampling, the step pool and the request seeds."""

    fanout: FanOut
    sampling: Sampling
    max_concurrent_steps: int = 8
    """Threads stepping environments at once."""
    model_version: int | None = None
    """The weight version every sample must come from (None: not checked), recorded in trajectories."""
    base_seed: int = 0
    """The sampler seed every request's seed derives from (`request_seed`)."""
    engine_name: str = "engine"
    """The engine's name in a version-mismatch error."""


class Scheduler:
    """Grows `tasks` together on `engine`; see the module docstring. `on_finished` is called (in the
    calling thread) once per task whose tree is complete, as soon as it is, and `on_episode` once per
    finished trajectory (what a progress display counts); `weights`, when given, brings newer weights into
    the engine between its steps."""

    def __init__(
        self,
        engine: GenerationEngine,
        config: SchedulerConfig,
        on_finished: Callable[[Task], None] = lambda task: None,
        weights: InFlightSync | None = None,
        on_episode: Callable[[], None] = lambda: None,
    ) -> None:
        self.engine, self.config = engine, config
        self.weights = weights
        self._held: list[BranchPoint] = []  # ready branch points waiting for the engine to take new weights
        self._resume: list[tuple[Asked, tuple[int, ...], Draft]] = []  # interrupted samples, to go on
        self.interrupted = 0
        """Samples stopped mid-turn for new weights and resubmitted with their tokens so far."""
        self.fanout, self.sampling = config.fanout, config.sampling
        self.model_version = config.model_version
        self.on_finished = on_finished
        self.on_episode = on_episode
        self.step_timeouts = 0
        """The records it keeps (tasks, branch points, requests sent, forks) are `treetrain.rollout.branch_points`.

Steps whose environment call missed its deadline (each became a timeout observation)."""
        self._points: dict[int, Sent] = {}
        self._steps: dict[Future[tuple[TokenEnv, TurnResult, Trajectory | None]], Fork] = {}
        self._forks_left: dict[int, int] = {}  # id(parent episode) -> forks not yet made

    def run(self, tasks: Sequence[Task]) -> None:
        """Grow every task's tree to the end (or to its first environment failure).

        When growing stops early (Ctrl-C, an engine or in-process environment error), steps not yet started
        are cancelled and running ones are not waited for: a tool call blocked forever must not hold the
        interrupt. Their worker-hosted environments are freed when the worker stops (the trainer closes it).
        """
        pool = self._pool = ThreadPoolExecutor(
            self.config.max_concurrent_steps, thread_name_prefix="treetrain-step"
        )
        finished = False
        try:
            for task in tasks:
                task.live.add(task.root)
                self._submit(BranchPoint(task, task.root, 0, (), (), at_root=True))
            while self.engine.busy or self._steps or self._held or self._resume:
                self._refresh_weights()
                if self.engine.busy:
                    self._answered(self.engine.poll())
                    done = [f for f in self._steps if f.done()]
                else:
                    done = list(wait(list(self._steps), return_when=FIRST_COMPLETED).done)
                for future in done:
                    self._stepped(future, self._steps.pop(future))
            finished = True
        finally:
            if not finished:  # the engine must not stay busy with requests no one will collect
                self.engine.abort()
            pool.shutdown(wait=finished, cancel_futures=True)
            for task in tasks:
                if finished:  # nothing is live after a complete run; a failed task freed its own
                    for episode in task.live:
                        release(episode)
                task.live.clear()

    # ----- generation -------------------------------------------------------------------------------
    def _refresh_weights(self) -> None:
        """Between engine steps: when newer weights wait, interrupt the engine (or, if it cannot be, wait
        until it is idle), sync, and send what was held or interrupted."""
        if self.weights is None:
            return
        if self.weights.due(self.engine.version):
            if self.engine.busy:
                stopped = self.engine.interrupt()
                if stopped is not None:
                    self._interrupted(stopped)
            if not self.engine.busy:
                self.weights.sync(self.engine)
        if (self._held or self._resume) and not self.weights.due(self.engine.version):
            held, self._held = self._held, []
            for point in held:
                if point.task.failure is None:
                    self._send(point)
                else:  # its task failed meanwhile: the point was released with the task
                    point.task.pending -= 1
            resume, self._resume = self._resume, []
            for asked, slots, draft in resume:
                self._go_on(asked, slots, draft)

    def _interrupted(self, stopped: list[Interrupted]) -> None:
        """Keep what each stopped request's samples drew: a finished sample is done, the others go on, those
        that drew the same (nothing, mostly: a request still waiting) together as one request."""
        for item in stopped:
            sent = self._points.pop(item.request_id)
            asked = sent.asked
            slots = range(len(item.samples)) if sent.slots is None else sent.slots
            same: dict[Draft, list[int]] = {}
            for slot, sample in zip(slots, item.samples, strict=True):
                if isinstance(sample, Completion):
                    asked.samples[slot] = continued(sent.draft, sample, asked.stops)
                else:
                    same.setdefault(sent.draft.then(sample.tokens, sample.logprobs, sample.runs), []).append(
                        slot
                    )
            for draft, group in same.items():
                self._resume.append((asked, tuple(group), draft))
                self.interrupted += len(group) if draft.tokens else 0
            self._complete(asked)

    def _go_on(self, asked: Asked, slots: tuple[int, ...], draft: Draft) -> None:
        """Send the rest of interrupted samples that drew `draft`: the branch point's context plus the draft."""
        point, request = asked.point, asked.request
        if asked.abandoned:
            return
        if point.task.failure is not None:  # the point was released with its task
            asked.abandoned = True
            point.task.pending -= 1
            return
        left = request.max_new_tokens - len(draft.tokens)
        if left < 1 or cut_at_stop(draft.tokens, asked.stops) is not None:
            for slot in slots:
                asked.samples[slot] = finished(draft, asked.stops, "length")
            self._complete(asked)
            return
        if not draft.tokens and len(slots) == request.n:  # nothing was drawn: the request as it was
            self._points[self.engine.submit(request)] = Sent(asked)
            return
        key = (*point.key, (2 + slots[0], len(draft.tokens)))
        rest = GenerationRequest(
            context=(*request.context, *draft.tokens), n=len(slots), max_new_tokens=left, sampling=request.sampling,
            stop=request.stop, group=request.group, children=request.children,
            seed=request_seed(self.config.base_seed, point.task.seed, key),
        )  # fmt: skip
        self._points[self.engine.submit(rest)] = Sent(asked, slots, draft)

    def _submit(self, point: BranchPoint) -> None:
        point.task.pending += 1
        if self.weights is not None and self.weights.due(self.engine.version):
            self._held.append(point)  # sampled under the new weights, once the engine has them
        else:
            self._send(point)

    def _send(self, point: BranchPoint) -> None:
        n = self.fanout.policy_factor(point.depth, point.at_root)
        episode = point.episode
        stop = (*((t,) for t in episode.stop_token_ids), *episode.stop_sequences)
        request = GenerationRequest(
            context=episode.context,
            n=n,
            max_new_tokens=episode.turn_budget(),
            sampling=self.sampling,
            stop=tuple(dict.fromkeys(stop)),
            seed=request_seed(self.config.base_seed, point.task.seed, point.key),
            group=point.task.prefix,
            children=self.fanout.env_factor(point.depth + (n > 1)),
        )
        self._points[self.engine.submit(request)] = Sent(Asked(point, request, [None] * n))

    def _answered(self, results: list[GenerationResult]) -> None:
        if self.model_version is not None:
            check_versions(results, self.model_version, self.config.engine_name)
        for result in results:
            sent = self._points.pop(result.request_id)
            asked = sent.asked
            if sent.slots is None:
                asked.samples = list(result.completions)
            else:
                for slot, completion in zip(sent.slots, result.completions, strict=True):
                    asked.samples[slot] = continued(sent.draft, completion, asked.stops)
            self._complete(asked)

    def _complete(self, asked: Asked) -> None:
        """Fork and step a branch point's samples once all of them are back."""
        if asked.abandoned or any(c is None for c in asked.samples):
            return
        samples = [c for c in asked.samples if c is not None]
        point = asked.point
        task = point.task
        task.pending -= 1
        if task.failure is not None:  # the task already failed: drop what its requests bring back
            self._drop(task, point.episode)
            return
        n = len(samples)
        depth = point.depth + (n > 1)
        k = self.fanout.env_factor(depth)
        self._forks_left[id(point.episode)] = n * k
        for i, sample in enumerate(samples):
            path = (*point.path, i) if n > 1 else point.path
            for j in range(k):
                fork_path = (*path, j) if k > 1 else path
                key = (*point.key, (0, i * k + j))
                fork = Fork(task, point.episode, sample, j, depth + (k > 1), fork_path, key)
                self._steps[self._pool.submit(self._fork_and_step, fork)] = fork
                task.pending += 1

    # ----- environment ------------------------------------------------------------------------------
    def _fork_and_step(self, fork: Fork) -> tuple[TokenEnv, TurnResult, Trajectory | None]:
        """In a pool thread: fork the parent, step the copy with the sample, reward it when finished."""
        if fork.task.failure is not None:
            raise _Abandoned
        try:
            episode = fork.parent.fork(branch=fork.branch)
        except Exception as exc:
            raise _TaskFailed("fork", exc) from None
        try:
            sample = fork.sample
            result = episode.step(sample.tokens, sample.logprobs, sample.version, runs=sample.runs)
            trajectory = None
            if episode.done:
                tid = f"{fork.task.prefix}/{'.'.join(map(str, fork.path)) or '0'}"
                trajectory = episode.trajectory(tid, fork.task.rubric, self.model_version)
        except BaseException as exc:
            release(episode)
            if isinstance(exc, Exception):
                raise _TaskFailed("rubric" if episode.done else "step", exc) from None
            raise
        return episode, result, trajectory

    def _stepped(self, future: Future[tuple[TokenEnv, TurnResult, Trajectory | None]], fork: Fork) -> None:
        task = fork.task
        task.pending -= 1
        self._parent_done(task, fork.parent)
        self._handle_step(future, fork)
        if task.pending == 0 and task.failure is None:
            self.on_finished(task)

    def _handle_step(
        self, future: Future[tuple[TokenEnv, TurnResult, Trajectory | None]], fork: Fork
    ) -> None:
        task = fork.task
        try:
            episode, _, trajectory = future.result()
        except _Abandoned:
            return
        except _TaskFailed as failed:
            self._fail(task, EnvError.raised(task.root.env_name, failed.method, failed.exc))
            return
        self.step_timeouts += episode.timed_out
        if task.failure is not None:
            self._release(episode)
            return
        if trajectory is not None:
            task.finished.append((fork.key, trajectory))
            self._release(episode)
            self.on_episode()
            return
        task.live.add(episode)
        _, child = fork.key[-1]
        self._submit(BranchPoint(task, episode, fork.depth, fork.path, (*fork.key[:-1], (1, child))))

    def _parent_done(self, task: Task, parent: TokenEnv) -> None:
        left = self._forks_left[id(parent)] - 1
        if left:
            self._forks_left[id(parent)] = left
            return
        del self._forks_left[id(parent)]
        self._drop(task, parent)

    def _drop(self, task: Task, episode: TokenEnv) -> None:
        if episode in task.live:
            task.live.discard(episode)
            self._release(episode)

    def _release(self, episode: TokenEnv) -> None:
        """Free an environment from a pool thread: a release waits for its worker, which may be busy with
        slow tools, and the engine must keep being polled meanwhile."""
        self._pool.submit(release, episode)

    def _fail(self, task: Task, error: EnvError) -> None:
        if task.failure is None:
            task.failure = error
            for episode in list(task.live):
                self._drop(task, episode)


class _Abandoned(Exception):
    """A step of a task that had already failed: never run."""


class _TaskFailed(Exception):
    """One task's fork, step or rubric raised `exc`: that task ends, the others go on."""

    def __init__(self, method: str, exc: Exception) -> None:
        super().__init__(method)
        self.method, self.exc = method, exc
