"""The one place a run's settings become the rollout's (`treetrain.rollout.sources.engine_config`): the
config's sections are the objects the rollout takes, and the engine's KV share of memory is the planner's
budget, read by the same function."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from envs.wrapper import EpisodeLimits, WrapperConfig
from treetrain.memory.budget import free_memory, memory_budget_bytes
from treetrain.rollout.fanout import FanOut
from treetrain.rollout.prefix_sampler import Sampling
from treetrain.rollout.sources.engine_config import HF_KV_SHARE, engine_spec, wrapper_config
from treetrain.rollout.tree_rollout import RolloutConfig
from treetrain.train.config import load_config


def test_the_rollout_section_is_the_schedule_the_rollout_takes() -> None:
    """One default, defined once: `rollout.fanout` is `FanOut` itself, so the trainer and a bare rollout agree."""
    assert load_config(None).rollout.fanout == RolloutConfig().fanout == FanOut()
    assert load_config(None, ["rollout.fanout.after_assistant_turn=2"]).rollout.fanout == FanOut(
        after_assistant_turn=2
    )
    assert load_config(None, ["rollout.fanout.root=3"]).rollout.fanout != FanOut()


def test_sampling_and_episode_sections_are_the_objects_the_rollout_takes() -> None:
    """`rollout.sampling` is `Sampling` and `rollout.episode` is `EpisodeLimits`: one default each, and the
    trainer hands them to the sampler and the token wrapper unchanged (the episode budget resolved against
    the model's context)."""
    cfg = load_config(None)
    assert cfg.rollout.sampling == RolloutConfig().sampler.sampling == Sampling()
    assert cfg.rollout.episode == WrapperConfig().episode == EpisodeLimits()
    assert (cfg.rollout.episode.max_turns, cfg.rollout.episode.max_turn_tokens) == (4, 96)
    changed = load_config(None, ["rollout.sampling.top_p=0.9", "rollout.episode.max_turns=6"])
    assert changed.rollout.sampling == Sampling(top_p=0.9) != Sampling()
    assert changed.rollout.episode == EpisodeLimits(max_turns=6) != EpisodeLimits()

    text = SimpleNamespace(max_position_embeddings=2048)
    model = SimpleNamespace(
        config=SimpleNamespace(get_text_config=lambda decoder: text), generation_config=None
    )
    assert wrapper_config(changed, model).episode == EpisodeLimits(max_turns=6, max_episode_tokens=2048)
    fixed = load_config(None, ["rollout.episode.max_episode_tokens=512"])
    assert wrapper_config(fixed, model).episode.max_episode_tokens == 512


def _model() -> torch.nn.Module:
    """A module with the attributes the wrapper reads (a context, no generation config)."""
    model = torch.nn.Linear(2, 2)
    text = SimpleNamespace(max_position_embeddings=2048)
    model.config = SimpleNamespace(get_text_config=lambda decoder: text)  # type: ignore[assignment]
    return model


def test_the_hf_engines_kv_share_is_a_quarter_of_the_planners_budget() -> None:
    """Without `rollout.hf_kv_budget` the engine's KV may take 1/4 of what the planner plans for, read by
    the planner's own function (`memory_budget_bytes`); with it, exactly what it says. The other fields
    are the run's, unchanged."""
    model = _model()
    cpu = torch.device("cpu")
    for budget in ("8GiB", None):
        extra = [f"memory_budget={budget}"] if budget else []
        cfg = load_config(None, [*extra, "seed=5", "rollout.max_staleness=1"])
        spec = engine_spec(cfg, model, world_size=2, checkpoint="/ckpt")
        assert spec.hf_kv_bytes == memory_budget_bytes(budget, cpu) // HF_KV_SHARE
        assert (spec.kind, spec.seed, spec.world_size, spec.checkpoint) == ("hf", 5, 2, "/ckpt")
        assert spec.in_flight_weights and spec.max_tokens == 2048
    assert engine_spec(load_config(None), model, 1, "demo").hf_kv_bytes == memory_budget_bytes(None, cpu) // 4
    own = load_config(None, ["rollout.hf_kv_budget=3MiB", "memory_budget=8GiB"])
    assert engine_spec(own, model, 1, "demo").hf_kv_bytes == 3 << 20
    assert not engine_spec(own, model, 1, "demo").in_flight_weights  # K = 0: weights never change in flight


def test_a_sampler_on_another_device_than_the_trainer_sizes_its_kv_from_that_device() -> None:
    """ZeRO-3's `hf` sampler samples from a CPU shadow while the trainer's `memory_budget` is its GPU's: the
    default KV share is then a quarter of what the CPU has free, not of the trainer's budget (here the
    trainer's model is on the `meta` device, standing for a GPU); a set `hf_kv_budget` still wins."""
    model = _model().to("meta")
    cpu = torch.device("cpu")
    cfg = load_config(None, ["memory_budget=8GiB", "rollout.max_staleness=1"])
    host = engine_spec(cfg, model, 2, "/ckpt", "cpu").hf_kv_bytes
    assert 0 < host <= free_memory(cpu) // HF_KV_SHARE * 1.5 and host != (8 << 30) // HF_KV_SHARE
    same = engine_spec(cfg, model, 2, "/ckpt", "meta")  # the control: the trainer's own device
    assert same.hf_kv_bytes == (8 << 30) // HF_KV_SHARE
    own = load_config(None, ["rollout.hf_kv_budget=3MiB", "memory_budget=8GiB"])
    assert engine_spec(own, model, 1, "demo", "cpu").hf_kv_bytes == 3 << 20
