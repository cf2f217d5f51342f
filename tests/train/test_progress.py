"""The progress bar never shows an unmeasured peak or an idle update as a zero measurement."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from treetrain.cli.main import main
from treetrain.train.config import load_config
from treetrain.train.loop import Trainer
from treetrain.train.metrics import UpdateMetrics, read_metrics
from treetrain.train.progress import Progress
from treetrain.tree.format import save_trees
from treetrain.tree.synthetic import synthetic_group


def _row(update: int, peak: int | None, dropped: int = 0) -> UpdateMetrics:
    return UpdateMetrics(
        update=update, version=update, reward_mean=0.25, reward_std=0.4, trajectories=4, groups=1,
        groups_dropped=dropped, loss=0.0, pg=0.0, kl=0.0, entropy=0.0, clipped=0.0,
        mode="none" if dropped else "tree", contract="exact", graph_tokens=0 if dropped else 40,
        nograd_tokens=0 if dropped else 20, flat_token_cost=0 if dropped else 300,
        token_cost=0 if dropped else 140, rollout_seconds=1.0, train_seconds=0.0 if dropped else 1.0,
        peak_bytes=peak, predicted_peak_bytes=peak or 0,
    )  # fmt: skip


def test_fields_label_what_was_not_measured() -> None:
    bar = Progress()
    assert bar.fields(_row(0, None)) == {
        "reward": "0.25",
        "tok_s": "60",
        "saved": "53%",
        "peak": "not measured yet",
    }
    assert bar.fields(_row(1, 2048))["peak"] == "2.0 KiB"
    assert bar.fields(_row(2, None))["peak"] == "2.0 KiB (update 1)"
    idle = bar.fields(_row(3, None, dropped=1))
    assert idle == {"reward": "0.25", "update": "no step: all 1 groups dropped", "peak": "2.0 KiB (update 1)"}
    assert (
        Progress.after([_row(0, None), _row(1, 4096), _row(2, None)]).fields(_row(3, None))["peak"]
        == "4.0 KiB (update 1)"
    )


def test_trainer_bar_shows_last_peak_and_dropped_update(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trees = tmp_path / "trees"
    trees.mkdir()
    group = dict(prefix=24, branches=4, suffix=4, depth=1, vocab=64)
    save_trees([synthetic_group(**group, seed=0, rewards=[1.0, 0.0, 0.0, 1.0])], trees / "a.msgpack")
    save_trees([synthetic_group(**group, seed=1, rewards=[1.0, 1.0, 1.0, 1.0])], trees / "b.msgpack")
    cfg = load_config(
        None,
        [
            "model.path=tiny-llama", f"rollout.trees={trees}/*.msgpack", "rollout.groups_per_update=1",
            "updates=2", "measure_memory_every=2", "checkpoint_every=0", f"run_dir={tmp_path / 'run'}",
        ],
    )  # fmt: skip
    Trainer(cfg, progress=True).run()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert rows[0].peak_bytes > 0 and rows[1].groups_dropped == 1 and rows[1].peak_bytes is None
    raw = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert '"peak_bytes": null' in raw[1] and '"peak_bytes": null' not in raw[0]
    shown = capsys.readouterr().err
    assert "no step: all 1 groups dropped" in shown and "(update 0)" in shown
    assert "peak=0" not in shown and "tok_s=0" not in shown
    frames = [f for f in shown.replace("\n", "\r").split("\r") if f.startswith("train:")]
    after = {n: [f for f in frames if f" {n}/2 " in f] for n in (1, 2)}
    assert after[1] and after[2], frames  # each update's own reward, not the one before it
    assert all(f"reward={rows[0].reward_mean:.2f}" in f for f in after[1]), after[1]
    assert all(f"reward={rows[1].reward_mean:.2f}" in f for f in after[2]), after[2]
    assert rows[0].reward_mean != rows[1].reward_mean


def test_reward_plot_is_titled_with_its_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reward.png copied out of its run directory still says which run it shows."""
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    from treetrain.train.summary import plot_rewards

    titles: list[str] = []
    original = Axes.set_title
    monkeypatch.setattr(
        Axes, "set_title", lambda ax, label, *a, **k: titles.append(label) or original(ax, label, *a, **k)
    )
    run = tmp_path / "my-run"
    run.mkdir()
    rows = [_row(i, None) for i in range(3)]
    assert (
        plot_rewards(rows, run / "reward.png") == run / "reward.png"
        and (run / "reward.png").stat().st_size > 0
    )
    assert plot_rewards(rows, run / "other.png", run_name="named") is not None
    assert titles == ["my-run: reward over 3 updates", "named: reward over 3 updates"]


