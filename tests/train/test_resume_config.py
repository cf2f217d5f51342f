"""`--resume` runs with the run's saved config.yaml: `--set` changes only what it names, only where that is
safe (`RESUMABLE`), and a saved config that is missing, linked, special or malformed is refused in one line."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from test_config_hostile import _alias_bomb

from treetrain.cli.main import main
from treetrain.errors import ConfigError
from treetrain.train.config import dump_config, load_config
from treetrain.train.metrics import read_metrics
from treetrain.train.resume import RESUMABLE, resume_config
from treetrain.train.rundir import claim_run_dir

SAVED = ["model.path=tiny-llama", "updates=8", "rollout.groups_per_update=2", "optim.lr=0.001"]


def _run(tmp_path: Path, *extra: str) -> Path:
    run = tmp_path / "run"
    claim_run_dir(run, resume=False, overwrite=False).release()
    (run / "config.yaml").write_text(dump_config(load_config(None, [*SAVED, f"run_dir={run}", *extra])))
    return run


def test_resume_keeps_every_saved_setting_and_changes_only_what_is_named(tmp_path: Path) -> None:
    run = _run(tmp_path)
    cfg = resume_config(run, None, [])
    assert cfg == load_config(None, [*SAVED, f"run_dir={run}"])  # not the defaults: 60 updates, 4 groups
    assert cfg.updates == 8 and cfg.rollout.groups_per_update == 2
    cfg = resume_config(run, None, ["updates=12", "checkpoint_every=3", "threads=1", "memory_budget=2GiB"])
    assert (cfg.updates, cfg.checkpoint_every, cfg.threads, cfg.memory_budget) == (12, 3, 1, "2GiB")
    assert cfg.rollout.groups_per_update == 2 and cfg.optim.lr == 0.001
    same = resume_config(
        run, None, ["optim.lr=0.001", "rollout.groups_per_update=2"]
    )  # equal values: no change
    assert same == load_config(None, [*SAVED, f"run_dir={run}"])


def test_a_fleet_run_resumes_without_a_server_gone_for_good(tmp_path: Path) -> None:
    """The fleet is where samples are drawn, not what an update computes: a resume may leave a dead server
    out (its start checks every URL), add one, or move the gloo transfer address and the timeout."""
    two = "rollout.vllm.urls=['http://127.0.0.1:8001', 'http://127.0.0.1:8002']"
    run = _run(tmp_path, "rollout.engine=vllm-server", two)
    changed = ["rollout.vllm.urls=['http://127.0.0.1:8002']", "rollout.vllm.request_timeout_s=60",
               "rollout.vllm.transfer_host=10.0.0.2", "device=cpu"]  # fmt: skip
    cfg = resume_config(run, None, changed)
    assert cfg.rollout.vllm.urls == ("http://127.0.0.1:8002",) and cfg.rollout.vllm.request_timeout_s == 60
    assert (cfg.rollout.vllm.transfer_host, cfg.device) == ("10.0.0.2", "cpu")
    with pytest.raises(ConfigError, match=r"^--resume: rollout.engine is 'vllm-server' .* cannot change"):
        resume_config(run, None, ["rollout.engine=hf"])  # the engine is what samples: not the fleet


@pytest.mark.parametrize(
    "assignment",
    ["optim.lr=0.5", "rollout.groups_per_update=4", "seed=3", "model.path=tiny-qwen3", "replay.contract=response_only",
     "env.kwargs={digits: 3}", "loss.ratio_source=sampler"],
)  # fmt: skip
def test_a_change_outside_resumable_is_refused_naming_the_key(tmp_path: Path, assignment: str) -> None:
    run = _run(tmp_path)
    key = assignment.split("=")[0]
    assert key not in RESUMABLE
    with pytest.raises(
        ConfigError, match=rf"--resume: {key.split('=')[0]}\S* is .* cannot change on resume"
    ) as e:
        resume_config(run, None, [assignment])
    assert len(str(e.value).splitlines()) == 1


def test_a_config_file_on_resume_is_held_to_the_same_rule(tmp_path: Path) -> None:
    run = _run(tmp_path)
    (tmp_path / "more.yaml").write_text("updates: 9\n")
    assert resume_config(run, tmp_path / "more.yaml", []).updates == 9
    (tmp_path / "other.yaml").write_text("optim:\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match=r"optim\.lr"):
        resume_config(run, tmp_path / "other.yaml", [])


def _plant_config(run: Path, case: str) -> None:
    path = run / "config.yaml"
    path.unlink()
    if case == "missing":
        return
    if case == "fifo":
        os.mkfifo(path)
    elif case == "dev-zero":
        path.symlink_to("/dev/zero")
    elif case == "directory":
        path.mkdir()
    elif case == "100MB":
        with path.open("wb") as f:
            f.truncate(100 << 20)
    else:
        path.write_bytes(
            {
                "a-list": b"- updates: 3\n- seed: 1\n",
                "not-yaml": b"updates: [1, 2\n  : : ]]\n",
                "alias-bomb": _alias_bomb().encode(),
                "binary": bytes(range(256)) * 4,
                "text": b"just some text, not a mapping\n",
                "unknown-key": b"updatez: 3\n",
            }[case]
        )


CASES = ("missing", "fifo", "dev-zero", "directory", "100MB", "a-list", "not-yaml", "alias-bomb", "binary", "text",
         "unknown-key")  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_a_bad_saved_config_is_a_one_line_refusal(tmp_path: Path, case: str, capsys) -> None:
    run = _run(tmp_path)
    _plant_config(run, case)
    start = time.monotonic()
    code = main(["train", "--resume", "--run-dir", str(run), "--no-progress", "--set", "optim.lr=0.002"])
    err = capsys.readouterr().err
    assert code == 2 and time.monotonic() - start < 10
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "--resume" in err and "config.yaml" in err, err
    assert not (run / "metrics.jsonl").exists()


def test_a_good_saved_config_passes_the_same_path(tmp_path: Path, capsys) -> None:
    """Negative control for the cases above: the untouched saved config gets past the config checks (and
    the changed learning rate is what is refused)."""
    run = _run(tmp_path)
    assert main(["train", "--resume", "--run-dir", str(run), "--no-progress", "--set", "optim.lr=0.002"]) == 2
    err = capsys.readouterr().err
    assert "optim.lr is 0.001 in the saved run" in err and len(err.strip().splitlines()) == 1


TINY = [
    "model.path=tiny-llama", "rollout.groups_per_update=2", "rollout.fanout.root=4", "rollout.episode.max_turns=2",
    "rollout.episode.max_turn_tokens=12", "optim.lr=0.01", "advantages.zero_variance=keep", "measure_memory_every=0",
]  # fmt: skip


def test_resume_as_printed_continues_the_same_run(tmp_path: Path, capsys) -> None:
    """A 2-update, 2-group run resumed exactly as the interrupt message prints it runs no more updates and
    keeps config.yaml; `--updates 3` adds one update of 2 groups; another learning rate is refused."""
    run = tmp_path / "run"
    sets = [a for kv in [*TINY, "updates=2"] for a in ("--set", kv)]
    assert main(["train", "--run-dir", str(run), "--no-progress", *sets]) == 0
    saved = (run / "config.yaml").read_text()
    capsys.readouterr()
    assert main(["train", "--resume", "--run-dir", str(run), "--no-progress"]) == 0
    assert [r.update for r in read_metrics(run / "metrics.jsonl")] == [0, 1]
    assert (run / "config.yaml").read_text() == saved
    assert main(["train", "--resume", "--run-dir", str(run), "--no-progress", "--updates", "3"]) == 0
    rows = read_metrics(run / "metrics.jsonl")
    assert [r.update for r in rows] == [0, 1, 2] and rows[2].groups == 2
    assert (run / "config.yaml").read_text() == saved.replace("updates: 2\n", "updates: 3\n") != saved
    capsys.readouterr()
    assert main(["train", "--resume", "--run-dir", str(run), "--no-progress", "--set", "optim.lr=0.5"]) == 2
    err = capsys.readouterr().err
    assert "optim.lr" in err and len(err.strip().splitlines()) == 1
    assert len(read_metrics(run / "metrics.jsonl")) == 3
    # the same change made by editing config.yaml is held to the same rule: the checkpoint knows better
    edited = saved.replace("updates: 2\n", "updates: 3\n")
    for key, new in [("lr", "0.5"), ("seed", "12345")]:
        line = next(ln for ln in edited.splitlines() if ln.strip().startswith(f"{key}:"))
        (run / "config.yaml").write_text(edited.replace(line, line.split(":")[0] + f": {new}", 1))
        assert main(["train", "--resume", "--run-dir", str(run), "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert "the saved config was edited" in err and "checkpoints/update-00003" in err and "\n" not in err
        assert f"{key} is {new}" in err, err
    assert len(read_metrics(run / "metrics.jsonl")) == 3
    # negative control: an edit of a setting a resume may change is taken
    (run / "config.yaml").write_text(edited.replace("measure_memory_every: ", "measure_memory_every: 7 #", 1))
    assert main(["train", "--resume", "--run-dir", str(run), "--print-config"]) == 0
    assert "measure_memory_every: 7" in capsys.readouterr().out


def test_print_config_on_resume_shows_the_saved_settings(tmp_path: Path, capsys) -> None:
    run = _run(tmp_path)
    assert main(["train", "--resume", "--run-dir", str(run), "--updates", "9", "--print-config"]) == 0
    (tmp_path / "shown.yaml").write_text(capsys.readouterr().out)
    cfg = load_config(tmp_path / "shown.yaml")  # the printed YAML loads back as the resumed config
    assert cfg == load_config(None, [*SAVED, f"run_dir={run}", "updates=9"])
