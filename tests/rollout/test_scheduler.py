"""The concurrent scheduler against the sequential reference loop, and what concurrency must not change:
trees, ids, order, seeds, failures and weight versions."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from support.env_fixtures import FixedTurnsEnv, NoisyEnv, tiny_model, tokenizer
from transformers import AutoTokenizer, LlamaForCausalLM

from envs import EpisodeLimits, Message, StepResult, WrapperConfig
from envs.remote import WorkerEnvFactory
from treetrain.rollout import FanOut, RolloutConfig, SamplerConfig, Sampling, rollout_trees
from treetrain.rollout.engines.generation import (
    Completion,
    EngineStats,
    GenerationRequest,
    GenerationResult,
    VersionMismatchError,
)
from treetrain.rollout.engines.hf_engine import HFEngine
from treetrain.train.models import DEMO_MODEL

torch.set_num_threads(1)
SHARP = tiny_model(init=0.5)
SHORT = WrapperConfig(EpisodeLimits(max_turns=4, max_turn_tokens=6, max_episode_tokens=1024))


def _ids(result: object) -> list[list[str]]:
    return [[t.id for t in tree.trajectories()] for tree in result.trees]  # type: ignore[attr-defined]


def test_greedy_demo_rollout_gives_the_sequential_loops_trees(tmp_path: Path) -> None:
    """The demo model, the calculator in its worker process, the demo's fan-out: identical trees."""
    model = LlamaForCausalLM.from_pretrained(DEMO_MODEL).eval()
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    wrapper = WrapperConfig(EpisodeLimits(max_episode_tokens=1024), stop_token_ids=(2,))
    factory = WorkerEnvFactory("calculator", {})
    try:
        runs = {}
        for concurrent in (False, True):
            config = RolloutConfig(
                sampler=SamplerConfig(Sampling(temperature=0.0)), wrapper=wrapper, concurrent=concurrent
            )
            runs[concurrent] = rollout_trees(
                model,
                tok,
                factory,
                [0, 1, 2, 3],
                tmp_path / str(concurrent),
                config,
                env_name="calculator",
                engine=HFEngine(model),
            )
    finally:
        factory.close()
    assert [t.id for t in runs[True].trees] == [t.id for t in runs[False].trees]
    assert _ids(runs[True]) == _ids(runs[False])
    assert all(len(t.trajectories()) == 8 for t in runs[True].trees)
    assert runs[True].stats.forward_calls < runs[False].stats.forward_calls / 2  # batched across tasks


@pytest.mark.parametrize(
    "fanout",
    [FanOut(root=2, after_tool_result=2, max_depth=3), FanOut(root=2, after_assistant_turn=2, max_depth=3)],
)
def test_greedy_trees_with_policy_and_environment_branching(tmp_path: Path, fanout: FanOut) -> None:
    runs = {}
    for concurrent in (False, True):
        config = RolloutConfig(fanout, SamplerConfig(Sampling(temperature=0.0)), SHORT, concurrent=concurrent)
        runs[concurrent] = rollout_trees(
            SHARP,
            tokenizer(),
            NoisyEnv,
            [0, 1, 2],
            tmp_path / str(concurrent),
            config,
            engine=HFEngine(SHARP),
        )
    assert [t.id for t in runs[True].trees] == [t.id for t in runs[False].trees]
    assert _ids(runs[True]) == _ids(runs[False])


def test_sampled_trees_depend_on_seeds_not_on_batching_or_threads(tmp_path: Path) -> None:
    fanout = FanOut(root=3, after_tool_result=2, max_depth=3)
    sampler = SamplerConfig(Sampling(temperature=1.0), seed=11)
    trees = []
    for k, (rows, steps) in enumerate([(64, 8), (2, 1), (5, 3)]):
        config = RolloutConfig(fanout, sampler, SHORT, max_concurrent_steps=steps)
        engine = HFEngine(SHARP, max_rows=rows)
        result = rollout_trees(SHARP, tokenizer(), NoisyEnv, [0, 1], tmp_path / str(k), config, engine=engine)
        trees.append([t.id for t in result.trees])
    assert trees[0] == trees[1] == trees[2]
    other = RolloutConfig(fanout, SamplerConfig(Sampling(temperature=1.0), seed=12), SHORT)
    assert [
        t.id
        for t in rollout_trees(
            SHARP, tokenizer(), NoisyEnv, [0, 1], tmp_path / "o", other, engine=HFEngine(SHARP)
        ).trees
    ] != trees[0]