LOAD_DEMO = """
import sys
from transformers import AutoModelForCausalLM
from treetrain.train.models import DEMO_MODEL
from treetrain.train.progress import hide_library_bars
if sys.argv[1] == "hide":
    hide_library_bars()
AutoModelForCausalLM.from_pretrained(DEMO_MODEL)
"""


@pytest.mark.timeout(240)
@pytest.mark.launch
def test_no_progress_hides_the_weight_loading_bar() -> None:
    """`--no-progress` calls `hide_library_bars`; transformers draws a bar while it loads weights."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), *sys.path]), "TQDM_DISABLE": ""}
    err = {}
    for mode in ("show", "hide"):
        done = subprocess.run(
            [sys.executable, "-c", LOAD_DEMO, mode], capture_output=True, text=True, timeout=200, env=env
        )
        assert done.returncode == 0, done.stderr
        err[mode] = done.stderr
    assert "Loading weights" in err["show"]  # the control: the bar is there to hide
    assert "Loading weights" not in err["hide"], err["hide"]


@pytest.mark.timeout(240)
@pytest.mark.launch
def test_plan_no_progress_hides_the_weight_loading_bar_too(tmp_path: Path) -> None:
    """`treetrain plan --model demo --no-progress` loads the demo's weights without their bar (the test
    above is the control: loading the demo without `hide_library_bars` draws it)."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), *sys.path]), "TQDM_DISABLE": ""}
    tree = str(tmp_path / "t.msgpack")
    save_trees(
        [synthetic_group(prefix=24, branches=4, suffix=4, vocab=64, seed=0, rewards=[1.0, 0.0] * 2)], tree
    )
    argv = ["plan", tree, "--model", "demo", "--budget", "1GiB", "--no-progress"]
    done = subprocess.run(
        [sys.executable, "-m", "treetrain", *argv], capture_output=True, text=True, timeout=200, env=env
    )
    assert done.returncode == 0 and "speedup" in done.stdout, done.stderr
    assert "Loading weights" not in done.stderr and "%|" not in done.stderr, done.stderr


def _recorded(tmp_path: Path, *extra: str):
    """Two updates on two recorded trees (no environment, no rollout): the cheapest real run."""
    trees = tmp_path / "trees"
    trees.mkdir()
    group = dict(prefix=24, branches=4, suffix=4, depth=1, vocab=64)
    for seed in (0, 1):
        save_trees(
            [synthetic_group(**group, seed=seed, rewards=[1.0, 0.0, 0.0, 1.0])], trees / f"{seed}.msgpack"
        )
    sets = [
        "model.path=tiny-llama", f"rollout.trees={trees}/*.msgpack", "rollout.groups_per_update=1", "updates=2",
        "measure_memory_every=1", "checkpoint_every=0", f"run_dir={tmp_path / 'run'}", *extra,
    ]  # fmt: skip
    return load_config(None, sets)


def test_no_progress_logs_one_line_per_update(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """`--no-progress` draws no bar and logs each update in one line instead (a batch job is not silent until
    its summary); the last line names what the run directory holds."""
    run = tmp_path / "run"
    cfg = _recorded(tmp_path)
    caplog.set_level("INFO", logger="treetrain.train.loop")
    sets = [f"rollout.trees={cfg.rollout.trees}", "model.path=tiny-llama", "rollout.groups_per_update=1"]
    sets += ["updates=2", "checkpoint_every=0"]
    argv = ["train", "--run-dir", str(run), "--no-progress", *(a for kv in sets for a in ("--set", kv))]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    rows = read_metrics(run / "metrics.jsonl")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("update ")]
    assert lines == [Progress.line(r, 2) for r in rows], lines
    assert lines[0].startswith(f"update 0 (1/2): reward {rows[0].reward_mean:.3f}") and "loss " in lines[0]
    assert "rollout " in lines[1] and "train " in lines[1] and "tokens " in lines[1]
    assert "%|" not in err  # no bar
    assert out.splitlines()[-1] == (
        f"run directory: {run} (metrics.jsonl, reward.png, summary.txt, final/, checkpoints/)"
    )


