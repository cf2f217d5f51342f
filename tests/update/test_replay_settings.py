"""One replay vocabulary: the config's `replay` section and the engine's `ReplayConfig` share their settings
through `ReplaySettings` (declared, documented and checked once), and the section's forced planner choices
are checked by `Overrides`, the same object every other caller builds."""

from __future__ import annotations

from dataclasses import fields

import pytest

from treetrain.errors import ConfigError
from treetrain.memory.overrides import Overrides
from treetrain.replay.batch import ReplayConfig
from treetrain.replay.replay_settings import ReplaySettings
from treetrain.update.settings import ReplaySection

SHARED = [f.name for f in fields(ReplaySettings)]
CHANGED = {
    "contract": "response_only",
    "score_microbatch": 3,
    "skip_inert": False,
    "max_logit_elements": 1234,
}


def test_every_shared_setting_is_declared_once() -> None:
    assert sorted(CHANGED) == sorted(SHARED)  # the values below change every shared field
    for cls in (ReplaySection, ReplayConfig):
        assert set(cls.__annotations__) & set(SHARED) == set(), (
            f"{cls.__name__} declares a shared field again"
        )


@pytest.mark.parametrize("name", SHARED)
def test_the_replay_config_carries_each_shared_setting(name: str) -> None:
    section = ReplaySection(**{name: CHANGED[name]})
    config = section.replay_config(seed=7)
    assert getattr(config, name) == CHANGED[name] and config.seed == 7
    # negative control: a config not derived from the section keeps the default
    assert getattr(ReplayConfig(seed=7), name) != CHANGED[name]


@pytest.mark.parametrize("bad", [{"score_microbatch": -1}, {"max_logit_elements": 0}, {"contract": "nope"}])
def test_a_shared_setting_is_refused_with_one_message_for_both(bad: dict[str, object]) -> None:
    messages = []
    for cls in (ReplaySection, ReplayConfig):
        with pytest.raises(ConfigError) as caught:
            cls(**bad)  # type: ignore[arg-type]
        messages.append(str(caught.value))
    assert messages[0] == messages[1] and messages[0].startswith(f"{next(iter(bad))}: ")


@pytest.mark.parametrize("bad", [{"microbatch": -1}, {"chunk_size": -2}, {"keep_graphs": "some"}])
def test_the_section_checks_its_forced_choices_as_overrides_does(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError) as section:
        ReplaySection(**bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as forced:
        Overrides(**bad)  # type: ignore[arg-type]
    assert str(section.value) == str(forced.value)
    ReplaySection(**{next(iter(bad)): None})  # negative control: null leaves the choice to the planner


def test_the_section_forces_what_it_names_and_spells_never_split_as_the_engine_does() -> None:
    forced = ReplaySection(microbatch=2, chunk_size=0, retention="1KiB").overrides("tree")
    assert forced == Overrides(mode="tree", microbatch=2, chunk_size=0, retention=1024)
    assert forced.chunk is None and Overrides(chunk_size=64).chunk == 64
