"""The training loop end to end on a tiny model: artifacts, resume, and config validation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.train_cases import TINY
from transformers import AutoModelForCausalLM

from treetrain.cli.main import main
from treetrain.errors import ConfigError
from treetrain.train.config import dump_config, load_config
from treetrain.train.loop import Trainer
from treetrain.train.metrics import read_metrics
from treetrain.tree.format import load_trees

pytestmark = pytest.mark.launch  # end-to-end runs: each starts its environment worker processes


def _cfg(run_dir: Path, *extra: str):
    return load_config(None, [*TINY, f"run_dir={run_dir}", *extra])


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_three_updates_end_to_end(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path / "run", "updates=3")
    trainer = Trainer(cfg, progress=False)
    before = _weights(trainer.backend.module)
    summary = trainer.run()
    after = _weights(trainer.backend.module)
    assert any(not torch.equal(before[k], after[k]) for k in before), "no parameter changed"
    run = tmp_path / "run"
    rows = read_metrics(run / "metrics.jsonl")
    assert [r.update for r in rows] == [0, 1, 2] and [r.version for r in rows] == [1, 2, 3]
    assert all(r.trajectories == 8 and r.graph_tokens > 0 for r in rows)
    tree_files = sorted((run / "rollouts").glob("**/*.msgpack"))
    assert len(tree_files) == 6 and all(load_trees(f) for f in tree_files)
    for f in tree_files:  # update u's rollouts were sampled by weight version u, every policy token of them
        update = int(f.relative_to(run / "rollouts").parts[0].split("-")[1])
        assert {v for t in load_trees(f) for vs in t.node_versions for v in vs} == {update}, f
    exported = AutoModelForCausalLM.from_pretrained(run / "final", local_files_only=True)
    for k, v in exported.state_dict().items():
        assert torch.allclose(v, after[k]), k
    assert (run / "reward.png").stat().st_size > 1000
    assert "mean reward" in (run / "summary.txt").read_text()
    assert summary.updates == 3
    assert (run / "config.yaml").read_text() == dump_config(cfg)


def test_resume_reproduces_the_next_update(tmp_path: Path) -> None:
    straight = Trainer(_cfg(tmp_path / "a", "updates=3"), progress=False)
    straight.run()
    first = Trainer(_cfg(tmp_path / "b", "updates=2"), progress=False)
    first.run()
    resumed = Trainer(_cfg(tmp_path / "b", "updates=3"), resume=True, progress=False)
    assert resumed.state.update == 2 and resumed.state.version == 2
    resumed.run()
    a = read_metrics(tmp_path / "a" / "metrics.jsonl")
    b = read_metrics(tmp_path / "b" / "metrics.jsonl")
    assert [r.update for r in b] == [0, 1, 2]
    assert a[2].reward_mean == b[2].reward_mean and a[2].loss == pytest.approx(b[2].loss, rel=1e-6, abs=1e-9)
    wa = load_file(tmp_path / "a" / "final" / "model.safetensors")
    wb = load_file(tmp_path / "b" / "final" / "model.safetensors")
    assert all(torch.allclose(wa[k], wb[k], rtol=1e-6, atol=1e-7) for k in wa)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("rollout.fanout.root=0", "rollout.fanout.root"),
        ("rollout.fanout.max_depth=65", "rollout.fanout.max_depth"),
        ("loss.aggregation=mean", "loss.aggregation"),
        ("optim.lr=-1", "optim.lr"),
        ("nonsense=1", "nonsense"),
        ("loss.kl_coef=0.1", "model.reference"),
        ("memory_budget=lots", "memory_budget"),
        ("replay.microbatch=two", "replay.microbatch"),
    ],
)
def test_bad_config_fails_before_any_work(tmp_path: Path, override: str, field: str, capsys) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, [override])
    code = main(["train", "--run-dir", str(tmp_path / "run"), "--set", override, "--no-progress"])
    assert code == 2
    assert field in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_config_file_and_print_config(tmp_path: Path, capsys) -> None:
    path = tmp_path / "c.toml"
    path.write_text('updates = 7\n[loss]\nkl_coef = 0.02\n[model]\nreference = "initial"\n')
    assert main(["train", "--config", str(path), "--set", "seed=3", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "updates: 7" in out and "kl_coef: 0.02" in out and "seed: 3" in out
    yml = tmp_path / "c.yaml"
    yml.write_text("rollout:\n  fanout:\n    root: 0\n")
    assert main(["train", "--config", str(yml), "--print-config"]) == 2
    assert "rollout.fanout.root" in capsys.readouterr().err


@pytest.mark.distributed
def test_two_rank_deepspeed_run_matches_one_process(tmp_path: Path) -> None:
    """`torchrun -m treetrain train` on 2 ranks (ZeRO-2) makes the same first update as one process."""
    import os
    import sys

    from support.ports import free_port
    from support.ports import run as launch

    sgd = ["optim.name=sgd", "optim.lr=0.5", "optim.grad_clip=0"]  # one step is exactly -lr * g: scale shows
    common = [*TINY, "updates=1", "measure_memory_every=0", *sgd]
    single = Trainer(_cfg(tmp_path / "one", "updates=1", "measure_memory_every=0", *sgd), progress=False)
    start = _weights(single.backend.module)
    single.run()
    args = [a for kv in common for a in ("--set", kv)]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "-m", "treetrain", "train", "--run-dir", str(tmp_path / "two"), "--no-progress",
        "--set", "distributed.backend=deepspeed", "--set", "distributed.zero_stage=2", *args,
    ]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    done = launch(cmd, env, 600)
    assert done.returncode == 0, done.output[-3000:]
    one = load_file(tmp_path / "one" / "final" / "model.safetensors")
    two = load_file(tmp_path / "two" / "final" / "model.safetensors")
    a = torch.cat([(one[k] - start[k]).flatten() for k in sorted(one)])
    b = torch.cat([(two[k] - start[k]).flatten() for k in sorted(one)])
    assert float(a.norm()) > 0
    assert float((a - b).norm()) <= 1e-4 * float(a.norm())
    rows = read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert len(rows) == 1 and rows[0].trajectories == 8


def test_demo_defaults_run_one_update(tmp_path: Path) -> None:
    """The embedded default (shipped checkpoint, calculator) loads, samples, and steps."""
    cfg = load_config(None, [f"run_dir={tmp_path / 'demo'}", "updates=1", "checkpoint_every=0"])
    trainer = Trainer(cfg, progress=False)
    assert trainer.reference is None and type(trainer.backend.module).__name__ == "LlamaForCausalLM"
    trainer.run()
    row = read_metrics(tmp_path / "demo" / "metrics.jsonl")[0]
    assert row.trajectories == 32 and row.mode == "tree" and row.tokens_saved > 0.5


def test_cli_trees_overwrite_and_resume(tmp_path: Path, capsys) -> None:
    """Recorded trees feed training; a used run directory needs --overwrite or --resume; bad trees are refused."""
    sets = [a for kv in [*TINY, "updates=1", "measure_memory_every=0"] for a in ("--set", kv)]
    first = tmp_path / "first"
    assert main(["train", "--run-dir", str(first), "--no-progress", *sets]) == 0
    recorded = first / "rollouts"
    again = ["train", "--run-dir", str(first), "--no-progress", *sets]
    assert main(again) == 2
    assert "--resume" in capsys.readouterr().err
    assert main([*again, "--overwrite", "--trees", str(recorded)]) == 0
    rows = read_metrics(first / "metrics.jsonl")
    assert len(rows) == 1 and rows[0].rollout_seconds == 0.0 and rows[0].trajectories == 8
    assert not (first / "rollouts").exists(), "--overwrite must remove the earlier run's rollouts"
    resumed = [
        "train",
        "--run-dir",
        str(first),
        "--no-progress",
        "--resume",
        "--trees",
        str(recorded),
    ]
    capsys.readouterr()
    assert main([*resumed, *sets, "--updates", "2"]) == 2  # the rollouts were removed with the earlier run
    assert "rollouts' does not exist" in capsys.readouterr().err
    assert main([*resumed[:-1], f"{recorded}/**/*.msgpack", *sets, "--updates", "2"]) == 2
    err = capsys.readouterr().err
    assert "rollout.trees" in err and "cannot change on resume" in err and len(err.splitlines()) == 1
    code = main(
        [
            "train",
            "--run-dir",
            str(tmp_path / "x"),
            "--no-progress",
            *sets,
            "--trees",
            "trees/tool_use.msgpack",
        ]
    )
    assert code == 2
    assert "outside the model's vocabulary" in capsys.readouterr().err


def test_sampler_logprobs_at_any_temperature_are_the_policys() -> None:
    """The loss scores at the sampling temperature, so the sampler's ratio and corrections are accepted at
    any temperature; top_p below 1, and a loss.temperature other than the sampling one, are refused."""
    for use in ("loss.ratio_source=sampler", "loss.sampler_correction=token_truncate"):
        cfg = load_config(None, [use, "rollout.sampling.temperature=0.7"])
        assert cfg.policy_loss.logit_temperature == 0.7 and cfg.loss.temperature is None
        field = use.split("=")[0].replace(".", r"\.")
        with pytest.raises(ConfigError, match=rf"^{field}: .*top-p nucleus renormalised .*top_p=0\.9\)"):
            load_config(None, [use, "rollout.sampling.top_p=0.9"])
        with pytest.raises(ConfigError, match=rf"^{field}: .*loss\.temperature=1\.0 scores another"):
            load_config(None, [use, "rollout.sampling.temperature=0.7", "loss.temperature=1"])
        load_config(None, [use, "rollout.sampling.temperature=0.7", "loss.temperature=0.7"])
    cold = load_config(
        None, ["rollout.sampling.temperature=0.7", "loss.temperature=1", "rollout.sampling.top_p=0.9"]
    )
    assert cold.policy_loss.logit_temperature == 1.0  # without either, scoring elsewhere is the user's choice
    with pytest.raises(ConfigError, match=r"^loss\.temperature: must be a finite number > 0"):
        load_config(None, ["loss.temperature=0"])


def test_sampler_correction_settings_are_named_from_the_top_of_the_config() -> None:
    for sets, field in (
        (["loss.sampler_correction_cap=1"], "loss.sampler_correction_cap"),
        (["loss.sampler_correction=tis"], "loss.sampler_correction"),
        (["loss.sampler_correction=token_truncate", "loss.ratio_source=sampler"], "loss.sampler_correction"),
    ):
        with pytest.raises(ConfigError) as info:
            load_config(None, sets)
        assert str(info.value).startswith(f"{field}: ") and "\n" not in str(info.value)


def test_metrics_rows_carry_the_sampler_gap_of_live_rollouts(tmp_path: Path) -> None:
    """The built-in sampler draws at temperature 1 from the same weights: its logprobs and the scoring pass's
    differ only by the arithmetic (a KV-cached decode against a batched forward), and the row says by how much."""
    cfg = _cfg(
        tmp_path / "run", "updates=1", "measure_memory_every=0", "loss.sampler_correction=token_truncate"
    )
    Trainer(cfg, progress=False).run()
    (row,) = read_metrics(tmp_path / "run" / "metrics.jsonl")
    mean, largest = row.sampler_logprob_gap_mean, row.sampler_logprob_gap_max
    print(f"sampler gap: mean {mean}, max {largest}")
    assert mean is not None and largest is not None
    assert 0.0 <= mean <= largest < 1e-2
    assert row.sampler_corrected_fraction == 0.0  # no weight near the cap of 2 at such a gap


@pytest.mark.parametrize("scored_at", [None, "1.0"], ids=["sampling-temperature", "negative-control-at-1"])
def test_a_tempered_run_is_scored_at_its_sampling_temperature(tmp_path: Path, scored_at: str | None) -> None:
    """Sampled at 0.7, the trainer's scoring pass agrees with the sampler to rounding (a correction is on, so
    nothing was refused); scored at 1 instead (the negative control, allowed without a correction), the gap
    measures the temperature. The trees written say how they were sampled."""
    extra = (
        ["loss.sampler_correction=token_truncate"] if scored_at is None else [f"loss.temperature={scored_at}"]
    )
    cfg = _cfg(
        tmp_path / "run", "updates=1", "measure_memory_every=0", "rollout.sampling.temperature=0.7", *extra
    )
    Trainer(cfg, progress=False).run()
    (row,) = read_metrics(tmp_path / "run" / "metrics.jsonl")
    mean, largest = row.sampler_logprob_gap_mean, row.sampler_logprob_gap_max
    print(f"scored at {scored_at or 0.7}: sampler gap mean {mean}, max {largest}")
    assert mean is not None and largest is not None
    if scored_at is None:
        assert largest < 1e-5 and row.sampler_corrected_fraction == 0.0
    else:
        assert mean > 1e-3
    files = sorted((tmp_path / "run" / "rollouts").glob("**/*.msgpack"))
    assert files and all(
        t.sampling is not None and t.sampling.temperature == 0.7 for f in files for t in load_trees(f)
    )


def test_metrics_skip_a_partial_last_line(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path / "run", "updates=2", "measure_memory_every=0")
    Trainer(cfg, progress=False).run()
    path = tmp_path / "run" / "metrics.jsonl"
    path.write_text(path.read_text() + '{"update": 2, "vers')
    assert [r.update for r in read_metrics(path)] == [0, 1]
    from treetrain.train.metrics import MetricsError

    path.write_text('{"update": 0, "vers\n' + path.read_text())
    with pytest.raises(MetricsError, match=r"metrics\.jsonl:1"):
        read_metrics(path)


@pytest.mark.parametrize("extra", [("loss.kl_coef=0.05", "model.reference=initial"), ("mode=flat",)])
def test_kl_reference_and_forced_flat_runs(tmp_path: Path, extra: tuple[str, ...]) -> None:
    trainer = Trainer(
        _cfg(tmp_path / "run", "updates=2", "rollout.groups_per_update=2", *extra), progress=False
    )
    trainer.run()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r.version for r in rows] == [1, 2] and rows[0].graph_tokens > 0
    assert rows[0].mode == ("flat" if "mode=flat" in extra else "tree")
    # The first update's policy is the reference itself (KL 0); after one step the KL term must show.
    assert rows[0].kl == 0.0 and (rows[1].kl > 0) == ("loss.kl_coef=0.05" in extra)