class _ScriptedEngine:
    """Answers every request on the next poll with one fixed turn; records what it was asked."""

    def __init__(self, version: int = 0, answer_version: int | None = None) -> None:
        self.version, self.stats = version, EngineStats()
        self.answer_version = version if answer_version is None else answer_version
        self.asked: list[GenerationRequest] = []
        self._open: list[int] = []

    def submit(self, request: GenerationRequest) -> int:
        self.asked.append(request)
        self._open.append(len(self.asked) - 1)
        return len(self.asked) - 1

    @property
    def busy(self) -> bool:
        return bool(self._open)

    def poll(self) -> list[GenerationResult]:
        end = self.asked[0].stop[0][0]
        out = [
            GenerationResult(i, tuple(Completion((5, end), (-1.0, -0.5), "stop", self.answer_version) for _ in range(self.asked[i].n)))
            for i in self._open
        ]  # fmt: skip
        self._open = []
        return out

    def sync_weights(self, model: object, version: int) -> None:
        self.version = version

    def release_group(self, group: str) -> None:
        pass

    def abort(self) -> None:
        self._open = []

    def close(self) -> None:
        pass


class _Gated(FixedTurnsEnv):
    """Seed 0's steps wait until `GATE` is set; seed 1 runs freely."""

    GATE = threading.Event()

    def reset(self, seed: int) -> Sequence[Message]:
        self.seed = seed
        return super().reset(seed)

    def step(self, message: Message) -> StepResult:
        if self.seed == 0 and not self.GATE.wait(timeout=20):
            raise TimeoutError("seed 1 never finished while seed 0's tool waited")
        return super().step(message)


def test_a_slow_tool_delays_only_its_own_tree(tmp_path: Path) -> None:
    finished: list[int] = []
    from treetrain.rollout import tree_writer

    real_save = tree_writer.save_tree

    def recording(tree: object, path: Path) -> None:
        finished.append(int(path.name.split("-s")[1].split("-")[0]))
        if finished == [1]:
            _Gated.GATE.set()  # seed 1's tree is written while seed 0's tool is still waiting
        real_save(tree, path)  # type: ignore[arg-type]

    _Gated.GATE.clear()
    config = RolloutConfig(FanOut(root=2), SamplerConfig(Sampling()), SHORT, model_version=3)
    tree_writer.save_tree = recording  # type: ignore[assignment]
    try:
        result = rollout_trees(
            SHARP, tokenizer(), _Gated, [0, 1], tmp_path, config, engine=_ScriptedEngine(3)
        )
    finally:
        tree_writer.save_tree = real_save
    assert finished == [1, 0]
    assert [t.trajectories()[0].id.split("/")[0] for t in result.trees] == [
        "_Gated-s0",
        "_Gated-s1",
    ]  # task order
    assert all(t.meta.model_version == 3 for tree in result.trees for t in tree.trajectories())


def test_a_sample_from_other_weights_stops_the_rollout(tmp_path: Path) -> None:
    config = RolloutConfig(FanOut(root=2), SamplerConfig(Sampling()), SHORT, model_version=4)
    with pytest.raises(VersionMismatchError, match="weight version 3, but the trainer is at version 4"):
        rollout_trees(SHARP, tokenizer(), FixedTurnsEnv, [0], tmp_path, config, engine=_ScriptedEngine(4, 3))
    assert not list((tmp_path / "trees").glob("*.msgpack"))


def test_an_environment_failure_drops_only_its_task(tmp_path: Path) -> None:
    config = RolloutConfig(FanOut(root=2, after_tool_result=2, max_depth=2), SamplerConfig(Sampling()), SHORT)
    engine = _ScriptedEngine()
    factory = WorkerEnvFactory("support.scripted_envs:FailsOnSeedEnv", {"seed": 1})
    try:
        result = rollout_trees(
            SHARP, tokenizer(), factory, [0, 1, 2], tmp_path, config, engine=engine, env_name="f"
        )
    finally:
        factory.close()
    assert [seed for seed, _ in result.failures] == [1]
    assert result.failures[0][1].exception == "ValueError: boom"
    assert [t.trajectories()[0].id.split("/")[0] for t in result.trees] == ["f-s0", "f-s2"]
    assert len(list((tmp_path / "trees").glob("*.msgpack"))) == 2
    roots = [r for r in engine.asked if r.n == 2 and len(r.context) < 40]
    assert len({r.seed for r in roots}) == len(roots)  # every branch point has its own seed
