"""Tree rollouts with a tiny random-init Llama: fan-out shape, divergence points, prefix-KV reuse,
sampler logprobs, and trees on disk before the rollout returns."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from support.env_fixtures import FixedTurnsEnv, NoisyEnv, tiny_model, tokenizer

from envs import Environment, EpisodeLimits, WrapperConfig, make_env
from treetrain.rollout import (
    FanOut,
    RolloutConfig,
    Sampler,
    SamplerConfig,
    Sampling,
    fork_cache,
    rollout_trees,
)
from treetrain.rollout.engines.hf_engine import HFEngine
from treetrain.trajectory import Role, Trajectory
from treetrain.tree import TrajectoryTree
from treetrain.tree.format import load_tree
from treetrain.tree.stats import tree_stats

torch.set_num_threads(1)
#: Near-uniform next-token distributions: sibling samples differ at their first token, so divergence
#: points sit exactly at branch points.
MODEL = tiny_model(init=0.02)
#: Peaked, context-sensitive distributions: a wrong KV cache visibly changes the tokens.
SHARP = tiny_model(init=0.5)
SHORT = WrapperConfig(EpisodeLimits(max_turns=8, max_turn_tokens=6, max_episode_tokens=1024))


def _rollout(
    tmp_path: Path, env: type[Environment] | None = None, **kwargs: object
) -> tuple[TrajectoryTree, ...]:
    config = RolloutConfig(wrapper=SHORT, **kwargs)  # type: ignore[arg-type]
    factory = env or FixedTurnsEnv
    return rollout_trees(
        MODEL, tokenizer(), factory, [0], tmp_path, config, env_name="fixed", engine=HFEngine(MODEL)
    ).trees


def _path(traj: Trajectory) -> tuple[int, ...]:
    return tuple(int(x) for x in traj.id.split("/")[1].split("."))


def _lcp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _boundaries(traj: Trajectory) -> list[int]:
    """Context length at each policy branch point: after the prompt and after each observation."""
    out, pos = [], 0
    for seg in traj.calls[0].segments:
        pos += len(seg)
        if seg.role is not Role.POLICY:
            out.append(pos)
    return out


def test_fanout_is_validated() -> None:
    assert FanOut(root=3, after_tool_result=2, max_depth=3).max_leaves == 12
    assert FanOut(root=1, after_tool_result=2, max_depth=2).max_leaves == 4
    with pytest.raises(ValueError, match=r"^root: must be in \[1, 4096\], got 0$"):
        FanOut(root=0)
    with pytest.raises(ValueError, match=r"^max_trajectories: the schedule can produce up to 4096 "):
        FanOut(root=8, after_tool_result=8, max_depth=4)
    with pytest.raises(ValueError, match=r"^after_assistant_turn: must be an integer"):
        FanOut(after_assistant_turn=True)
    with pytest.raises(
        ValueError, match=r"^max_depth: must be in"
    ):  # refused before `max_leaves` is computed
        FanOut(after_tool_result=2, max_depth=10**18)


def test_policy_fanout_gives_expected_leaves_and_divergence_points(tmp_path: Path) -> None:
    fan = FanOut(root=3, after_tool_result=2, max_depth=3)
    (tree,) = _rollout(tmp_path, fanout=fan, sampler=SamplerConfig(Sampling(temperature=1.5), seed=0))
    trajs = tree.trajectories()
    assert len(trajs) == 3 * 2 * 2 == len(tree.leaves())
    assert sorted(_path(t) for t in trajs) == sorted(itertools.product(range(3), range(2), range(2)))
    for a, b in itertools.combinations(trajs, 2):
        d = _lcp(_path(a), _path(b))  # the branch point where their schedules part
        assert _lcp(a.calls[0].tokens, b.calls[0].tokens) == _boundaries(a)[d] == _boundaries(b)[d]
    divergence = [tree.nodes[i] for i in tree.divergence_points()]
    assert len(divergence) == 1 + 3 + 6
    assert sorted(len(n.children) for n in divergence) == [2] * 9 + [3]
    assert all(n.roles[-1] is not Role.POLICY for n in divergence)


def test_environment_fanout_branches_after_the_assistant_turn(tmp_path: Path) -> None:
    fan = FanOut(root=2, after_assistant_turn=2, max_depth=2)
    (tree,) = _rollout(
        tmp_path, env=NoisyEnv, fanout=fan, sampler=SamplerConfig(Sampling(temperature=1.5), seed=1)
    )
    trajs = tree.trajectories()
    assert sorted(_path(t) for t in trajs) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for a, b in itertools.combinations(trajs, 2):
        split = _lcp(a.calls[0].tokens, b.calls[0].tokens)
        if _path(a)[0] == _path(b)[0]:  # same assistant turn, different environment answers
            policy_end, obs_end = (sum(len(s) for s in a.calls[0].segments[:k]) for k in (2, 3))
            assert policy_end <= split < obs_end
        else:
            assert split == _boundaries(a)[0]


@pytest.mark.parametrize(
    "sampling", [SamplerConfig(Sampling(temperature=0.0)), SamplerConfig(Sampling(temperature=1.0), seed=3)]
)
def test_prefix_reuse_gives_the_same_tokens(tmp_path: Path, sampling: SamplerConfig) -> None:
    fan = FanOut(root=2, after_tool_result=2, max_depth=3)
    config = RolloutConfig(fanout=fan, sampler=sampling, wrapper=SHORT)
    runs = {}
    for reuse in (True, False):
        # no shared pieces: which requests arrive together, and so share a common prefix, depends on timing
        engine = HFEngine(SHARP, keep_prefixes=reuse, share_contexts=False)
        runs[reuse] = rollout_trees(
            SHARP, tokenizer(), FixedTurnsEnv, [0, 1], tmp_path / str(reuse), config, engine=engine
        )
    for with_reuse, without in zip(runs[True].trees, runs[False].trees):
        assert with_reuse.trajectories() == without.trajectories()
        assert len(with_reuse.trajectories()) == 8
    assert runs[True].stats.encoded_tokens < runs[False].stats.encoded_tokens
    if not sampling.sampling.greedy:  # greedy siblings are identical and merge, so the tree is a single path
        unique = sum(tree_stats(t).unique_tokens for t in runs[True].trees)
        assert runs[True].stats.encoded_tokens <= unique


def _continue(sampler: Sampler, reuse: bool, corrupt: bool = False) -> tuple[int, ...]:
    """Sample a turn, append an observation, and sample the next turn with or without the kept KV."""
    context = tuple(tokenizer().encode("<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"))
    (first,) = sampler.sample(None, context, n=1, max_new_tokens=5)
    obs = tuple(tokenizer().encode("<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"))
    if not reuse:
        (second,) = sampler.sample(None, context + first.tokens + obs, n=1, max_new_tokens=8)
        return second.tokens
    assert first.state is not None and first.state.length == len(context) + len(first.tokens) - 1
    if corrupt:
        first.state.cache.crop(-1)  # the cache now misses one context token
    (second,) = sampler.sample(first.state, (first.tokens[-1], *obs), n=1, max_new_tokens=8)
    return second.tokens


def test_kept_state_matches_reencoding_and_a_corrupt_one_does_not() -> None:
    sampler = Sampler(SHARP, SamplerConfig(Sampling(temperature=0.0)), tokenizer().encode("<|im_end|>"))
    reference = _continue(sampler, reuse=False)
    assert _continue(sampler, reuse=True) == reference
    assert _continue(sampler, reuse=True, corrupt=True) != reference  # negative control


def test_fork_cache_shares_nothing() -> None:
    sampler = Sampler(MODEL, SamplerConfig(Sampling(temperature=0.0)), (2,))
    (sample,) = sampler.sample(None, (5, 6, 7, 8), n=1, max_new_tokens=3)
    assert sample.state is not None
    parent = sample.state.cache
    child = fork_cache(parent, [0])
    before = parent.layers[0].keys.clone()
    sampler.sample(type(sample.state)(child, sample.state.length), (9,), n=1, max_new_tokens=3)
    assert torch.equal(parent.layers[0].keys, before) and parent.get_seq_length() == sample.state.length


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_logprobs_are_those_of_the_sampling_distribution(tmp_path: Path, top_p: float) -> None:
    temperature = 0.7
    fan = FanOut(root=2, after_tool_result=1, max_depth=1)
    (tree,) = _rollout(
        tmp_path, fanout=fan, sampler=SamplerConfig(Sampling(temperature=temperature, top_p=top_p), seed=2)
    )
    for traj in tree.trajectories():
        tokens = torch.tensor([traj.calls[0].tokens])
        with torch.no_grad():
            logits = MODEL(input_ids=tokens).logits[0].double() / temperature  # [T, V]
        pos = 0
        for seg in traj.calls[0].segments:
            if seg.role is Role.POLICY:
                assert seg.logprobs is not None
                for i, (tok, recorded) in enumerate(zip(seg.tokens, seg.logprobs)):
                    row = logits[pos + i - 1]
                    probs = row.softmax(-1)
                    before = (probs * (probs > probs[tok])).sum()  # mass of strictly likelier tokens
                    assert before < top_p or top_p == 1.0
                    keep = (
                        torch.tensor([(probs * (probs > p)).sum() < top_p for p in probs])
                        if top_p < 1
                        else None
                    )
                    ref = row.masked_fill(~keep, -math.inf) if keep is not None else row
                    assert recorded == pytest.approx(ref.log_softmax(-1)[tok].item(), abs=1e-4)
            pos += len(seg)


def test_greedy_logprobs_are_zero_and_turns_stop_on_the_end_marker(tmp_path: Path) -> None:
    (tree,) = _rollout(tmp_path, fanout=FanOut(root=1), sampler=SamplerConfig(Sampling(temperature=0.0)))
    (traj,) = tree.trajectories()
    end = tokenizer().convert_tokens_to_ids("<|im_end|>")
    for seg in traj.calls[0].segments:
        if seg.role is Role.POLICY:
            assert seg.logprobs == (0.0,) * len(seg)
            assert end not in seg.tokens[:-1] and (
                seg.tokens[-1] == end or len(seg) == SHORT.episode.max_turn_tokens
            )


@pytest.mark.parametrize("concurrent", [True, False])
def test_a_task_that_crashes_ends_alone_and_the_others_are_on_disk(tmp_path: Path, concurrent: bool) -> None:
    config = RolloutConfig(fanout=FanOut(root=2), wrapper=SHORT, concurrent=concurrent)
    made = []

    class Crashing(FixedTurnsEnv):
        def step(self, message: Any) -> Any:  # the second task's environment fails late in its episode
            if self.count == 1:
                raise RuntimeError("crash while rolling out the second seed")
            return super().step(message)

    def factory() -> Environment:
        made.append(1)
        return FixedTurnsEnv(turns=1) if len(made) == 1 else Crashing()

    engine = HFEngine(MODEL) if concurrent else None
    crashed = rollout_trees(MODEL, tokenizer(), factory, [0, 1], tmp_path, config, engine=engine)
    ((seed, error),) = crashed.failures
    assert seed == 1 and "crash while rolling out the second seed" in error.exception
    assert "Traceback" in error.traceback and error.method == "step"
    (saved,) = (tmp_path / "trees").glob("*.msgpack")  # the first task's tree, complete
    assert crashed.paths == (saved,) and tree_stats(load_tree(saved)).num_trajectories == 2

    result = rollout_trees(MODEL, tokenizer(), FixedTurnsEnv, [5, 6], tmp_path / "ok", config, engine=engine)
    assert len(result.paths) == 2 and result.failures == ()  # control: the same engine, nothing fails
    for tree, path in zip(result.trees, result.paths):
        assert path.parent == tmp_path / "ok" / "trees"
        again = load_tree(path)
        assert again.id == tree.id and again.trajectories() == tree.trajectories()


def test_a_long_prompt_or_a_template_error_ends_its_task_alone(tmp_path: Path) -> None:
    from envs import Message
    from envs.template import TemplateError

    class Faulty(FixedTurnsEnv):
        def reset(self, seed: int) -> Any:
            if seed == 1:
                return (Message("user", "word " * 3000),)  # over SHORT's 1024-token episode budget
            if seed == 3:
                raise TemplateError("the template cannot render this conversation")
            return super().reset(seed)

    config = RolloutConfig(
        fanout=FanOut(root=2), sampler=SamplerConfig(Sampling(temperature=0.0)), wrapper=SHORT
    )
    engine = HFEngine(MODEL)
    result = rollout_trees(MODEL, tokenizer(), Faulty, [0, 1, 2, 3], tmp_path / "f", config, "fixed", engine)
    assert [(seed, e.method, e.exception.split(":")[0]) for seed, e in result.failures] == [
        (1, "reset", "PromptTooLongError"),
        (3, "reset", "TemplateError"),
    ]
    assert all("Traceback" in e.traceback for _, e in result.failures) and not engine.busy
    healthy = rollout_trees(
        MODEL, tokenizer(), FixedTurnsEnv, [0, 2], tmp_path / "h", config, "fixed", engine
    )
    assert healthy.failures == ()  # control: the same tasks without the faulty ones give the same trees
    assert [t.id for t in result.trees] == [t.id for t in healthy.trees] and len(result.trees) == 2


def test_builtin_lookup_rollout_shares_the_long_prompt(tmp_path: Path) -> None:
    config = RolloutConfig(
        fanout=FanOut(root=3), wrapper=WrapperConfig(EpisodeLimits(max_turns=2, max_turn_tokens=4))
    )
    result = rollout_trees(
        MODEL,
        tokenizer(),
        lambda: make_env("lookup", num_rows=20),
        [0],
        tmp_path,
        config,
        env_name="lookup",
        engine=HFEngine(MODEL),
    )
    (tree,) = result.trees
    first = tree.nodes[tree.nodes[0].children[0]]
    assert len(first.trajectories) == 3 and len(first) >= 500 and set(first.roles) == {Role.PROMPT}
    assert all(t.meta.env == "lookup" and 0.0 <= t.reward <= 1.0 for t in tree.trajectories())


@pytest.mark.parametrize("concurrent", [True, False])
def test_on_episode_counts_every_finished_trajectory(tmp_path: Path, concurrent: bool) -> None:
    """`RolloutConfig.on_episode` (what the trainer's bar counts) is called once per trajectory, on the
    concurrent scheduler and on the sequential loop alike."""
    finished: list[int] = []
    fan = FanOut(root=3, after_tool_result=2, max_depth=3)
    config = RolloutConfig(
        wrapper=SHORT, fanout=fan, concurrent=concurrent, on_episode=lambda: finished.append(len(finished))
    )
    engine = HFEngine(MODEL) if concurrent else None
    result = rollout_trees(MODEL, tokenizer(), FixedTurnsEnv, [0, 1], tmp_path, config, "fixed", engine)
    assert len(finished) == sum(len(t.trajectories()) for t in result.trees) == 2 * 3 * 2 * 2
    assert RolloutConfig(on_episode=print) == RolloutConfig()  # it shapes nothing
