"""`treetrain plan`: the ledger table, the peak and its cause, the decision; --json; clear failures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.replay_cases import VOCAB

import treetrain.memory.planner as planner
from treetrain.cli.main import main
from treetrain.tree.format import save_trees
from treetrain.tree.synthetic import synthetic_group


@pytest.fixture(scope="module")
def trees_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "group.msgpack"
    rewards = [float(i % 3 == 0) for i in range(6)]
    save_trees(
        [synthetic_group(prefix=96, branches=6, suffix=10, depth=2, vocab=VOCAB, seed=3, rewards=rewards)],
        path,
    )
    return path


def test_prints_ledger_peak_and_decision(trees_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["plan", str(trees_file), "--model", "tiny-llama", "--budget", "64MiB", "--vocab", str(VOCAB)])
        == 0
    )
    out = capsys.readouterr().out
    assert "<- peak" in out and "prompt_group" in out
    assert "peak " in out and "at row" in out
    assert "mode: tree (exact)" in out and "flat:" in out and "because" in out
    assert "attention against resident KV: shared-past" in out


def test_says_when_attention_falls_back_to_the_concatenated_past(
    trees_file: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    args = ["plan", str(trees_file), "--model", "tiny-llama", "--budget", "64MiB", "--vocab", str(VOCAB)]
    assert main([*args, "--attn", "eager"]) == 0
    assert "attention against resident KV: shared-past" in capsys.readouterr().out
    # No preset falls back; a model whose attention does not decompose gets the planner's reason printed.
    monkeypatch.setattr(planner, "shared_past_reason", lambda model: "attn_logit_softcapping (test)")
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "attention against resident KV: concatenated" in out and "attn_logit_softcapping (test)" in out


def test_json_gives_the_same(trees_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "plan",
        str(trees_file),
        "--model",
        "tiny-llama",
        "--budget",
        "64MiB",
        "--contract",
        "response_only",
    ]
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["decision"]["mode"] == "tree" and doc["decision"]["contract"] == "response_only"
    assert set(doc["costs"]) == {"tree", "flat"}
    ledger = doc["ledger"]
    assert ledger["rows"][ledger["peak_step"]]["total"] == ledger["peak"]["total"]
    assert doc["costs"]["tree"]["peak"] == ledger["peak"]["total"]
    assert main(args) == 0
    assert "peak" in capsys.readouterr().out


def test_overrides_reach_the_plan(trees_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", str(trees_file), "--model", "tiny-llama", "--budget", "1GiB", "--json"]
    assert main([*args, "--mode", "flat", "--microbatch", "3"]) == 0
    decision = json.loads(capsys.readouterr().out)["decision"]
    assert decision["mode"] == "flat" and decision["microbatch"] == 3 and "mode" in decision["forced"]


@pytest.mark.parametrize("budget", ["lots", "-1GiB", "8XB", "0"])
def test_bad_budget_is_a_clear_error(
    trees_file: Path, budget: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan", str(trees_file), "--model", "tiny-llama", "--budget", budget])
    assert info.value.code == 2
    assert "--budget" in capsys.readouterr().err


def test_budget_nothing_fits_names_the_smallest_peak(
    trees_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", str(trees_file), "--model", "tiny-llama", "--budget", "10KiB"]) == 2
    assert "smallest predicted peak" in capsys.readouterr().err


def test_retention_below_minimum_names_it(trees_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", str(trees_file), "--model", "tiny-llama", "--budget", "1GiB", "--mode", "tree"]
    assert main([*args, "--microbatch", "1", "--chunk-size", "0", "--retention", "100"]) == 2
    assert "minimum feasible budget" in capsys.readouterr().err


def test_unreadable_inputs_exit_2(
    tmp_path: Path, trees_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", str(tmp_path / "missing.msgpack"), "--model", "tiny-llama", "--budget", "1GiB"]) == 2
    assert "missing.msgpack' does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.msgpack"
    bad.write_bytes(b"not a tree file")
    assert main(["plan", str(bad), "--model", "tiny-llama", "--budget", "1GiB"]) == 2
    assert "bad.msgpack: file: not a treetrain tree file (it looks like text" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["plan", str(tmp_path / "empty"), "--model", "tiny-llama", "--budget", "1GiB"]) == 2
    assert "no *.msgpack tree files under" in capsys.readouterr().err
    assert main(["plan", str(trees_file), "--model", "tiny-nonesuch", "--budget", "1GiB"]) == 2
    assert "cannot load model" in capsys.readouterr().err


def test_plan_with_a_training_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--config plans as `treetrain train` would: its model, reference (KL) and loss; bad trees are refused."""
    trees = tmp_path / "t.msgpack"
    save_trees([synthetic_group(prefix=40, branches=4, suffix=8, vocab=500, seed=s) for s in range(2)], trees)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  path: tiny-llama\n  reference: initial\nloss:\n  kl_coef: 0.05\n")
    assert main(["plan", str(trees), "--config", str(cfg), "--budget", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "reference" in out and "mode: tree" in out
    assert main(["plan", "trees/tool_use.msgpack", "--config", str(cfg), "--budget", "1GiB"]) == 2
    assert "outside the model's vocabulary" in capsys.readouterr().err


def test_demo_model_is_accepted_as_in_train(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--model demo` names the shipped checkpoint, as `model.path=demo` does for `treetrain train`."""
    fits = tmp_path / "fits.msgpack"
    save_trees(
        [synthetic_group(prefix=32, branches=3, suffix=4, vocab=200, seed=0, rewards=[1.0, 0.0, 0.0])], fits
    )
    assert main(["plan", str(fits), "--model", "demo", "--budget", "64MiB"]) == 0
    assert "mode: " in capsys.readouterr().out
    alien = tmp_path / "alien.msgpack"
    save_trees(
        [synthetic_group(prefix=8, branches=2, suffix=2, vocab=5000, seed=0, rewards=[1.0, 0.0])], alien
    )
    assert main(["plan", str(alien), "--model", "demo", "--budget", "64MiB"]) == 2
    assert "outside the model's vocabulary" in capsys.readouterr().err
    assert main(["plan", str(fits), "--model", str(tmp_path / "nowhere"), "--budget", "64MiB"]) == 2
    assert "'demo'" in capsys.readouterr().err


def tiny_parameters(family: str) -> int:
    from treetrain.models.presets import tiny_model

    return sum(p.numel() for p in tiny_model(family, VOCAB).parameters())


def test_plan_lora_on_a_named_model(trees_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--model NAME --set model.lora.r=...` plans adapters on that model (not the config's default) and
    compares them with full fine-tuning: the frozen base has no gradient and no optimizer state."""
    args = ["plan", str(trees_file), "--model", "tiny-llama", "--vocab", str(VOCAB), "--budget", "64MiB"]
    args += [
        "--mode",
        "tree",
        "--microbatch",
        "0",
        "--chunk-size",
        "0",
        "--retention",
        "unbounded",
    ]  # no search
    assert main([*args, "--set", "model.lora.r=4", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    lora, full = doc["lora_vs_full_finetuning"]["lora"], doc["lora_vs_full_finetuning"]["full"]
    assert doc["ledger"]["persistent"]["params"] == lora["params"]
    assert full["params"] == 4 * tiny_parameters("llama")  # float32 bytes of tiny-llama, not the demo model
    adapters = lora["params"] - full["params"]
    assert 0 < adapters < full["params"] // 10
    assert lora["grads"] == adapters and full["grads"] == full["params"]
    assert lora["optimizer"] == 2 * adapters and full["optimizer"] == 2 * full["params"]
    assert main([*args, "--set", "model.lora.r=4"]) == 0
    out = capsys.readouterr().out
    assert (
        "LoRA adapters (base frozen)" in out and "full fine-tuning, same model" in out and "LoRA saves" in out
    )


def test_each_file_is_one_advantage_group_as_in_train(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file's trees are normalized together, as the trainer normalizes one task's trees: a file whose trees
    are each constant but differ from one another is trained (and planned); a file constant throughout is
    dropped (`advantages.zero_variance=drop`), and a plan with nothing left to train says so."""

    def group(name: str, rewards: list[list[float]]) -> Path:
        path = tmp_path / f"{name}.msgpack"
        trees = [
            synthetic_group(prefix=40, branches=3, suffix=8, vocab=500, seed=len(name) + i, rewards=r)
            for i, r in enumerate(rewards)
        ]
        save_trees(trees, path)
        return path

    varied = group("varied", [[0.0, 1.0, 0.0]])
    between = group("between", [[0.0] * 3, [1.0] * 3])  # constant within each tree, not within the file
    constant = group("constant", [[1.0] * 3, [1.0] * 3])
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  path: tiny-llama\n")

    def flat_tokens(*files: Path) -> int:
        assert main(["plan", *map(str, files), "--config", str(cfg), "--budget", "1GiB", "--json"]) == 0
        return int(json.loads(capsys.readouterr().out)["costs"]["flat"]["token_cost"])

    alone = flat_tokens(varied)
    assert flat_tokens(varied, between) > alone  # per-tree grouping would drop `between`
    assert flat_tokens(varied, constant) == alone  # negative control: a constant group is dropped
    assert main(["plan", str(constant), "--config", str(cfg), "--budget", "1GiB"]) == 2
    err = capsys.readouterr().err
    assert "equal rewards" in err and "nothing to plan" in err and len(err.strip().splitlines()) == 1
    kl = ["--set", "loss.kl_coef=0.1", "--set", "model.reference=initial"]  # a KL term trains on them
    assert main(["plan", str(constant), "--config", str(cfg), *kl, "--budget", "1GiB"]) == 2
    assert "zero_variance=keep" in capsys.readouterr().err


def test_trees_with_equal_rewards_say_there_is_nothing_to_train(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`plan --model` keeps zero-variance groups; when every group has equal rewards, every advantage is 0
    and an update trains nothing: one line says so, never a speedup of nothing over nothing (`infx`)."""
    path = tmp_path / "equal.msgpack"
    save_trees([synthetic_group(prefix=40, branches=3, suffix=8, vocab=500, seed=1, rewards=[1.0] * 3)], path)
    varied = tmp_path / "varied.msgpack"
    save_trees(
        [synthetic_group(prefix=40, branches=3, suffix=8, vocab=500, seed=2, rewards=[0.0, 1.0, 0.0])], varied
    )
    args = ["--model", "tiny-llama", "--budget", "64MiB"]
    assert main(["plan", str(path), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "equal rewards (zero variance" in err and "nothing to plan" in err and "\n" not in err
    assert "inf" not in err and "speedup" not in err
    assert main(["plan", str(path), str(varied), *args]) == 0  # negative control: one varied group plans
    assert "speedup" in capsys.readouterr().out


def test_a_chunk_size_too_small_to_plan_is_refused_before_the_model_loads(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--chunk-size 1` on a shipped tree gave no answer within 300 s: the work is counted up front and
    refused in one line naming the smallest chunk size that is answered."""
    tree = str(Path(__file__).parents[2] / "trees" / "long_prefix.msgpack")
    for extra in (["--chunk-size", "1"], ["--set", "replay.chunk_size=2"]):  # the flag, and the config's
        argv = ["plan", tree, "--model", "tiny-llama", "--budget", "64MiB", *extra]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "units, more than the" in err and "\n" not in err, err
    assert int(err.split("give ")[1].split()[0]) > 2  # names a chunk size that is answered
    argv = ["plan", tree, "--model", "tiny-llama", "--budget", "64MiB", "--chunk-size", "64"]
    assert main(argv) == 0  # negative control: a chunk size the planner prices plans
    assert "chunk size=64" in capsys.readouterr().out