def test_line_names_the_lag_and_only_a_measured_peak() -> None:
    row = _row(4, None)
    assert "peak" not in Progress.line(row, 9) and "lag" not in Progress.line(row, 9)
    lagged = replace(_row(4, 2048), staleness_mean=0.5, staleness_max=1)
    assert Progress.line(lagged, 9).endswith("lag 0.50 (max 1), peak 2.0 KiB")
    idle = Progress.line(_row(5, None, dropped=1), 9)
    assert (
        idle.startswith("update 5 (6/9): reward 0.250 (std 0.400), no step: all 1 groups dropped")
        and "loss" not in idle
    )


@pytest.mark.parametrize("redirected", [True, False])
def test_log_lines_are_never_glued_onto_the_bar(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, redirected: bool
) -> None:
    """A line logged while the bar is drawn is written above it (tqdm's logging redirect), never appended to
    the bar's last frame; the control (the redirect taken out) shows the line glued, so the check can fail."""
    import contextlib
    import logging
    import sys

    import treetrain.train.loop as loop

    if not redirected:
        monkeypatch.setattr(loop, "logging_redirect_tqdm", lambda loggers: contextlib.nullcontext())
    console = logging.StreamHandler(sys.stderr)  # what `treetrain train` installs (logging.basicConfig)
    logging.getLogger().addHandler(console)
    note = logging.getLogger("treetrain.test")
    note.setLevel("INFO")
    try:
        trainer = Trainer(
            _recorded(tmp_path), progress=True, on_point=lambda point, i: note.info("note %d", i)
        )
        trainer.run()
    finally:
        logging.getLogger().removeHandler(console)
    err = capsys.readouterr().err
    segments = [seg for line in err.split("\n") for seg in line.split("\r")]
    notes = [seg for seg in segments if "note 0" in seg]
    assert notes, err
    assert all(seg == "note 0" for seg in notes) == redirected, notes


@pytest.mark.timeout(300)
@pytest.mark.launch  # an end-to-end run: it starts its environment worker processes
def test_the_bar_says_what_the_update_is_doing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The first update no longer sits at `0/N` without a word: it counts the episodes as they finish, then
    says it trains."""
    from support.train_cases import TINY

    cfg = load_config(None, [*TINY, "updates=1", "checkpoint_every=0", f"run_dir={tmp_path / 'run'}"])
    Trainer(cfg, progress=True).run()
    frames = [f for f in capsys.readouterr().err.replace("\n", "\r").split("\r") if f.startswith("train")]
    said = [f.split(":")[0] for f in frames]
    counts = [s for s in said if s.startswith("train (sampling")]
    assert counts[0] == "train (sampling 0/8 episodes)" and counts[-1] == "train (sampling 8/8 episodes)", (
        said
    )
    assert len(set(counts)) == 9, said  # each episode as it finished
    assert said.index("train (training on 8 episodes)") > said.index(counts[-1]), said


@pytest.mark.parametrize("hidden", [False, True])
def test_no_progress_reaches_the_calibration_bar(monkeypatch: pytest.MonkeyPatch, hidden: bool) -> None:
    """`hide_library_bars` sets tqdm's own `TQDM_DISABLE`, which the memory calibration's bar (drawn on a
    terminal otherwise) honours; without it the bar is left to tqdm's terminal check (the control)."""
    import treetrain.memory.calibration_probes as probes
    from treetrain.models.presets import tiny_model
    from treetrain.train.progress import hide_library_bars

    monkeypatch.setenv("TQDM_DISABLE", "")  # recorded: hide_library_bars's change is undone after the test
    if hidden:
        hide_library_bars()
    asked: list[object] = []
    monkeypatch.setattr(probes, "tqdm", lambda chosen, **kw: asked.append(kw["disable"]) or [])
    probes.measure(tiny_model("llama", 64), "exact", with_entropy=False, max_logit_elements=1 << 16)
    assert asked == [True if hidden else None]
