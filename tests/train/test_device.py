"""The `device` setting: where one process trains and evaluates. `auto` takes the GPU torch sees, else the
CPU; a name that is no device, a GPU that is not there, or a device beside DeepSpeed's own placement is one
line, before any model loads. The GPU branches run here with torch's CUDA queries answered by the test
(the machine has none); `bench/gpu_check.py` trains on a real one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import treetrain.train.models as models
from treetrain.assets import DEMO_MODEL
from treetrain.cli.main import main
from treetrain.errors import ConfigError
from treetrain.train.config import load_config
from treetrain.train.device import check_device_name, train_device

TINY = ["--set", "model.path=tiny-llama", "--set", "updates=1", "--set", "measure_memory_every=0"]


def _gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize(
    ("name", "gpus", "local_rank", "want"),
    [
        ("auto", 0, "0", "cpu"),
        ("auto", 2, "0", "cuda:0"),
        ("auto", 2, "1", "cuda:1"),  # a launcher's second process
        ("cpu", 2, "0", "cpu"),
        ("cuda", 1, "0", "cuda:0"),
        ("cuda:1", 2, "0", "cuda:1"),
    ],
)
def test_the_name_means_this_process_device(
    monkeypatch: pytest.MonkeyPatch, name: str, gpus: int, local_rank: str, want: str
) -> None:
    _gpus(monkeypatch, gpus)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert train_device(name) == torch.device(want)


@pytest.mark.parametrize(
    ("name", "gpus", "why"),
    [
        ("cuda", 0, r"^device: 'cuda', but torch .* sees no CUDA device .*; use device: cpu, or auto$"),
        ("cuda:2", 2, r"^device: cuda:2, but torch sees 2 CUDA device\(s\) \(cuda:0 to cuda:1\)$"),
        ("gpu", 1, r"^device: 'gpu' is not 'auto', 'cpu', 'cuda' or 'cuda:N'$"),
    ],
)
def test_a_device_that_is_not_there_is_one_line(
    monkeypatch: pytest.MonkeyPatch, name: str, gpus: int, why: str
) -> None:
    _gpus(monkeypatch, gpus)
    with pytest.raises(ConfigError, match=why):
        train_device(name)


def test_a_malformed_local_rank_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 2)
    monkeypatch.setenv("LOCAL_RANK", "one")
    with pytest.raises(
        ConfigError, match=r"^device: 'auto' takes the GPU at the launcher's LOCAL_RANK, which is 'one'$"
    ):
        train_device("auto")
    assert train_device("cuda:1") == torch.device("cuda", 1)  # an explicit index needs none


def test_under_deepspeed_a_rank_past_the_visible_gpus_is_not_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A launcher that gives each rank one GPU (`CUDA_VISIBLE_DEVICES`) leaves LOCAL_RANK past what the rank
    sees: DeepSpeed places the model, so the trainer never resolves `device` there."""
    from treetrain.train import loop

    _gpus(monkeypatch, 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    asked: list[str] = []
    monkeypatch.setattr(loop, "train_device", lambda name: asked.append(name))

    def load(*args: object, **kwargs: object) -> None:
        raise RuntimeError("loading")  # the device is resolved (or not) before this

    monkeypatch.setattr(models, "_load", load)
    cfg = load_config(
        None, [f"run_dir={tmp_path / 'run'}", "model.path=tiny-llama", "distributed.backend=deepspeed"]
    )
    with pytest.raises(RuntimeError, match="loading"):
        loop.Trainer(cfg)
    assert asked == []
    one = load_config(None, [f"run_dir={tmp_path / 'one'}", "model.path=tiny-llama"])
    with pytest.raises(RuntimeError, match="loading"):
        loop.Trainer(one)
    assert asked == ["auto"]  # the negative control: one process asks


@pytest.mark.parametrize("bad", ["gpu", "CUDA", "cuda:", "cuda:-1", "cuda:99999", "mps", "", "cpu:0", "7"])
def test_the_config_refuses_what_is_no_device_name(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"^device: "):
        load_config(None, [f"device={bad}"])
    check_device_name("cuda:3")  # the name is checked, not whether the machine has it


def test_deepspeed_places_its_ranks_itself() -> None:
    deepspeed = ["distributed.backend=deepspeed"]
    with pytest.raises(
        ConfigError, match=r"^device: 'cpu' with distributed.backend=deepspeed.*leave device: auto$"
    ):
        load_config(None, [*deepspeed, "device=cpu"])
    assert load_config(None, deepspeed).device == "auto"


@pytest.mark.parametrize("verb", ["train", "eval"])
def test_a_gpu_that_is_not_there_ends_the_command_in_one_line_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, verb: str
) -> None:
    _gpus(monkeypatch, 0)
    built: list[object] = []
    monkeypatch.setattr(models, "_load", lambda *a, **k: built.append(a))  # a model load would be recorded
    run = tmp_path / "run"
    if verb == "train":
        argv = ["train", "--run-dir", str(run), *TINY, "--no-progress"]
    else:
        argv = ["eval", "--model", str(DEMO_MODEL), "--env", "calculator", "--tasks", "1"]
    assert main([*argv, "--set", "device=cuda"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-2000:]
    assert "device: 'cuda', but torch" in err and built == []
    assert not run.exists(), "a run that never started must leave nothing"
